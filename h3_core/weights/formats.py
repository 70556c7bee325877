"""Weight formats: how tensors are stored, decided from the header before any weight is read.

A component (DiT, VAE, ...) says *what* a file holds; its format says *how* the numbers are stored:
"gguf" (a GGUF file: per-tensor GGML types, `gguf_file` / `quant.ggml`), "dense" (plain bf16 / fp16 / fp32
tensors) or "quantised" (the Comfy-Org int8_convrot, fp8_scaled, w6a8 and nvfp4_awq files).
A quantised file is described layer by layer by its `.comfy_quant`
markers (`weights.quant.plan`, which refuses unknown or unimplemented layer formats by name, before
any weight is read); this registry only tells the storage kinds apart, with the layer-format registry's
own suffix and dtype sets (`weights.quant.layouts`), where each layer format is one class. The pruned
("AdaLN curve") DiTs are not a format: they are a key family of the DiT handler (`pruned.py`), dense or quantised.
Detection records the format (`Detection.format`), so the loaders can route on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from .errors import UnsupportedCheckpointError, preview
from .headers import Header
from .quant import layouts as quant_layouts

SUPPORTED_FILES = (
    "supported: the Comfy-Org single files minimax_h3_{fl2va,ref2va}_{bf16,int8_convrot}.safetensors, "
    "minimax_h3_video_vae_{fp16,int8_convrot}.safetensors, minimax_h3_audio_vae_fp32.safetensors, "
    "qwen3vl_32b_minimax_h3_{bf16,int8_convrot,nvfp4_awq}.safetensors; "
    "a GGUF DiT or text-encoder file (ComfyUI-GGUF's converter: Comfy tensor names, GGML types); "
    "a diffusers component folder (config.json + safetensors); "
    "or a native MiniMaxAI FL2VA/Ref2VA partition"
)

DENSE_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "BOOL"}
PRUNED_TABLE_KEY = "adaln_t_table"  # the pruned DiT's table (pruned.TABLE_KEY)


@dataclass(frozen=True)
class WeightFormat:
    """`recognise(header)` returns a description of the evidence (for messages), or None."""

    name: str
    supported: bool
    recognise: Callable[[Header], str | None]


def _quantised(header: Header) -> str | None:
    # The quantised layer formats' own sets (`quant.layouts`): their side-tensor suffixes and storage dtypes.
    suffixes = tuple(f".{suffix}" for suffix in quant_layouts.side_suffixes())
    companions = [key for key in header.tensors if key.endswith(suffixes)]
    weights = [k for k, info in header.tensors.items()
               if info.dtype in quant_layouts.STORAGE_DTYPES and not k.endswith(suffixes)]
    if not (companions or weights):
        return None
    detail = []
    if weights:
        dtypes = "/".join(sorted({header.tensors[key].dtype for key in weights}))
        detail.append(f"{len(weights)} weights stored as {dtypes} (e.g. {preview(weights, 2)})")
    if companions:
        detail.append(f"{len(companions)} quantisation tensors (e.g. {preview(companions, 2)})")
    return f"quantised MiniMax-H3 checkpoint ({'; '.join(detail)})"


def _gguf(header: Header) -> str | None:
    # GGUF's own tensor types (read by `quant.ggml`; types no dequantiser knows were refused with the header).
    return "GGUF" if header.container == "gguf" else None


def _dense(header: Header) -> str | None:
    return "dense" if all(info.dtype in DENSE_DTYPES for info in header.tensors.values()) else None


# Checked in order. (The pruned "AdaLN curve" DiT is not a format: it is a key family of the DiT, see pruned.py.)
FORMATS = (
    WeightFormat("gguf", supported=True, recognise=_gguf),
    WeightFormat("quantised", supported=True, recognise=_quantised),
    WeightFormat("dense", supported=True, recognise=_dense),
)


def supported_names() -> list[str]:
    # "dense" first: messages read "dense, quantised" (the registry order is the recognition order).
    return sorted((fmt.name for fmt in FORMATS if fmt.supported), key=lambda name: name != "dense")


def detect_format(header: Header, where: str) -> WeightFormat:
    """The header's format, or `UnsupportedCheckpointError` naming it and the supported ones."""
    name = os.path.basename(os.path.normpath(where))
    supported = ", ".join(supported_names())
    for fmt in FORMATS:
        evidence = fmt.recognise(header)
        if evidence is None:
            continue
        if fmt.supported:
            return fmt
        raise UnsupportedCheckpointError(
            f"{name}: {evidence}; weight format {fmt.name!r} is not supported (supported formats: {supported}); "
            f"{SUPPORTED_FILES}."
        )
    dtypes = sorted({info.dtype for info in header.tensors.values()} - DENSE_DTYPES)
    raise UnsupportedCheckpointError(
        f"{name}: unknown weight format: tensors stored as {'/'.join(dtypes)}; supported formats: {supported} "
        f"({'/'.join(sorted(DENSE_DTYPES))}); {SUPPORTED_FILES}."
    )
