"""mxfp8 (community files comfy-kitchen reads): e4m3 codes with one E8M0 power-of-two scale per 32 values.

weight F8_E4M3 [N, K] (N, K multiples of 32); weight_scale F8_E8M0 [roundup(N, 128), roundup(K/32, 4)] in cuBLAS'
blocked layout (swizzled 128x4 tiles, re-tiled when a fused projection's rows are split); optional input_scale.
"""

from __future__ import annotations

import torch

from ...errors import H3WeightsError
from .. import kitchen
from ..layer_format import LayerFormat, LayerSpec, roundup, want


class MXFP8(LayerFormat):
    name = "mxfp8"
    side_tensors = ("weight_scale", "input_scale")
    required = frozenset({"weight_scale"})
    copied = frozenset({"input_scale"})
    tiled = frozenset({"weight_scale"})  # re-tiled by `follow_rows`
    summary = "mxfp8 (block 32)"

    def check(self, where: str, marker: dict, tensors: dict) -> LayerSpec:
        dtype, shape = tensors["weight"]
        want(dtype == "F8_E4M3" and len(shape) == 2 and shape[0] % 32 == 0 and shape[1] % 32 == 0, where,
             f"mxfp8 weight must be F8_E4M3 [N, K] with N, K multiples of 32, got {dtype} {list(shape)}")
        n, k = shape
        s_dtype, s_shape = tensors["weight_scale"]
        blocked = (roundup(n, 128), roundup(k // 32, 4))
        want(s_dtype in ("F8_E8M0", "U8") and tuple(s_shape) == blocked, where,
             f"mxfp8 weight_scale must be F8_E8M0 {list(blocked)} (blocked layout), got {s_dtype} {list(s_shape)}")
        return LayerSpec(self, (n, k), marker, tensors, group_size=32)

    def label(self, spec: LayerSpec) -> str:
        return "mxfp8 (e4m3, E8M0 scale per 32)"

    def follow_rows(self, layer, suffix, weight, tensor, op, count):
        """Block scales (cuBLAS' 128x4 tiles, kitchen's layout) through a row operation: untiled to [N, K/32]
        (one row per weight row), `op`, tiled again per part (kitchen's own `from_blocked` / `to_blocked`)."""
        rows, blocks = weight.shape[0], weight.shape[1] // 32
        if tensor.device.type == "meta":
            part = rows // count if count > 1 else rows
            shape = (roundup(part, 128), roundup(blocks, 4))
            return tuple(torch.empty(shape, dtype=tensor.dtype, device="meta") for _ in range(count))
        from comfy_kitchen.float_utils import from_blocked, to_blocked

        plain = from_blocked(tensor.view(torch.uint8), num_rows=rows, num_cols=blocks)
        return tuple(to_blocked(part.contiguous(), flatten=False).view(tensor.dtype) for part in op(plain))

    def dequantise(self, spec: LayerSpec, stored: dict, dtype: torch.dtype) -> torch.Tensor:
        layout = kitchen.tensor_module().TensorCoreMXFP8Layout
        params = layout.Params(scale=stored["weight_scale"].view(torch.float8_e8m0fnu), orig_dtype=dtype,
                               orig_shape=tuple(spec.shape))
        return layout.dequantize(stored["weight"], params)

    def quantise(self, weight: torch.Tensor, options: dict) -> tuple[dict, dict]:
        n, k = weight.shape
        if n % 32 or k % 32:
            raise H3WeightsError(f"mxfp8 needs 32-aligned [N, K], got {[n, k]} (kitchen would pad the storage)")
        qdata, params = kitchen.tensor_module().TensorCoreMXFP8Layout.quantize(weight)
        return {"weight": qdata, "weight_scale": params.scale}, {"format": self.name}

    def stored_header(self, shape: tuple[int, int], options: dict) -> tuple[dict, dict]:
        n, k = shape
        return ({"weight": ("F8_E4M3", (n, k)), "weight_scale": ("F8_E8M0", (roundup(n, 128), roundup(k // 32, 4)))},
                {"format": self.name})
