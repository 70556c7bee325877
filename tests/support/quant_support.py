"""Shared helpers for the quantised-weights tests (no tests here).

The references are built straight from comfy-kitchen's layouts, not through `h3_core.weights.quant`,
so "quantised model == dense model holding kitchen's dequantisation" compares two independent paths.
"""

from __future__ import annotations

import json
import math

import torch
from safetensors import safe_open

from h3_core.weights.safetensors_io import write_file


def read(path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, dict(handle.metadata() or {})


def layers_of(tensors: dict) -> dict:
    """{layer prefix: (marker dict, {suffix: tensor})} of every `.comfy_quant`-marked layer."""
    by_prefix: dict = {}
    for key, tensor in tensors.items():
        prefix, _, suffix = key.rpartition(".")
        by_prefix.setdefault(prefix, {})[suffix] = tensor
    out = {}
    for prefix, family in by_prefix.items():
        if "comfy_quant" in family:
            marker = json.loads(family.pop("comfy_quant").numpy().tobytes())
            out[prefix] = (marker, family)
    return out


def kitchen_dequant(marker: dict, family: dict, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight comfy-kitchen's own layouts give (pre_quant_scale not folded)."""
    from comfy_kitchen import tensor as kt

    fmt, weight = marker["format"], family["weight"]
    if fmt == "int8_tensorwise":
        params = kt.TensorWiseINT8Layout.Params(
            scale=family["weight_scale"], orig_dtype=dtype, orig_shape=tuple(weight.shape),
            convrot=bool(marker.get("convrot")), convrot_groupsize=marker.get("convrot_groupsize", 256))
        return kt.TensorWiseINT8Layout.dequantize(weight, params)
    if fmt == "float8_e4m3fn":
        params = kt.TensorCoreFP8Layout.Params(scale=family["weight_scale"], orig_dtype=dtype,
                                               orig_shape=tuple(weight.shape))
        return kt.TensorCoreFP8Layout.dequantize(weight, params)
    if fmt == "asym_w4a8_int8":
        return kt.dequantize_w4a8_int8_weight(weight, family["weight_s_rel"], family["weight_s_channel"],
                                              group_size=marker["group_size"],
                                              convrot_groupsize=marker["convrot_groupsize"], output_dtype=dtype)
    assert fmt == "nvfp4", fmt
    rows, cols = weight.shape[0], weight.shape[1] * 2
    params = kt.TensorCoreNVFP4Layout.Params(scale=family["weight_scale_2"], orig_dtype=dtype,
                                             orig_shape=(rows, cols), block_scale=family["weight_scale"])
    return kt.TensorCoreNVFP4Layout.dequantize(weight, params)[:rows, :cols]


def dense_reference(path, out_path, dtype: torch.dtype) -> dict:
    """Write `path` with every quantised layer replaced by kitchen's dequantisation in `dtype` (the file's other
    tensors untouched). Returns {layer: pre_quant_scale} for the AWQ layers (the reference multiplies their input)."""
    tensors, metadata = read(path)
    prescales = {}
    for prefix, (marker, family) in layers_of(tensors).items():
        for suffix in family:
            if suffix != "bias":
                del tensors[f"{prefix}.{suffix}"]
        del tensors[f"{prefix}.comfy_quant"]
        tensors[f"{prefix}.weight"] = kitchen_dequant(marker, family, dtype)
        if "pre_quant_scale" in family:
            prescales[prefix] = family["pre_quant_scale"]
    write_file(str(out_path), tensors, metadata)
    return prescales


def prescale_inputs(model, prescales: dict, rename) -> list:
    """Forward pre-hooks multiplying the input of each AWQ layer by its scale (x * s, in the input's dtype)."""
    modules = dict(model.named_modules())
    handles = []
    for prefix, scale in prescales.items():
        def hook(module, args, scale=scale):
            return (args[0] * scale.to(args[0].dtype),)

        handles.append(modules[rename(prefix)].register_forward_pre_hook(hook))
    return handles


E2M1_GAP = (1 / 6) * (1 + 2**-4)  # the largest relative gap of the nvfp4 grid (between 4 and 6), e4m3 block scale


def error_and_bound(marker: dict, family: dict, original: torch.Tensor) -> tuple[float, float]:
    """(max |W_hat - W| / max |W|, and the bound on it the format explains) for one layer in fp32.

    int8: the stored codes are within half a step s/2 of the (rotated) weight; ConvRot's orthonormal
    un-rotation keeps each group's L2 error, so an entry is within sqrt(g) * s / 2.
    fp8 e4m3: 3 mantissa bits round within 2^-4 of the value, subnormals within 2^-10 of the scale.
    w6a8: codes within 2 six-bit steps (kitchen's least-squares scales: up to ~1.7 at outliers) of the rotated
    weight, then snapped to the int8 grid (half a step of s_channel); un-rotation as for int8.
    nvfp4: an E2M1 code is within (1/6)(1 + 2^-4) of its block maximum; AWQ layers are compared as stored (W / s).
    """
    fmt = marker["format"]
    weight = original.to(torch.float32)
    if "pre_quant_scale" in family:
        weight = weight / family["pre_quant_scale"].to(torch.float32)
    dense = kitchen_dequant(marker, family, torch.float32)
    error = (dense - weight).abs()
    peak = weight.abs().max()
    if fmt == "int8_tensorwise":
        group = marker.get("convrot_groupsize", 1) if marker.get("convrot") else 1
        allowed = math.sqrt(group) * family["weight_scale"].reshape(-1, 1) / 2 * (1 + 1e-5)
    elif fmt == "float8_e4m3fn":
        allowed = weight.abs() / 16 + family["weight_scale"] * 2**-10
    elif fmt == "asym_w4a8_int8":
        n = weight.shape[0]
        steps = family["weight_s_rel"].to(torch.float32) * family["weight_s_channel"].reshape(n, 1)
        rotation = marker["convrot_groupsize"]
        allowed = math.sqrt(rotation) * (2 * steps.amax(dim=1, keepdim=True)
                                         + family["weight_s_channel"].reshape(n, 1) / 2)
    else:
        blocks = weight.reshape(weight.shape[0], -1, 16).abs().amax(dim=-1, keepdim=True)
        allowed = (E2M1_GAP * blocks * (1 + 1e-5)).expand(-1, -1, 16).reshape(weight.shape)
    allowed = allowed + peak * 2**-20  # fp32 rounding of the dequantisation itself (q * s)
    assert bool((error <= allowed).all()), f"{fmt}: error exceeds its bound by {(error - allowed).max().item()}"
    return float(error.max() / peak), float((allowed.expand_as(error)).max() / peak)
