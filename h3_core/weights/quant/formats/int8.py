"""int8_tensorwise: int8 codes with one F32 scale per output row (or per tensor), optionally ConvRot-rotated.

weight I8 [N, K]; weight_scale F32 per output row [N, 1] (or a scalar); optional ConvRot: the weight is stored
rotated by a block-diagonal regular Hadamard of `convrot_groupsize` (a power of 4 dividing K). Also used for
embedding tables (one scale per row, no ConvRot), dequantised per gathered row (`dequantise_rows`).
"""

from __future__ import annotations

import torch

from ...errors import H3WeightsError
from .. import kitchen
from ..layer_format import SCALAR, LayerFormat, LayerSpec, is_power_of_4, positive_int, want


class Int8Tensorwise(LayerFormat):
    name = "int8_tensorwise"
    side_tensors = ("weight_scale",)
    required = frozenset({"weight_scale"})
    file_names = {"int8_convrot": {"convrot": True}, "int8": {"convrot": False}, name: {"convrot": False}}
    summary = "int8_tensorwise (with or without ConvRot; int8_convrot files)"

    def check(self, where: str, marker: dict, tensors: dict) -> LayerSpec:
        dtype, shape = tensors["weight"]
        want(dtype == "I8" and len(shape) == 2, where,
             f"int8_tensorwise weight must be I8 2-D, got {dtype} {list(shape)}")
        n, k = shape
        s_dtype, s_shape = tensors["weight_scale"]
        want(s_dtype == "F32" and tuple(s_shape) in (*SCALAR, (n, 1), (n,)), where,
             f"int8_tensorwise weight_scale must be F32 [] or [{n}, 1], got {s_dtype} {list(s_shape)}")
        convrot = bool(marker.get("convrot", False))
        group = positive_int(marker, "convrot_groupsize", 256, where) if convrot else 0
        if convrot:
            want(is_power_of_4(group) and k % group == 0, where,
                 f"ConvRot group {group} must be a power of 4 dividing in_features {k}")
        return LayerSpec(self, (n, k), marker, tensors, convrot=convrot, convrot_groupsize=group)

    def label(self, spec: LayerSpec) -> str:
        if spec.convrot:
            return f"int8_convrot (group {spec.convrot_groupsize})"
        return "int8 row-wise" if spec.tensors["weight_scale"][1] not in SCALAR else "int8 tensor-wise"

    def embeddable(self, spec: LayerSpec) -> bool:
        """Row-wise scales, codes not rotated: rows can be gathered before dequantising."""
        return not spec.convrot

    def _params(self, spec: LayerSpec, scale: torch.Tensor, dtype: torch.dtype, shape):
        layout = kitchen.tensor_module().TensorWiseINT8Layout
        return layout, layout.Params(scale=kitchen.row_scale(scale, shape[0]), orig_dtype=dtype,
                                     orig_shape=tuple(shape), convrot=spec.convrot,
                                     convrot_groupsize=spec.convrot_groupsize or 256)

    def dequantise(self, spec: LayerSpec, stored: dict, dtype: torch.dtype) -> torch.Tensor:
        layout, params = self._params(spec, stored["weight_scale"], dtype, spec.shape)
        return layout.dequantize(stored["weight"], params)

    def dequantise_rows(self, spec: LayerSpec, stored: dict, indices: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
        """Rows `indices` of an int8 row-wise embedding table, dequantised after the gather (kitchen's
        `TensorWiseINT8Layout.dequantize_embedding`): the [V, D] table is never materialised."""
        weight = stored["weight"]
        layout, params = self._params(spec, stored["weight_scale"], dtype, weight.shape)
        return layout.dequantize_embedding(weight, params, indices)

    def quantise(self, weight: torch.Tensor, options: dict) -> tuple[dict, dict]:
        """Options: `convrot` (default True), `convrot_groupsize` (default: `kitchen.default_rotation`)."""
        n, k = weight.shape
        convrot = bool(options.get("convrot", True))
        group = int(options.get("convrot_groupsize") or kitchen.default_rotation(k)) if convrot else 0
        if convrot and not (is_power_of_4(group) and k % group == 0):
            raise H3WeightsError(f"ConvRot group {group} must be a power of 4 dividing in_features {k}")
        qdata, params = kitchen.tensor_module().TensorWiseINT8Layout.quantize(
            weight, is_weight=True, per_channel=True, convrot=convrot, convrot_groupsize=group or 256)
        return {"weight": qdata, "weight_scale": params.scale.to(torch.float32).reshape(n, 1)}, self._marker(group)

    def stored_header(self, shape: tuple[int, int], options: dict) -> tuple[dict, dict]:
        n, k = shape
        group = (options.get("convrot_groupsize") or kitchen.default_rotation(k)) if options.get("convrot") else 0
        return {"weight": ("I8", (n, k)), "weight_scale": ("F32", (n, 1))}, self._marker(group)

    def _marker(self, group: int) -> dict:
        return {"format": self.name, "convrot": True, "convrot_groupsize": group} if group else {"format": self.name}

    def gemm_min_sm(self):
        return kitchen.tensor_module().TensorWiseINT8Layout.MIN_SM_VERSION

    def kitchen_forward(self, spec, stored, x, bias):
        """Kitchen's W8A8 GEMM: the activation is rotated and row-quantised too."""
        import comfy_kitchen as ck

        scale = stored["weight_scale"].reshape(-1)
        return ck.int8_linear(x, stored["weight"], scale, bias, x.dtype, convrot=spec.convrot,
                              convrot_groupsize=spec.convrot_groupsize or 256)
