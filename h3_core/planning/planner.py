"""Memory planner: what a job needs on the device and in host RAM, from safetensors headers only.

Nothing here reads tensor data or touches a GPU: parameter bytes are summed from the header's
dtypes and shapes (a 66 GB DiT is planned in milliseconds), activations are counted from the
model's widths and the job's sequence length. The same numbers drive `--offload auto`, the
ComfyUI loaders' memory request and `python -m h3_core plan`.

Activation model (inference, batch 1, no autograd): the DiT runs one packed sequence of
S = video tokens + audio tokens + text tokens through blocks whose largest moment is the feed-forward
phase: the residual stream and its normalised copy (2 x hidden), the fused fc1 output (2 x ffn) and the
SwiGLU product (ffn) are alive at once. Attention with a fused (flash / memory-efficient) kernel is
O(S) and smaller (2 x hidden + q, k, v + the rotated q, k + the attention output). At 1344x768 and 124
frames that is S ~ 38.2k tokens and ~4.1 GB in bf16, 11.2 GB at 345 frames (docs/ARCHITECTURE.md).
The text encoder (Qwen3-VL) keeps every layer's hidden state (diffusers asks for `hidden_states[50]`)
on top of its widest phase, the MLP (gate, up and their product: 3 x intermediate).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from .. import configs, facts
from ..safetensors_header import DTYPES

# A prompt's Qwen presentation length when the caller does not know it: a few hundred words of
# prompt plus the chat template.
DEFAULT_TEXT_TOKENS = 512

DIT_COMPONENTS = ("transformer", "transformer_ref")
COMPONENTS = (*DIT_COMPONENTS, "text_encoder", "vae", "audio_vae")


# --- parameters (headers only) -------------------------------------------------------------------


def _tensor_table(header_or_path) -> Mapping:
    """name -> entry with `.nbytes` for a path (file or sharded folder), a weights `Header`, a parsed
    safetensors header, or a mapping of such entries."""
    if isinstance(header_or_path, (str, os.PathLike)):
        from ..weights.headers import read_header

        path = os.fspath(header_or_path)
        if os.path.isdir(path):
            files = sorted(
                os.path.join(path, name) for name in os.listdir(path) if name.endswith(".safetensors")
            )
        else:
            files = [path]
        return read_header(files).tensors
    tensors = getattr(header_or_path, "tensors", header_or_path)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"parameter_bytes takes a path, a header or a tensor table, not {type(header_or_path)}")
    return tensors


def _entry_bytes(entry) -> int:
    nbytes = getattr(entry, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    begin, end = entry.data_offsets  # safetensors_header.TensorEntry: the byte span is the truth
    return int(end) - int(begin)


def parameter_bytes(header_or_path) -> int:
    """Bytes of every tensor a checkpoint stores (its weights as held in memory at their stored dtype)."""
    return sum(_entry_bytes(entry) for entry in _tensor_table(header_or_path).values())


# --- sequence lengths ------------------------------------------------------------------------------


def dit_tokens(*, width: int, height: int, frames: int, text_tokens: int = DEFAULT_TEXT_TOKENS,
               condition_frames: int = 0) -> int:
    """The DiT's packed sequence length: video patches + stereo audio latents + prompt tokens
    (+ latent frames of visual conditions: keyframes and references travel as extra video rows)."""
    patch_t, patch_h, patch_w = facts.PATCH_SIZE
    grid_h = height // (facts.VAE_SPATIAL_FACTOR * patch_h)
    grid_w = width // (facts.VAE_SPATIAL_FACTOR * patch_w)
    video = (facts.video_latent_frames(frames) + condition_frames) // patch_t * grid_h * grid_w
    audio = facts.audio_latent_frames(frames) * facts.AUDIO_CHANNELS
    return video + audio + int(text_tokens)


def _image_tokens(width: int, height: int) -> int:
    return math.ceil(width / facts.VISION_TOKEN_PX) * math.ceil(height / facts.VISION_TOKEN_PX)


def text_tokens(prepared, tokenizer) -> int:
    """The Qwen presentation's length for a stage-0 `Prepared` request, estimated from above: the prompt's tokens
    plus one vision block per keyframe or reference image and per second of reference video (each block one token
    per 32 x 32 px), plus labels. The `text_tokens` the text encoder's `activation_bytes` take."""
    tokens = len(tokenizer(prepared.prompt)["input_ids"]) + 64
    for image in prepared.keyframes:
        tokens += _image_tokens(*image.size) + 16
    for ref in prepared.references:
        if getattr(ref, "image", None) is not None:
            tokens += _image_tokens(*ref.image.size) + 16
        frames = getattr(ref, "frames", None)
        if frames is not None and len(frames):
            height, width = frames.shape[1:3] if hasattr(frames, "shape") else frames[0].size[::-1]
            blocks = math.ceil(len(frames) * facts.VIDEO_BLOCKS_PER_FRAME)
            tokens += blocks * (_image_tokens(width, height) + 16)
    return tokens


