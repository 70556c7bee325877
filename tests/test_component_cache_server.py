"""The component cache behind the encoder endpoint: headers, metrics, and the disk tier across server processes.

* In process: a prompt-only change answers from the references' cached parts (`X-H3-Cache-Components`), bitwise the
  local encode, and `/metrics` counts hits and misses per component and bytes per tier.
* Real `python -m h3_core serve --cache-dir DIR` processes: a second server sharing DIR hits what the first computed,
  a restarted server hits the disk tier, and a server whose writes fail (a file-size limit: the kernel refuses
  every cache write, as a full disk would) still answers every request correctly; nothing outside DIR appears.
"""

from __future__ import annotations

import os
import resource
import signal

import pytest
from support.encoder_process import ServerProcess
from support.remote_cases import CASES
from support.remote_http import cache_components, metric_samples, raw, wire

from h3_core.remote import protocol
from h3_core.remote.engines.aiohttp_server import ServerThread
from h3_core.remote.server.config import ServerConfig
from h3_core.testing import SERVER_THREADS

MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Local reference encodes at the servers' thread count."""


@pytest.fixture(scope="module")
def stage(encoder_stage):
    return encoder_stage  # conftest: loaded once per session


@pytest.fixture(scope="module")
def local(stage):
    return {prompt: stage.encode(_with_prompt(prompt)).to_bytes() for prompt in ("first", "second")}


def _with_prompt(prompt: str):
    base = CASES["ref2va"]
    return base.__class__(**{**base.__dict__, "prompt": f"<Picture 1> and <Video 1>, {prompt}."})


def _post(url: str, prompt: str) -> tuple[int, dict, bytes]:
    content_type, body = wire(_with_prompt(prompt))
    status, headers, data = raw(url, "POST", protocol.ENCODE_PATH, body, {"Content-Type": content_type},
                                 timeout=120)
    return status, dict(headers), data


REFERENCES = ("video.0", "video.1", "audio.0", "audio.1")


def test_prompt_only_change_hits_every_reference_in_memory(stage, local, tmp_path):
    config = ServerConfig(threads=SERVER_THREADS, cache_dir=str(tmp_path / "cache"), cache_disk_bytes=64 * MiB)
    with ServerThread(stage, config) as server:
        status, headers, data = _post(server.url, "first")
        assert status == 200 and data == local["first"] and headers[protocol.H_CACHE] == "miss"
        assert cache_components(headers) == dict.fromkeys(("text", *REFERENCES), "miss")
        status, headers, data = _post(server.url, "second")
        assert status == 200 and data == local["second"]
        assert cache_components(headers) == {"text": "miss", **dict.fromkeys(REFERENCES, "memory")}
        status, headers, data = _post(server.url, "second")  # the whole answer: no parts computed or looked up
        assert headers[protocol.H_CACHE] == "hit" and protocol.H_CACHE_COMPONENTS not in headers
        status, _, text = raw(server.url, "GET", "/metrics")
        samples = metric_samples(text.decode())
    hits = "h3_encoder_cache_component_hits_total"
    assert samples[(hits, (("component", "video"), ("tier", "memory")))] == 2
    assert samples[(hits, (("component", "audio"), ("tier", "memory")))] == 2
    assert samples[("h3_encoder_cache_component_misses_total", (("component", "text"),))] == 2
    assert samples[("h3_encoder_cache_component_misses_total", (("component", "video"),))] == 2
    memory = samples[("h3_encoder_cache_component_bytes", (("tier", "memory"),))]
    disk = samples[("h3_encoder_cache_component_bytes", (("tier", "disk"),))]
    assert 0 < memory < disk < 64 * MiB  # disk: the same tensors plus each file's header
    assert samples[("h3_encoder_cache_component_faults_total", (("kind", "corrupt"),))] == 0


def test_a_second_process_and_a_restart_hit_the_shared_directory(tiny_dir, local, tmp_path):
    root = tmp_path / "cache"
    args = ("--cache-dir", str(root), "--cache-disk-bytes", str(64 * MiB))
    first, second = ServerProcess(tiny_dir, args=args), ServerProcess(tiny_dir, args=args)
    try:
        first.wait_listening(), second.wait_listening()
        status, headers, data = _post(first.url, "first")
        assert status == 200 and data == local["first"]
        assert set(cache_components(headers).values()) == {"miss"}
        status, headers, data = _post(second.url, "second")  # the other process: its memory is empty
        assert status == 200 and data == local["second"]
        assert cache_components(headers) == {"text": "miss", **dict.fromkeys(REFERENCES, "disk")}
    finally:
        first.proc.send_signal(signal.SIGTERM)
        second.close()
        first.proc.wait(60)
        first.close()
    restarted = ServerProcess(tiny_dir, args=args)
    try:
        restarted.wait_listening()
        status, headers, data = _post(restarted.url, "first")
        assert status == 200 and data == local["first"]
        assert set(cache_components(headers).values()) == {"disk"}
        status, headers, data = _post(restarted.url, "second")  # references now in this process's memory too
        assert status == 200 and data == local["second"]
        assert cache_components(headers) == {"text": "disk", **dict.fromkeys(REFERENCES, "memory")}
    finally:
        restarted.close()
    assert os.listdir(tmp_path) == ["cache"]  # nothing outside DIR
    assert sorted(os.listdir(root)) == ["entries", "lock", "tmp"] and os.listdir(root / "tmp") == []


def _small_files():
    """In the server process: any file write past 4 KiB fails with EFBIG, as a full disk fails with ENOSPC (the log
    is cut there too; media decode in process: the sandbox's scratch files would hit the limit as well)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_a_server_whose_cache_writes_fail_still_answers(tiny_dir, local, tmp_path):
    root = tmp_path / "cache"
    server = ServerProcess(tiny_dir, args=("--cache-dir", str(root), "--component-cache-mb", "0",
                                           "--decode-in-process"), preexec_fn=_small_files)
    try:
        server.wait_listening()
        status, headers, data = _post(server.url, "first")
        assert status == 200 and data == local["first"] and set(cache_components(headers).values()) == {"miss"}
        status, headers, data = _post(server.url, "second")
        assert status == 200 and data == local["second"]
        status, _, text = raw(server.url, "GET", "/metrics")
        samples = metric_samples(text.decode())
        failed = samples[("h3_encoder_cache_component_faults_total", (("kind", "write_errors"),))]
    finally:
        server.close()
    kept = list((root / "entries").rglob("*.safetensors"))
    assert all(path.stat().st_size <= 4096 for path in kept) and os.listdir(root / "tmp") == []
    # Every write of a part larger than the limit failed, in both requests; the small parts were kept and hit.
    misses = sum(outcome == "miss" for outcome in cache_components(headers).values())
    assert len(kept) < 5 and failed == (5 - len(kept)) + misses and misses == 5 - len(kept)
