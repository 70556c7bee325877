"""float8_e4m3fn (the fp8_scaled files): e4m3 codes with one F32 scale per tensor.

weight F8_E4M3 [N, K]; weight_scale F32 scalar; optional input_scale F32 scalar (a static activation scale
only the fp8 GEMM reads). A `full_precision_matrix_mult` marker option asks for the weight-only path.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .. import kitchen
from ..layer_format import LayerFormat, LayerSpec, scalar_f32, want


class Float8E4M3(LayerFormat):
    name = "float8_e4m3fn"
    side_tensors = ("weight_scale", "input_scale")
    required = frozenset({"weight_scale"})
    copied = frozenset({"input_scale"})
    file_names = {"fp8_scaled": {}}
    summary = "float8_e4m3fn (fp8_scaled files)"

    def check(self, where: str, marker: dict, tensors: dict) -> LayerSpec:
        dtype, shape = tensors["weight"]
        want(dtype == "F8_E4M3" and len(shape) == 2, where,
             f"float8_e4m3fn weight must be F8_E4M3 2-D, got {dtype} {list(shape)}")
        scalar_f32(tensors, ("weight_scale", "input_scale"), where, self.name)
        return LayerSpec(self, tuple(shape), marker, tensors)

    def label(self, spec: LayerSpec) -> str:
        full = " full-precision matmul" if spec.marker.get("full_precision_matrix_mult") else ""
        static = " + input_scale" if "input_scale" in spec.tensors else ""
        return f"fp8 e4m3 (per-tensor scale{static}{full})"

    def dequantise(self, spec: LayerSpec, stored: dict, dtype: torch.dtype) -> torch.Tensor:
        layout = kitchen.tensor_module().TensorCoreFP8Layout
        params = layout.Params(scale=stored["weight_scale"], orig_dtype=dtype, orig_shape=tuple(spec.shape))
        return layout.dequantize(stored["weight"], params)

    def quantise(self, weight: torch.Tensor, options: dict) -> tuple[dict, dict]:
        """Options: `full_precision_matrix_mult` (a marker flag), `input_scale` (a float, stored F32)."""
        qdata, params = kitchen.tensor_module().TensorCoreFP8Layout.quantize(weight, dtype=torch.float8_e4m3fn)
        stored = {"weight": qdata, "weight_scale": params.scale.to(torch.float32).reshape(())}
        if options.get("input_scale") is not None:
            stored["input_scale"] = torch.tensor(float(options["input_scale"]), dtype=torch.float32)
        return stored, self._marker(options)

    def stored_header(self, shape: tuple[int, int], options: dict) -> tuple[dict, dict]:
        stored = {"weight": ("F8_E4M3", tuple(shape)), "weight_scale": ("F32", ())}
        if options.get("input_scale") is not None:
            stored["input_scale"] = ("F32", ())
        return stored, self._marker(options)

    def _marker(self, options: dict) -> dict:
        return {"format": self.name, **({"full_precision_matrix_mult": True}
                                        if options.get("full_precision_matrix_mult") else {})}

    def gemm_min_sm(self):
        return kitchen.tensor_module().TensorCoreFP8Layout.MIN_SM_VERSION

    def kitchen_forward(self, spec, stored, x, bias):
        """`torch._scaled_mm` through kitchen's fp8 linear, for layers with a static `input_scale` that do not
        ask for full precision (kitchen falls back to dequantising where the device has no fp8); else None."""
        if "input_scale" not in stored or spec.marker.get("full_precision_matrix_mult"):
            return None
        import comfy_kitchen as ck

        kt = kitchen.tensor_module()
        fp8 = kt.TensorCoreFP8Layout
        x_params = fp8.Params(scale=stored["input_scale"], orig_dtype=x.dtype, orig_shape=tuple(x.shape))
        x_q = kt.QuantizedTensor(ck.quantize_per_tensor_fp8(x, stored["input_scale"]), fp8.__name__, x_params)
        w_params = fp8.Params(scale=stored["weight_scale"], orig_dtype=x.dtype, orig_shape=spec.shape)
        w_q = kt.QuantizedTensor(stored["weight"], fp8.__name__, w_params)
        out = F.linear(x_q, w_q, bias)
        return out.dequantize() if isinstance(out, kt.QuantizedTensor) else out
