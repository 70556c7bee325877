"""The per-layer `.comfy_quant` marker: a 1-D uint8 tensor holding UTF-8 JSON.

ComfyUI core and comfy-kitchen mark every quantised linear `P` with `P.comfy_quant`, e.g.
`{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}` (72 bytes exactly as
`json.dumps` writes it). No file-level metadata is involved. The marker is the only trusted
statement of a layer's format: file names are never consulted. Options may also sit in a nested
`"params"` object (core accepts both spellings); `parse` flattens them.

Markers are read before any weight, so their size is bounded here: a hostile header cannot make
the reader allocate more than `MAX_MARKER_BYTES` per layer.
"""

from __future__ import annotations

import json

import torch

from ...safetensors_header import HeaderError, loads_bounded
from ..errors import H3WeightsError

MARKER_SUFFIX = "comfy_quant"
MAX_MARKER_BYTES = 4096  # real markers are 27-80 bytes


def encode(marker: dict) -> torch.Tensor:
    """The marker tensor kitchen / core write: `json.dumps` with default separators, as uint8."""
    raw = json.dumps(marker).encode("utf-8")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def parse(tensor: torch.Tensor, where: str) -> dict:
    """A marker tensor -> its options, `params` flattened in. Refuses anything but a small JSON object."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise H3WeightsError(f"{where}: a .comfy_quant marker must be a 1-D uint8 tensor, got {tensor.dtype} "
                             f"{list(tensor.shape)}")
    if tensor.numel() > MAX_MARKER_BYTES:
        raise H3WeightsError(f"{where}: .comfy_quant marker of {tensor.numel()} bytes exceeds {MAX_MARKER_BYTES}")
    try:
        value = loads_bounded(tensor.numpy().tobytes(), what=".comfy_quant marker", max_depth=4)
    except HeaderError as exc:
        raise H3WeightsError(f"{where}: unreadable .comfy_quant marker ({exc})") from None
    if not isinstance(value, dict) or not isinstance(value.get("format"), str):
        raise H3WeightsError(f"{where}: .comfy_quant marker is not a JSON object with a \"format\" string")
    flat = {k: v for k, v in value.items() if k != "params"}
    nested = value.get("params")
    if isinstance(nested, dict):
        for key, option in nested.items():
            flat.setdefault(key, option)
    return flat
