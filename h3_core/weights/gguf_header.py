"""The pack's own GGUF header reader: bounded, so a hostile or cut file costs milliseconds and a few MB.

The `gguf` package's `GGUFReader` trusts the counts it reads: one metadata array claiming 2^62 items made it
allocate until the machine ran dry, and model-folder listings read every `.gguf` header (`/object_info` hung). This
reader parses the same format (magic, version, tensor and key/value counts, every key with its typed value, arrays
with their item type and count, strings with their length, then the tensor directory) under these rules:

- every count and length is checked against the bytes left in the file *before* anything is read or allocated:
  a count the rest of the file cannot hold is a cut file or a lie, and both get the "incomplete file (interrupted
  download?)" message naming what claimed too much;
- `MAX_TENSORS` tensor entries, `MAX_KEYS` metadata entries, `MAX_HEADER_BYTES` of header, `MAX_WALKED` strings or
  nested arrays walked through and `MAX_DEPTH` levels of array nesting at most (each justified where defined);
- metadata arrays are skipped (their bytes stepped over, never turned into Python objects) unless the caller keeps
  their key (`keep`): a tokenizer's 150k strings cost a walk over lengths, not 150k objects; a kept array is small
  or refused (`MAX_KEPT_ITEMS`);
- the header is read with plain reads in bounded chunks (never mapped: a file cut while mapped is a SIGBUS).

Only the format is parsed here (no `gguf`, torch or numpy): GGML type ids, shapes and data extents are judged by
`gguf_file`, which turns the `Directory` into `TensorInfo`s. Directories are cached by (path, size, mtime) with the
error of a bad file, so the several looks one load takes (listing, projector pairing, the header) parse once.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

from .errors import H3WeightsError, IncompleteFileError

MAGIC = b"GGUF"
# Real GGUF files hold < 2,000 tensors (H3's DiT ~1,500, a 32B Qwen3-VL ~700 plus ~350 in its projector; llama.cpp's
# largest published models ~1,100). 16,384 is 8x the largest and bounds what one hostile directory costs (~0.1 s).
MAX_TENSORS = 16_384
# Metadata: ~40 keys in llama.cpp files, one `comfy.gguf.orig_shape.*` key per reshaped tensor in ComfyUI-GGUF's.
MAX_KEYS = MAX_TENSORS + 4_096
# A real header (tokenizer vocabulary and merges included) is < 10 MB; 64 MiB is what one header read may hold.
MAX_HEADER_BYTES = 64 << 20
# Strings inside arrays and nested arrays are walked one by one (each states its own length): the largest real
# vocabularies walk < 450k (Llama 3: 128k tokens + 280k merges; Qwen: 151k + 151k; Gemma 3: 262k). 1M is twice that
# and bounds a walk to ~0.5 s of one core.
MAX_WALKED = 1 << 20
MAX_DEPTH = 2  # arrays of arrays: the format allows them, no writer nests deeper than one level
MAX_KEPT_ITEMS = 4_096  # a kept array (an original shape, a rope section list, a layer flag list) is this small
MAX_KEPT_TOTAL = 1 << 16  # and all of a file's kept items together (one short shape a tensor at most)
MAX_NAME = 65_535  # the format's own limit on a key's length; also applied to tensor names
MAX_DIMS = 4  # GGML_MAX_DIMS
_CHUNK = 1 << 20
_U64 = struct.Struct("<Q")

# GGUF value types: id -> (name, struct code, size); STRING (8) and ARRAY (9) are variable-sized.
_SCALARS = {0: ("UINT8", "B", 1), 1: ("INT8", "b", 1), 2: ("UINT16", "H", 2), 3: ("INT16", "h", 2),
            4: ("UINT32", "I", 4), 5: ("INT32", "i", 4), 6: ("FLOAT32", "f", 4), 7: ("BOOL", "?", 1),
            10: ("UINT64", "Q", 8), 11: ("INT64", "q", 8), 12: ("FLOAT64", "d", 8)}
STRING, ARRAY = 8, 9
_MIN_SIZE = {**{k: v[2] for k, v in _SCALARS.items()}, STRING: 8, ARRAY: 12}  # the least bytes one item takes


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the directory: dimensions as stored (innermost first), GGML type id, absolute data offset."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int


@dataclass(frozen=True)
class Directory:
    path: str
    size: int
    version: int
    alignment: int
    data_start: int
    tensors: tuple[TensorEntry, ...]
    values: dict  # every scalar value, and the arrays of kept keys as lists; other arrays are absent


class _Cursor:
    """Little-endian reads from the file's start, each checked against the bytes the file has left. Reads go
    forward through a window of about `_CHUNK` bytes, so stepping over a large array holds none of it."""

    def __init__(self, handle, path: str, size: int):
        self.handle, self.path, self.size = handle, path, size
        self.window, self.base, self.pos, self.walked, self.kept = b"", 0, 0, 0, 0

    def left(self) -> int:
        return self.size - self.pos

    def need(self, count: int, what: str) -> None:
        """Refuse, before reading or allocating, a `count` of bytes the file or the header cap cannot hold."""
        if count > self.left():
            raise IncompleteFileError(
                f"{self.path}: incomplete file - {what} needs {count} bytes at byte {self.pos}, the file has "
                f"{self.left()} left (interrupted download?)")
        if self.pos + count > MAX_HEADER_BYTES:
            raise H3WeightsError(f"{self.path}: GGUF header larger than {MAX_HEADER_BYTES >> 20} MiB ({what} at "
                                 f"byte {self.pos} needs {count} more); real headers are < 10 MB")

    def _fill(self, count: int, what: str) -> None:
        """Make the `count` bytes at the position readable from the window (checked first)."""
        self.need(count, what)
        end = self.pos + count
        if end > self.base + len(self.window):
            offset = self.pos - self.base
            tail = self.window[offset:] if 0 <= offset <= len(self.window) else b""
            start = self.pos + len(tail)
            self.handle.seek(start)
            self.window = tail + self.handle.read(min(max(end - start, _CHUNK), self.size - start))
            self.base = self.pos
            if self.base + len(self.window) < end:  # the file shrank since its size was read
                ended = self.base + len(self.window)
                raise IncompleteFileError(f"{self.path}: incomplete file - it ended at byte {ended} while reading "
                                          f"{what} (interrupted download?)")

    def take(self, count: int, what: str) -> bytes:
        self._fill(count, what)
        out = self.window[self.pos - self.base:self.pos - self.base + count]
        self.pos += count
        return out

    def skip_strings(self, count: int, what: str) -> None:
        """Step over `count` strings (the hot path of tokenizer arrays: one length read and one step each)."""
        unpack = _U64.unpack_from
        for _ in range(count):
            if self.pos + 8 > self.base + len(self.window):
                self._fill(8, what)
            length = unpack(self.window, self.pos - self.base)[0]
            self.pos += 8
            self.skip(length, what)

    def skip(self, count: int, what: str) -> None:
        self.need(count, what)
        self.pos += count

    def unpack(self, code: str, what: str):
        return struct.unpack("<" + code, self.take(struct.calcsize("<" + code), what))

    def u32(self, what: str) -> int:
        return self.unpack("I", what)[0]

    def u64(self, what: str) -> int:
        return self.unpack("Q", what)[0]

    def string(self, what: str, limit: int | None = None) -> bytes:
        length = self.u64(f"the length of {what}")
        if limit is not None and length > limit:
            raise H3WeightsError(f"{self.path}: {what} is {length} bytes long, more than the {limit} allowed")
        return self.take(length, what)

    def count_walk(self, count: int, what: str) -> None:
        self.walked += count
        if self.walked > MAX_WALKED:
            raise H3WeightsError(f"{self.path}: {what}: more than {MAX_WALKED} strings or arrays inside metadata "
                                 "arrays (real files walk < 450,000)")


def _decode(raw: bytes, path: str, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise H3WeightsError(f"{path}: {what} is not UTF-8 text") from None


def _value(cur: _Cursor, type_id: int, key: str, keep: bool, depth: int = 0):
    """One value of `type_id`; arrays are returned as lists when `keep`, else stepped over (None)."""
    if type_id in _SCALARS:
        return cur.unpack(_SCALARS[type_id][1], f"the value of {key}")[0]
    if type_id == STRING:
        return _decode(cur.string(f"the string value of {key}"), cur.path, f"the value of {key}")
    if type_id != ARRAY:
        raise H3WeightsError(f"{cur.path}: {key}: unknown GGUF value type {type_id}")
    if depth >= MAX_DEPTH:
        raise H3WeightsError(f"{cur.path}: {key}: arrays nested more than {MAX_DEPTH} deep")
    item_type, count = cur.unpack("IQ", f"the array header of {key}")
    if item_type not in _MIN_SIZE:
        raise H3WeightsError(f"{cur.path}: {key}: unknown GGUF array item type {item_type}")
    what = f"metadata array {key} ({count} items)"
    cur.need(count * _MIN_SIZE[item_type], what)  # before a single item is read
    if keep:
        cur.kept += count
        if count > MAX_KEPT_ITEMS or cur.kept > MAX_KEPT_TOTAL:
            raise H3WeightsError(f"{cur.path}: {what}: more than the {MAX_KEPT_ITEMS} items (and {MAX_KEPT_TOTAL} in "
                                 "all) read for the keys the pack uses")
    if item_type in _SCALARS:
        _, code, size = _SCALARS[item_type]
        if not keep:
            cur.skip(count * size, what)
            return None
        return list(struct.unpack(f"<{count}{code}", cur.take(count * size, what)))
    cur.count_walk(count, what)
    if keep:
        return [_value(cur, item_type, key, True, depth + 1) for _ in range(count)]
    if item_type == STRING:
        cur.skip_strings(count, what)
    else:
        for _ in range(count):
            _value(cur, item_type, key, False, depth + 1)
    return None


def parse(path: str, keep: tuple[str, ...] = ()) -> Directory:
    """The directory of the GGUF file at `path` (see the module docstring); arrays of keys starting with one of
    `keep` are kept as lists. Raises `H3WeightsError` (`IncompleteFileError` for a cut file) naming the limit."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            return _parse(_Cursor(handle, path, size), keep)
    except OSError as exc:
        raise H3WeightsError(f"{path}: cannot read the GGUF header ({exc.strerror or exc})") from None


