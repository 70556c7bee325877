"""GGUF layers: the GGML block types this package reads, and one layer's dequantisation.

A GGUF file (ComfyUI-GGUF's converter, llama.cpp's tools) stores each tensor in one GGML type. F32, F16
and BF16 tensors are plain dense tensors. Every other accepted type is a block quantisation: a row of K
values is K / block_size blocks of `type_size` bytes each (Q8_0: 32 values in 34 bytes; Q4_K: 256 values
in 144 bytes). Such a layer is held in memory exactly as stored, as U8 bytes:

- `[N, K / block_size * type_size]` when K is a multiple of the block size (every release layer): rows of
  bytes are rows of the weight, so the fused-qkv split and the fc1 half swap move them unchanged;
- `[n_blocks, type_size]` otherwise (ComfyUI-GGUF's `comfy.gguf.orig_shape` files: a tensor quantised as one
  flat run of blocks); then the marker states the dense shape, and the layer cannot be row-split.

A block-quantised tensor of a module that is not a Linear (a convolution, an embedding table) is dequantised
once at load (`route.install`), as ComfyUI-GGUF does with large token tables: only Linears compute from blocks.

The accepted quantised types are exactly those diffusers' torch dequantisers know
(`diffusers.quantizers.gguf.utils.dequantize_functions`: Q4_0..Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS); any
other GGML type is refused by name before any weight is read. Dequantisation runs those functions in
float32 (bit-identical to the `gguf` package's numpy dequantiser) and casts once to the compute dtype.
"""

from __future__ import annotations

import functools

import torch

from ..errors import H3WeightsError

GGUF = "gguf"  # the layer format (the marker's "format") of a GGUF block-quantised layer
DENSE_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # GGML type -> safetensors dtype tag


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


def marker(ggml_type: str, shape: tuple[int, ...]) -> dict:
    """The marker the loaders give a GGUF layer (GGUF files carry none): its type, and its dense shape only
    when the storage is flat (a row-aligned layer's shape follows from its bytes, also after a row split)."""
    out = {"format": GGUF, "ggml_type": ggml_type}
    if len(shape) != 2 or shape[1] % block_sizes(ggml_type)[0]:
        out["shape"] = [int(dim) for dim in shape]
    return out


def dense_shape(marker_dict: dict, stored: tuple[int, ...], where: str) -> tuple[int, ...]:
    """The shape a GGUF tensor stands for ([N, K] for a layer), from its marker and stored bytes (validated)."""
    ggml_type = marker_dict.get("ggml_type")
    if ggml_type not in quantised_types():
        raise H3WeightsError(f"{where}: GGML type {ggml_type!r} is not read (supported: {supported_text()})")
    block, size = block_sizes(ggml_type)
    if len(stored) != 2:
        raise H3WeightsError(f"{where}: a {ggml_type} layer is stored as U8 2-D bytes, got {list(stored)}")
    if "shape" in marker_dict:
        shape = tuple(int(d) for d in marker_dict["shape"])
        numel = 1
        for dim in shape:
            numel *= dim
        if numel != stored[0] * stored[1] // size * block or stored[1] != size:
            raise H3WeightsError(f"{where}: {ggml_type} bytes {list(stored)} do not hold a {list(shape)} weight")
        return shape
    if stored[1] % size:
        raise H3WeightsError(f"{where}: {ggml_type} rows of {stored[1]} bytes are not whole {size}-byte blocks")
    return (stored[0], stored[1] // size * block)


def dequantise(raw: torch.Tensor, ggml_type: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The dense `shape` weight of one GGUF layer in `dtype` (diffusers' dequantiser, run in float32)."""
    gguf, functions = _library()
    qtype = gguf.GGMLQuantizationType[ggml_type]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size)
    dense = functions[qtype](blocks, block, size, dtype=torch.float32)
    return dense.reshape(shape).to(dtype)
