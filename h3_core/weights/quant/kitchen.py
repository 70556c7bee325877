"""Quantise and dequantise one layer through comfy-kitchen's own layouts (its eager backend on CPU).

Nothing here re-implements kitchen's maths: every code, scale and rotation comes from
`comfy_kitchen.tensor.*Layout.quantize/dequantize` or `dequantize_w4a8_int8_weight`, so a file
written here has kitchen's (and so ComfyUI core's) bits, and a weight read here is kitchen's
dequantisation of it. The few lines that are ours say why next to them.
"""

from __future__ import annotations

import torch

from ..errors import H3WeightsError
from .layouts import FP8, INT8, MXFP8, NVFP4, W6A8, is_power_of_4


def _kitchen():
    try:
        from comfy_kitchen import tensor as layouts
    except ImportError as exc:  # a runtime dependency (requirements.txt); say which when it is missing
        raise H3WeightsError(f"quantised weights need comfy-kitchen (pip install comfy-kitchen): {exc}") from None
    return layouts


def default_rotation(k: int) -> int:
    """The ConvRot group for in_features `k`: 256 (every H3 release layer) when it divides `k`, else the
    largest power of 4 that does (tiny widths: 64 for K = 64 or 128, 16 for K = 32)."""
    group = 256
    while group >= 4:
        if k % group == 0:
            return group
        group //= 4
    raise H3WeightsError(f"in_features {k} is not divisible by 4: no ConvRot group fits")


def _row_scale(scale: torch.Tensor, rows: int) -> torch.Tensor:
    # Kitchen broadcasts the scale against [N, K]: a 1-D per-row scale must stand as [N, 1].
    return scale.reshape(rows, 1) if scale.dim() == 1 and scale.numel() == rows and rows > 1 else scale


def dequantise(fmt: str, tensors: dict, shape: tuple[int, int], dtype: torch.dtype, *, convrot: bool = False,
               convrot_groupsize: int = 256, group_size: int = 16) -> torch.Tensor:
    """The dense [N, K] weight of one layer in `dtype`, as kitchen computes it (pre_quant_scale not folded)."""
    layouts = _kitchen()
    weight = tensors["weight"]
    if fmt == INT8:
        params = layouts.TensorWiseINT8Layout.Params(
            scale=_row_scale(tensors["weight_scale"], shape[0]), orig_dtype=dtype, orig_shape=tuple(shape),
            convrot=convrot, convrot_groupsize=convrot_groupsize or 256)
        return layouts.TensorWiseINT8Layout.dequantize(weight, params)
    if fmt == FP8:
        params = layouts.TensorCoreFP8Layout.Params(scale=tensors["weight_scale"], orig_dtype=dtype,
                                                    orig_shape=tuple(shape))
        return layouts.TensorCoreFP8Layout.dequantize(weight, params)
    if fmt == W6A8:
        s_rel = tensors["weight_s_rel"]
        if s_rel.dtype == torch.uint8:  # core reads U8-stored group scales as e4m3 bytes
            s_rel = s_rel.view(torch.float8_e4m3fn)
        codebook = tensors.get("weight_codebook")
        return layouts.dequantize_w4a8_int8_weight(
            weight, s_rel, tensors["weight_s_channel"], group_size=group_size,
            codebook=None if codebook is None else codebook.to(torch.float32),
            convrot_groupsize=convrot_groupsize, output_dtype=dtype)
    if fmt == NVFP4:
        params = layouts.TensorCoreNVFP4Layout.Params(
            scale=tensors["weight_scale_2"], orig_dtype=dtype, orig_shape=tuple(shape),
            block_scale=tensors["weight_scale"])
        dense = layouts.TensorCoreNVFP4Layout.dequantize(weight, params)
        # Kitchen returns the 16-padded storage shape; the layer is the logical one.
        return dense[: shape[0], : shape[1]]
    if fmt == MXFP8:
        params = layouts.TensorCoreMXFP8Layout.Params(
            scale=tensors["weight_scale"].view(torch.float8_e8m0fnu), orig_dtype=dtype, orig_shape=tuple(shape))
        return layouts.TensorCoreMXFP8Layout.dequantize(weight, params)
    raise H3WeightsError(f"no dequantisation for layer format {fmt!r}")


