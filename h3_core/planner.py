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

import os
from collections.abc import Mapping

import torch

from . import configs, facts

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
        from .weights.headers import read_header

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


def transformer_config(tiny: bool = False) -> dict:
    return configs.get("transformer", tiny=tiny)
