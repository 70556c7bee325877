"""Write quantised Comfy-file tensors from dense ones: the tiny twins of the published quantised files.

`quantise_state_dict(state, fmt, layers)` takes a Comfy single-file state dict (reference names:
`blocks.N.attn.qkv_proj.weight`, `model.layers.N.mlp.down_proj.weight`, ...) and returns the same
dict with every listed layer replaced by what the published files store for it: the quantised
`P.weight`, its side tensors and the `P.comfy_quant` marker, all from comfy-kitchen's quantisers.
Everything not listed is returned as it is (same tensor objects).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...safetensors_header import DTYPE_TAGS
from ..errors import H3WeightsError
from . import kitchen, markers
from .layouts import FP8, INT8, MXFP8, NVFP4, W6A8, roundup

# File-level names (as the published file names spell them) and marker names -> (marker format, defaults).
FILE_FORMATS = {
    "int8_convrot": (INT8, {"convrot": True}),
    "int8": (INT8, {"convrot": False}),
    INT8: (INT8, {"convrot": False}),
    "fp8_scaled": (FP8, {}),
    FP8: (FP8, {}),
    "w6a8": (W6A8, {}),
    "w4a8": (W6A8, {"bits": 4}),
    W6A8: (W6A8, {}),
    "nvfp4": (NVFP4, {}),
    "nvfp4_awq": (NVFP4, {}),
    MXFP8: (MXFP8, {}),
}


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

    `fmt`: a file-level name ("int8_convrot", "int8", "fp8_scaled", "w6a8", "nvfp4"/"nvfp4_awq") or a
    marker format ("int8_tensorwise", "float8_e4m3fn", "asym_w4a8_int8", "nvfp4").
    `layers`: layer names (`P` or `P.weight`), or a mapping name -> per-layer options that override the
    format's defaults (see `kitchen.quantise`: e.g. {"convrot": False} for an int8 layer whose width has
    no ConvRot group, {"full_precision_matrix_mult": True, "input_scale": 0.01} for fp8, {"pre_quant_scale":
    s} for an AWQ nvfp4 layer). A layer's bias (if any) stays dense, as in the published files.
    """
    if fmt not in FILE_FORMATS:
        raise H3WeightsError(f"unknown quantisation format {fmt!r}; one of {sorted(FILE_FORMATS)}")
    marker_format, defaults = FILE_FORMATS[fmt]
    plan = _layer_options(layers)
    missing = sorted(prefix for prefix in plan if f"{prefix}.weight" not in state)
    if missing:
        raise H3WeightsError(f"cannot quantise layers absent from the state dict: {missing[:5]}")
    out = dict(state)
    for prefix in sorted(plan):
        if f"{prefix}.{markers.MARKER_SUFFIX}" in state:
            raise H3WeightsError(f"{prefix} is already quantised")
        stored, marker = kitchen.quantise(marker_format, state[f"{prefix}.weight"], {**defaults, **plan[prefix]})
        for suffix, tensor in stored.items():
            out[f"{prefix}.{suffix}"] = tensor.contiguous()
        out[f"{prefix}.{markers.MARKER_SUFFIX}"] = markers.encode(marker)
    return out


def quantised_header(fmt: str, shape: tuple[int, int], options: dict | None = None) -> tuple[dict, dict]:
    """What `quantise_state_dict` stores for one [N, K] layer, without data: ({suffix: (dtype tag, shape)},
    marker). The header-only twin of `kitchen.quantise` (a test holds the two equal), used to describe
    release-size files whose weights are not at hand."""
    if fmt not in FILE_FORMATS:
        raise H3WeightsError(f"unknown quantisation format {fmt!r}; one of {sorted(FILE_FORMATS)}")
    marker_format, defaults = FILE_FORMATS[fmt]
    options = {**defaults, **(options or {})}
    n, k = shape
    if marker_format == INT8:
        group = (options.get("convrot_groupsize") or kitchen.default_rotation(k)) if options.get("convrot") else 0
        marker = {"format": INT8, "convrot": True, "convrot_groupsize": group} if group else {"format": INT8}
        return {"weight": ("I8", (n, k)), "weight_scale": ("F32", (n, 1))}, marker
    if marker_format == FP8:
        stored = {"weight": ("F8_E4M3", (n, k)), "weight_scale": ("F32", ())}
        if options.get("input_scale") is not None:
            stored["input_scale"] = ("F32", ())
        marker = {"format": FP8, **({"full_precision_matrix_mult": True} if options.get("full_precision_matrix_mult")
                                    else {})}
        return stored, marker
    if marker_format == W6A8:
        group = int(options.get("group_size", 16))
        rotation = int(options.get("convrot_groupsize") or kitchen.default_rotation(k))
        four = int(options.get("bits", 6)) == 4
        stored = {"weight": ("I8", (n, k // 2 if four else 3 * k // 4)), "weight_s_rel": ("F8_E4M3", (n, k // group)),
                  "weight_s_channel": ("F32", (n,))}
        if four:
            stored["weight_codebook"] = ("F32", (16,))
        return stored, {"format": W6A8, "group_size": group, "convrot_groupsize": rotation}
    if marker_format == MXFP8:
        return {"weight": ("F8_E4M3", (n, k)), "weight_scale": ("F8_E8M0", (roundup(n, 128), roundup(k // 32, 4)))}, {
            "format": MXFP8}
    stored = {"weight": ("U8", (n, k // 2)), "weight_scale": ("F8_E4M3", (roundup(n, 128), roundup(k // 16, 4))),
              "weight_scale_2": ("F32", ())}
    prescale = options.get("pre_quant_scale")
    if prescale is not None:
        # A tensor option is stored in its own dtype; a dtype tag names it (the published nvfp4_awq file: BF16).
        tag = DTYPE_TAGS[prescale.dtype] if isinstance(prescale, torch.Tensor) else str(prescale)
        stored["pre_quant_scale"] = (tag, (k,))
    return stored, {"format": NVFP4, "full_precision_matrix_mult": True}
