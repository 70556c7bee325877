"""Tiny twins of the published Comfy-Org precisions and quantised files, next to the tiny fp32 single files.

`write_twins(models_dir)` reads the tiny fp32 Comfy files `tiny.write_comfy_models` wrote and writes,
into the same ComfyUI `models/` folder (deterministic bytes, comfy-kitchen's own quantisers):

    diffusion_models/minimax_h3_tiny_{fl2va,ref2va}_bf16.safetensors          bf16, fp32 islands kept
    diffusion_models/minimax_h3_tiny_{fl2va,ref2va}_int8_convrot.safetensors  block linears int8 + ConvRot,
                                                                              AdaLN projections int8 row-wise
    text_encoders/qwen3vl_minimax_h3_tiny_{bf16,int8_convrot,nvfp4_awq}.safetensors
    vae/minimax_h3_tiny_video_vae_{fp16,int8_convrot}.safetensors             decoder ViT linears int8 + ConvRot

Same tensor names, dtypes and `.comfy_quant` markers as the release files; the shape rules are the
release's with rotation groups that fit tiny widths: ConvRot uses the largest power of 4 (at most
256, every release layer's group) dividing in_features, i.e. 64 for the tiny DiT / text encoder
(K = 64 or 128) and 16 / 64 for the tiny VAE decoder (K = 32 / 128). Quantisation starts from the
fp32 weights (what each format costs is then measured against the fp32 model itself); the other
tensors are stored in the release dtypes. The nvfp4 file's AWQ `pre_quant_scale` (on o_proj and
down_proj, the layers without a norm to fold it into) is synthetic: the square root of each input
column's relative magnitude (stored bf16, as published), since no calibration activations exist for
random weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..weights.headers import read_file_header
from ..weights.quant import quantise_state_dict
from ..weights.release_headers import DIT_BLOCK_LINEARS, DIT_FP32_PREFIXES, TE_AWQ, TE_LINEARS, VAE_DECODER_LINEARS
from ..weights.safetensors_io import write_file

# The published files' layer sets (float32 islands, quantised linears) have one home: weights/release_headers.
DIT_ADALN = re.compile(r"blocks\.\d+\.adaln_proj\.linear\.weight")
TE_EMBED = "model.embed_tokens.weight"
VAE_FP32 = ("latents_mean", "latents_std")

SOURCES = {  # twin family -> the tiny fp32 file it is made from (relative to the models folder)
    "fl2va": "diffusion_models/minimax_h3_tiny_fl2va_fp32.safetensors",
    "ref2va": "diffusion_models/minimax_h3_tiny_ref2va_fp32.safetensors",
    "text_encoder": "text_encoders/qwen3vl_minimax_h3_tiny_fp32.safetensors",
    "video_vae": "vae/minimax_h3_tiny_video_vae_fp32.safetensors",
}
TWIN_FILES = {
    "fl2va": ("bf16", "int8_convrot"),
    "ref2va": ("bf16", "int8_convrot"),
    "text_encoder": ("bf16", "int8_convrot", "nvfp4_awq"),
    "video_vae": ("fp16", "int8_convrot"),
}


def twin_path(family: str, variant: str) -> str:
    """Where a twin lives in the models folder, e.g. ("fl2va", "int8_convrot") -> diffusion_models/..."""
    source = SOURCES[family]
    return source.replace("_fp32.safetensors", f"_{variant}.safetensors")


def _read(path: Path) -> tuple[dict, dict]:
    """The tensors and metadata of one of the build's own files, read into memory (no file is memory-mapped)."""
    from safetensors.torch import load

    return load(path.read_bytes()), dict(read_file_header(str(path))[1])


def _dense_rest(tensors: dict, quantised: dict, dtype_of) -> dict:
    """Tensors of `quantised` (the writer's output) not produced by quantisation, cast by `dtype_of(name)`."""
    out = {}
    for name, tensor in quantised.items():
        fresh = name not in tensors or quantised[name] is not tensors[name]
        out[name] = tensor if fresh or not tensor.is_floating_point() else tensor.to(dtype_of(name))
    return out


def _dit_dtype(name: str) -> torch.dtype:
    return torch.float32 if name.startswith(DIT_FP32_PREFIXES) else torch.bfloat16


def _awq_scale(weight: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for AWQ's per-input-channel smoothing scale (see the module docstring)."""
    column = weight.abs().amax(dim=0).to(torch.float32)
    # bf16, the published file's pre_quant_scale dtype
    return (column / column.mean()).clamp(min=0.25, max=4.0).sqrt().to(torch.bfloat16)


def dit_twin(tensors: dict, variant: str) -> dict:
    if variant == "bf16":
        return {name: t.to(_dit_dtype(name)) if t.is_floating_point() else t for name, t in tensors.items()}
    blocks = [name for name in tensors if DIT_BLOCK_LINEARS.fullmatch(name)]
    # The release AdaLN projections (in_features 2688, not a multiple of 256) are int8 without ConvRot.
    adaln = {name: {"convrot": False} for name in tensors if DIT_ADALN.fullmatch(name)}
    quantised = quantise_state_dict(quantise_state_dict(tensors, "int8_convrot", blocks), "int8", adaln)
    return _dense_rest(tensors, quantised, _dit_dtype)


def text_encoder_twin(tensors: dict, variant: str) -> dict:
    linears = [name for name in tensors if TE_LINEARS.fullmatch(name)]
    if variant == "bf16":
        return {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in tensors.items()}
    if variant == "int8_convrot":
        quantised = quantise_state_dict(tensors, "int8_convrot", linears)
    else:
        awq = {name: ({"pre_quant_scale": _awq_scale(tensors[name])} if TE_AWQ.fullmatch(name) else {})
               for name in linears}
        quantised = quantise_state_dict(quantise_state_dict(tensors, "nvfp4", awq), "int8", [TE_EMBED])
    return _dense_rest(tensors, quantised, lambda name: torch.bfloat16)


def video_vae_twin(tensors: dict, variant: str) -> dict:
    def dtype_of(name: str) -> torch.dtype:
        # The int8 file keeps the decoder's unquantised tensors in fp32 (see release_headers._video_vae).
        keep = name in VAE_FP32 or (variant == "int8_convrot" and name.startswith("decoder."))
        return torch.float32 if keep else torch.float16

    if variant == "fp16":
        return {name: t.to(dtype_of(name)) if t.is_floating_point() else t for name, t in tensors.items()}
    linears = [name for name in tensors if VAE_DECODER_LINEARS.fullmatch(name)]
    return _dense_rest(tensors, quantise_state_dict(tensors, "int8_convrot", linears), dtype_of)


_MAKERS = {"fl2va": dit_twin, "ref2va": dit_twin, "text_encoder": text_encoder_twin, "video_vae": video_vae_twin}


def write_twins(models_dir: str | Path) -> list[Path]:
    """Write every twin next to the tiny fp32 files (which must exist); returns the paths written."""
    models_dir = Path(models_dir)
    written = []
    for family, variants in TWIN_FILES.items():
        tensors, metadata = _read(models_dir / SOURCES[family])
        for variant in variants:
            path = models_dir / twin_path(family, variant)
            write_file(str(path), _MAKERS[family](tensors, variant), metadata)
            written.append(path)
    return written
