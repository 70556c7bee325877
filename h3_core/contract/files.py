"""The contract as a file: `save` writes the wire form (`wire.encode`) piece by piece, `load` checks it and
memory-maps it.

`load` reads the 8-byte prefix and the header first and checks them against the file's size before it maps
or reads any data, and refuses anything but a regular file without opening it for a read that could block (a
FIFO, a device). The data is then mapped copy-on-write (the tensors are views of the mapping: writable, private
to this process, paged in from the page cache) and checked with one checksum pass, the only full read; with
`mmap=False` it is read into one buffer instead, which the tensors then own.

A mapped file must not be truncated in place while its tensors live (the pages behind the cut would fault):
`save` never does that (a temporary file, then a rename; the old mapping keeps the old inode). Windows cannot
rename over a mapped file, so there `load` reads eagerly unless asked.
"""

from __future__ import annotations

import mmap as _mmap
import os
import secrets
import stat

from .. import safetensors_header as st
from . import wire
from .errors import ContractError

MAP_BY_DEFAULT = os.name != "nt"


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
    buf = wire.new_buffer(length)
    view, got = memoryview(buf), 0
    while got < length:
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    if got != length:
        raise _bad(f"truncated: read {got} of {length} data bytes from {shown} (changed while reading?)")
    return buf


def load(cls, path: str | os.PathLike, *, mmap: bool | None = None):
    """Read, check and validate a file written by `save` (or a version-1 file): prefix and header first, then the
    data mapped (`mmap=True`, the default except on Windows) or read into memory (`mmap=False`)."""
    use_map = MAP_BY_DEFAULT if mmap is None else bool(mmap)
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
        try:
            parsed = st.read_header(f, size=info.st_size)
        except st.HeaderError as error:
            raise _bad(str(error)) from None
        checked = wire.plan(parsed, info.st_size - parsed.data_start)
        if use_map and checked.data_len:
            try:
                buf = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_COPY)
            except (OSError, ValueError) as error:
                raise _bad(f"cannot map {shown}: {error}") from None
            if len(buf) != info.st_size:
                buf.close()
                raise _bad(f"truncated: {shown} changed size while being read")
            start = parsed.data_start
        else:
            buf, start = _read_data(f, checked.data_len, shown), 0
    wire.verify(checked, memoryview(buf)[start:start + checked.data_len])
    return wire.build(cls, checked, buf, start)