def _dtype_bytes(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else int(dtype)


def _dit_widths(config: Mapping) -> tuple[int, int]:
    """(per-token elements alive in the widest phase, hidden width)."""
    hidden = int(config["hidden_size"])
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    ffn = int(config["ffn_dim"])
    feed_forward = 2 * hidden + 2 * ffn + ffn  # residual + normed input, fused fc1 (gate|value), SwiGLU
    attention = 2 * hidden + 3 * inner + 2 * inner + inner  # + q, k, v, rotated q, k, attention output
    return max(feed_forward, attention), hidden


def _text_widths(config: Mapping) -> tuple[int, int, int]:
    text = config.get("text_config", config)
    hidden = int(text["hidden_size"])
    inner = int(text["num_attention_heads"]) * int(text["head_dim"])
    kv = int(text["num_key_value_heads"]) * int(text["head_dim"])
    mlp = 2 * hidden + 3 * int(text["intermediate_size"])
    attention = 2 * hidden + inner + 2 * kv + inner + kv + inner
    return max(mlp, attention), hidden, min(int(text["num_hidden_layers"]), facts.TEXT_ENCODER_LAYER)


def activation_bytes(*, width: int, height: int, frames: int, text_tokens: int = DEFAULT_TEXT_TOKENS,
                     dtype=torch.bfloat16, component: str = "transformer", config: Mapping | None = None) -> int:
    """Peak bytes of activations one forward of `component` allocates for a `width`x`height`x`frames` job.

    `config` is the component's model config (default: the release's; pass the tiny one for the tiny
    H3). Weights, the allocator's reserve and the CUDA context are not included (see `plan`).
    """
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; expected one of {', '.join(COMPONENTS)}")
    size = _dtype_bytes(dtype)
    if component in DIT_COMPONENTS:
        config = config or configs.RELEASE_TRANSFORMER
        per_token, _ = _dit_widths(config)
        tokens = dit_tokens(width=width, height=height, frames=frames, text_tokens=text_tokens)
        return tokens * per_token * size
    if component == "text_encoder":
        config = config or configs.RELEASE_TEXT_ENCODER
        per_token, hidden, layers = _text_widths(config)
        return int(text_tokens) * (per_token + (layers + 1) * hidden) * size
    if component == "vae":
        return _video_vae_bytes(width, height, frames, size, config or configs.RELEASE_VIDEO_VAE)
    return _audio_vae_bytes(frames, size, config or configs.RELEASE_AUDIO_VAE)


def _video_vae_bytes(width: int, height: int, frames: int, size: int, config: Mapping) -> int:
    """Tiled decode: the whole output video in fp32 (it is assembled in place) plus one tile's work:
    a 256 px tile of one 5-latent chunk through the decoder ViT and its 20-frame pixel output."""
    output = 3 * frames * width * height * 4
    tile = int(configs.RELEASE_PIPELINE_CONFIG.get("vae_tile_size", 256))
    tokens = facts.LATENTS_PER_CLIP * (tile // facts.VAE_SPATIAL_FACTOR) ** 2
    width_vit = int(config["decoder_num_attention_heads"]) * int(config["decoder_attention_head_dim"])
    vit = tokens * (4 * width_vit + 3 * int(config.get("decoder_ffn_mult", 4)) * width_vit) * size
    pixels = 3 * 4 * facts.LATENTS_PER_CLIP * tile * tile * 4 * 3  # chunk output, blend weights, fp32 copy
    return output + vit + pixels


def _audio_vae_bytes(frames: int, size: int, config: Mapping) -> int:
    """BigVGAN decode of the stereo track (fp32 always): channels halve as the rate multiplies, so the
    widest stage holds max_k(channels_k x length_k); x2 for the anti-aliased activation's upsampling and
    x4 for the tensors a residual unit keeps alive (input, activation, convolution, running sum)."""
    length = facts.audio_latent_frames(frames) * facts.AUDIO_CHANNELS
    channels, widest = int(config["decoder_dim"]), 0
    for rate in config["decoder_rates"]:
        channels, length = max(channels // 2, 1), length * int(rate)
        widest = max(widest, channels * length)
    return widest * 2 * 4 * 4


# --- per-component plans (headers only) ------------------------------------------------------------

# Allocator slack, CUDA context and kernel workspaces on top of weights and activations.
RESERVE_BYTES = 1 << 30
# Host RAM the process needs besides weights (interpreter, torch, tokenizer, media).
HOST_OVERHEAD_BYTES = 3 << 30
STREAMABLE = (*DIT_COMPONENTS, "text_encoder")

# The ModuleLists block streaming walks (file names after dropping `model.` / `language_model.`).
_BLOCK = re.compile(r"^(layers|visual\.blocks|visual\.deepstack_merger_list|blocks|transformer_blocks)\.(\d+)\.")


def _block_of(name: str) -> tuple[str, int] | None:
    for prefix in ("model.", "language_model."):
        name = name.removeprefix(prefix)
    match = _BLOCK.match(name)
    return (match.group(1), int(match.group(2))) if match else None


def _dtype_tag_bytes(tag: str) -> int:
    dtype = DTYPES.get(tag)
    return dtype.itemsize if dtype is not None else 1


@dataclass(frozen=True)
class ComponentPlan:
    """One component's memory on the device (resident or streamed) and in host RAM, for one job."""

    component: str
    name: str  # file name (or a label)
    stored_bytes: int  # bytes in the file
    device_bytes: int  # bytes once loaded at the compute dtype
    rest_bytes: int  # device bytes outside the streamed block lists
    largest_block: int
    blocks: int
    activation: int
    dtype: torch.dtype
    heads: int = 0  # the DiT's attention heads (0: not a DiT, or unknown): sequence-parallel degrees divide them
    ranks: int = 1  # sequence-parallel ranks this plan is per GPU of (`per_rank`)

    def per_rank(self, ranks: int) -> "ComponentPlan":
        """This DiT's plan on each GPU of `ranks` sequence-parallel ranks (h3_core/sequence_parallel.py): the weights
        are replicated on every rank, the activations split (each rank holds 1/N of the packed sequence; Ulysses'
        attention holds the whole sequence for 1/N of the heads, the same bytes)."""
        if ranks == self.ranks:
            return self
        if self.component not in DIT_COMPONENTS:
            raise ValueError(f"only the DiT runs sequence-parallel, not the {self.component}")
        full = self.activation * self.ranks
        return replace(self, activation=-(-full // ranks), ranks=ranks)

    def divides(self, ranks: int) -> bool:
        """Whether `ranks` sequence-parallel ranks can share this DiT's heads (unknown heads: assumed yes)."""
        return not self.heads or self.heads % ranks == 0

    @property
    def streamable(self) -> bool:
        return self.component in STREAMABLE and self.blocks > 0

    @property
    def resident_peak(self) -> int:
        return self.device_bytes + self.activation + RESERVE_BYTES

    @property
    def streamed_peak(self) -> int:
        """The unstreamed rest, the running block and the one prefetched behind it."""
        if not self.streamable:
            return self.resident_peak
        return self.rest_bytes + 2 * self.largest_block + self.activation + RESERVE_BYTES

    def peak(self, offload: str) -> int:
        return self.streamed_peak if offload == "block" else self.resident_peak

    def host_bytes(self, offload: str) -> int:
        """Host RAM to run well: streamed weights live in host RAM (pinned copies, or the file's pages);
        a resident load passes through it tensor by tensor (memory-mapped, no full copy)."""
        return HOST_OVERHEAD_BYTES + (self.device_bytes if offload == "block" else 0)


def _loaded_itemsize(component: str, tag: str, compute: torch.dtype, all_fp32: bool) -> int:
    """Bytes per element of a stored floating tensor once loaded (the loaders' dtype rule): a float32 run
    widens everything; the VAEs load in float32; a float32-throughout file (the tiny H3, fp32 exports) takes
    the compute dtype; the pruned DiT's float16 AdaLN projections load as float32; otherwise as stored (a bf16
    release file's float32 islands are the modules kept in float32). Integer (quantised) storage never changes."""
    if compute == torch.float32 or component in ("vae", "audio_vae"):
        return 4
    if all_fp32:
        return compute.itemsize
    if tag == "F16" and component in DIT_COMPONENTS:
        return 4
    return _dtype_tag_bytes(tag)


def plan_component(component: str, tensors: Mapping, *, name: str = "", width: int, height: int, frames: int,
                   text_tokens: int = DEFAULT_TEXT_TOKENS, device: str = "cuda", dtype=None,
                   config: Mapping | None = None) -> ComponentPlan:
    """Plan one component from its tensor table (`{name: entry}` with `.dtype` tags and `.nbytes`).

    Each tensor is counted at the size the loaders give it (`_loaded_itemsize`)."""
    from ..dtypes import compute_dtype

    compute = compute_dtype(component, device, dtype)
    floating = {"F64", "F32", "F16", "BF16"}
    all_fp32 = all(entry.dtype == "F32" for entry in tensors.values() if entry.dtype in floating)
    per_block: dict[tuple[str, int], int] = {}
    device_bytes = rest = 0
    for tensor_name, entry in tensors.items():
        if tensor_name.endswith(".comfy_quant"):  # per-layer format markers: parsed at load, never kept
            continue
        nbytes = _entry_bytes(entry)
        if entry.dtype in floating:
            size = _loaded_itemsize(component, entry.dtype, compute, all_fp32)
            nbytes = nbytes // _dtype_tag_bytes(entry.dtype) * size
        device_bytes += nbytes
        block = _block_of(tensor_name) if component in STREAMABLE else None
        if block is None:
            rest += nbytes
        else:
            per_block[block] = per_block.get(block, 0) + nbytes
    activation = activation_bytes(width=width, height=height, frames=frames, text_tokens=text_tokens,
                                  dtype=torch.float32 if component == "audio_vae" else compute,
                                  component=component, config=config)
    return ComponentPlan(
        component=component,
        name=name,
        stored_bytes=sum(_entry_bytes(entry) for entry in tensors.values()),
        device_bytes=device_bytes,
        rest_bytes=rest,
        largest_block=max(per_block.values(), default=0),
        blocks=len(per_block),
        activation=activation,
        dtype=compute,
        heads=int((config or configs.RELEASE_TRANSFORMER)["num_attention_heads"]) if component in DIT_COMPONENTS else 0,
    )


def plan_file(path, *, width: int, height: int, frames: int, text_tokens: int = DEFAULT_TEXT_TOKENS,
              device: str = "cuda", dtype=None) -> ComponentPlan:
    """`plan_component` for a checkpoint on disk: its header says what it is and its model widths."""
    from ..weights import components, detect

    det = detect(os.fspath(path))
    config = components.resolve_config(det)
    return plan_component(det.slot, det.header.tensors, name=os.path.basename(os.fspath(path).rstrip("/")),
                          width=width, height=height, frames=frames, text_tokens=text_tokens, device=device,
                          dtype=dtype, config=config)


# --- verdicts: does a plan fit a machine ------------------------------------------------------------------------------

GB = 1e9  # the plan command and tables state sizes in GB of 1e9 bytes

# Published Comfy-Org files (bytes; docs/REAL_WEIGHTS.md): the alternatives a refusal suggests.
PUBLISHED = {
    "transformer": (
        ("minimax_h3_{p}_bf16", 66_280_000_000),
        ("minimax_h3_{p}_pruned_bf16", 40_230_000_000),
        ("minimax_h3_{p}_int8_convrot", 34_038_892_334),
        ("minimax_h3_{p}_pruned_int8_convrot", 20_970_379_616),
        ("minimax_h3_{p}_pruned_fp8_scaled", 20_958_205_608),
        ("minimax_h3_{p}_pruned_w6a8", 15_980_000_000),
    ),
    "text_encoder": (
        ("qwen3vl_32b_minimax_h3_bf16", 51_500_000_000),
        ("qwen3vl_32b_minimax_h3_int8_convrot", 27_141_342_152),
        ("qwen3vl_32b_minimax_h3_nvfp4_awq", 15_687_142_551),
    ),
}


@dataclass(frozen=True)
class Verdict:
    """Whether one file fits a machine, how (resident or streamed), at what device peak and host RAM, and if not,
    what to do instead."""

    role: str
    offload: str | None  # "none" / "block" / None (does not fit)
    peak: int
    host: int
    advice: str
    ranks: int = 1  # sequence-parallel ranks the peak is per GPU of
    resident_from: int | None = None  # DiT: smallest sequence-parallel degree that fits resident (None: none <= 8)

    @property
    def label(self) -> str:
        return {"none": "fits resident", "block": "fits streamed", None: "does not fit"}[self.offload]


def _fits(peak: int, host: int, vram: int, ram: int | None) -> bool:
    return peak <= vram and (ram is None or host <= ram)


def _scaled(plan: ComponentPlan, stored: int) -> ComponentPlan:
    """`plan` with its weights scaled to another published file of the same component (same layer
    structure, different bytes per weight): an estimate for advice only."""
    ratio = stored / max(plan.stored_bytes, 1)
    return ComponentPlan(
        component=plan.component, name="", stored_bytes=stored, device_bytes=int(plan.device_bytes * ratio),
        rest_bytes=int(plan.rest_bytes * ratio), largest_block=int(plan.largest_block * ratio), blocks=plan.blocks,
        activation=plan.activation, dtype=plan.dtype,
    )


def _alternatives(plan: ComponentPlan, extra: int, vram: int, ram: int | None) -> str:
    partition = "ref2va" if plan.component == "transformer_ref" else "fl2va"
    key = "text_encoder" if plan.component == "text_encoder" else "transformer"
    for pattern, stored in sorted(PUBLISHED[key], key=lambda item: -item[1]):
        if stored >= plan.stored_bytes:
            continue
        other = _scaled(plan, stored)
        for offload in ("none", "block"):
            if _fits(other.peak(offload) + extra, other.host_bytes(offload), vram, ram):
                name = pattern.format(p=partition)
                return f"use {name}.safetensors ({stored / GB:.1f} GB) with --offload {offload}"
    return ""


def decide(role: str, plan: ComponentPlan, extra_for, vram: int, ram: int | None) -> Verdict:
    """First of resident / streamed that fits; `extra_for(offload)` adds what shares the device. The one rule the
    `plan` command (`plan_report`) and the published tables (`plan_tables`) both judge a machine by."""
    for offload in ("none", "block") if plan.streamable else ("none",):
        peak = max(plan.peak(offload), extra_for(offload))
        host = plan.host_bytes(offload)
        if _fits(peak, host, vram, ram):
            return Verdict(role, offload, peak, host, "")
    offload = "block" if plan.streamable else "none"
    peak, host = max(plan.peak(offload), extra_for(offload)), plan.host_bytes(offload)
    advice = [_alternatives(plan, max(0, extra_for(offload) - plan.peak(offload)), vram, ram)]
    if plan.component == "text_encoder":
        advice.append("or run the text encoder on an encoder server (`serve`) and `encode --server URL`")
    if ram is not None and host > ram:
        advice.append(f"streaming this file needs {host / GB:.0f} GB host RAM")
    return Verdict(role, None, peak, host, "; ".join(a for a in advice if a) or "no published file fits")
