"""The media sandbox as a deployed service runs it: no secrets in the decoders, and a stop is not the media's fault.

* The decoder host and its workers start with a scrubbed environment: the server's bearer token (and any other
  variable the server was given) never reaches the processes that parse untrusted bytes.
* A worker stopped from outside (the SIGTERM a service manager sends a whole control group) is `DecoderStopped`,
  answered `503 decoder_stopped` with Retry-After, and the client retries it: the request succeeds, where it used to
  get a final `422 invalid_media`.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from h3_core import media, testing
from h3_core.media import sandbox as media_sandbox
from h3_core.remote import protocol

SECRET = "sandbox-env-secret-" + "q" * 24


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as file:
        entries = file.read().split(b"\0")
    return dict(entry.decode("utf-8", "replace").partition("=")[::2] for entry in entries if entry)


def _children(pid: int) -> list[int]:
    """Live direct children of `pid`, from /proc (Linux): a zombie (a worker killed by the previous test and not
    yet reaped by its waiter) is not one, or a test would signal it instead of the worker it started."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as file:
                stat = file.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != b"Z":
            found.append(int(name))
    return found


def _workers() -> list[int]:
    """The sandbox's decode workers now: grandchildren of the decoder host (host -> waiter -> worker)."""
    host = media_sandbox._HOST.process
    if host is None or host.poll() is not None:
        return []
    return [worker for waiter in _children(host.pid) for worker in _children(waiter)]


@pytest.fixture
def fresh_host(monkeypatch):
    """A decoder host started after the secrets are in this process's environment (as in a server)."""
    monkeypatch.setenv("H3_ENCODER_TOKEN", SECRET)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("H3_RAY_TEST_TOKEN", SECRET)
    host = media_sandbox._HOST.process
    if host is not None and host.poll() is None:
        host.kill()
        host.wait(10)
    yield
    host = media_sandbox._HOST.process
    if host is not None and host.poll() is None:  # leave no host holding this test's environment
        host.kill()
        host.wait(10)


def test_decoders_start_without_the_servers_secrets(fresh_host):
    png = media.encode_png_bytes(testing.image(1, 32, 48))
    np.testing.assert_array_equal(media_sandbox.decode_isolated("read_image", png), media.read_image(png))
    env = _environ(media_sandbox._HOST.process.pid)
    assert SECRET not in "".join(f"{key}={value}" for key, value in env.items())
    assert not {"H3_ENCODER_TOKEN", "AWS_SECRET_ACCESS_KEY", "H3_RAY_TEST_TOKEN"} & set(env)
    assert set(env) <= set(media_sandbox._ENV_KEPT) | {"PYTHONPATH"} | {k for k in env if k.startswith("LC_")}
    # A worker is a fork of that host: the same environment (checked on one that is alive).
    result: list = []
    hung = threading.Thread(target=lambda: result.append(_hang_briefly()), daemon=True)
    hung.start()
    assert testing.wait_until(lambda: bool(_workers()), timeout=30)
    worker_env = _environ(_workers()[0])
    assert "H3_ENCODER_TOKEN" not in worker_env and SECRET not in str(worker_env)
    hung.join(30)
    assert result == ["timed out"]


def _hang_briefly() -> str:
    try:
        media_sandbox.decode_isolated("selftest_hang", b"x", timeout_s=3.0)
    except media.MediaError as error:
        return "timed out" if "timed out" in str(error) else str(error)
    return "returned"


def test_the_crash_hook_still_reaches_the_workers(monkeypatch, fresh_host):
    marker = "crash-marker-" + "m" * 16
    monkeypatch.setenv(media_sandbox.TEST_CRASH_ENV, marker)
    with pytest.raises(media.MediaError, match="signal 11"):
        media_sandbox.decode_isolated("read_image", marker.encode())


@pytest.fixture
def default_stop_signals():
    """A decoder host started with SIGTERM and SIGHUP at their defaults, as systemd starts a unit's processes. A test
    run under `nohup` would otherwise hand its ignored SIGHUP down to the host and its workers (fork and exec keep
    an ignored signal ignored), and a worker sent SIGHUP would never stop."""
    before = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGHUP)}
    _stop_host()
    yield
    _stop_host()  # the next test's host inherits the run's own dispositions again
    for sig, handler in before.items():
        signal.signal(sig, handler)


