"""Read safetensors headers without touching tensor data.

Detection and checking must take seconds even for a 66 GB file, so everything here parses the
JSON header (the first `8 + n` bytes of the file) and nothing else. Tensors can then be stood in
for by `meta` tensors of the right dtype and shape, which run through the same key converters as
real weights do.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from .errors import H3WeightsError, IncompleteFileError

# safetensors dtype tags -> torch dtypes. Tags missing here (exotic fp4 packings...) are kept as
# strings in TensorInfo and refused later by name, never silently reinterpreted.
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

# A header larger than this is not a real checkpoint header (the release DiT's is ~100 KB).
_MAX_HEADER_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it."""

    dtype: str
    shape: tuple[int, ...]
    file: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        torch_dtype = SAFETENSORS_DTYPES.get(self.dtype)
        itemsize = torch_dtype.itemsize if torch_dtype is not None else 1
        return numel * itemsize


@dataclass(frozen=True)
class Header:
    """All tensors of one checkpoint (one file or all shards of a folder) plus file metadata."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    files: tuple[str, ...]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.tensors.items()}

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())


def read_file_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse one `.safetensors` header: `{name: TensorInfo}` and the `__metadata__` dict."""
    try:
        file_size = os.path.getsize(path)
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise H3WeightsError(f"{path}: too short to be a safetensors file (no 8-byte header length)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise H3WeightsError(
                    f"{path}: not a safetensors file (header length {header_len} does not fit in {file_size} bytes)"
                )
            raw = handle.read(header_len)
    except OSError as exc:
        raise H3WeightsError(f"{path}: cannot read safetensors header ({exc})") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise H3WeightsError(f"{path}: safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise H3WeightsError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    data_end = 0
    for name, entry in header.items():
        try:
            tensors[name] = TensorInfo(dtype=str(entry["dtype"]), shape=tuple(int(s) for s in entry["shape"]), file=path)
            data_end = max(data_end, int(entry["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise H3WeightsError(f"{path}: malformed header entry for tensor {name!r}") from exc
    # An interrupted download keeps a valid header but loses data; say so before anyone loads it.
    if file_size < 8 + header_len + data_end:
        raise IncompleteFileError(
            f"{path}: incomplete file - the header describes {8 + header_len + data_end} bytes, the file has "
            f"{file_size} (interrupted download?)"
        )
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def read_header(files: list[str] | tuple[str, ...]) -> Header:
    """Merge the headers of one file or of all shards of a sharded checkpoint.

    A tensor name appearing in two shards is an error rather than "last one wins": a checkpoint
    that says two different things about one weight cannot be loaded faithfully.
    """
    if not files:
        raise H3WeightsError("no .safetensors files to read")
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for path in files:
        file_tensors, file_metadata = read_file_header(path)
        duplicated = set(tensors) & set(file_tensors)
        if duplicated:
            raise H3WeightsError(f"{path}: tensors also present in another shard: {sorted(duplicated)[:5]}")
        tensors.update(file_tensors)
        for key, value in file_metadata.items():
            metadata.setdefault(key, value)
    return Header(tensors=tensors, metadata=metadata, files=tuple(files))


def meta_tensor(info: TensorInfo) -> torch.Tensor:
    """A data-free stand-in for one tensor (dtype-exact when the tag is known)."""
    dtype = SAFETENSORS_DTYPES.get(info.dtype, torch.uint8)
    return torch.empty(info.shape, dtype=dtype, device="meta")


def meta_state_dict(header: Header) -> dict[str, torch.Tensor]:
    """The whole checkpoint as meta tensors, for running converters without reading data."""
    return {name: meta_tensor(info) for name, info in header.tensors.items()}