def _parse(cur: _Cursor, keep: tuple[str, ...]) -> Directory:
    path = cur.path
    if bytes(cur.take(4, "the GGUF magic")) != MAGIC:
        raise H3WeightsError(f"{path}: not a GGUF file (no GGUF magic)")
    version = cur.u32("the GGUF version")
    if version & 0xFFFF == 0 and version >> 16:
        raise H3WeightsError(f"{path}: a big-endian GGUF file; only little-endian GGUF files are read")
    if version not in (2, 3):
        raise H3WeightsError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
    n_tensors, n_keys = cur.u64("the tensor count"), cur.u64("the metadata count")
    if n_tensors > MAX_TENSORS:
        raise H3WeightsError(f"{path}: {n_tensors} tensor entries, more than the {MAX_TENSORS} a GGUF file may hold "
                             "here (real files hold < 2,000)")
    if n_keys > MAX_KEYS:
        raise H3WeightsError(f"{path}: {n_keys} metadata entries, more than the {MAX_KEYS} a GGUF file may hold here")
    # Each key/value takes >= 13 bytes and each tensor entry >= 24: a count the file cannot hold stops here.
    cur.need(n_keys * 13 + n_tensors * 24, f"{n_keys} metadata entries and {n_tensors} tensor entries")
    values: dict = {}
    keys: set[str] = set()
    for index in range(n_keys):
        key = _decode(cur.string(f"metadata key #{index}", MAX_NAME), path, f"metadata key #{index}")
        if key in keys:
            raise H3WeightsError(f"{path}: metadata key {key!r} appears twice")
        keys.add(key)
        kept = key.startswith(keep) if keep else False
        value = _value(cur, cur.u32(f"the type of {key}"), key, kept)
        if value is not None:
            values[key] = value
    alignment = values.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 30:
        raise H3WeightsError(f"{path}: general.alignment {alignment!r} is not a power of two (UINT32)")
    tensors, seen = [], set()
    for index in range(n_tensors):
        name = _decode(cur.string(f"tensor name #{index}", MAX_NAME), path, f"tensor name #{index}")
        if name in seen:
            raise H3WeightsError(f"{path}: tensor {name!r} appears twice")
        seen.add(name)
        n_dims = cur.u32(f"the dimension count of {name}")
        if n_dims > MAX_DIMS:
            raise H3WeightsError(f"{path}: {name}: {n_dims} dimensions, more than GGML's {MAX_DIMS}")
        dims = cur.unpack(f"{n_dims}Q", f"the dimensions of {name}")
        type_id, offset = cur.unpack("IQ", f"the type and offset of {name}")
        tensors.append(TensorEntry(name, tuple(dims), type_id, offset))
    data_start = cur.pos + (-cur.pos) % alignment
    tensors = tuple(TensorEntry(t.name, t.dims, t.type_id, data_start + t.offset) for t in tensors)
    return Directory(path, cur.size, version, alignment, data_start, tensors, values)


# --- cache ------------------------------------------------------------------------------------------------------

_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 16  # one load's looks at a file and its neighbours (a directory at the caps is ~3 MB)
_LOCK = threading.Lock()  # model-folder listings may read headers in a worker thread


def read(path: str, keep: tuple[str, ...] = ()) -> Directory:
    """`parse`, cached by (path, size, mtime): a file's directory and its error are read once per version."""
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise H3WeightsError(f"{path}: cannot read the GGUF header ({exc.strerror or exc})") from None
    key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns, keep)
    with _LOCK:
        found = _CACHE.get(key)
        if found is not None:
            _CACHE.move_to_end(key)
    if found is None:
        try:
            found = parse(path, keep)
        except H3WeightsError as exc:
            found = exc
        with _LOCK:
            _CACHE[key] = found
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    if isinstance(found, H3WeightsError):
        raise type(found)(str(found))  # a fresh exception: the cached one keeps no traceback chain
    return found
