"""Refuse the published MiniMax-H3 variants this package cannot load faithfully.

Two families are recognised from the header alone and refused with a message that says what is
supported instead:
- pruned ("AdaLN curve") DiTs: `time_embedder` replaced by an `adaln_t_table` buffer and every
  AdaLN projection rewired to its K inputs; `MiniMaxH3Transformer3DModel` has no such path;
- quantised files (ConvRot int8, fp8_scaled, w6a8, nvfp4/AWQ): integer or fp8 weights with
  `*.weight_scale` / `*.comfy_quant` companions; dequantising them is a separate concern.
"""

from __future__ import annotations

import os

from .errors import UnsupportedCheckpointError, preview
from .headers import Header

SUPPORTED_FILES = (
    "supported: unquantised (bf16/fp16/fp32) weights - the Comfy-Org single files "
    "minimax_h3_{fl2va,ref2va}_bf16.safetensors, minimax_h3_video_vae_fp16.safetensors, "
    "minimax_h3_audio_vae_fp32.safetensors, qwen3vl_32b_minimax_h3_bf16.safetensors; "
    "a diffusers component folder (config.json + safetensors); "
    "or a native MiniMaxAI FL2VA/Ref2VA partition"
)

# Companion tensors that only quantised formats carry (Comfy quant ops, fp8_scaled, AWQ...).
_QUANT_SUFFIXES = (
    ".weight_scale",
    ".comfy_quant",
    ".scale_weight",
    ".input_scale",
    ".weight_scale_2",
    ".qweight",
    ".qzeros",
    ".scales",
)
# Integer/fp8 storage for a weight means a quantised (or packed) tensor, whatever its name.
_QUANT_DTYPES = {"I8", "U8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "I4", "U4"}


def refuse_unsupported(header: Header, where: str) -> None:
    """Raise `UnsupportedCheckpointError` for a pruned or quantised checkpoint; return otherwise."""
    name = os.path.basename(os.path.normpath(where))
    if "adaln_t_table" in header.tensors:
        shape = list(header.tensors["adaln_t_table"].shape)
        raise UnsupportedCheckpointError(
            f"{name}: pruned MiniMax-H3 DiT (it replaces time_embedder with adaln_t_table {shape} and feeds "
            "every AdaLN projection from that table), which MiniMaxH3Transformer3DModel cannot run; "
            f"{SUPPORTED_FILES}."
        )
    quant_companions = [key for key in header.tensors if key.endswith(_QUANT_SUFFIXES)]
    quant_weights = [
        key
        for key, info in header.tensors.items()
        if info.dtype in _QUANT_DTYPES and not key.endswith(_QUANT_SUFFIXES)
    ]
    if quant_companions or quant_weights:
        dtypes = sorted({header.tensors[key].dtype for key in quant_weights})
        detail = []
        if quant_weights:
            detail.append(f"{len(quant_weights)} weights stored as {'/'.join(dtypes)} (e.g. {preview(quant_weights, 2)})")
        if quant_companions:
            detail.append(f"{len(quant_companions)} quantisation tensors (e.g. {preview(quant_companions, 2)})")
        raise UnsupportedCheckpointError(
            f"{name}: quantised MiniMax-H3 checkpoint ({'; '.join(detail)}); this package loads unquantised "
            f"weights only and does not dequantise; {SUPPORTED_FILES}."
        )
