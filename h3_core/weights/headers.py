"""A checkpoint's safetensors headers (one file or every shard), read without touching tensor data.

Detection and checking must take seconds even for a 66 GB file, so everything here reads only the
header (through `h3_core.safetensors_header`, the package's one parser) and nothing else. Tensors can
then be stood in for by `meta` tensors of the right dtype and shape, which run through the same key
converters as real weights do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..safetensors_header import DTYPES, HeaderError
from ..safetensors_header import read_header as read_safetensors_header
from .errors import H3WeightsError, IncompleteFileError
from .tensor_info import TensorInfo


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

    @property
    def container(self) -> str:
        """"gguf" for GGUF files (`gguf_file`), else "safetensors"."""
        return "gguf" if any(info.ggml_type for info in self.tensors.values()) else "safetensors"


def read_file_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse one `.safetensors` (or GGUF, told by its magic) header: `{name: TensorInfo}` and the metadata."""
    from . import gguf_file

    if gguf_file.is_gguf(path):
        return gguf_file.read_file_header(path)
    try:
        file_size = os.path.getsize(path)
        parsed = read_safetensors_header(path)
    except OSError as exc:
        raise H3WeightsError(f"{path}: cannot read safetensors header ({exc.strerror or exc})") from exc
    except HeaderError as exc:
        raise H3WeightsError(f"{path}: not a safetensors file ({exc})") from None
    tensors = {name: TensorInfo(dtype=entry.dtype, shape=entry.shape, file=path)
               for name, entry in parsed.tensors.items()}
    # An interrupted download keeps a valid header but loses data; say so before anyone loads it.
    if file_size < parsed.data_start + parsed.data_end:
        raise IncompleteFileError(
            f"{path}: incomplete file - the header describes {parsed.data_start + parsed.data_end} bytes, the file "
            f"has {file_size} (interrupted download?)"
        )
    return tensors, {str(k): str(v) for k, v in (parsed.metadata or {}).items()}


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
    dtype = DTYPES.get(info.dtype, torch.uint8)
    return torch.empty(info.shape, dtype=dtype, device="meta")


def meta_state_dict(header: Header) -> dict[str, torch.Tensor]:
    """The whole checkpoint as meta tensors, for running converters without reading data."""
    return {name: meta_tensor(info) for name, info in header.tensors.items()}
