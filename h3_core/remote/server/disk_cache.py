"""The component cache's disk tier: `serve --cache-dir DIR --cache-disk-bytes N` (docs/DEPLOY.md §7).

One safetensors file per entry, `DIR/entries/<2 hex>/<key>.safetensors`; its `__metadata__` is the entry's index
record (key, SHA-256 of the tensors' names, dtypes, shapes and bytes), so there is no shared index file to keep
consistent between processes. Several server processes (Ray replicas on one host, or servers on a shared volume)
use one DIR safely:

* writes are atomic: the bytes go to `DIR/tmp/<unique>.part` (mode 0600), are fsynced, then renamed over the
  entry's name, so a reader sees a whole entry or none (an identical entry written by two processes at once: the
  last rename wins, with the same bytes);
* reads take the whole file into memory (never mmap: a file another process replaces or deletes cannot fault this
  one), then parse and check it; a truncated, corrupt or foreign file is counted, deleted and recomputed, never
  served;
* the tier is bounded in bytes: after each write the writer takes `DIR/lock` (an exclusive `flock`) and deletes
  least recently used entries (by mtime; a hit touches its file) until the total fits;
* every failure to write (a full disk, a read-only volume) is counted and the request goes on uncached.

Entries are trusted once their checksum matches (it guards against corruption, not forgery), so the directory is
the boundary (h3_core/private_dir.py): DIR is created 0700 and an existing DIR that another user owns or that group
or others may write is refused at start (`UnsafeCacheDirError`, saying `chmod 700 DIR` or choose another); entries
are written 0600; names are resolved against descriptors of the checked directories and opened with O_NOFOLLOW and
O_NONBLOCK, so a link is never followed (a linked shard or entry is neither read, counted nor deleted: eviction
unlinks only regular files of this user inside DIR) and a FIFO or device at an entry's name is a miss, not a
blocked model thread. Nothing outside DIR is created, written or deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ... import private_dir
from ...component_cache import CACHE_VERSION, Tensors
from .config import ServerConfigError

log = logging.getLogger("h3_core.remote.server")

SUFFIX = ".safetensors"
STALE_TMP_S = 3600.0  # a .part file this old was left by a process that died mid-write


class UnsafeCacheDirError(ServerConfigError, private_dir.UnsafeDirectoryError):
    """`--cache-dir` names a directory someone other than the server's user could write (the message says the fix)."""


def check_dir(root: str | os.PathLike) -> None:
    """Refuse (`UnsafeCacheDirError`) a cache directory others can write, creating it 0700 when absent: what
    `DiskTier` does first, callable before a server binds its port."""
    os.close(_open_root(root))


def _open_root(root: str | os.PathLike) -> int:
    try:
        return private_dir.open_dir(root, "--cache-dir")
    except private_dir.UnsafeDirectoryError as error:
        raise UnsafeCacheDirError(str(error)) from None