def _stop_host() -> None:
    host = media_sandbox._HOST.process
    if host is not None and host.poll() is None:
        host.kill()
        host.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # SIGINT: ignored by the workers
def test_a_worker_stopped_from_outside_is_not_a_media_error(sig, default_stop_signals):
    outcome: list = []

    def call():
        try:
            media_sandbox.decode_isolated("selftest_hang", b"x", timeout_s=60.0)
        except BaseException as error:  # noqa: BLE001 - recorded for the assertions
            outcome.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert testing.wait_until(lambda: bool(_workers()), timeout=30)
    os.kill(_workers()[0], sig)  # what `systemctl stop` does to every process of the unit (KillMode=control-group)
    caller.join(30)
    (error,) = outcome
    assert isinstance(error, media_sandbox.DecoderStopped) and not isinstance(error, media.MediaError)
    assert f"stopped by signal {int(sig)}" in str(error)
    mapped = protocol.error_from_exception(error)
    assert (mapped.status, mapped.code) == (503, "decoder_stopped")
    # The sandbox's own kill (timeout) and a crash stay media errors (422): they are the input's doing.
    with pytest.raises(media.MediaError, match="timed out"):
        media_sandbox.decode_isolated("selftest_hang", b"x", timeout_s=0.3)


def test_a_decode_stopped_mid_request_is_retried_by_the_client(tiny_dir, default_stop_signals):
    """A real server and client: the first sandbox worker of a ref2va request is stopped with SIGTERM; the server
    answers 503 decoder_stopped with Retry-After, the client retries, and the answer is the normal one.

    On a busy machine the watcher can miss: it may not look at /proc while a worker lives, or a worker may exit
    between that look and the `kill` (a signal to a worker that has answered, or to its zombie, changes nothing).
    A miss is not a failure: the request is sent again until one stop lands mid-decode (at most 5 attempts)."""
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource
    from h3_core.remote.client.encoder_client import EncoderClient
    from h3_core.remote.engines.aiohttp_server import ServerThread
    from h3_core.remote.server.config import ServerConfig
    from h3_core.request import EncodeRequest

    stage = EncoderStage(ModelSource.from_path(tiny_dir))
    request = EncodeRequest(prompt="<Video 1> plays.", width=64, height=64, num_frames=124,
                            ref_videos=[testing.video(4.0, 128, 128)])

    def stop_first_worker(done: threading.Event):
        while not done.is_set():
            for worker in _workers():
                try:
                    os.kill(worker, signal.SIGTERM)
                except ProcessLookupError:
                    continue
                return
            time.sleep(0.002)

    def count(metrics: str, status: int) -> float:
        line = f'h3_encoder_requests_total{{status="{status}",task="ref2va"}} '
        return sum(float(row[len(line):]) for row in metrics.splitlines() if row.startswith(line))

    answers, attempts = [], 0
    with ServerThread(stage, ServerConfig(threads=testing.SERVER_THREADS, cache_bytes=0)) as server:
        while attempts < 5:
            attempts += 1
            done = threading.Event()
            watcher = threading.Thread(target=stop_first_worker, args=(done,), daemon=True)
            watcher.start()
            answers.append(EncoderClient(server.url, token="", read_timeout=120).encode(request).to_bytes())
            done.set()
            watcher.join(10)
            metrics = server.call(lambda: server.service.metrics.render()[0].decode())
            if count(metrics, 503):
                break
        answers.append(EncoderClient(server.url, token="", read_timeout=120).encode(request).to_bytes())
    assert count(metrics, 503) == 1, f"no stop landed mid-decode in {attempts} attempts"
    assert count(metrics, 200) == attempts  # each attempt answered, the stopped one after its retry
    assert "422" not in metrics.split("h3_encoder_requests_total")[1].split("# HELP")[0]
    assert len(set(answers)) == 1


def test_the_decoder_host_imports_no_torch():
    """The host is a small process that forks a worker per call: what it imports (the media modules, and the
    safetensors header parser it reads results with) must not pull in torch, diffusers or transformers."""
    import subprocess
    import sys
    from pathlib import Path

    assert "._serve(fd)" in media_sandbox._BOOT
    code = media_sandbox._BOOT.replace("._serve(fd)", "") + (
        "\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', 'transformers')))")
    directory = str(Path(media_sandbox.__file__).parent.parent)  # the h3_core folder, as the host gets it
    out = subprocess.run([sys.executable, "-c", code, directory, "0"], capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.strip() == "[]"
