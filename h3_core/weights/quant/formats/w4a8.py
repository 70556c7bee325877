"""asym_w4a8_int8: 6-bit (Comfy-Org's w6a8 files) or 4-bit (community W4A8) grouped codes, always ConvRot-rotated.

At 4 bits: weight I8 [N, K/2], optional weight_codebook [16] (a Lloyd-Max table the 4-bit codes index); at 6 bits
("w6a8"): weight I8 [N, 3K/4] (K/2 bytes of low nibbles, then K/4 bytes of top-2-bit planes); both:
weight_s_rel F8_E4M3 [N, K/group_size], weight_s_channel F32 [N]. The bit depth follows from the row width.
"""

from __future__ import annotations

import torch

from ...errors import H3WeightsError
from .. import kitchen
from ..layer_format import LayerFormat, LayerSpec, is_power_of_4, positive_int, want


class AsymW4A8Int8(LayerFormat):
    name = "asym_w4a8_int8"
    side_tensors = ("weight_s_rel", "weight_s_channel", "weight_codebook")
    required = frozenset({"weight_s_rel", "weight_s_channel"})
    copied = frozenset({"weight_codebook"})
    file_names = {"w6a8": {}, "w4a8": {"bits": 4}}
    summary = ("asym_w4a8_int8 at 6 bits (w6a8 files) and at 4 bits (W4A8, optional 16-entry codebook)")

    def check(self, where: str, marker: dict, tensors: dict) -> LayerSpec:
        dtype, shape = tensors["weight"]
        want(dtype == "I8" and len(shape) == 2, where,
             f"asym_w4a8_int8 weight must be I8 2-D, got {dtype} {list(shape)}")
        n, cols = shape
        group = positive_int(marker, "group_size", 16, where)
        rot = positive_int(marker, "convrot_groupsize", 256, where)
        r_dtype, r_shape = tensors["weight_s_rel"]
        want(r_dtype in ("F8_E4M3", "U8", "F32") and len(r_shape) == 2 and r_shape[0] == n, where,
             f"weight_s_rel must be F8_E4M3 [{n}, K/{group}], got {r_dtype} {list(r_shape)}")
        k = r_shape[1] * group
        bits = cols * 8 // k if k else 0
        if bits * k != cols * 8 or bits not in (4, 6):
            raise H3WeightsError(f"{where}: packed row of {cols} bytes matches neither 4 nor 6 bits for K={k}")
        if bits == 6:
            kitchen.require_six_bit(where)
        if "weight_codebook" in tensors:
            b_dtype, b_shape = tensors["weight_codebook"]
            want(bits == 4 and b_dtype in ("F32", "BF16", "F16") and tuple(b_shape) == (16,), where,
                 f"weight_codebook must be a float [16] of a 4-bit layer, got {b_dtype} {list(b_shape)} at {bits} bits")
        want(k % 32 == 0 and group % 16 == 0 and is_power_of_4(rot) and k % rot == 0, where,
             f"6-bit layout needs K % 32 == 0, group_size a multiple of 16 and a power-of-4 ConvRot group dividing "
             f"K; got K={k}, group_size={group}, convrot_groupsize={rot}")
        c_dtype, c_shape = tensors["weight_s_channel"]
        want(c_dtype == "F32" and tuple(c_shape) == (n,), where,
             f"weight_s_channel must be F32 [{n}], got {c_dtype} {list(c_shape)}")
        return LayerSpec(self, (n, k), marker, tensors, convrot=True, convrot_groupsize=rot, group_size=group,
                         bits=bits)

    def label(self, spec: LayerSpec) -> str:
        if spec.bits == 4:
            codebook = ", codebook" if "weight_codebook" in spec.tensors else ""
            return f"w4a8 (4-bit, group {spec.group_size}, ConvRot {spec.convrot_groupsize}{codebook})"
        return f"w6a8 (6-bit, group {spec.group_size}, ConvRot {spec.convrot_groupsize})"

    @staticmethod
    def _codebook(stored: dict):
        codebook = stored.get("weight_codebook")
        return None if codebook is None else codebook.to(torch.float32)

    def dequantise(self, spec: LayerSpec, stored: dict, dtype: torch.dtype) -> torch.Tensor:
        return kitchen.tensor_module().dequantize_w4a8_int8_weight(
            stored["weight"], kitchen.e4m3(stored["weight_s_rel"]), stored["weight_s_channel"],
            group_size=spec.group_size, codebook=self._codebook(stored), convrot_groupsize=spec.convrot_groupsize,
            output_dtype=dtype)

    def quantise(self, weight: torch.Tensor, options: dict) -> tuple[dict, dict]:
        """Options: `group_size` (16), `convrot_groupsize` (default: `kitchen.default_rotation`), `bits` (6 or 4:
        4 bits write a codebook)."""
        group, rotation, bits = self._options(weight.shape[1], options)
        if bits == 6:
            kitchen.require_six_bit("w6a8 quantisation")
        qdata, params = kitchen.tensor_module().AsymW4A8Int8Layout.quantize(
            weight, group_size=group, convrot_groupsize=rotation, bits=bits, codebook=bits == 4)
        stored = {"weight": qdata, "weight_s_rel": params.scale, "weight_s_channel": params.s_channel}
        if getattr(params, "codebook", None) is not None:
            stored["weight_codebook"] = params.codebook
        return stored, {"format": self.name, "group_size": group, "convrot_groupsize": rotation}

    def stored_header(self, shape: tuple[int, int], options: dict) -> tuple[dict, dict]:
        n, k = shape
        group, rotation, bits = self._options(k, options)
        four = bits == 4
        stored = {"weight": ("I8", (n, k // 2 if four else 3 * k // 4)), "weight_s_rel": ("F8_E4M3", (n, k // group)),
                  "weight_s_channel": ("F32", (n,))}
        if four:
            stored["weight_codebook"] = ("F32", (16,))
        return stored, {"format": self.name, "group_size": group, "convrot_groupsize": rotation}

    @staticmethod
    def _options(k: int, options: dict) -> tuple[int, int, int]:
        rotation = int(options.get("convrot_groupsize") or kitchen.default_rotation(k))
        return int(options.get("group_size", 16)), rotation, int(options.get("bits", 6))

    def gemm_min_sm(self):
        return kitchen.tensor_module().AsymW4A8Int8Layout.MIN_SM_VERSION

    def kitchen_forward(self, spec, stored, x, bias):
        """Kitchen's W4A8 / W6A8 int8 GEMM (the activation is rotated and int8-quantised)."""
        return kitchen.tensor_module().w4a8_int8_linear(
            x, stored["weight"], kitchen.e4m3(stored["weight_s_rel"]), stored["weight_s_channel"], bias=bias,
            codebook=self._codebook(stored), group_size=spec.group_size, convrot_groupsize=spec.convrot_groupsize,
            out_dtype=x.dtype)
