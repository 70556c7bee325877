"""The one safetensors header parser: bytes or a file in, the header's tensor table and metadata out.

A safetensors file is `u64 little-endian N`, then N bytes of JSON (`{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`), then the data buffer the offsets point
into. Everything here reads only the first `8 + N` bytes, so a 66 GB checkpoint is inspected in
milliseconds, and every size is checked before anything is allocated for it: the length prefix
against one cap, the JSON's nesting depth before it is parsed (a hostile header of a million `[`
would otherwise raise RecursionError inside `json`), every entry's shape against its byte span.

Callers add their own policy on top: the weights code turns `HeaderError` into `H3WeightsError`
and checks that the file holds the data the offsets describe; the conditioning contract checks its
tensor set, checksums and that the tensors tile the data buffer exactly.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

# Also `DTYPES` and `DTYPE_TAGS` (tag <-> torch dtype), built on first use by the module's `__getattr__`.
__all__ = [
    "MAX_COUNT",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS_PER_FILE",
    "MAX_JSON_DEPTH",
    "ITEMSIZES",
    "HeaderError",
    "ParsedHeader",
    "TensorEntry",
    "header_length",
    "loads_bounded",
    "parse_header",
    "read_header",
]

# safetensors dtype tags -> bytes per element. A tag missing here (exotic fp4 packings ...) is kept as a string in
# `TensorEntry.dtype` and refused later, by name, by whoever needs the data. Parsing needs only these sizes, so the
# module imports no torch: the media sandbox's decoder host (kept torch-free) reads its results' headers here too.
ITEMSIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
    "F8_E8M0": 1,  # mxfp8 block scales (power-of-two exponents)
}
# ... and -> torch dtypes (`DTYPES`, with the inverse `DTYPE_TAGS`), built on first use (see `__getattr__`).
_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}
_torch_tables: dict[str, dict] = {}


def __getattr__(name: str):
    """`DTYPES` (tag -> torch dtype) and `DTYPE_TAGS` (torch dtype -> tag), importing torch when first asked for."""
    if name not in ("DTYPES", "DTYPE_TAGS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _torch_tables:
        import torch

        dtypes = {tag: getattr(torch, attr) for tag, attr in _TORCH_NAMES.items()}
        _torch_tables.update(DTYPES=dtypes, DTYPE_TAGS={dtype: tag for tag, dtype in dtypes.items()})
    return _torch_tables[name]

# A model header is bounded by what a model file holds: its tensor count, each entry's size, and the metadata.
# H3's largest published file has about 2,000 tensors and a header of a few hundred KB (docs/REAL_WEIGHTS.md); the
# caps leave 8x room. safetensors' own cap (100 MB) let a hostile 93 MB header cost minutes of parsing and GBs of
# memory before any check: a header over this one is refused from its 8-byte length prefix, before it is read.
MAX_TENSORS_PER_FILE = 16_384
MAX_ENTRY_BYTES = 384  # one `"name":{"dtype":..,"shape":[..],"data_offsets":[..,..]}` with a long name
MAX_METADATA_BYTES = 2 << 20  # `__metadata__` (quantisation maps, provenance)
MAX_HEADER_BYTES = MAX_TENSORS_PER_FILE * MAX_ENTRY_BYTES + MAX_METADATA_BYTES  # 8 MiB
# Shapes and offsets are int64 wherever they are used (torch, numpy): a larger count is corrupt, not big.
MAX_COUNT = (1 << 63) - 1
# A safetensors header nests 3 deep ({name: {"shape": [...]}}); anything far deeper is hostile.
MAX_JSON_DEPTH = 16

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


class HeaderError(ValueError):
    """The bytes are not a well-formed safetensors header. Messages state sizes and names, never raw bytes."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it; `begin`/`end` are relative to the start of the data buffer."""

    name: str
    dtype: str  # the safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self):
        """The tag's torch dtype (None for a tag torch has no dtype for); imports torch."""
        return __getattr__("DTYPES").get(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ParsedHeader:
    """A parsed header: the tensor table (file order), the raw `__metadata__` and where the data starts."""

    tensors: dict[str, TensorEntry]
    metadata: dict | None
    header_len: int

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_end(self) -> int:
        """Bytes of data buffer the offsets reach (its minimal length)."""
        return max((entry.end for entry in self.tensors.values()), default=0)


def header_length(prefix: bytes | bytearray | memoryview, max_bytes: int = MAX_HEADER_BYTES) -> int:
    """The JSON header length N from the 8-byte prefix, refused above `max_bytes`."""
    if len(prefix) < 8:
        raise HeaderError(f"truncated: {len(prefix)} bytes is shorter than the 8-byte safetensors length prefix")
    n = int.from_bytes(bytes(prefix[:8]), "little")
    if n > max_bytes:
        raise HeaderError(f"corrupted: header length {n} exceeds the {max_bytes}-byte limit")
    return n


def _max_depth(raw: bytes) -> int:
    """Deepest `[`/`{` nesting of a JSON text, ignoring brackets inside strings; vectorised, no recursion."""
    stripped = _STRING.sub(b'""', raw)
    steps = _DEPTH_STEP[np.frombuffer(stripped, dtype=np.uint8)]
    if not steps.any():
        return 0
    return int(np.cumsum(steps, dtype=np.int64).max())


def loads_bounded(raw: bytes | bytearray | memoryview | str, what: str = "header",
                  max_depth: int = MAX_JSON_DEPTH) -> object:
    """`json.loads` that refuses nesting deeper than `max_depth` before parsing, and never echoes the input."""
    data = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"corrupted or not safetensors: {what} is not valid JSON (not UTF-8 at byte "
                          f"{exc.start})") from None
    depth = _max_depth(data)
    if depth > max_depth:
        raise HeaderError(f"corrupted: {what} JSON nests {depth} deep, more than the {max_depth} allowed")
    try:
        return json.loads(text)
    except RecursionError:  # unreachable after the depth check; kept so no input can escape as RecursionError
        raise HeaderError(f"corrupted: {what} JSON nests too deep") from None
    except ValueError as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        pos = f" at byte {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
        raise HeaderError(f"corrupted or not safetensors: {what} is not valid JSON ({detail}{pos})") from None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(name: str, limit: int = 60) -> str:
    """A tensor name as an error message shows it: escaped and cut short (names come from the file)."""
    text = ascii(name)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def parse_header(raw: bytes | bytearray | memoryview, header_len: int | None = None,
                 max_tensors: int = MAX_TENSORS_PER_FILE) -> ParsedHeader:
    """Parse the N header bytes (without the prefix) into a tensor table.

    Checks what every safetensors reader needs: a JSON object of well-formed entries whose byte span
    matches its shape for every known dtype, at most `max_tensors` entries, every dimension and offset an int64.
    It does not check that spans are disjoint or tile the
    buffer: callers that need that (the contract) check it against the data they hold.
    """
    header = loads_bounded(raw)
    if not isinstance(header, dict):
        raise HeaderError("corrupted or not safetensors: header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise HeaderError("corrupted: __metadata__ is not a JSON object")
    if len(header) > max_tensors:
        raise HeaderError(f"corrupted: the header lists {len(header)} tensors, more than the {max_tensors} allowed")
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise HeaderError(f"corrupted tensor table entry for {_shown(name)}")
        tag, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not (isinstance(tag, str) and isinstance(shape, list) and all(_is_count(s) for s in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise HeaderError(f"corrupted tensor table entry for {_shown(name)}")
        begin, end = offsets
        # torch and numpy count in int64 and multiply every dimension, even beside a 0: [1, 0, 2**64] is corrupt
        if end > MAX_COUNT or math.prod(s for s in shape if s) * 8 > MAX_COUNT:
            raise HeaderError(f"corrupted: tensor {_shown(name)} has shape {_shown(str(shape))} or offsets beyond "
                              f"what an int64 can count")
        itemsize = ITEMSIZES.get(tag)
        if itemsize is not None:
            nbytes = math.prod(shape) * itemsize
            if end - begin != nbytes:
                raise HeaderError(f"corrupted: tensor {_shown(name)} spans {end - begin} bytes, its shape needs "
                                  f"{nbytes}")
        tensors[name] = TensorEntry(name, tag, tuple(shape), begin, end)
    return ParsedHeader(tensors, metadata, len(raw) if header_len is None else header_len)


def _read_exactly(handle: BinaryIO, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = handle.read(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_header(source: bytes | bytearray | memoryview | BinaryIO | str | os.PathLike,
                max_bytes: int = MAX_HEADER_BYTES, size: int | None = None,
                max_tensors: int = MAX_TENSORS_PER_FILE) -> ParsedHeader:
    """Parse the header of a safetensors byte string, an open binary file (read from its current position)
    or a path. Reads exactly `8 + N` bytes, and none of the N when `size` (the file's, known for a path)
    cannot hold them; the size of what follows is the caller's to check."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        n = header_length(source, max_bytes)
        if 8 + n > len(source):
            raise HeaderError(f"truncated: header claims {n} bytes but only {len(source) - 8} follow the length "
                              f"prefix")
        return parse_header(memoryview(source)[8:8 + n], n, max_tensors)
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as handle:
            return read_header(handle, max_bytes, os.fstat(handle.fileno()).st_size, max_tensors)
    n = header_length(_read_exactly(source, 8), max_bytes)
    if size is not None and 8 + n > size:
        raise HeaderError(f"truncated: header claims {n} bytes but only {max(0, size - 8)} follow the length "
                          f"prefix")
    raw = _read_exactly(source, n)
    if len(raw) != n:
        raise HeaderError(f"truncated: header claims {n} bytes but only {len(raw)} follow the length prefix")
    return parse_header(raw, n, max_tensors)