class DiskTier:
    tier = "disk"

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.entries, self.tmp = self.root / "entries", self.root / "tmp"
        # Every later name is resolved against these descriptors of the checked directories (private_dir.py).
        self._fds: list[int] = []
        self._root_fd = self._keep(_open_root(self.root))
        try:
            self._entries_fd = self._keep(private_dir.open_subdir(self._root_fd, "entries", "--cache-dir"))
            self._tmp_fd = self._keep(private_dir.open_subdir(self._root_fd, "tmp", "--cache-dir"))
        except private_dir.UnsafeDirectoryError as error:
            self.close()
            raise UnsafeCacheDirError(f"{self.root}: {error}") from None
        except BaseException:
            self.close()
            raise
        self._mutex = threading.Lock()  # the counters (model thread writes, metrics scrape reads)
        self.bytes = 0  # as of this process's last scan
        self.evictions = self.corrupt = self.write_errors = 0
        self._clean_stale_tmp()
        self._scan()

    def _keep(self, fd: int) -> int:
        self._fds.append(fd)
        return fd

    def close(self) -> None:
        """Close the directory descriptors (also when collected); the tier is not used afterwards."""
        fds = getattr(self, "_fds", [])  # absent when __init__ failed before opening anything
        while fds:
            with contextlib.suppress(OSError):
                os.close(fds.pop())

    def __del__(self):
        self.close()

    # --- reading ------------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        _check_key(key)
        return self.entries / key[:2] / f"{key}{SUFFIX}"

    def get(self, key: str) -> tuple[Tensors, str] | None:
        _check_key(key)
        shard = private_dir.open_subdir_if_safe(self._entries_fd, key[:2])
        if shard is None:
            return None
        name = f"{key}{SUFFIX}"
        try:
            try:
                # A hit sets the mtime of the file it read (least recently *used* goes first).
                data = private_dir.read_entry(shard, name, self.max_bytes, touch=True)
            except private_dir.NotTrusted as error:
                # A link, FIFO, device, another user's file or one too large for this tier (a server with a larger
                # budget wrote it): never read, never followed. A computed answer's write renames over the name.
                log.warning("component cache: %s is not an entry this server trusts (%s); recomputing", name, error)
                return None
            except OSError as error:
                log.warning("component cache: cannot read %s: %s", name, error)
                return None
            if data is None:
                return None
            try:
                tensors = _parse(data, key)
            except _Corrupt as error:
                self._count("corrupt")
                log.warning("component cache: %s is corrupt (%s); deleted, recomputing", name, error)
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=shard)  # unlinkat removes the name itself, never a link's target
                return None
            return tensors, self.tier
        finally:
            os.close(shard)

    # --- writing ------------------------------------------------------------------------------

    def put(self, key: str, tensors: Tensors) -> None:
        _check_key(key)
        try:
            data = _serialise(key, tensors)
            if len(data) > self.max_bytes:
                return
            shard = private_dir.open_subdir(self._entries_fd, key[:2], "--cache-dir")
            try:
                private_dir.write_entry(shard, f"{key}{SUFFIX}", data, tmp_fd=self._tmp_fd)  # 0600, temp + rename
            finally:
                os.close(shard)
            self._evict()
        except (OSError, private_dir.UnsafeDirectoryError) as error:
            # A full disk, a read-only volume, a planted shard: the request goes on uncached.
            self._count("write_errors")
            log.warning("component cache: writing an entry failed (%s); continuing without it", error)

    def _evict(self) -> None:
        """Delete least recently used entries until the tier fits, one process at a time (flock on DIR/lock)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        lock = os.open("lock", flags, 0o600, dir_fd=self._root_fd)
        try:
            if not stat.S_ISREG(os.fstat(lock).st_mode):
                raise OSError(f"{self.root / 'lock'} is not a regular file")
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entries = self._scan()
                total = sum(size for *_, size, _ in entries)
                for shard, name, size, _ in sorted(entries, key=lambda entry: entry[3]):
                    if total <= self.max_bytes:
                        break
                    fd = private_dir.open_subdir_if_safe(self._entries_fd, shard)
                    if fd is None:
                        continue
                    try:
                        # The scan found a regular file of ours under this name; unlinkat never follows a link.
                        os.unlink(name, dir_fd=fd)
                        self._count("evictions")
                    except FileNotFoundError:
                        pass
                    finally:
                        os.close(fd)
                    total -= size
                self.bytes = total
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        finally:
            os.close(lock)

    def _scan(self) -> list[tuple[str, str, int, float]]:
        """(shard, name, size, mtime) of every entry now in DIR: regular files of this user in private shard
        directories, links never followed (a linked shard or entry is neither counted nor deleted); updates
        `bytes`."""
        found = []
        for shard, info in _subdirs(self._entries_fd):
            fd = private_dir.open_subdir_if_safe(self._entries_fd, shard)
            if fd is None:
                continue
            try:
                for name, info in private_dir.regular_files(fd):
                    if name.endswith(SUFFIX):
                        found.append((shard, name, info.st_size, info.st_mtime))
            finally:
                os.close(fd)
        self.bytes = sum(size for *_, size, _ in found)
        return found

    def _clean_stale_tmp(self) -> None:
        now = time.time()
        for name, info in private_dir.regular_files(self._tmp_fd):
            if name.endswith(".part") and now - info.st_mtime > STALE_TMP_S:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._tmp_fd)

    def _count(self, name: str) -> None:
        with self._mutex:
            setattr(self, name, getattr(self, name) + 1)

    def stats(self) -> dict[str, int]:
        with self._mutex:
            return {"bytes": self.bytes, "evictions": self.evictions, "corrupt": self.corrupt,
                    "write_errors": self.write_errors}


def _check_key(key: str) -> None:
    if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
        raise ValueError("a component cache key is 64 lowercase hex digits")


def _subdirs(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of the real directories (never links) directly in `dir_fd`."""
    return private_dir.entries(dir_fd, lambda info: stat.S_ISDIR(info.st_mode))


class _Corrupt(Exception):
    pass


def _checksum(tensors: Tensors) -> str:
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        hasher.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}|".encode())
        if tensor.numel():
            hasher.update(tensor.view(torch.uint8).numpy())
    return hasher.hexdigest()


def _serialise(key: str, tensors: Tensors) -> bytes:
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    record = {"version": CACHE_VERSION, "key": key, "sha256": _checksum(tensors)}
    return save_safetensors(tensors, metadata={"h3_component": json.dumps(record, sort_keys=True)})


def _parse(data: bytes, key: str) -> Tensors:
    """The entry's tensors, or `_Corrupt`: a short or garbled file, another key's entry, a checksum mismatch."""
    try:
        if len(data) < 8:
            raise _Corrupt("shorter than a safetensors header")
        header_len = int.from_bytes(data[:8], "little")
        if header_len > len(data) - 8:
            raise _Corrupt("truncated header")
        header = json.loads(data[8:8 + header_len])
        record = json.loads(header.get("__metadata__", {}).get("h3_component", "null"))
        if not isinstance(record, dict) or record.get("version") != CACHE_VERSION or record.get("key") != key:
            raise _Corrupt("not this key's entry")
        tensors = load_safetensors(data)  # copies out of `data`: the tensors own their memory
    except _Corrupt:
        raise
    except (SafetensorError, ValueError, TypeError, AttributeError, RuntimeError) as error:
        raise _Corrupt(f"{type(error).__name__}: {str(error)[:100]}") from None
    if _checksum(tensors) != record.get("sha256"):
        raise _Corrupt("checksum mismatch")
    return tensors
