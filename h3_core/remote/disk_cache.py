"""The component cache's disk tier: `serve --cache-dir DIR --cache-disk-bytes N` (docs/DEPLOY.md §7).

One safetensors file per entry, `DIR/entries/<2 hex>/<key>.safetensors`; its `__metadata__` is the entry's index
record (key, SHA-256 of the tensors' names, dtypes, shapes and bytes), so there is no shared index file to keep
consistent between processes. Several server processes (Ray replicas on one host, or servers on a shared volume)
use one DIR safely:

* writes are atomic: the bytes go to `DIR/tmp/<unique>.part`, are fsynced, then renamed over the entry's name,
  so a reader sees a whole entry or none (an identical entry written by two processes at once: the last rename
  wins, with the same bytes);
* reads take the whole file into memory (never mmap: a file another process replaces or deletes cannot fault this
  one), then parse and check it; a truncated, corrupt or foreign file is counted, deleted and recomputed, never
  served;
* the tier is bounded in bytes: after each write the writer takes `DIR/lock` (an exclusive `flock`) and deletes
  least recently used entries (by mtime; a hit touches its file) until the total fits;
* every failure to write (a full disk, a read-only volume) is counted and the request goes on uncached.

Nothing outside DIR is created, written or deleted. DIR is created 0700: its entries are trusted (the checksum
guards against corruption, not forgery), so only the server's own user should be able to write there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..component_cache import CACHE_VERSION, Tensors

log = logging.getLogger("h3_core.remote.server")

SUFFIX = ".safetensors"
STALE_TMP_S = 3600.0  # a .part file this old was left by a process that died mid-write


class DiskTier:
    tier = "disk"

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.entries, self.tmp = self.root / "entries", self.root / "tmp"
        for folder in (self.root, self.entries, self.tmp):
            folder.mkdir(mode=0o700, parents=folder is self.root, exist_ok=True)
        self._lock_path = self.root / "lock"
        self._mutex = threading.Lock()  # the counters (model thread writes, metrics scrape reads)
        self.bytes = 0  # as of this process's last scan
        self.evictions = self.corrupt = self.write_errors = 0
        self._clean_stale_tmp()
        self._scan()

    # --- reading ------------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError("a component cache key is 64 lowercase hex digits")
        return self.entries / key[:2] / f"{key}{SUFFIX}"

    def get(self, key: str) -> tuple[Tensors, str] | None:
        path = self.path(key)
        try:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if size > self.max_bytes:  # written by a server with a larger budget: not ours to read whole
                    return None
                data = handle.read(size + 1)
        except FileNotFoundError:
            return None
        except OSError as error:
            log.warning("component cache: cannot read %s: %s", path.name, error)
            return None
        try:
            tensors = _parse(data, key)
        except _Corrupt as error:
            self._count("corrupt")
            log.warning("component cache: %s is corrupt (%s); deleted, recomputing", path.name, error)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently *used* goes first
        return tensors, self.tier

    # --- writing ------------------------------------------------------------------------------

    def put(self, key: str, tensors: Tensors) -> None:
        try:
            data = _serialise(key, tensors)
            if len(data) > self.max_bytes:
                return
            path = self.path(key)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            part = self.tmp / f"{key}.{os.getpid()}.{secrets.token_hex(4)}.part"
            try:
                with open(part, "xb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(part, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    part.unlink()
            self._evict()
        except OSError as error:  # a full disk, a read-only volume: the request goes on uncached
            self._count("write_errors")
            log.warning("component cache: writing an entry failed (%s); continuing without it", error)

    def _evict(self) -> None:
        """Delete least recently used entries until the tier fits, one process at a time (flock on DIR/lock)."""
        with open(self._lock_path, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                entries = self._scan()
                total = sum(size for _, size, _ in entries)
                for path, size, _ in sorted(entries, key=lambda entry: entry[2]):
                    if total <= self.max_bytes:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                        self._count("evictions")
                    total -= size
                self.bytes = total
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _scan(self) -> list[tuple[Path, int, float]]:
        """(path, size, mtime) of every entry now in DIR; updates `bytes`."""
        found = []
        for shard in _listdir(self.entries):
            for entry in _listdir(shard):
                if entry.name.endswith(SUFFIX):
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:
                        continue
                    found.append((Path(entry.path), stat.st_size, stat.st_mtime))
        self.bytes = sum(size for _, size, _ in found)
        return found

    def _clean_stale_tmp(self) -> None:
        now = time.time()
        for entry in _listdir(self.tmp):
            with contextlib.suppress(OSError):
                if entry.name.endswith(".part") and now - entry.stat().st_mtime > STALE_TMP_S:
                    os.unlink(entry.path)

    def _count(self, name: str) -> None:
        with self._mutex:
            setattr(self, name, getattr(self, name) + 1)

    def stats(self) -> dict[str, int]:
        with self._mutex:
            return {"bytes": self.bytes, "evictions": self.evictions, "corrupt": self.corrupt,
                    "write_errors": self.write_errors}


class _Corrupt(Exception):
    pass


def _listdir(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


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
