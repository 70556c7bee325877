"""Full-content identity of weight files: every byte counts, and a large file is read once per version.

`sources.identity` (the model fingerprint, every component cache key) is built from `file_identity`. A file of at
most `DIRECT_BYTES` (configs, tokenizers, small weights) is hashed whole each time (SHA-256, as always). A larger
one is hashed whole with xxh3-128 in `CHUNK` reads - a fine-tune that changes only middle tensors changes it, which
sampling the size and first and last MiB did not - and the digest is remembered in a per-user cache directory so
that the next load costs a stat and a small read instead of reading 66 GB again.

The cache (`cache_dir()`: `$H3_WEIGHT_DIGEST_CACHE`, else `$XDG_CACHE_HOME/minimax-h3/weight-digests`, else
`~/.cache/minimax-h3/weight-digests`; `H3_WEIGHT_DIGEST_CACHE=off` disables it) is per user because model folders
are often read-only or shared. One small JSON file per weight file (named by its real path), holding the version of
the file it describes: real path, device, inode, size, mtime and ctime in ns. Any of them changing - a rewrite in
place, a copy, a new download renamed over the old name, even one that restores the old mtime (ctime cannot be set
back) - makes the entry stale and the file is hashed again. Entries are believed only from a private directory
(h3_core/private_dir.py: 0700, this user's, links never followed); where that cannot be checked (Windows) a digest
is remembered by the process only.

xxh3-128 is not a cryptographic hash: it tells versions of a file apart, it does not resist someone crafting a
collision. Whoever can write the weights already decides every output, so forging a digest gains them nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time

import xxhash

from .. import private_dir
from .errors import H3WeightsError

log = logging.getLogger(__name__)

DIRECT_BYTES = 16 << 20  # files up to this size: SHA-256 of the whole bytes each time (the identity they always had)
CHUNK = 16 << 20  # read size of the full digest of larger files
ALGORITHM = "xxh3_128"
ENTRY_VERSION = 1
ENTRY_MAX_BYTES = 8192  # a cache entry is a few hundred bytes; anything larger is not one of ours
ENV = "H3_WEIGHT_DIGEST_CACHE"
# This process's digests by file version: one load asks for the model's and each component's identity (the same
# files several times), and with the cache off or unwritable a 66 GB file would otherwise be read each time.
MEMO_ENTRIES = 4096
_MEMO: dict[tuple, str] = {}


class WeightDigestError(H3WeightsError):
    """A weight file that cannot be identified: not a regular file, or changing while it is read."""


def cache_dir() -> str | None:
    """Where digests are remembered (None: `H3_WEIGHT_DIGEST_CACHE=off`)."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() in ("off", "0", "none"):
        return None
    if chosen:
        return os.path.abspath(os.path.expanduser(chosen))
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "minimax-h3", "weight-digests")


def file_identity(path: str | os.PathLike) -> bytes:
    """32 bytes that change whenever any byte of the regular file `path` changes (see the module docstring)."""
    path = os.fspath(path)
    # O_NONBLOCK: a FIFO under a model folder must not block the loader; it is refused below instead.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise WeightDigestError(f"{path}: not a regular file ({stat.filemode(before.st_mode)}); weights are read "
                                    "from regular files only")
        if before.st_size <= DIRECT_BYTES:
            data = _read_all(fd, path, before)
            return hashlib.sha256(data).digest()
        version = _version(os.path.realpath(path), before)
        memo_key = tuple(version.values())
        digest = _MEMO.get(memo_key) or _remembered(version)
        if digest is None:
            digest = _full_digest(fd, path, before)
            _remember(version, digest)
        if len(_MEMO) >= MEMO_ENTRIES:
            _MEMO.clear()
        _MEMO[memo_key] = digest
    finally:
        os.close(fd)
    return hashlib.sha256(f"{ALGORITHM}:{before.st_size}:".encode() + bytes.fromhex(digest)).digest()


def _changed(before: os.stat_result, after: os.stat_result) -> bool:
    return (before.st_size, before.st_mtime_ns, before.st_ctime_ns) != (after.st_size, after.st_mtime_ns,
                                                                         after.st_ctime_ns)


