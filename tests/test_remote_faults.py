"""The encoder server as a real process (`python -m h3_core serve`) on loopback: kill, restart, drain, bind rules.

* Server killed (SIGKILL) mid-request: the client whose request was running reports a clear error within its
  timeout; a client with retries rides out a restart on the same port and gets the right answer.
* SIGTERM drains: every accepted request is answered, then the process exits 0.
* A non-loopback bind without a token is refused at start, before any model is loaded.
"""

from __future__ import annotations

import concurrent.futures
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from support import warm_cli
from support.encoder_process import REPO, ServerProcess, server_env

from h3_core.remote.client.encoder_client import EncoderClient, RemoteUnavailableError
from h3_core.request import EncodeRequest, VideoInput
from h3_core.testing import SERVER_THREADS, wait_until

THREADS = SERVER_THREADS  # the server processes run with H3_THREADS=1; the local reference too


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here compares with local encodes at the servers' thread count (conftest.one_thread)."""


def _load(client) -> dict:
    try:
        return client.health()["load"]
    except Exception:  # noqa: BLE001
        return {}


def _heavy(tag: str) -> EncodeRequest:
    """A ref2va request with a reference video: ~1-3 s in the tiny model, long enough to be caught mid-flight."""
    rng = np.random.default_rng(len(tag))
    frames = rng.integers(0, 256, (72, 96, 96, 3), dtype=np.uint8)
    return EncodeRequest(prompt=f"<Video 1> {tag}", ref_videos=[VideoInput(frames=frames, fps=24.0)],
                         ref_images=[rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)], num_frames=124)


@pytest.fixture(scope="module")
def stage(encoder_stage):
    return encoder_stage  # conftest: loaded once per session


def test_non_loopback_bind_without_token_is_refused_at_start(tmp_path):
    env = server_env()
    env.pop("H3_THREADS")  # nothing to compute: refused before torch is even imported
    # A models folder that does not exist: the bind refusal names the token, so it came before any model load (which
    # would fail first otherwise). Decided by order, not by a time bound that a loaded machine breaks (a refusal
    # took 75 s of wall time at load average 25 on 2 cores).
    absent = tmp_path / "no-models-here"
    cases = (("0.0.0.0", env, ()), ("::", env, ()), ("0.0.0.0", dict(env, H3_ENCODER_TOKEN="short"), ()),
             ("0.0.0.0", dict(env, H3_ENCODER_TOKEN="t" * 32), ("--token-env", "MY_H3_TOKEN")))
    for host, case_env, extra in cases:
        result = warm_cli.run(["serve", "--models", str(absent), "--host", host, "--port", "0", *extra], cwd=REPO,
                              env=case_env, capture_output=True, timeout=600)
        message = result.stderr.decode()
        assert result.returncode == 2, message[-2000:]
        assert "refusing to bind" in message or "at least 16" in message, message
        assert not extra or "MY_H3_TOKEN" in message  # --token-env names the variable that was read
        assert "listening" not in result.stdout.decode()


def _light(tag: str) -> EncodeRequest:
    return EncodeRequest(prompt=f"A quick one: {tag}.", width=64, height=64)


def test_kill_mid_request_then_restart_and_drain(tiny_dir, request):
    first = ServerProcess(tiny_dir)  # starts loading while this process loads its own reference stage
    second = None
    try:
        stage = request.getfixturevalue("stage")
        url = first.wait_listening()
        probe = EncoderClient(url, retries=0, connect_timeout=2)
        assert probe.capabilities()["model"]["fingerprint"] == stage.fingerprint

        doomed = EncoderClient(url, retries=0, read_timeout=60)
        patient = EncoderClient(url, retries=40, backoff_s=0.25, backoff_max_s=1.0, read_timeout=60,
                                total_timeout=150)
        survivor_request = _light("survives a restart")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            doomed_future = pool.submit(doomed.encode, _heavy("dies with the server"))
            assert wait_until(lambda: _load(probe).get("running") == 1, timeout=30)
            patient_future = pool.submit(patient.encode, survivor_request)
            assert wait_until(lambda: _load(probe).get("queued") == 1, timeout=30)

            first.proc.send_signal(signal.SIGKILL)  # both requests are in flight: one running, one queued
            killed_at = time.perf_counter()
            with pytest.raises(RemoteUnavailableError) as info:
                doomed_future.result(timeout=60)
            reported_after = time.perf_counter() - killed_at
            assert reported_after < 20.0, reported_after  # real time: well within its 60 s read timeout, no hang
            message = str(info.value)
            assert "connection lost mid-request" in message or "connection refused" in message, message
            print(f"\n[kill] client error {reported_after * 1000:.0f} ms after SIGKILL: {message[:160]}")

            first.proc.wait(30)
            second = ServerProcess(tiny_dir, port=first.port)  # restart on the same port
            assert second.wait_listening() == url
            t0 = time.perf_counter()
            survived = patient_future.result(timeout=180)
            print(f"[restart] the retrying client was answered {time.perf_counter() - t0:.1f} s after the new "
                  "server was listening")
        assert survived.to_bytes() == stage.encode(survivor_request).to_bytes()  # another process, same bytes

        # The CLI's `encode --server` goes through the same client: same bytes as a local encode.
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "cond.safetensors"
            result = warm_cli.run(["encode", "--server", url, "--prompt", "From the command line.", "--width", "64",
                                   "--height", "64", "--out", str(out)], cwd=REPO, env=server_env(),
                                  capture_output=True, timeout=120)
            assert result.returncode == 0, result.stderr.decode()[-2000:]
            local = stage.encode(EncodeRequest(prompt="From the command line.", width=64, height=64))
            assert out.read_bytes() == local.to_bytes()

        # SIGTERM drains: the accepted requests are all answered, then the process exits 0.
        requests = [_heavy("drain"), _light("drain 1"), _light("drain 2")]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(EncoderClient(url, retries=0, read_timeout=60).encode, requests[0])]
            assert wait_until(lambda: _load(probe).get("running") == 1, timeout=30)
            futures += [pool.submit(EncoderClient(url, retries=0, read_timeout=60).encode, r) for r in requests[1:]]
            assert wait_until(lambda: _load(probe).get("active_requests") == 3, timeout=30)
            second.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: _load(probe) == {}, timeout=10)  # the listener closes at once
            with pytest.raises(RemoteUnavailableError):  # so new work is refused while draining
                EncoderClient(url, retries=0, connect_timeout=2).encode(_light("too late"))
            results = [future.result(timeout=120) for future in futures]
        assert second.proc.wait(60) == 0
        assert "all accepted requests answered" in second.stderr()
        for sent, result in zip(requests, results):
            assert result.to_bytes() == stage.encode(sent).to_bytes()
    finally:
        first.close()
        if second is not None:
            second.close()
