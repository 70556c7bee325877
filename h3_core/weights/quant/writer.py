"""Write quantised Comfy-file tensors from dense ones: the tiny twins of the published quantised files.

`quantise_state_dict(state, fmt, layers)` takes a Comfy single-file state dict (reference names:
`blocks.N.attn.qkv_proj.weight`, `model.layers.N.mlp.down_proj.weight`, ...) and returns the same
dict with every listed layer replaced by what the published files store for it: the quantised
`P.weight`, its side tensors and the `P.comfy_quant` marker, all from the format class's quantiser
(comfy-kitchen's for the Comfy formats). Everything not listed is returned as it is (same tensor objects).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import H3WeightsError
from . import layouts, markers


def _file_format(fmt: str):
    """(format, default options) for a quantisation name (`layouts.file_formats`), or a refusal naming them."""
    names = layouts.file_formats()
    if fmt not in names:
        raise H3WeightsError(f"unknown quantisation format {fmt!r}; one of {sorted(names)}")
    return names[fmt]


def _layer_options(layers) -> dict[str, dict]:
    """`layers` as {layer prefix P: options}: names may be given as `P` or `P.weight`."""
    items = layers.items() if isinstance(layers, Mapping) else ((name, {}) for name in layers)
    out = {}
    for name, options in items:
        prefix = name[: -len(".weight")] if name.endswith(".weight") else name
        out[prefix] = dict(options or {})
    return out


def quantise_state_dict(state: dict[str, torch.Tensor], fmt: str, layers) -> dict[str, torch.Tensor]:
    """`state` with each layer of `layers` quantised to `fmt` (Comfy-file tensors with `.comfy_quant` markers).

    `fmt`: a file-level name ("int8_convrot", "int8", "fp8_scaled", "w6a8", "w4a8", "nvfp4"/"nvfp4_awq") or a
    marker format ("int8_tensorwise", "float8_e4m3fn", "asym_w4a8_int8", "nvfp4", "mxfp8").
    `layers`: layer names (`P` or `P.weight`), or a mapping name -> per-layer options that override the
    format's defaults (see each format's `quantise`: e.g. {"convrot": False} for an int8 layer whose width has
    no ConvRot group, {"full_precision_matrix_mult": True, "input_scale": 0.01} for fp8, {"pre_quant_scale":
    s} for an AWQ nvfp4 layer). A layer's bias (if any) stays dense, as in the published files.
    """
    layer_format, defaults = _file_format(fmt)
    plan = _layer_options(layers)
    missing = sorted(prefix for prefix in plan if f"{prefix}.weight" not in state)
    if missing:
        raise H3WeightsError(f"cannot quantise layers absent from the state dict: {missing[:5]}")
    out = dict(state)
    for prefix in sorted(plan):
        if f"{prefix}.{markers.MARKER_SUFFIX}" in state:
            raise H3WeightsError(f"{prefix} is already quantised")
        weight = state[f"{prefix}.weight"]
        if weight.dim() != 2 or not weight.is_floating_point():
            raise H3WeightsError(f"only 2-D floating weights are quantised, got {weight.dtype} {list(weight.shape)}")
        stored, marker = layer_format.quantise(weight, {**defaults, **plan[prefix]})
        for suffix, tensor in stored.items():
            out[f"{prefix}.{suffix}"] = tensor.contiguous()
        out[f"{prefix}.{markers.MARKER_SUFFIX}"] = markers.encode(marker)
    return out


def quantised_header(fmt: str, shape: tuple[int, int], options: dict | None = None) -> tuple[dict, dict]:
    """What `quantise_state_dict` stores for one [N, K] layer, without data: ({suffix: (dtype tag, shape)},
    marker). The header-only twin of the format's `quantise` (a test holds the two equal), used to describe
    release-size files whose weights are not at hand (their byte counts are what the planner plans with)."""
    layer_format, defaults = _file_format(fmt)
    return layer_format.stored_header(tuple(shape), {**defaults, **(options or {})})
