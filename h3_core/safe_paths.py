"""Resolve a file or folder a workflow names, inside a root the operator chose, without trusting the name.

A workflow is data from whoever shared it: a name like `/etc/passwd`, `../../x`, a symlink out of the root, a
FIFO or a device must never be opened. Every check here works on the name and on `stat` results, so nothing is
opened until the path is known to be a regular file inside the root; `open_regular` then opens without
blocking (a FIFO swapped in after the check cannot hang the caller) and checks the opened file again.

Error messages name the constraint and the (truncated) name the workflow gave, never bytes of any file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from .safetensors_header import HeaderError, read_header

MAX_NAME_CHARS = 200  # of a workflow-given name quoted in an error message


class UnsafePathError(ValueError):
    """The name does not resolve to an allowed file or folder; the message says which rule it broke."""


def _quoted(name: object) -> str:
    text = name if isinstance(name, str) else repr(name)
    if len(text) > MAX_NAME_CHARS:
        text = text[:MAX_NAME_CHARS] + "..."
    return repr(text)


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise UnsafePathError(f"{what}: expected a file name, got {_quoted(name)}")
    if "\x00" in name:
        raise UnsafePathError(f"{what}: the name {_quoted(name)} contains a NUL byte")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise UnsafePathError(f"{what}: {_quoted(name)} is an absolute path; give a name relative to the folder")
    if ".." in name.replace("\\", "/").split("/"):
        raise UnsafePathError(f"{what}: {_quoted(name)} contains '..'; only names inside the folder are allowed")
    return name


def _inside(root_real: str, candidate_real: str) -> bool:
    try:
        return os.path.commonpath([root_real, candidate_real]) == root_real and candidate_real != root_real
    except ValueError:  # different drives
        return False


def resolve_file(root: str | os.PathLike, name: str, *, suffixes: tuple[str, ...] = (".safetensors",),
                 what: str = "file", folder_label: str | None = None) -> Path:
    """The real path of regular file `name` under `root`.

    Refuses absolute names, `..`, anything whose real path (symlinks resolved) leaves the root, names not ending
    in one of `suffixes`, and anything that is not a regular file (FIFOs, devices, sockets, folders). Only `stat`
    is used: nothing is opened.
    """
    label = folder_label or os.fspath(root)
    _check_name(name, what)
    if suffixes and not name.lower().endswith(tuple(s.lower() for s in suffixes)):
        raise UnsafePathError(f"{what}: {_quoted(name)} is not a {'/'.join(suffixes)} file")
    root_real = os.path.realpath(root)
    candidate = os.path.realpath(os.path.join(root_real, name))
    if not _inside(root_real, candidate):
        raise UnsafePathError(f"{what}: {_quoted(name)} resolves outside {label} (symlinks are followed before "
                              "this check)")
    if suffixes and not candidate.lower().endswith(tuple(s.lower() for s in suffixes)):
        raise UnsafePathError(f"{what}: {_quoted(name)} links to a file that is not a {'/'.join(suffixes)} file")
    try:
        info = os.stat(candidate)
    except OSError:
        raise UnsafePathError(f"{what}: {_quoted(name)} not found in {label}") from None
    if not stat.S_ISREG(info.st_mode):
        raise UnsafePathError(f"{what}: {_quoted(name)} is not a regular file (FIFOs, devices and folders are "
                              "refused)")
    return Path(candidate)


def resolve_child_dir(roots: list[str | os.PathLike], name: str, *, what: str = "model folder",
                      folder_label: str = "the model folder") -> Path:
    """The folder `name` directly inside one of `roots` (first match).

    `name` must be exactly one path component: the workflow cannot walk anywhere. An entry the operator placed
    in the root (a real folder, or a symlink to one) is used as it is, the way ComfyUI follows symlinks in its
    own model folders.
    """
    _check_name(name, what)
    if "/" in name or "\\" in name or name in (".", ""):
        raise UnsafePathError(f"{what}: {_quoted(name)} must be the name of a folder directly inside {folder_label}")
    for root in roots:
        candidate = Path(os.path.realpath(root)) / name
        if candidate.parent != Path(os.path.realpath(root)):  # belt and braces: one component, no tricks
            continue
        try:
            info = os.stat(candidate)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode):
            return candidate
    raise UnsafePathError(f"{what}: {_quoted(name)} not found in {folder_label}")


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """Open a regular file for reading without ever blocking on a FIFO, and check what was opened."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        raise UnsafePathError(f"cannot open {_quoted(os.fspath(path))}: {error.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(f"{_quoted(os.fspath(path))} is not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_safetensors_header(path: str | os.PathLike, what: str = "file") -> dict:
    """Read only the 8-byte length prefix and the JSON header of a safetensors file (the pack's one header
    parser), check them against the file size, and return the tensor table. The message states which rule was
    broken, never the bytes or numbers read: the file may be anything on the host."""
    with open_regular(path) as handle:
        try:
            return read_header(handle, size=os.fstat(handle.fileno()).st_size).tensors
        except HeaderError:
            raise UnsafePathError(f"{what}: not a safetensors file (its length prefix or JSON header is malformed "
                                  "or does not fit the file)") from None