def dequantise_rows(tensors: dict, indices: torch.Tensor, dtype: torch.dtype, *, convrot: bool = False,
                    convrot_groupsize: int = 256) -> torch.Tensor:
    """Rows `indices` of an int8 row-wise embedding table, dequantised after the gather (kitchen's
    `TensorWiseINT8Layout.dequantize_embedding`): the [V, D] table is never materialised."""
    layouts = _kitchen()
    weight = tensors["weight"]
    params = layouts.TensorWiseINT8Layout.Params(
        scale=_row_scale(tensors["weight_scale"], weight.shape[0]), orig_dtype=dtype, orig_shape=tuple(weight.shape),
        convrot=convrot, convrot_groupsize=convrot_groupsize or 256)
    return layouts.TensorWiseINT8Layout.dequantize_embedding(weight, params, indices)


def quantise(fmt: str, weight: torch.Tensor, options: dict) -> tuple[dict, dict]:
    """One dense [N, K] weight -> (stored tensors by suffix, marker) with kitchen's quantisers.

    `options`: int8 `convrot` (default True) / `convrot_groupsize`; w6a8 `group_size` (16) /
    `convrot_groupsize`; fp8 `full_precision_matrix_mult`, `input_scale` (a float); nvfp4
    `pre_quant_scale` (a [K] float tensor, stored in its own dtype: the stored weight is W / s and the input
    is multiplied by s).
    """
    layouts = _kitchen()
    if weight.dim() != 2 or not weight.is_floating_point():
        raise H3WeightsError(f"only 2-D floating weights are quantised, got {weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    if fmt == INT8:
        convrot = bool(options.get("convrot", True))
        group = int(options.get("convrot_groupsize") or default_rotation(k)) if convrot else 0
        if convrot and not (is_power_of_4(group) and k % group == 0):
            raise H3WeightsError(f"ConvRot group {group} must be a power of 4 dividing in_features {k}")
        qdata, params = layouts.TensorWiseINT8Layout.quantize(
            weight, is_weight=True, per_channel=True, convrot=convrot, convrot_groupsize=group or 256)
        marker = {"format": INT8, "convrot": True, "convrot_groupsize": group} if convrot else {"format": INT8}
        return {"weight": qdata, "weight_scale": params.scale.to(torch.float32).reshape(n, 1)}, marker
    if fmt == FP8:
        qdata, params = layouts.TensorCoreFP8Layout.quantize(weight, dtype=torch.float8_e4m3fn)
        stored = {"weight": qdata, "weight_scale": params.scale.to(torch.float32).reshape(())}
        if options.get("input_scale") is not None:
            stored["input_scale"] = torch.tensor(float(options["input_scale"]), dtype=torch.float32)
        marker = {"format": FP8}
        if options.get("full_precision_matrix_mult"):
            marker["full_precision_matrix_mult"] = True
        return stored, marker
    if fmt == W6A8:
        group = int(options.get("group_size", 16))
        rotation = int(options.get("convrot_groupsize") or default_rotation(k))
        bits = int(options.get("bits", 6))
        qdata, params = layouts.AsymW4A8Int8Layout.quantize(
            weight, group_size=group, convrot_groupsize=rotation, bits=bits, codebook=bits == 4)
        stored = {"weight": qdata, "weight_s_rel": params.scale, "weight_s_channel": params.s_channel}
        if getattr(params, "codebook", None) is not None:
            stored["weight_codebook"] = params.codebook
        return stored, {"format": W6A8, "group_size": group, "convrot_groupsize": rotation}
    if fmt == NVFP4:
        if n % 16 or k % 16:
            raise H3WeightsError(f"nvfp4 needs 16-aligned [N, K], got {[n, k]} (kitchen would pad the storage)")
        stored = {}
        prescale = options.get("pre_quant_scale")
        if prescale is not None:
            stored["pre_quant_scale"] = prescale.reshape(k)
            weight = weight / prescale.to(weight.dtype)  # x W^T = (x * s) (W / s)^T: AWQ smoothing
        qdata, params = layouts.TensorCoreNVFP4Layout.quantize(weight)
        stored.update(weight=qdata, weight_scale=params.block_scale, weight_scale_2=params.scale.reshape(()))
        return stored, {"format": NVFP4, "full_precision_matrix_mult": True}
    if fmt == MXFP8:
        if n % 32 or k % 32:
            raise H3WeightsError(f"mxfp8 needs 32-aligned [N, K], got {[n, k]} (kitchen would pad the storage)")
        qdata, params = layouts.TensorCoreMXFP8Layout.quantize(weight)
        return {"weight": qdata, "weight_scale": params.scale}, {"format": MXFP8}
    raise H3WeightsError(f"cannot quantise to layer format {fmt!r}")
