"""GGUF layers: the GGML block types this package reads, and one layer's dequantisation.

A GGUF file (ComfyUI-GGUF's converter, llama.cpp's tools) stores each tensor in one GGML type. F32, F16
and BF16 tensors are plain dense tensors. Every other accepted type is a block quantisation: a row of K
values is K / block_size blocks of `type_size` bytes each (Q8_0: 32 values in 34 bytes; Q4_K: 256 values
in 144 bytes). Such a layer is held in memory exactly as stored, as U8 bytes:

- `[N, K / block_size * type_size]` when K is a multiple of the block size (every release layer): rows of
  bytes are rows of the weight, so the fused-qkv split and the fc1 half swap move them unchanged;
- `[n_blocks, type_size]` otherwise (ComfyUI-GGUF's `comfy.gguf.orig_shape` files: a tensor quantised as one
  flat run of blocks); then the marker states the dense shape, and the layer cannot be row-split.

The layer format itself (marker, validation, label, dequantise / quantise) is `formats.GGUF`, one registered
class for every GGML type; this module is the GGML arithmetic it and `gguf_file` share.

A block-quantised tensor of a module that is not a Linear (a convolution, an embedding table) is dequantised
once at load (`route.install`), as ComfyUI-GGUF does with large token tables: only Linears compute from blocks.

The accepted quantised types are exactly those diffusers' torch dequantisers know
(`diffusers.quantizers.gguf.utils.dequantize_functions`: Q4_0..Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS); any
other GGML type is refused by name before any weight is read. Dequantisation runs those functions in
float32 (bit-identical to the `gguf` package's numpy dequantiser) and casts once to the compute dtype.

The only floating-point numbers inside a block are its fp16 super-scales (`d`, and `dmin` where the type has
one; the sub-block scales are small integers), so `non_finite` tests those fields of every block, on their bits:
one NaN or infinite `d` turns its 32 or 256 values, and every output of the layer they feed, into NaN.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import H3WeightsError

DENSE_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # GGML type -> safetensors dtype tag
# Byte offsets of the fp16 scales in one block (the block layouts of ggml-common.h / gguf.quants).
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
# A float is non-finite exactly when every exponent bit is set: (unsigned view, exponent mask) per dense type.
_EXPONENT = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}
_PIECE = 1 << 20  # values (or blocks) tested at a time: a bounded temporary whatever the tensor's size


@functools.lru_cache(maxsize=1)
def _library():
    try:
        import gguf
        from diffusers.quantizers.gguf.utils import dequantize_functions
    except ImportError as exc:  # a runtime dependency (requirements.txt); say which when it is missing
        raise H3WeightsError(f"GGUF files need the gguf package (pip install gguf): {exc}") from None
    return gguf, dequantize_functions


def quantised_types() -> tuple[str, ...]:
    """The GGML block types read (diffusers' dequantisers), e.g. ("IQ4_NL", ..., "Q8_0")."""
    gguf, functions = _library()
    return tuple(sorted(qtype.name for qtype in functions if qtype.name not in DENSE_TYPES))


def supported_text() -> str:
    return f"GGUF {'/'.join(DENSE_TYPES)} and {'/'.join(quantised_types())}"


def block_sizes(ggml_type: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type."""
    gguf, _ = _library()
    return tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]])


def stored_shape(ggml_type: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """The U8 storage of a quantised tensor of dense `shape` (see the module docstring)."""
    block, size = block_sizes(ggml_type)
    numel = 1
    for dim in shape:
        numel *= dim
    if numel % block:
        raise H3WeightsError(f"a {ggml_type} tensor of shape {list(shape)} is not a whole number of {block}-value "
                             "blocks")
    if len(shape) == 2 and shape[1] % block == 0:
        return (shape[0], shape[1] // block * size)
    return (numel // block, size)


def dequantise(raw: torch.Tensor, ggml_type: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The dense `shape` weight of one GGUF layer in `dtype` (diffusers' dequantiser, run in float32)."""
    gguf, functions = _library()
    qtype = gguf.GGMLQuantizationType[ggml_type]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size)
    dense = functions[qtype](blocks, block, size, dtype=torch.float32)
    return dense.reshape(shape).to(dtype)


def type_name(type_id: int) -> str:
    """The GGML type name of a file's type id ("Q8_0"), or "type id N" for one the `gguf` package does not know."""
    gguf, _ = _library()
    try:
        return gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type id {type_id}"


def tensor_bytes(ggml_type: str, dims: tuple[int, ...], where: str) -> int:
    """The bytes a tensor of GGUF dimensions `dims` (innermost first) takes in `ggml_type` (rows are whole blocks)."""
    if ggml_type in DENSE_TYPES:
        block, size = 1, {"F32": 4, "F16": 2, "BF16": 2}[ggml_type]
    else:
        block, size = block_sizes(ggml_type)
    if dims and dims[0] % block:
        raise H3WeightsError(f"{where}: a {ggml_type} row of {dims[0]} values is not a whole number of {block}-value "
                             "blocks")
    numel = 1
    for dim in dims:
        numel *= dim
    return numel // block * size


def non_finite(raw: np.ndarray, ggml_type: str) -> bool:
    """Whether the stored bytes `raw` (uint8) of one `ggml_type` tensor hold a NaN or an infinity: every value of a
    dense tensor, every fp16 scale of a block-quantised one. Tested on the bits, a bounded piece at a time."""
    raw = raw.reshape(-1)
    if ggml_type in DENSE_TYPES:
        kind, mask = _EXPONENT[ggml_type]
        values = raw.view(kind)
        return any(bool(((values[i:i + _PIECE] & mask) == mask).any()) for i in range(0, values.size, _PIECE))
    _, size = block_sizes(ggml_type)
    blocks = raw.reshape(-1, size)
    for start in range(0, blocks.shape[0], _PIECE):
        piece = blocks[start:start + _PIECE]
        for offset in HALF_FIELDS[ggml_type]:
            high = piece[:, offset + 1]  # a little-endian fp16's high byte: sign, the 5 exponent bits, 2 mantissa
            if ((high & 0x7C) == 0x7C).any():
                return True
    return False
