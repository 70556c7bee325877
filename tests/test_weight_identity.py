"""Weight identity (h3_core/weights/sources.py `identity`, h3_core/weights/digest.py): every byte counts.

Security issue 36, item 4: the identity used to sample a large file's size and first and last MiB, so a fine-tune
that changed only middle tensors kept the fingerprint and every component cache key, and `serve --cache-dir`
answered the new encoder with the old encoder's embeddings. Here:

* a one-byte change in the middle of a large file (same size, same first and last MiB, even the old mtime put
  back) gives a new identity; so does a new file renamed over the old name;
* the full digest of a large file is computed once per file version and remembered in a private per-user cache
  (0700 directory, 0600 entries, links and FIFOs never trusted; a directory others can write is refused);
* end to end on the tiny H3: after such a change the encoder's text entry on disk is not served (slow: tiny build).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import threading
from pathlib import Path

import pytest
import torch
from support.remote_cases import CASES

from h3_core import component_cache
from h3_core.weights import digest
from h3_core.weights.sources import identity

BIG = digest.DIRECT_BYTES + (24 << 20)  # past the size hashed whole each time: the remembered full digest
MiB = 1 << 20


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch) -> Path:
    """A private digest cache per test, never the user's ~/.cache, and an empty in-process memo."""
    folder = tmp_path / "digests"
    monkeypatch.setenv(digest.ENV, str(folder))
    monkeypatch.setattr(digest, "_MEMO", {})
    return folder


def _big_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(BIG))
    return path


