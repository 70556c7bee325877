"""The encoder's per-component cache (h3_core/component_cache.py) and its disk tier (remote/server/disk_cache.py).

* Bitwise: for t2va, fl2va and ref2va, every mix of cached and computed parts (text, each keyframe's or reference's
  video latents, each soundtrack's or audio's rows) assembles exactly the bytes of an uncached encode.
* Keys: a new prompt reuses every reference's latents; new media, a new seed-free identity (thread count) miss.
* Disk tier: entries survive a new tier object (a restart), a corrupt or truncated entry is recomputed and never
  served, a failing write (full disk) and a tiny byte budget leave the encode correct, eviction keeps the bound,
  nothing outside the directory is touched.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from support.remote_cases import CASES

from h3_core import component_cache
from h3_core.component_cache import CacheRecord, MemoryTier
from h3_core.remote.server.cache import ComponentTiers
from h3_core.remote.server.disk_cache import DiskTier


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Same thread count as the server tests (bits depend on it)."""


@pytest.fixture(scope="module")
def stage(encoder_stage):
    return encoder_stage  # conftest: loaded once per session


@pytest.fixture(scope="module")
def uncached(stage):
    return {task: stage.encode(request).to_bytes() for task, request in CASES.items()}


def _encode(stage, request, cache) -> tuple[bytes, CacheRecord]:
    with component_cache.using(cache) as record:
        return stage.encode(request).to_bytes(), record


@pytest.mark.parametrize("task", sorted(CASES))
def test_every_mix_of_hits_and_misses_is_bitwise_the_uncached_answer(task, stage, uncached):
    full = MemoryTier(1 << 30)
    data, record = _encode(stage, CASES[task], full)
    assert data == uncached[task]
    labels = list(record.outcomes)
    assert set(record.outcomes.values()) == {"miss"}
    expected = {"t2va": ["text"], "fl2va": ["text", "video.0", "video.1"],
                "ref2va": ["text", "video.0", "video.1", "audio.0", "audio.1"]}[task]
    assert labels == expected
    for size in range(len(labels) + 1):
        for cached in itertools.combinations(labels, size):
            partial = MemoryTier(1 << 30)
            for label in cached:
                partial.put(record.keys[label], full.get(record.keys[label])[0])
            data, mix = _encode(stage, CASES[task], partial)
            assert data == uncached[task], cached
            assert mix.outcomes == {label: "memory" if label in cached else "miss" for label in labels}
            assert mix.keys == record.keys


def test_a_new_prompt_reuses_every_reference_and_new_media_misses(stage):
    cache = MemoryTier(1 << 30)
    base = CASES["ref2va"]
    _encode(stage, base, cache)
    _, record = _encode(stage, base.__class__(**{**base.__dict__, "prompt": "<Picture 1> and a new prompt."}), cache)
    assert record.outcomes == {"text": "miss", "video.0": "memory", "video.1": "memory", "audio.0": "memory",
                               "audio.1": "memory"}
    image = base.ref_images[0].copy()
    image[0, 0, 0] ^= 1  # one bit of one pixel
    _, record = _encode(stage, base.__class__(**{**base.__dict__, "ref_images": [image]}), cache)
    assert record.outcomes["video.0"] == "miss" and record.outcomes["text"] == "miss"  # the image is in the prompt
    assert record.outcomes["video.1"] == record.outcomes["audio.0"] == "memory"
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)  # CPU bits depend on the thread count: a different key
    try:
        _, record = _encode(stage, base, cache)
    finally:
        torch.set_num_threads(before)
    assert set(record.outcomes.values()) == {"miss"}


def test_without_a_cache_nothing_is_hashed(stage, monkeypatch):
    def fail(*args):
        raise AssertionError("hashed without a cache")

    monkeypatch.setattr(component_cache, "digest", fail)
    stage.encode(CASES["ref2va"])  # no `using(...)`: the stage runs as it always did


