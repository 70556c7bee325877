"""Shared builders for the `h3_core.weights` tests (no tests here).

Tiny components come from `h3_core.configs.get(name, tiny=True)` under a fixed seed, and then get
a small seeded perturbation of every parameter, so no norm is an identity and no bias is zero:
a converter that dropped or swapped such a tensor could otherwise still pass a forward check.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from h3_core import configs

QWEN_IMAGE_PAD = 151655
QWEN_VISION_START = 151652
QWEN_VISION_END = 151653


def _perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(0.02 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model.eval()


def tiny_transformer(seed: int = 0):
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    return _perturb(MiniMaxH3Transformer3DModel.from_config(configs.get("transformer", tiny=True)), seed)


def tiny_video_vae(seed: int = 0):
    from diffusers import AutoencoderKLMiniMaxH3

    generator = torch.Generator().manual_seed(seed)
    config = configs.get("vae", tiny=True)
    config["latents_mean"] = torch.randn(24, generator=generator).tolist()
    config["latents_std"] = (0.5 + torch.rand(24, generator=generator)).tolist()
    torch.manual_seed(seed)
    return _perturb(AutoencoderKLMiniMaxH3.from_config(config), seed)


def tiny_audio_vae(seed: int = 0):
    from diffusers import AutoencoderKLMiniMaxH3Audio

    generator = torch.Generator().manual_seed(seed)
    config = configs.get("audio_vae", tiny=True)
    config["latents_mean"] = torch.randn(32, generator=generator).tolist()
    config["latents_std"] = (0.5 + torch.rand(32, generator=generator)).tolist()
    torch.manual_seed(seed)
    return _perturb(AutoencoderKLMiniMaxH3Audio.from_config(config), seed)


def tiny_text_encoder(seed: int = 0, num_layers: int | None = None):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = configs.get("text_encoder", tiny=True)
    if num_layers is not None:
        config["text_config"]["num_hidden_layers"] = num_layers
    torch.manual_seed(seed)
    return _perturb(Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config)), seed)


def state_dicts_equal(a: torch.nn.Module | dict, b: torch.nn.Module | dict) -> bool:
    a = a.state_dict() if isinstance(a, torch.nn.Module) else a
    b = b.state_dict() if isinstance(b, torch.nn.Module) else b
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def dit_forward(model, seed: int = 0):
    """One tiny packed sequence: 3 text rows, 4 video rows, 2 audio rows, two timesteps."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    video_dim = config.in_channels * config.patch_size[0] * config.patch_size[1] * config.patch_size[2]
    text, video, audio = 3, 4, 2
    length = text + video + audio
    tags = torch.tensor([1] * text + [0] * video + [2] * audio)
    positions = torch.stack(
        [
            torch.arange(length, dtype=torch.float64),
            torch.zeros(length, dtype=torch.float64),
            torch.arange(length) % 2.0,
        ],
        dim=-1,
    )
    with torch.no_grad():
        out = model(
            hidden_states=torch.randn(1, video, video_dim, generator=generator),
            audio_hidden_states=torch.randn(1, audio, config.audio_in_channels, generator=generator),
            encoder_hidden_states=torch.randn(1, text, config.text_dim, generator=generator),
            timestep=torch.tensor([0.3, 0.8]),
            timestep_indices=torch.tensor([0] * (text + video) + [1] * audio),
            token_tags=tags,
            position_ids=positions,
            video_indices=torch.arange(text, text + video),
            audio_indices=torch.arange(text + video, length),
            text_indices=torch.arange(text),
        )
    return out.sample, out.audio_sample


class TokenTypes:
    """The one method of `Qwen3VLProcessor` that diffusers' `get_qwen3vl_prompt_embeds` calls
    (the real Qwen3-VL processor needs torchvision even for images)."""

    def create_mm_token_type_ids(self, batch):
        return [[1 if t == QWEN_IMAGE_PAD else 0 for t in sequence] for sequence in batch]


def qwen_presentation(seed: int = 0):
    """Token ids with one 64x64 image block (grid 1x4x4 -> 4 pad tokens) and its pixel patches."""
    generator = torch.Generator().manual_seed(seed)
    ids = [9707, 11, QWEN_VISION_START] + [QWEN_IMAGE_PAD] * 4 + [QWEN_VISION_END, 1879, 374, 264]
    vision = {
        "pixel_values": torch.randn(16, 3 * 2 * 16 * 16, generator=generator),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }
    return ids, vision


def prompt_embeds(text_encoder, seed: int = 0) -> torch.Tensor:
    """diffusers' own `hidden_states[50]` reader on the presentation above."""
    from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

    ids, vision = qwen_presentation(seed)
    with torch.no_grad():
        return get_qwen3vl_prompt_embeds(text_encoder, TokenTypes(), ids, vision, device="cpu", dtype=torch.float32)


# --- header-only safetensors fixtures ---------------------------------------------------------

_DTYPE_TAGS = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
}


def write_header_only(path: str, shapes: dict, metadata: dict | None = None) -> int:
    """A valid safetensors file whose data region is a sparse hole: correct size, no disk use.

    `shapes` maps names to `(torch dtype, shape)`. Returns the file size. Reading any tensor
    gives zeros; a reader that only parses headers never notices the difference.
    """
    header, offset = {}, 0
    for name in sorted(shapes):
        dtype, shape = shapes[name]
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        header[name] = {"dtype": _DTYPE_TAGS[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
    os.truncate(path, 8 + len(raw) + offset)
    return 8 + len(raw) + offset


def shapes_of(state: dict, dtype_of=None) -> dict:
    """`{name: (dtype, shape)}` of a (meta) state dict, optionally re-typed by `dtype_of(name, t)`."""
    return {k: ((dtype_of(k, t) if dtype_of else t.dtype), tuple(t.shape)) for k, t in state.items()}


# --- release-size, data-free checkpoints --------------------------------------------------------


def sparse_files_supported(directory) -> bool:
    """Header-only release fixtures are 66 GB sparse files: only build them where holes are free."""
    probe = os.path.join(str(directory), ".sparse-probe")
    with open(probe, "wb"):
        pass
    try:
        os.truncate(probe, 2**30)
        return os.stat(probe).st_blocks * 512 < 2**20
    finally:
        os.remove(probe)


def release_meta_model(component: str):
    """The release-size model on the meta device (diffusers / transformers names)."""
    from accelerate import init_empty_weights

    if component == "text_encoder":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        with init_empty_weights(include_buffers=False):
            return Qwen3VLForConditionalGeneration(Qwen3VLConfig(**configs.get("text_encoder", tiny=False)))
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

    cls, name = {
        "transformer": (MiniMaxH3Transformer3DModel, "transformer"),
        "vae": (AutoencoderKLMiniMaxH3, "vae"),
        "audio_vae": (AutoencoderKLMiniMaxH3Audio, "audio_vae"),
    }[component]
    with init_empty_weights(include_buffers=False):
        return cls.from_config(configs.get(name, tiny=False))


# The DiT's fp32 islands (patch projections, time embedder, output heads, rope); everything else ships in bf16.
DIT_FP32_PREFIXES = (
    "video_patch_proj.",
    "audio_patch_proj.",
    "time_embedder.",
    "final_layer.video_out.",
    "final_layer.audio_out.",
    "rope.",
)


def dit_dtype(name, tensor):
    return torch.float32 if name.startswith(DIT_FP32_PREFIXES) else torch.bfloat16
