"""The contract as a file: `save` writes the wire form (`wire.encode`) piece by piece, `load` reads it into memory
and checks it.

Conditioning files are files users can upload or replace (ComfyUI's `input/`, a `--cond` argument), and they are
small, so `load` never memory-maps them: a mapping shares the file's pages, so a file rewritten in place would
change tensors after their checksum was verified, and one truncated in place would kill the process with SIGBUS
on the next read of a page past the cut. Instead `load` reads the 8-byte prefix and the header first, checks
them against the file's size (the header against the contract's own cap, `wire.MAX_HEADER_BYTES`) before it reads
any data, reads the data into one buffer that the tensors then own, and checks it after reading (the checksum,
every value finite). It refuses anything but a regular file without opening it for a read that could block (a
FIFO, a device). A file that changes while it is read fails with a clear `ContractError`; one that changes after
`load` returned cannot touch the conditioning.
"""

from __future__ import annotations

import os
import secrets
import stat

from .. import safetensors_header as st
from . import wire
from .errors import ContractError


def _bad(msg: str) -> ContractError:
    return ContractError(f"payload: {msg}", field="payload")


def save(cond, path: str | os.PathLike) -> None:
    """Write the wire form to `path` atomically (a temporary file in the same folder, then a rename), the header
    and then each tensor's bytes straight from its storage."""
    encoded = wire.encode(cond)
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as f:
            for buffer in encoded.buffers():
                f.write(buffer)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _read_data(f, length: int, shown: str):
    """The next `length` bytes of `f` in one new buffer; a file that ends early, or goes on past them, changed
    while being read (its size was checked against the header before)."""
    buf = wire.new_buffer(length)
    view, got = memoryview(buf), 0
    while got < length:
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    if got != length or f.read(1):
        raise _bad(f"truncated: read {got} of {length} data bytes from {shown} (changed while reading?)")
    return buf


def _refuse_other_safetensors(prefix: bytes, size: int, shown: str) -> None:
    """A well-formed safetensors file whose header alone is larger than any conditioning's is another kind of file (a
    model or a LoRA: what users pick by mistake): say so, instead of the reader's "header length exceeds" words."""
    if len(prefix) == 8:
        n = int.from_bytes(prefix, "little")
        if wire.MAX_HEADER_BYTES < n <= size - 8:
            raise _bad(f"{shown} is not an H3 conditioning file: its safetensors header alone is {n} bytes, which "
                       f"exceeds the {wire.MAX_HEADER_BYTES}-byte limit of any conditioning (a model, LoRA or other "
                       "weights file?). Pick a file MiniMax H3 Save Conditioning or `python -m h3_core encode` wrote")


def load(cls, path: str | os.PathLike, *, mmap: bool | None = None):
    """Read, check and validate a file written by `save` (or a version-1 file): prefix and header first, then the
    data read into memory and checked after reading. `mmap=True` is refused: a conditioning file is never mapped
    (see the module's docstring); the keyword stays so older callers passing `mmap=False` keep working."""
    if mmap:
        raise ValueError("H3Conditioning.load never memory-maps a conditioning file (a file replaced or truncated "
                         "under a mapping changes or crashes the reader); omit mmap")
    path = os.fspath(path)
    shown = ascii(path) if len(path) <= 200 else ascii(path[:200]) + "..."
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        raise _bad(f"cannot read {shown}: {error.strerror}") from None
    if not stat.S_ISREG(mode):  # a directory, FIFO, socket or device: refuse without opening it
        raise _bad(f"{shown} is not a regular file")
    try:  # O_NONBLOCK: should the path be swapped for a FIFO after the check, opening it cannot hang
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as error:
        raise _bad(f"cannot read {shown}: {error.strerror}") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise _bad(f"{shown} is not a regular file")
        _refuse_other_safetensors(f.read(8), info.st_size, shown)
        f.seek(0)
        try:
            parsed = st.read_header(f, wire.MAX_HEADER_BYTES, info.st_size, wire.MAX_TENSORS)
        except st.HeaderError as error:
            raise _bad(str(error)) from None
        checked = wire.plan(parsed, info.st_size - parsed.data_start)
        if checked.trailing:
            raise _bad(f"{shown} is in wire form {wire.STREAM_VERSION} (an answer's streamed form, its checksum after "
                       f"the data); a conditioning file is form {wire.WIRE_VERSION}: write it with "
                       "H3Conditioning.save")
        buf = _read_data(f, checked.data_len, shown)
    wire.verify(checked, memoryview(buf))
    return wire.build(cls, checked, buf, 0)