# --- the disk tier -----------------------------------------------------------------------------------------------


def _entries(root) -> list:
    return sorted(p for p in (root / "entries").rglob("*.safetensors"))


def test_disk_tier_survives_a_restart_and_is_bitwise(tmp_path, stage, uncached):
    root = tmp_path / "cache"
    _, first = _encode(stage, CASES["ref2va"], ComponentTiers(0, str(root), 1 << 30))
    assert set(first.outcomes.values()) == {"miss"} and len(_entries(root)) == 5
    restarted = ComponentTiers(1 << 30, str(root), 1 << 30)  # a new process: empty memory, the same directory
    data, record = _encode(stage, CASES["ref2va"], restarted)
    assert data == uncached["ref2va"]
    assert set(record.outcomes.values()) == {"disk"}
    data, record = _encode(stage, CASES["ref2va"], restarted)  # promoted into memory
    assert data == uncached["ref2va"] and set(record.outcomes.values()) == {"memory"}
    assert sorted(os.listdir(tmp_path)) == ["cache"]  # nothing outside DIR
    assert sorted(os.listdir(root)) == ["entries", "lock", "tmp"] and os.listdir(root / "tmp") == []


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage", "empty", "other_key"])
def test_a_corrupt_entry_is_recomputed_never_served(damage, tmp_path, stage, uncached):
    root = tmp_path / "cache"
    _, first = _encode(stage, CASES["fl2va"], DiskTier(root, 1 << 30))
    path = DiskTier(root, 1 << 30).path(first.keys["video.1"])
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) - 7])
    elif damage == "flipped":  # one bit of the latents: only the checksum can tell
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a valid entry of another key under this key's name
        path.write_bytes(DiskTier(root, 1 << 30).path(first.keys["video.0"]).read_bytes())
    tier = DiskTier(root, 1 << 30)
    out, record = _encode(stage, CASES["fl2va"], tier)
    assert out == uncached["fl2va"]
    assert record.outcomes == {"text": "disk", "video.0": "disk", "video.1": "miss"}
    assert tier.stats()["corrupt"] == 1
    _, record = _encode(stage, CASES["fl2va"], DiskTier(root, 1 << 30))  # rewritten whole by the recompute
    assert set(record.outcomes.values()) == {"disk"}


def test_a_full_disk_leaves_the_answer_right(tmp_path, stage, uncached, monkeypatch):
    root = tmp_path / "cache"
    tier = DiskTier(root, 1 << 30)
    real_write = os.write

    def full_disk_write(fd, data):  # the entry's temporary file only: what a full volume fails
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".part"):
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk_write)
    out, record = _encode(stage, CASES["ref2va"], tier)
    monkeypatch.undo()
    assert out == uncached["ref2va"] and set(record.outcomes.values()) == {"miss"}
    assert tier.stats()["write_errors"] == 5 and _entries(root) == [] and os.listdir(root / "tmp") == []


def test_the_disk_tier_stays_within_its_bytes(tmp_path, stage, uncached):
    root = tmp_path / "cache"
    probe = DiskTier(tmp_path / "probe", 1 << 30)
    _encode(stage, CASES["ref2va"], probe)
    sizes = [p.stat().st_size for p in _entries(tmp_path / "probe")]
    budget = sum(sizes) - min(sizes)  # one entry too few
    tier = DiskTier(root, budget)
    out, _ = _encode(stage, CASES["ref2va"], tier)
    assert out == uncached["ref2va"]
    assert sum(p.stat().st_size for p in _entries(root)) <= budget
    assert tier.stats()["evictions"] >= 1 and tier.stats()["bytes"] <= budget
    tiny = DiskTier(tmp_path / "tiny", 64)  # smaller than any entry: nothing is stored, nothing fails
    out, _ = _encode(stage, CASES["ref2va"], tiny)
    assert out == uncached["ref2va"] and _entries(tmp_path / "tiny") == []
    assert tiny.stats()["write_errors"] == 0