def _read_all(fd: int, path: str, before: os.stat_result) -> bytes:
    data = os.read(fd, before.st_size + 1)  # one byte more than stated tells a file that grew
    while len(data) <= before.st_size:
        more = os.read(fd, before.st_size + 1 - len(data))
        if not more:
            break
        data += more
    if len(data) != before.st_size or _changed(before, os.fstat(fd)):
        raise WeightDigestError(f"{path}: changed while it was read; load it once it is completely written")
    return data


def _full_digest(fd: int, path: str, before: os.stat_result) -> str:
    start = time.perf_counter()
    log.info("hashing %s (%.1f GB) once to identify it; the digest is remembered in %s", path,
             before.st_size / 1e9, cache_dir() or "no cache (H3_WEIGHT_DIGEST_CACHE=off)")
    hasher = xxhash.xxh3_128()
    view = memoryview(bytearray(CHUNK))  # one buffer, refilled: no 16 MiB allocation per read
    total = 0
    with open(fd, "rb", buffering=0, closefd=False) as handle:
        while n := handle.readinto(view):
            hasher.update(view[:n])
            total += n
    if total != before.st_size or _changed(before, os.fstat(fd)):
        raise WeightDigestError(f"{path}: changed while it was read ({total} of {before.st_size} bytes hashed); "
                                "load it once it is completely written")
    seconds = time.perf_counter() - start
    log.info("hashed %s in %.1f s (%.0f MB/s)", path, seconds, before.st_size / 1e6 / max(seconds, 1e-9))
    return hasher.hexdigest()


def _version(real: str, info: os.stat_result) -> dict:
    return {"version": ENTRY_VERSION, "algorithm": ALGORITHM, "path": real, "dev": info.st_dev, "ino": info.st_ino,
            "size": info.st_size, "mtime_ns": info.st_mtime_ns, "ctime_ns": info.st_ctime_ns}


def _entry_name(real: str) -> str:
    # One entry per real path: a rewritten file replaces its entry instead of adding one, so the cache stays as
    # small as the set of weight files ever loaded.
    return hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:40] + ".json"


def _open_cache() -> int | None:
    """The cache directory's descriptor; None when disabled or impossible to create (a read-only home: the digest
    is then computed each time). A directory others can write is refused (`UnsafeDirectoryError`): its entries
    would decide which weights a server claims to run."""
    folder = cache_dir()
    if folder is None or not private_dir.SUPPORTED:  # Windows: remembered by this process only (`_MEMO`)
        return None
    try:
        return private_dir.open_dir(folder, f"the weight digest cache (${ENV})")
    except private_dir.UnsafeDirectoryError as error:
        raise WeightDigestError(f"{error} (or set {ENV}=off to hash large weight files on every load)") from None
    except OSError as error:
        log.warning("weight digest cache %s unusable (%s); hashing large weight files on every load", folder, error)
        return None


def _remembered(version: dict) -> str | None:
    fd = _open_cache()
    if fd is None:
        return None
    try:
        data = private_dir.read_entry(fd, _entry_name(version["path"]), ENTRY_MAX_BYTES)
        if data is None:
            return None
        entry = json.loads(data)
    except (private_dir.NotTrusted, OSError, ValueError) as error:  # stale, torn or foreign: hash again
        log.warning("weight digest cache: ignoring the entry of %s (%s)", version["path"], error)
        return None
    finally:
        os.close(fd)
    if not isinstance(entry, dict) or {k: entry.get(k) for k in version} != version:
        return None
    digest = entry.get("digest")
    if not isinstance(digest, str) or len(digest) != 32 or any(c not in "0123456789abcdef" for c in digest):
        return None
    return digest


def _remember(version: dict, digest: str) -> None:
    fd = _open_cache()
    if fd is None:
        return
    try:
        data = json.dumps({**version, "digest": digest}, sort_keys=True).encode()
        # No fsync: a torn entry fails to parse and the file is simply hashed again.
        private_dir.write_entry(fd, _entry_name(version["path"]), data, sync=False)
    except OSError as error:
        log.warning("weight digest cache: cannot remember the digest of %s (%s)", version["path"], error)
    finally:
        os.close(fd)
