"""Encode-ahead (nodes/encode_ahead.py) inside a real ComfyUI, against real H3 encoder servers on loopback.

Server A is listed in H3_ENCODER_URLS (the token's allow-list), server B is not. Each server's request log (one line
per request, with `cache=miss` / `cache=hit` for encodes) is what they received: the tests count from it.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from support.comfy_harness import comfy_factory, free_port  # noqa: F401  (session fixture)
from support.encoder_process import spawn_serve, wait_healthy

REPO = Path(__file__).resolve().parents[1]
GRAPH = json.loads((REPO / "workflows" / "api" / "ref2va_remote.json").read_text())


def _start_encoder(tiny_dir: Path, log_path: Path):
    port = free_port()
    log = open(log_path, "w")
    env = {**os.environ, "H3_THREADS": os.environ.get("H3_THREADS", "2"), "PYTHONUNBUFFERED": "1"}
    return spawn_serve(tiny_dir, port, log, env), log, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def encoders(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("encoders")
    started = [_start_encoder(tiny_dir, folder / f"{name}.log") for name in ("a", "b")]
    for proc, _, url in started:
        wait_healthy(url, proc, timeout=300)
    yield {"a": (started[0][2], folder / "a.log"), "b": (started[1][2], folder / "b.log")}
    for proc, log, _ in started:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def server(comfy_factory, tiny_dir, encoders):  # noqa: F811
    env = {"H3_TINY_DIR": str(tiny_dir), "H3_ENCODER_URLS": encoders["a"][0], "H3_ENCODE_AHEAD_DELAY": "0.2"}
    comfy = comfy_factory(Path(tiny_dir) / "comfyui", env)
    comfy.add_model("minimax_h3", tiny_dir, "tiny")
    return comfy


def graph(endpoint: str, prompt: str, steps: int = 4) -> dict:
    out = json.loads(json.dumps(GRAPH))
    encode = next(node for node in out.values() if node["class_type"] == "H3SplitRemoteEncode")
    encode["inputs"].update(endpoint=endpoint, prompt=f"<Picture 1> {prompt} like <Video 1>, to <Audio 2>.")
    next(node for node in out.values() if node["class_type"] == "H3SplitSampler")["inputs"]["steps"] = steps
    return out


def post(comfy, prompt_graph: dict) -> str:
    status, body = comfy.request("POST", "/prompt", {"prompt": prompt_graph, "client_id": uuid.uuid4().hex})
    assert status == 200, body
    return body["prompt_id"]


def wait_done(comfy, prompt_id: str, timeout: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = comfy.history(prompt_id)
        status = entry.get("status", {}).get("status_str")
        if status == "success":
            return entry
        if status == "error":
            raise AssertionError(f"prompt {prompt_id} failed: {json.dumps(entry['status'])[:3000]}\n"
                                 f"{comfy.log_tail()}")
        time.sleep(0.2)
    raise TimeoutError(f"prompt {prompt_id} did not finish\n{comfy.log_tail()}")


def settled(read, expected: int, limit_s: float = 30.0, quiet_s: float = 0.5) -> list:
    """`read()` once it holds at least `expected` entries (the server logs a request just after answering it; on
    a loaded machine, load average 8 on 2 cores, that line can lag by seconds) and then `quiet_s` more real seconds,
    so an entry that should not be there has had time to appear too."""
    deadline = time.monotonic() + limit_s
    while len(read()) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(quiet_s)
    return read()


def encodes(log_path: Path) -> list[str]:
    """The cache status of every encode the server answered, in order ('miss' = computed)."""
    return [line.rsplit("cache=", 1)[1].split()[0] for line in log_path.read_text().splitlines()
            if "POST /v1/encode" in line and "cache=" in line]


def requests(log_path: Path) -> list[str]:
    return [line for line in log_path.read_text().splitlines() if " GET /v1/" in line or " POST /v1/" in line]


def test_next_prompt_is_encoded_ahead_once_and_a_deleted_one_sends_nothing(server, encoders):
    url, log = encoders["a"]
    before = len(encodes(log))
    first = post(server, graph(url, "a red ball rolls", steps=24))  # runs at once (no one ahead of it)
    second = post(server, graph(url, "a blue cube slides"))  # waits behind the first: encoded ahead
    third = post(server, graph(url, "a green cone spins"))  # further back, then deleted: sends nothing
    server.request("POST", "/queue", {"delete": [third]})
    wait_done(server, first)
    wait_done(server, second)
    got = settled(lambda: encodes(log)[before:], 2)
    # One computed encode per distinct request that ran (first: by its node; second: ahead, then handed to its
    # node, which sent nothing itself: no cache hit either), and none for the deleted prompt.
    assert got == ["miss", "miss"], got
    comfy_log = server.log_text()
    assert f"encode-ahead: prompt {second} node 8 encoded ahead" in comfy_log, server.log_tail()
    assert f"encode-ahead: prompt {third}" not in comfy_log


def test_unchanged_request_is_encoded_once(server, encoders):
    """Queued twice with only the seed changed: one encode in all, whether the second prompt's encode-ahead or the
    first prompt's node got there first (the other takes it), and ComfyUI's cache serves the second node."""
    url, log = encoders["a"]
    before = len(encodes(log))
    first = post(server, graph(url, "a yellow kite flies", steps=24))
    again = graph(url, "a yellow kite flies", steps=24)
    next(node for node in again.values() if node["class_type"] == "H3SplitSampler")["inputs"]["seed"] = 7
    again = post(server, again)
    wait_done(server, first)
    wait_done(server, again)
    assert settled(lambda: encodes(log)[before:], 1) == ["miss"]


def test_endpoint_outside_the_allow_list_gets_nothing(server, encoders):
    url_a, _ = encoders["a"]
    url_b, log_b = encoders["b"]
    running = post(server, graph(url_a, "a white swan glides", steps=16))
    status, body = server.request("POST", "/prompt", {"prompt": graph(url_b, "a black cat jumps"),
                                                      "client_id": uuid.uuid4().hex})
    assert status == 400, body  # the node refuses an endpoint outside H3_ENCODER_URLS at validation
    wait_done(server, running)
    assert settled(lambda: requests(log_b), 0) == []  # not even a handshake reached B
