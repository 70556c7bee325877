"""The server as a real process (`python -m h3_core serve`) under hostile load (issue 13, items 2, 3, 8, 9).

Memory is read from /proc/<pid>/status of the server process: VmRSS and Threads after 100 refused requests whose
videos were decoded, VmHWM (peak) after a request that decodes to just under the per-request bound. Also: a
second SIGTERM stops at once, and accept() failures under a file-descriptor shortage are logged rate-limited.
"""

from __future__ import annotations

import http.client
import json
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from test_remote_faults import REPO, ServerProcess, _env

from h3_core import media
from h3_core.remote import packing, protocol

MiB = 1 << 20


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                out[key] = int(value.split()[0]) * (1024 if key.startswith("Vm") else 1)
    return out


def _post(url: str, body: dict, parts: list, timeout: float = 120) -> tuple[int, dict]:
    content_type, buffers = packing.encode_multipart(body, parts)
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", protocol.ENCODE_PATH, body=b"".join(buffers), headers={"Content-Type": content_type})
        reply = conn.getresponse()
        data = reply.read()
    finally:
        conn.close()
    return reply.status, (json.loads(data) if reply.status != 200 else {})


def _video(seconds: float, height: int, width: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    count = int(seconds * 24)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    frames = np.stack([np.roll(base, 4 * i, axis=1) for i in range(count)])
    return media.encode_mp4_bytes(frames, None, fps=24.0)


@pytest.fixture
def served(tiny_dir, request):
    servers = []

    def start(*args, **kwargs):
        server = ServerProcess(tiny_dir, args=args, **kwargs)
        servers.append(server)
        server.wait_listening()
        return server

    yield start
    for server in servers:
        server.close()


def test_refused_videos_leave_memory_and_threads_flat(served):
    """A reference video under H3's 2 s minimum is decoded, then refused (422): 100 of them must not pile up."""
    server = served()
    video = _video(1.9, 360, 640)  # 45 frames, 30 MiB decoded
    body = {"protocol": 1, "prompt": "<Video 1> moves.", "num_frames": 124,
            "ref_videos": [{"part": "v", "soundtrack": False}]}

    def refuse(count):
        for _ in range(count):
            status, reply = _post(server.url, body, [("v", "video/mp4", "v.mp4", video)])
            assert status == 422, reply

    refuse(10)
    before = _status(server.proc.pid)
    refuse(100)
    after = _status(server.proc.pid)
    growth = after["VmRSS"] - before["VmRSS"]
    print(f"100 refused videos: RSS {before['VmRSS'] / MiB:.0f} -> {after['VmRSS'] / MiB:.0f} MiB "
          f"(+{growth / MiB:.1f} MiB), threads {before['Threads']} -> {after['Threads']}")
    assert growth < 24 * MiB  # less than one refused request's decoded frames
    assert after["Threads"] <= before["Threads"] + 2


def test_peak_memory_of_an_accepted_request_is_under_the_stated_bound(served):
    """The documented per-request bound: peak extra memory <= max_body_bytes + 3 x max_request_decoded_bytes."""
    body_cap, decoded_cap = 64 * MiB, 256 * MiB
    server = served("--max-body-mb", "64", "--max-decoded-mb", "256")
    video = _video(14.0, 360, 640, seed=1)  # 336 frames x 640x360x3 = 221 MiB decoded, just under the bound
    assert len(video) < body_cap
    body = {"protocol": 1, "prompt": "<Video 1> moves.", "num_frames": 124,
            "ref_videos": [{"part": "v", "soundtrack": False}]}
    idle = _status(server.proc.pid)
    status, reply = _post(server.url, body, [("v", "video/mp4", "v.mp4", video)], timeout=600)
    assert status == 200, reply
    peak = _status(server.proc.pid)["VmHWM"]
    extra = peak - max(idle["VmHWM"], idle["VmRSS"])
    bound = body_cap + 3 * decoded_cap
    print(f"accepted request decoding to 221 MiB: peak {peak / MiB:.0f} MiB, {extra / MiB:.0f} MiB over idle; "
          f"stated bound {bound / MiB:.0f} MiB")
    assert extra < bound
    # One over the bound is refused from the headers, before decoding: the peak does not move.
    over = _video(15.0, 400, 640, seed=2)  # 360 frames x 640x400x3 = 264 MiB > 256 MiB
    status, reply = _post(server.url, body, [("v", "video/mp4", "v.mp4", over)])
    assert status == 413 and "max_request_decoded_bytes" in reply["error"]["message"], reply


def test_second_sigterm_stops_at_once(served):
    server = served()
    video = _video(14.0, 256, 256, seed=3)
    body = {"protocol": 1, "prompt": "<Video 1> moves.", "num_frames": 124,
            "ref_videos": [{"part": "v", "soundtrack": False}]}
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(_safe_post(server.url, body, video)), daemon=True)
               for _ in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "running\": 1" not in _health(server.url):
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert server.proc.poll() is None  # draining: the accepted requests are still being answered
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(30)
    elapsed = time.monotonic() - started
    for thread in threads:
        thread.join(30)
    answered = sum(1 for answer in answers if answer is not None and answer[0] == 200)
    print(f"second SIGTERM: exited {server.proc.returncode} after {elapsed:.2f} s with {3 - answered} "
          "accepted request(s) abandoned")
    assert elapsed < 2.0 and server.proc.returncode == 1 and answered < 3


def _safe_post(url, body, video):
    try:
        return _post(url, body, [("v", "video/mp4", "v.mp4", video)], timeout=120)
    except OSError:
        return None


def _health(url: str) -> str:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=2)
        conn.request("GET", protocol.HEALTH_PATH)
        return conn.getresponse().read().decode()
    except OSError:
        return ""


def test_accept_errors_are_logged_rate_limited(tiny_dir):
    """With the descriptor limit reached, asyncio fails accept() once a second; the log gets one line per 30 s."""
    limit = 256

    def low_nofile():
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    server = ServerProcess.__new__(ServerProcess)
    server.log = tempfile.NamedTemporaryFile(prefix="h3-serve-", suffix=".log", delete=False)
    server.url = None
    server.proc = subprocess.Popen(
        [sys.executable, "-m", "h3_core", "serve", "--models", str(tiny_dir), "--port", "0"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=server.log, preexec_fn=low_nofile)
    try:
        url = server.wait_listening()
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        socks = []
        started = time.monotonic()
        while time.monotonic() - started < 5:  # hold the server at its descriptor limit for 5 s
            try:
                socks.append(socket.create_connection((host, int(port)), timeout=1))
            except OSError:
                time.sleep(0.05)
            if len(socks) > limit + 64:
                time.sleep(0.1)
        log = server.stderr()
        reported = log.count("accepting connections fails")
        raw = log.count("socket.accept() out of system resource")
        print(f"5 s at the descriptor limit ({len(socks)} connections): {reported} rate-limited report(s), "
              f"{raw} raw asyncio report(s)")
        for sock in socks:
            sock.close()
        assert reported == 1 and raw == 0
    finally:
        server.close()
