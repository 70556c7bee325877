"""The quantised layer formats this package reads: each one's tensor family, checked from headers only.

A quantised linear `P` of dense shape [N, K] is stored as `P.weight` plus side tensors next to it
and the `P.comfy_quant` marker (see `markers`). What each supported marker format stores (the names,
dtypes and shape rules ComfyUI core and comfy-kitchen 0.2.40 use):

  int8_tensorwise   weight I8 [N, K]; weight_scale F32 per output row [N, 1] (or a scalar);
                    optional ConvRot: the weight is stored rotated by a block-diagonal regular Hadamard
                    of `convrot_groupsize` (a power of 4 dividing K). Also used for embedding tables
                    (one scale per row), dequantised per gathered row.
  float8_e4m3fn     weight F8_E4M3 [N, K]; weight_scale F32 scalar; optional input_scale F32 scalar (a
                    static activation scale only the fp8 GEMM reads).
  asym_w4a8_int8    at 4 bits (W4A8): weight I8 [N, K/2], optional weight_codebook [16] (a Lloyd-Max
                    table the 4-bit codes index); at 6 bits ("w6a8"): weight I8 [N, 3K/4] (K/2 bytes of
                    low nibbles, then K/4 bytes of top-2-bit planes); both: weight_s_rel F8_E4M3
                    [N, K/group_size], weight_s_channel F32 [N], always ConvRot-rotated. The bit depth follows
                    from the row width (4 bits: K/2 bytes; community W4A8 files, not Comfy-Org's).
  nvfp4             weight U8 [N, K/2] (two E2M1 codes a byte, high nibble first), weight_scale F8_E4M3
                    [roundup(N, 128), roundup(K/16, 4)] in cuBLAS' blocked layout, weight_scale_2 F32
                    scalar, optional input_scale, optional AWQ pre_quant_scale [K] (multiplies the input).

`describe` validates one layer's family against those rules and returns a `LayerSpec`; an unknown
format, or a known one this package does not implement, is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import H3WeightsError, UnsupportedCheckpointError

INT8 = "int8_tensorwise"
FP8 = "float8_e4m3fn"
W6A8 = "asym_w4a8_int8"
NVFP4 = "nvfp4"
MXFP8 = "mxfp8"
GGUF = "gguf"  # a GGUF file's block-quantised layer (`ggml`); its marker is made by the loaders, not stored
SUPPORTED_FORMATS = (INT8, FP8, W6A8, NVFP4, MXFP8, GGUF)
# Marker formats ComfyUI core knows but this package does not run (named in refusals).
UNIMPLEMENTED_FORMATS = ("float8_e5m2", "convrot_w4a4", "svdquant_w4a4", "awq_w4a16")
SUPPORTED_TEXT = (
    "int8_tensorwise (with or without ConvRot; int8_convrot files), float8_e4m3fn (fp8_scaled files), "
    "asym_w4a8_int8 at 6 bits (w6a8 files) and at 4 bits (W4A8, optional 16-entry codebook), "
    "nvfp4 (+ AWQ pre_quant_scale; nvfp4_awq files), mxfp8 (block 32)"
)

# Side tensors each format may carry besides `weight` (and a dense `bias`).
SIDE_TENSORS = {
    INT8: {"weight_scale"},
    FP8: {"weight_scale", "input_scale"},
    W6A8: {"weight_s_rel", "weight_s_channel", "weight_codebook"},
    NVFP4: {"weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale"},
    MXFP8: {"weight_scale", "input_scale"},
    GGUF: set(),
}
REQUIRED_SIDE = {INT8: {"weight_scale"}, FP8: {"weight_scale"}, W6A8: {"weight_s_rel", "weight_s_channel"},
                 NVFP4: {"weight_scale", "weight_scale_2"}, MXFP8: {"weight_scale"},
                 GGUF: set()}
# Every side-tensor suffix any Comfy quantised file uses (a key ending in one belongs to a layer P).
SIDE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "weight_s_rel",
                 "weight_s_channel", "weight_codebook", "weight_correction", "comfy_quant")
SCALAR = ((), (1,))


def roundup(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def is_power_of_4(value: int) -> bool:
    return value >= 4 and value & (value - 1) == 0 and (value.bit_length() - 1) % 2 == 0


@dataclass(frozen=True)
class LayerSpec:
    """One quantised layer as its file stores it. `shape` is the dense [out, in] it stands for."""

    format: str
    shape: tuple[int, int]
    marker: dict
    tensors: dict  # suffix -> (dtype tag, shape): weight and side tensors, as stored
    convrot: bool = False
    convrot_groupsize: int = 0
    group_size: int = 0  # w6a8 scale groups; nvfp4 blocks (16)
    bits: int = 8

    @property
    def label(self) -> str:
        """How `check` names the layer format, e.g. "int8_convrot (group 256)"."""
        if self.format == INT8:
            if self.convrot:
                return f"int8_convrot (group {self.convrot_groupsize})"
            return "int8 row-wise" if self.tensors["weight_scale"][1] not in SCALAR else "int8 tensor-wise"
        if self.format == FP8:
            full = " full-precision matmul" if self.marker.get("full_precision_matrix_mult") else ""
            static = " + input_scale" if "input_scale" in self.tensors else ""
            return f"fp8 e4m3 (per-tensor scale{static}{full})"
        if self.format == W6A8 and self.bits == 4:
            codebook = ", codebook" if "weight_codebook" in self.tensors else ""
            return f"w4a8 (4-bit, group {self.group_size}, ConvRot {self.convrot_groupsize}{codebook})"
        if self.format == W6A8:
            return f"w6a8 (6-bit, group {self.group_size}, ConvRot {self.convrot_groupsize})"
        if self.format == GGUF:
            return f"GGUF {self.marker['ggml_type']}"
        if self.format == MXFP8:
            return "mxfp8 (e4m3, E8M0 scale per 32)"
        awq = ", AWQ pre-scale" if "pre_quant_scale" in self.tensors else ""
        return f"nvfp4 (block 16{awq})"

    def row_aligned(self, suffix: str) -> bool | None:
        return row_aligned(self.format, suffix, self.tensors[suffix][1] if suffix in self.tensors else ())


def row_aligned(fmt: str, suffix: str, shape) -> bool | None:
    """Whether a layer's tensor `suffix` has one entry per output row, so it follows its weight through a
    fused-row split (qkv) or half swap (fc1); False: per tensor or per input channel (copied to every
    part); None: it cannot follow a row change (nvfp4's swizzled 128x4 block-scale tiles)."""
    if suffix in ("comfy_quant", "input_scale", "weight_scale_2", "pre_quant_scale", "weight_codebook"):
        return False
    if suffix == "weight":
        return True
    if fmt in (NVFP4, MXFP8) and suffix == "weight_scale":
        return None  # swizzled 128x4 tiles: re-tiled by `route.follow_rows` (mxfp8) or refused (nvfp4)
    return tuple(shape) not in SCALAR


def _shape(tensors: dict, suffix: str) -> tuple[int, ...]:
    return tuple(tensors[suffix][1])


def _want(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise H3WeightsError(f"{where}: {what}")


def _int(marker: dict, key: str, default: int, where: str) -> int:
    value = marker.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise H3WeightsError(f"{where}: marker option {key}={value!r} is not a positive integer")
    return value


def _int8(where: str, marker: dict, tensors: dict) -> LayerSpec:
    dtype, shape = tensors["weight"]
    _want(dtype == "I8" and len(shape) == 2, where, f"int8_tensorwise weight must be I8 2-D, got {dtype} {list(shape)}")
    n, k = shape
    s_dtype, s_shape = tensors["weight_scale"]
    _want(s_dtype == "F32" and tuple(s_shape) in (*SCALAR, (n, 1), (n,)), where,
          f"int8_tensorwise weight_scale must be F32 [] or [{n}, 1], got {s_dtype} {list(s_shape)}")
    convrot = bool(marker.get("convrot", False))
    group = _int(marker, "convrot_groupsize", 256, where) if convrot else 0
    if convrot:
        _want(is_power_of_4(group) and k % group == 0, where,
              f"ConvRot group {group} must be a power of 4 dividing in_features {k}")
    return LayerSpec(INT8, (n, k), marker, tensors, convrot=convrot, convrot_groupsize=group)


def _fp8(where: str, marker: dict, tensors: dict) -> LayerSpec:
    dtype, shape = tensors["weight"]
    _want(dtype == "F8_E4M3" and len(shape) == 2, where,
          f"float8_e4m3fn weight must be F8_E4M3 2-D, got {dtype} {list(shape)}")
    for suffix in ("weight_scale", "input_scale"):
        if suffix in tensors:
            s_dtype, s_shape = tensors[suffix]
            _want(s_dtype == "F32" and tuple(s_shape) in SCALAR, where,
                  f"float8_e4m3fn {suffix} must be an F32 scalar, got {s_dtype} {list(s_shape)}")
    return LayerSpec(FP8, tuple(shape), marker, tensors)


def _w6a8(where: str, marker: dict, tensors: dict) -> LayerSpec:
    dtype, shape = tensors["weight"]
    _want(dtype == "I8" and len(shape) == 2, where, f"asym_w4a8_int8 weight must be I8 2-D, got {dtype} {list(shape)}")
    n, cols = shape
    group = _int(marker, "group_size", 16, where)
    rot = _int(marker, "convrot_groupsize", 256, where)
    r_dtype, r_shape = tensors["weight_s_rel"]
    _want(r_dtype in ("F8_E4M3", "U8", "F32") and len(r_shape) == 2 and r_shape[0] == n, where,
          f"weight_s_rel must be F8_E4M3 [{n}, K/{group}], got {r_dtype} {list(r_shape)}")
    k = r_shape[1] * group
    bits = cols * 8 // k if k else 0
    if bits * k != cols * 8 or bits not in (4, 6):
        raise H3WeightsError(f"{where}: packed row of {cols} bytes matches neither 4 nor 6 bits for K={k}")
    if "weight_codebook" in tensors:
        b_dtype, b_shape = tensors["weight_codebook"]
        _want(bits == 4 and b_dtype in ("F32", "BF16", "F16") and tuple(b_shape) == (16,), where,
              f"weight_codebook must be a float [16] of a 4-bit layer, got {b_dtype} {list(b_shape)} at {bits} bits")
    _want(k % 32 == 0 and group % 16 == 0 and is_power_of_4(rot) and k % rot == 0, where,
          f"6-bit layout needs K % 32 == 0, group_size a multiple of 16 and a power-of-4 ConvRot group dividing "
          f"K; got K={k}, group_size={group}, convrot_groupsize={rot}")
    c_dtype, c_shape = tensors["weight_s_channel"]
    _want(c_dtype == "F32" and tuple(c_shape) == (n,), where,
          f"weight_s_channel must be F32 [{n}], got {c_dtype} {list(c_shape)}")
    return LayerSpec(W6A8, (n, k), marker, tensors, convrot=True, convrot_groupsize=rot, group_size=group, bits=bits)


def _nvfp4(where: str, marker: dict, tensors: dict) -> LayerSpec:
    dtype, shape = tensors["weight"]
    _want(dtype == "U8" and len(shape) == 2, where, f"nvfp4 weight must be U8 [N, K/2], got {dtype} {list(shape)}")
    n, k = shape[0], shape[1] * 2
    _want(n % 16 == 0 and k % 16 == 0, where, f"nvfp4 storage [{n}, {k // 2}] is not 16-aligned")
    s_dtype, s_shape = tensors["weight_scale"]
    blocked = (roundup(n, 128), roundup(k // 16, 4))
    _want(s_dtype == "F8_E4M3" and tuple(s_shape) == blocked, where,
          f"nvfp4 weight_scale must be F8_E4M3 {list(blocked)} (blocked layout), got {s_dtype} {list(s_shape)}")
    for suffix in ("weight_scale_2", "input_scale"):
        if suffix in tensors:
            t_dtype, t_shape = tensors[suffix]
            _want(t_dtype == "F32" and tuple(t_shape) in SCALAR, where,
                  f"nvfp4 {suffix} must be an F32 scalar, got {t_dtype} {list(t_shape)}")
    if "pre_quant_scale" in tensors:
        p_dtype, p_shape = tensors["pre_quant_scale"]
        _want(p_dtype in ("F32", "BF16", "F16") and tuple(p_shape) == (k,), where,
              f"nvfp4 pre_quant_scale must be a float [{k}], got {p_dtype} {list(p_shape)}")
    return LayerSpec(NVFP4, (n, k), marker, tensors, group_size=16, bits=4)


def _mxfp8(where: str, marker: dict, tensors: dict) -> LayerSpec:
    dtype, shape = tensors["weight"]
    _want(dtype == "F8_E4M3" and len(shape) == 2 and shape[0] % 32 == 0 and shape[1] % 32 == 0, where,
          f"mxfp8 weight must be F8_E4M3 [N, K] with N, K multiples of 32, got {dtype} {list(shape)}")
    n, k = shape
    s_dtype, s_shape = tensors["weight_scale"]
    blocked = (roundup(n, 128), roundup(k // 32, 4))
    _want(s_dtype in ("F8_E8M0", "U8") and tuple(s_shape) == blocked, where,
          f"mxfp8 weight_scale must be F8_E8M0 {list(blocked)} (blocked layout), got {s_dtype} {list(s_shape)}")
    return LayerSpec(MXFP8, (n, k), marker, tensors, group_size=32)


def _gguf(where: str, marker: dict, tensors: dict) -> LayerSpec:
    from . import ggml

    dtype, shape = tensors["weight"]
    _want(dtype == "U8", where, f"a GGUF block-quantised weight is held as U8 bytes, got {dtype} {list(shape)}")
    return LayerSpec(GGUF, ggml.dense_shape(marker, tuple(shape), where), marker, tensors)


_DESCRIBE = {INT8: _int8, FP8: _fp8, W6A8: _w6a8, NVFP4: _nvfp4, MXFP8: _mxfp8, GGUF: _gguf}


def refuse_formats(where: str, formats: dict) -> None:
    """Refuse unknown / unimplemented marker formats, all named at once. `formats`: format -> a layer."""
    bad = {fmt: layer for fmt, layer in formats.items() if fmt not in SUPPORTED_FORMATS}
    if not bad:
        return
    named = "; ".join(
        f"{fmt!r} ({'known to ComfyUI, not implemented here' if fmt in UNIMPLEMENTED_FORMATS else 'unknown'}; "
        f"e.g. {layer})" for fmt, layer in sorted(bad.items()))
    raise UnsupportedCheckpointError(
        f"{where}: quantised layer format {named} is not supported; supported layer formats: {SUPPORTED_TEXT}")


def describe(where: str, marker: dict, tensors: dict) -> LayerSpec:
    """Validate one layer's tensors (`suffix -> (dtype tag, shape)`) against its marker's format."""
    fmt = marker["format"]
    refuse_formats(where, {fmt: where})
    if "weight" not in tensors:
        raise H3WeightsError(f"{where}: .comfy_quant marker without a weight")
    extra = set(tensors) - {"weight", "bias", "comfy_quant"} - SIDE_TENSORS[fmt]
    if extra:
        raise H3WeightsError(f"{where}: {fmt} layer carries unexpected tensors {sorted(extra)}")
    missing = REQUIRED_SIDE[fmt] - set(tensors)
    if missing:
        raise H3WeightsError(f"{where}: {fmt} layer lacks {sorted(missing)}")
    return _DESCRIBE[fmt](where, marker, {k: v for k, v in tensors.items() if k not in ("bias", "comfy_quant")})
