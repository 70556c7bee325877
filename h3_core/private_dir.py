"""A directory only this user can write, and the files in it, opened so that nobody else's file is trusted.

Used by the caches whose entries are believed once read (the encoder server's disk tier, remote/server/disk_cache.py,
and the per-user weight digests, weights/digest.py). Both hold only what this user wrote, so:

* the directory is created 0700, and an existing one that another user owns or that group or others may write is
  refused (`UnsafeDirectoryError`, naming the fix): anyone who can write there can plant an entry that is served;
* the directory is opened once and every later name is resolved against that descriptor (`dir_fd`), so a path
  component swapped for a link after the check changes nothing;
* names inside are opened with O_NOFOLLOW (a link is never followed, in or out of the directory) and O_NONBLOCK
  (a FIFO or device at an entry's name cannot block the caller), then checked with fstat: a regular file owned by
  this user, not writable by others, not larger than the caller's bound;
* files are written to a unique temporary name (O_EXCL, mode 0600) and renamed over the entry: readers see a
  whole file or none, and rename replaces a link or FIFO planted at the name rather than writing through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

# POSIX only (descriptor-relative names, O_NOFOLLOW, owners): where any is missing (Windows) nothing here may be
# used - callers check SUPPORTED - but importing the module must not fail, so the flags default to 0.
SUPPORTED = (os.name == "posix" and all(hasattr(os, flag) for flag in ("O_NOFOLLOW", "O_DIRECTORY", "O_NONBLOCK"))
             and os.open in os.supports_dir_fd and os.unlink in os.supports_dir_fd)
_NOFOLLOW, _DIRECTORY = getattr(os, "O_NOFOLLOW", 0), getattr(os, "O_DIRECTORY", 0)
_NONBLOCK, _CLOEXEC = getattr(os, "O_NONBLOCK", 0), getattr(os, "O_CLOEXEC", 0)
_OPEN_DIR = os.O_RDONLY | _DIRECTORY | _CLOEXEC
_OPEN_ENTRY = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC


class UnsafeDirectoryError(ValueError):
    """A cache directory that someone other than this user could write (or that is not a directory)."""


def why_unsafe(info: os.stat_result) -> str | None:
    """Why a directory or file with this stat may hold another user's bytes; None when only this user can write it."""
    if info.st_uid != os.geteuid():
        return f"it is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"its mode {stat.filemode(info.st_mode)} lets group or others write it"
    return None


def open_dir(path: str | os.PathLike, what: str, *, create: bool = True) -> int:
    """A descriptor of the private directory `path` (created 0700 with its parents when absent and `create`).

    The path itself may be a link the operator made (`/var/cache/h3 -> /ssd/h3`): the directory it leads to is the
    one checked and used. Raises `UnsafeDirectoryError` (saying how to fix it) for a directory others can write,
    and OSError when it cannot be created or opened."""
    path = os.fspath(path)
    if create:
        with contextlib.suppress(FileExistsError):
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            os.mkdir(path, 0o700)  # umask can only narrow it
    try:
        fd = os.open(path, _OPEN_DIR)
    except NotADirectoryError:
        raise UnsafeDirectoryError(f"{what} {path!r} is not a directory; choose another path") from None
    try:
        reason = why_unsafe(os.fstat(fd))
        if reason is not None:
            raise UnsafeDirectoryError(
                f"{what} {path!r} is refused: {reason}. Its entries are trusted once read, so only this user may "
                f"be able to write there: run `chmod 700 {path}` as its owner (`chown` it to this user if another "
                "user owns it), or choose a new directory, which is created with mode 0700")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_subdir(parent_fd: int, name: str, what: str) -> int:
    """A descriptor of the private sub-directory `name` of `parent_fd` (created 0700 when absent), never a link."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    try:
        fd = os.open(name, _OPEN_DIR | _NOFOLLOW, dir_fd=parent_fd)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeDirectoryError(f"{what}: {name!r} in the cache directory is not a directory (a link or a "
                                       "file); remove it") from None
        raise
    try:
        reason = why_unsafe(os.fstat(fd))
        if reason is not None:
            raise UnsafeDirectoryError(f"{what}: {name!r} in the cache directory is refused: {reason}; remove it "
                                       "(it is recreated with mode 0700)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_subdir_if_safe(parent_fd: int, name: str) -> int | None:
    """Like `open_subdir` without creating it: None when absent, a link, not a directory or not private."""
    try:
        fd = os.open(name, _OPEN_DIR | _NOFOLLOW, dir_fd=parent_fd)
    except OSError:
        return None
    if why_unsafe(os.fstat(fd)) is not None:
        os.close(fd)
        return None
    return fd


class NotTrusted(Exception):
    """An entry that is not a private regular file of a bounded size (the message says which)."""


def read_entry(dir_fd: int, name: str, max_bytes: int, *, touch: bool = False) -> bytes | None:
    """The bytes of the entry `name`, at most `max_bytes`; None when there is none.

    Raises `NotTrusted` for a link, a FIFO, a device, a directory, a file of another user or one others can write,
    or one larger than `max_bytes` - without reading it and without blocking. `touch` sets the mtime of the file
    read (never of whatever its name points at later)."""
    try:
        fd = os.open(name, _OPEN_ENTRY, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise NotTrusted("a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotTrusted(f"not a regular file ({stat.filemode(info.st_mode)})")
        reason = why_unsafe(info)
        if reason is not None:
            raise NotTrusted(reason)
        if info.st_size > max_bytes:
            raise NotTrusted(f"{info.st_size} bytes, over the bound of {max_bytes}")
        chunks, left = [], max_bytes + 1  # one byte more than allowed tells a file that grew since fstat
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise NotTrusted(f"grew past the bound of {max_bytes} bytes while read")
        if touch:
            with contextlib.suppress(OSError):
                os.utime(fd)
        return data
    finally:
        os.close(fd)


def write_entry(dir_fd: int, name: str, data: bytes, *, tmp_fd: int | None = None, sync: bool = True) -> None:
    """Write `data` as the entry `name` of `dir_fd`, mode 0600, atomically (a unique temporary file in `tmp_fd`,
    default the same directory, renamed over the name). OSError when the write fails (the temporary is removed)."""
    tmp_fd = dir_fd if tmp_fd is None else tmp_fd
    part = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.part"
    fd = os.open(part, _CREATE, 0o600, dir_fd=tmp_fd)
    try:
        try:
            os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(part, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part, dir_fd=tmp_fd)
        raise


def entries(dir_fd: int, wanted) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of the entries directly in `dir_fd` whose lstat `wanted` accepts (links are never followed)."""
    found = []
    try:
        with os.scandir(dir_fd) as it:
            names = [entry.name for entry in it]
    except OSError:
        return []
    for name in names:
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if wanted(info):
            found.append((name, info))
    return found


def regular_files(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of the regular files this user owns directly in `dir_fd`; links and everything else skipped."""
    return entries(dir_fd, lambda info: stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid())
