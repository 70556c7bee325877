"""The encoder server's disk tier (h3_core/remote/server/disk_cache.py) against a directory others tamper with.

Security issue 36, item 5: eviction followed a link inside DIR and deleted files outside it; a FIFO at an entry's
name blocked the model thread; an existing world-writable DIR was used as is and an entry planted there by another
writer was served. Here:

* links are never followed: a linked shard directory or entry is neither read, counted nor deleted, and the files
  it points at survive eviction;
* a FIFO at an entry's name is a miss within a second, and the next write replaces it;
* a DIR that group or others can write, or that another user owns, is refused with the fix (`chmod 700`);
  an entry owned by another user is not served;
* DIR and its folders are 0700, entries 0600 (whatever the umask), written by temp + rename.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from h3_core.remote.server import disk_cache
from h3_core.remote.server.config import ServerConfigError
from h3_core.remote.server.disk_cache import DiskTier, UnsafeCacheDirError

NOBODY = 65534


def _key(n: int) -> str:
    return hashlib.sha256(f"entry {n}".encode()).hexdigest()


def _tensors(n: int) -> dict[str, torch.Tensor]:
    return {"latents": torch.full((64, 64), float(n))}


def _entry_bytes() -> int:
    return len(disk_cache._serialise(_key(0), _tensors(0)))


def _outside_files(folder: Path, count: int) -> list[Path]:
    """Files outside DIR named and dated like the oldest entries: the first an LRU eviction would pick."""
    folder.mkdir()
    files = []
    for n in range(count):
        path = folder / f"{_key(100 + n)}.safetensors"
        path.write_bytes(disk_cache._serialise(_key(100 + n), _tensors(100 + n)))
        os.utime(path, (1_000_000 + n, 1_000_000 + n))
        files.append(path)
    return files


def test_eviction_never_follows_links_out_of_dir(tmp_path):
    root = tmp_path / "cache"
    tier = DiskTier(root, 3 * _entry_bytes())  # room for three entries
    outside = _outside_files(tmp_path / "precious", 3)
    # A linked shard directory (what deleted 2 of 3 files outside DIR) and a linked entry.
    (root / "entries" / "zz").symlink_to(outside[0].parent, target_is_directory=True)
    os.makedirs(root / "entries" / "00", mode=0o700)
    linked_entry = root / "entries" / "00" / f"{'0' * 64}.safetensors"
    linked_entry.symlink_to(outside[0])
    for n in range(6):  # twice the budget: eviction runs after every write past three
        tier.put(_key(n), _tensors(n))
    assert all(path.is_file() for path in outside), "a file outside DIR was deleted"
    assert linked_entry.is_symlink() and (root / "entries" / "zz").is_symlink()
    assert tier.stats()["evictions"] == 3 and tier.stats()["bytes"] <= 3 * _entry_bytes()
    assert [tier.get(_key(n)) is not None for n in range(6)] == [False] * 3 + [True] * 3
    assert tier.get("0" * 64) is None  # the linked entry is not read either


def test_a_linked_entry_is_not_served_and_a_write_replaces_the_link(tmp_path):
    root = tmp_path / "cache"
    tier = DiskTier(root, 1 << 20)
    (planted,) = _outside_files(tmp_path / "elsewhere", 1)
    key = _key(100)  # the planted file is a valid entry of this key
    path = tier.path(key)
    path.parent.mkdir(mode=0o700)
    path.symlink_to(planted)
    assert tier.get(key) is None
    tier.put(key, _tensors(7))
    assert not path.is_symlink() and planted.read_bytes() == disk_cache._serialise(key, _tensors(100))
    found, where = tier.get(key)
    assert where == "disk" and torch.equal(found["latents"], _tensors(7)["latents"])


def test_a_fifo_at_an_entry_is_a_miss_within_a_second(tmp_path):
    tier = DiskTier(tmp_path / "cache", 1 << 20)
    key = _key(1)
    path = tier.path(key)
    path.parent.mkdir(mode=0o700)
    os.mkfifo(path)
    answers = []
    started = time.monotonic()
    reader = threading.Thread(target=lambda: answers.append(tier.get(key)), daemon=True)
    reader.start()
    reader.join(1.0)
    if reader.is_alive():  # release the blocked reader of the old code before failing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("a FIFO at an entry's name blocked the model thread")
    assert answers == [None] and time.monotonic() - started < 1.0
    tier.put(key, _tensors(1))  # the computed answer's write replaces the FIFO
    assert stat.S_ISREG(path.lstat().st_mode) and tier.get(key)[1] == "disk"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o720])
def test_a_dir_others_can_write_is_refused(tmp_path, mode):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(UnsafeCacheDirError, match=rf"lets group or others write.*chmod 700 {root}"):
        DiskTier(root, 1 << 20)
    with pytest.raises(ServerConfigError):  # what `serve` reports as a configuration error
        disk_cache.check_dir(root)
    assert sorted(os.listdir(root)) == []  # refused before anything was written there
    root.chmod(0o700)
    DiskTier(root, 1 << 20).put(_key(0), _tensors(0))


def test_an_entry_planted_in_a_shared_dir_is_never_served(tmp_path):
    """The measured defect: a world-writable DIR used as is, another writer's entry served (`text=disk`)."""
    root = tmp_path / "shared"
    DiskTier(root, 1 << 20).put(_key(1), _tensors(1))
    root.chmod(0o777)
    # Another writer replaces the entry with its own, every value 7.0.
    path = root / "entries" / _key(1)[:2] / f"{_key(1)}.safetensors"
    path.write_bytes(disk_cache._serialise(_key(1), {"latents": torch.full((64, 64), 7.0)}))
    with pytest.raises(UnsafeCacheDirError, match="chmod 700"):
        DiskTier(root, 1 << 20)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_dir_or_entry_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(UnsafeCacheDirError, match=rf"owned by uid {NOBODY}, not by this user.*chown"):
        DiskTier(root, 1 << 20)
    os.chown(root, os.geteuid(), os.getegid())
    tier = DiskTier(root, 1 << 20)
    tier.put(_key(2), _tensors(2))
    os.chown(tier.path(_key(2)), NOBODY, NOBODY)  # an entry another user wrote (or replaced)
    assert tier.get(_key(2)) is None
    shard = tier.path(_key(2)).parent
    os.chown(shard, NOBODY, NOBODY)  # a shard folder another user made
    assert tier.get(_key(2)) is None


def test_dir_is_0700_and_entries_are_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        root = tmp_path / "made" / "cache"
        tier = DiskTier(root, 1 << 20)
        tier.put(_key(3), _tensors(3))
    finally:
        os.umask(old)
    for folder in (root, root / "entries", root / "tmp", tier.path(_key(3)).parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE(tier.path(_key(3)).stat().st_mode) == 0o600
    assert stat.S_IMODE((root / "lock").stat().st_mode) == 0o600
    assert os.listdir(root / "tmp") == []  # written as temp + rename


def test_an_entry_larger_than_the_budget_is_not_read(tmp_path):
    root = tmp_path / "cache"
    DiskTier(root, 1 << 20).put(_key(4), _tensors(4))
    small = DiskTier(root, 1024)  # another server's smaller budget: the entry is not read whole into memory
    assert small.get(_key(4)) is None and DiskTier(root, 1 << 20).get(_key(4))[1] == "disk"


def test_a_linked_folder_inside_dir_is_refused(tmp_path):
    root = tmp_path / "cache"
    DiskTier(root, 1 << 20).close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / "entries").rmdir()
    (root / "entries").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafeCacheDirError, match="'entries' in the cache directory is not a directory"):
        DiskTier(root, 1 << 20)