def _change_middle_byte_in_place(path: Path, offset: int | None = None) -> None:
    """One byte in place: same inode, same size, first and last MiB untouched, and the old mtime put back (what
    `rsync --inplace -t` or a careless tool leaves)."""
    before = path.stat()
    offset = before.st_size // 2 if offset is None else offset
    assert MiB <= offset < before.st_size - MiB
    with open(path, "r+b") as handle:
        handle.seek(offset)
        old = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([old[0] ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def test_a_middle_byte_changes_the_identity(tmp_path):
    weights = _big_file(tmp_path / "text_encoder" / "model.safetensors")
    first = identity("diffusers/text", {"text_encoder": weights.parent})
    assert identity("diffusers/text", {"text_encoder": weights.parent}) == first  # stable
    _change_middle_byte_in_place(weights)
    changed = identity("diffusers/text", {"text_encoder": weights.parent})
    assert changed != first
    # A new download renamed over the old name (a new inode) is hashed too; the same bytes give the same identity.
    fresh = tmp_path / "download.part"
    shutil.copyfile(weights, fresh)
    os.replace(fresh, weights)
    assert identity("diffusers/text", {"text_encoder": weights.parent}) == changed


def test_a_large_file_is_hashed_once_per_version(tmp_path, digest_cache, monkeypatch):
    weights = _big_file(tmp_path / "model.safetensors")
    reads = []
    full = digest._full_digest
    monkeypatch.setattr(digest, "_full_digest", lambda *args: reads.append(args[1]) or full(*args))
    first = digest.file_identity(weights)
    assert reads == [str(weights)]
    assert digest.file_identity(weights) == first and len(reads) == 1  # this process remembers it
    digest._MEMO.clear()  # a new process: the per-user cache remembers it
    assert digest.file_identity(weights) == first and len(reads) == 1
    os.utime(weights)  # touched: hashed again, to the same value
    assert digest.file_identity(weights) == first and len(reads) == 2
    # The cache is private: directory 0700, one entry 0600 naming the file's version.
    assert stat.S_IMODE(digest_cache.stat().st_mode) == 0o700
    (entry,) = digest_cache.iterdir()
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    record = json.loads(entry.read_text())
    assert record["path"] == os.path.realpath(weights) and record["size"] == BIG and len(record["digest"]) == 32


def test_small_files_keep_their_whole_bytes_sha256(tmp_path, digest_cache):
    """Configs, tokenizers and small weights: the identity they always had (no cache entry, no new fingerprint)."""
    import hashlib

    small = tmp_path / "config.json"
    small.write_text('{"a": 1}')
    assert digest.file_identity(small) == hashlib.sha256(small.read_bytes()).digest()
    assert not digest_cache.exists() or not any(digest_cache.iterdir())


def test_a_shared_digest_cache_is_refused(tmp_path, digest_cache):
    weights = _big_file(tmp_path / "model.safetensors")
    digest_cache.mkdir()
    digest_cache.chmod(0o777)  # anyone could plant the digest of other weights here
    with pytest.raises(digest.WeightDigestError, match=r"lets group or others write.*chmod 700 .*digests"):
        digest.file_identity(weights)
    digest_cache.chmod(0o700)
    digest.file_identity(weights)


def test_a_planted_cache_entry_is_not_believed(tmp_path, digest_cache, monkeypatch):
    weights = _big_file(tmp_path / "model.safetensors")
    honest = digest.file_identity(weights)
    monkeypatch.setattr(digest, "_MEMO", {})  # every lookup below goes to the cache directory
    (entry,) = digest_cache.iterdir()
    record = json.loads(entry.read_text())
    outside = tmp_path / "forged.json"
    outside.write_text(json.dumps({**record, "digest": "0" * 32}))
    entry.unlink()
    entry.symlink_to(outside)  # a link: never followed
    assert digest.file_identity(weights) == honest
    digest._MEMO.clear()
    assert not entry.is_symlink() and json.loads(entry.read_text())["digest"] == record["digest"]  # replaced
    entry.unlink()
    os.mkfifo(entry)  # a FIFO: never blocks the loader
    digest._MEMO.clear()
    done = []
    worker = threading.Thread(target=lambda: done.append(digest.file_identity(weights)), daemon=True)
    worker.start()
    worker.join(5)
    if worker.is_alive():  # unblock the reader of the old code before failing
        os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("a FIFO in the digest cache blocked the weight identity")
    assert done == [honest]


def test_a_fifo_among_the_weights_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(digest.WeightDigestError, match="not a regular file"):
        digest.file_identity(fifo)


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch, digest_cache):
    monkeypatch.setenv(digest.ENV, "off")
    weights = _big_file(tmp_path / "model.safetensors")
    reads = []
    full = digest._full_digest
    monkeypatch.setattr(digest, "_full_digest", lambda *args: reads.append(args[1]) or full(*args))
    first = digest.file_identity(weights)
    assert digest.file_identity(weights) == first and len(reads) == 1  # read once per process all the same
    _change_middle_byte_in_place(weights)
    assert digest.file_identity(weights) != first and not digest_cache.exists()


# --- end to end: the encoder's disk tier after new middle weights -------------------------------------------------


def _middle_tensor_byte(path: Path, name: str) -> int:
    """The offset of the first byte of tensor `name` (a middle layer: neither in the first nor the last MiB)."""
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    return 8 + header_len + header[name]["data_offsets"][0]


def test_new_middle_weights_are_not_answered_with_old_embeddings(tiny_dir, tmp_path, one_thread):
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource
    from h3_core.remote.server.disk_cache import DiskTier

    root = tmp_path / "h3"
    shutil.copytree(Path(tiny_dir) / "diffusers", root / "diffusers")
    shutil.copyfile(Path(tiny_dir) / "tiny.json", root / "tiny.json")  # still the tiny (its canvas rule)
    weights = root / "diffusers" / "text_encoder" / "model.safetensors"
    assert weights.stat().st_size > digest.DIRECT_BYTES  # the sampled path of the old identity
    request = CASES["t2va"]

    def encode(cache_dir):
        stage = EncoderStage(ModelSource.from_path(root / "diffusers"), components=("text",))
        with component_cache.using(DiskTier(cache_dir, 1 << 30)) as record:
            answer = stage.encode(request)
        return stage.fingerprint, answer.prompt_embeds.clone(), record.outcomes

    old_model, old_embeds, outcomes = encode(tmp_path / "cache")
    assert outcomes == {"text": "miss"}
    # A fine-tune of one middle layer: one byte of its input norm, every token's states change.
    offset = _middle_tensor_byte(weights, "model.language_model.layers.25.input_layernorm.weight")
    _change_middle_byte_in_place(weights, offset + 2)
    new_model, new_embeds, outcomes = encode(tmp_path / "cache")
    assert new_model != old_model  # clients see a new model identity
    assert outcomes == {"text": "miss"}  # the old embeddings on disk are not served
    assert not torch.equal(new_embeds, old_embeds)
    _, fresh_embeds, outcomes = encode(tmp_path / "fresh")  # what the new weights compute without any cache
    assert outcomes == {"text": "miss"} and torch.equal(new_embeds, fresh_embeds)
