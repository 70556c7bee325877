"""nvfp4 (Comfy-Org's nvfp4_awq text encoder): E2M1 codes in blocks of 16 with an e4m3 scale a block.

weight U8 [N, K/2] (two E2M1 codes a byte, high nibble first), weight_scale F8_E4M3 [roundup(N, 128),
roundup(K/16, 4)] in cuBLAS' blocked layout, weight_scale_2 F32 scalar, optional input_scale, optional AWQ
pre_quant_scale [K] (multiplies the input). The files ask for full-precision matmul: no quantised GEMM here.
"""

from __future__ import annotations

import torch

from ....safetensors_header import DTYPE_TAGS
from ...errors import H3WeightsError
from .. import kitchen
from ..layer_format import LayerFormat, LayerSpec, roundup, scalar_f32, want


class NVFP4(LayerFormat):
    name = "nvfp4"
    side_tensors = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")
    required = frozenset({"weight_scale", "weight_scale_2"})
    copied = frozenset({"input_scale", "weight_scale_2", "pre_quant_scale"})
    tiled = frozenset({"weight_scale"})  # swizzled 128x4 tiles: a fused-row split is refused
    file_names = {"nvfp4_awq": {}}
    summary = "nvfp4 (+ AWQ pre_quant_scale; nvfp4_awq files)"

    def check(self, where: str, marker: dict, tensors: dict) -> LayerSpec:
        dtype, shape = tensors["weight"]
        want(dtype == "U8" and len(shape) == 2, where, f"nvfp4 weight must be U8 [N, K/2], got {dtype} {list(shape)}")
        n, k = shape[0], shape[1] * 2
        want(n % 16 == 0 and k % 16 == 0, where, f"nvfp4 storage [{n}, {k // 2}] is not 16-aligned")
        s_dtype, s_shape = tensors["weight_scale"]
        blocked = (roundup(n, 128), roundup(k // 16, 4))
        want(s_dtype == "F8_E4M3" and tuple(s_shape) == blocked, where,
             f"nvfp4 weight_scale must be F8_E4M3 {list(blocked)} (blocked layout), got {s_dtype} {list(s_shape)}")
        scalar_f32(tensors, ("weight_scale_2", "input_scale"), where, self.name)
        if "pre_quant_scale" in tensors:
            p_dtype, p_shape = tensors["pre_quant_scale"]
            want(p_dtype in ("F32", "BF16", "F16") and tuple(p_shape) == (k,), where,
                 f"nvfp4 pre_quant_scale must be a float [{k}], got {p_dtype} {list(p_shape)}")
        return LayerSpec(self, (n, k), marker, tensors, group_size=16, bits=4)

    def label(self, spec: LayerSpec) -> str:
        awq = ", AWQ pre-scale" if "pre_quant_scale" in spec.tensors else ""
        return f"nvfp4 (block 16{awq})"

    def dequantise(self, spec: LayerSpec, stored: dict, dtype: torch.dtype) -> torch.Tensor:
        layout = kitchen.tensor_module().TensorCoreNVFP4Layout
        params = layout.Params(scale=stored["weight_scale_2"], orig_dtype=dtype, orig_shape=tuple(spec.shape),
                               block_scale=stored["weight_scale"])
        dense = layout.dequantize(stored["weight"], params)
        # Kitchen returns the 16-padded storage shape; the layer is the logical one.
        return dense[: spec.shape[0], : spec.shape[1]]

    def quantise(self, weight: torch.Tensor, options: dict) -> tuple[dict, dict]:
        """Option `pre_quant_scale`: a [K] float tensor, stored in its own dtype (the stored weight is W / s and the
        input is multiplied by s: AWQ smoothing)."""
        n, k = weight.shape
        if n % 16 or k % 16:
            raise H3WeightsError(f"nvfp4 needs 16-aligned [N, K], got {[n, k]} (kitchen would pad the storage)")
        stored = {}
        prescale = options.get("pre_quant_scale")
        if prescale is not None:
            stored["pre_quant_scale"] = prescale.reshape(k)
            weight = weight / prescale.to(weight.dtype)  # x W^T = (x * s) (W / s)^T
        qdata, params = kitchen.tensor_module().TensorCoreNVFP4Layout.quantize(weight)
        stored.update(weight=qdata, weight_scale=params.block_scale, weight_scale_2=params.scale.reshape(()))
        return stored, {"format": self.name, "full_precision_matrix_mult": True}

    def stored_header(self, shape: tuple[int, int], options: dict) -> tuple[dict, dict]:
        n, k = shape
        stored = {"weight": ("U8", (n, k // 2)), "weight_scale": ("F8_E4M3", (roundup(n, 128), roundup(k // 16, 4))),
                  "weight_scale_2": ("F32", ())}
        prescale = options.get("pre_quant_scale")
        if prescale is not None:
            # A tensor option is stored in its own dtype; a dtype tag names it (the published nvfp4_awq file: BF16).
            tag = DTYPE_TAGS[prescale.dtype] if isinstance(prescale, torch.Tensor) else str(prescale)
            stored["pre_quant_scale"] = (tag, (k,))
        return stored, {"format": self.name, "full_precision_matrix_mult": True}
