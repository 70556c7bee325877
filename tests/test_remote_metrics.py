"""`GET /metrics` and `/v1/health` ready vs loading, on a real loopback server around the tiny model.

The exposition is parsed with prometheus-client's own parser; the request counters must equal what the test sent,
status by status (200 computed, 200 from the cache, 400, 401, 422).
"""

from __future__ import annotations

import http.client
import json

import pytest
from support.remote_http import metric_samples

from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.remote import protocol
from h3_core.remote.engines.aiohttp_server import ServerThread
from h3_core.remote.server.config import ServerConfig
from h3_core.testing import SERVER_THREADS

TOKEN = "metrics-token-" + "x" * 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Same thread count as the server's model thread."""


@pytest.fixture(scope="module")
def stage(tiny_dir):
    return EncoderStage(ModelSource.from_path(tiny_dir), components=("text",))


def _call(server, method: str, path: str, body: dict | bytes | None = None, token: str | None = TOKEN):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), payload


def _encode_body(prompt: str, **extra) -> dict:
    return {"protocol": protocol.PROTOCOL_VERSION, "prompt": prompt, "width": 64, "height": 64, "num_frames": 124,
            **extra}


def test_metrics_count_what_was_sent(stage):
    config = ServerConfig(threads=SERVER_THREADS, token=TOKEN)
    with ServerThread(stage, config) as server:
        sent = {}

        def send(expected: int, body, token=TOKEN):
            status, _, _ = _call(server, "POST", protocol.ENCODE_PATH, body, token)
            assert status == expected
            sent[status] = sent.get(status, 0) + 1

        send(200, _encode_body("A red fox in the snow, take 1."))
        send(200, _encode_body("A red fox in the snow, take 2."))
        send(200, _encode_body("A red fox in the snow, take 1."))  # the cache answers
        send(400, b"{not json")
        send(400, _encode_body("x", unknown_field=1))
        send(401, _encode_body("no token"), token=None)
        send(422, _encode_body("Bad frame count.", num_frames=125))  # not 17k+5: refused by the model's rules
        status, _, _ = _call(server, "GET", "/metrics", token=None)
        assert status == 401  # the token guards metrics like every endpoint but health
        status, headers, payload = _call(server, "GET", "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")

    samples = metric_samples(payload.decode())
    requests = {labels: value for (name, labels), value in samples.items() if name == "h3_encoder_requests_total"}
    by_status = {}
    for labels, value in requests.items():
        by_status[int(dict(labels)["status"])] = by_status.get(int(dict(labels)["status"]), 0) + value
    assert by_status == sent
    assert requests[(("status", "200"), ("task", "t2va"))] == 3
    assert requests[(("status", "401"), ("task", "unknown"))] == 1
    assert samples[("h3_encoder_cache_hits_total", ())] == 1
    assert samples[("h3_encoder_request_seconds_count", (("cache", "hit"), ("task", "t2va")))] == 1
    assert samples[("h3_encoder_request_seconds_count", (("cache", "miss"), ("task", "t2va")))] == 2
    for phase, count in (("receive", 3), ("queue", 2), ("text", 2), ("serialise", 2), ("send", 3)):
        assert samples[("h3_encoder_phase_seconds_count", (("phase", phase),))] == count, phase
    assert ("h3_encoder_phase_seconds_count", (("phase", "video_vae"),)) not in samples  # t2va used no VAE
    assert samples[("h3_encoder_ready", ())] == 1 and samples[("h3_encoder_queue_depth", ())] == 0
    assert samples[("h3_encoder_model_load_seconds", (("component", "text"),))] > 0
    assert samples[("h3_encoder_device_memory_bytes", (("device", "cpu"), ("kind", "resident")))] > 0
    assert samples[("h3_encoder_events_total", (("event", "computed"),))] == 2


def test_health_tells_loading_from_ready(stage):
    with ServerThread(None, ServerConfig(threads=SERVER_THREADS)) as server:
        status, headers, payload = _call(server, "GET", protocol.HEALTH_PATH)
        assert status == 503 and json.loads(payload)["status"] == "loading" and int(headers["Retry-After"]) > 0
        status, headers, payload = _call(server, "POST", protocol.ENCODE_PATH, _encode_body("Too early."))
        assert status == 503 and json.loads(payload)["error"]["code"] == "loading" and "Retry-After" in headers
        status, _, payload = _call(server, "GET", protocol.CAPABILITIES_PATH)
        assert status == 503
        status, _, payload = _call(server, "GET", "/metrics")
        assert status == 200 and metric_samples(payload.decode())[("h3_encoder_ready", ())] == 0
        server.call(lambda: server.service.attach(stage, load_seconds=1.5))
        status, _, payload = _call(server, "GET", protocol.HEALTH_PATH)
        assert status == 200 and json.loads(payload)["status"] == "ok"
        status, _, _ = _call(server, "POST", protocol.ENCODE_PATH, _encode_body("Now ready."))
        assert status == 200
        samples = metric_samples(_call(server, "GET", "/metrics")[2].decode())
        assert samples[("h3_encoder_load_seconds", ())] == 1.5  # the whole load: its own gauge, so that
        assert ("h3_encoder_model_load_seconds", (("component", "total"),)) not in samples  # sum() is not doubled


def test_top_latency_bucket_reaches_the_longest_deadline_and_promtool_accepts_the_exposition(stage, tmp_path):
    import shutil
    import subprocess

    for deadline, top in ((300.0, 900.0), (1800.0, 1800.0)):
        config = ServerConfig(threads=SERVER_THREADS, default_deadline_s=deadline, max_deadline_s=deadline)
        with ServerThread(stage, config) as server:
            assert _call(server, "POST", protocol.ENCODE_PATH, _encode_body("A fox."), token=None)[0] == 200
            text = _call(server, "GET", "/metrics", token=None)[2].decode()
        bounds = [float(dict(labels)["le"]) for (name, labels), _ in metric_samples(text).items()
                  if name == "h3_encoder_request_seconds_bucket"]
        assert max(b for b in bounds if b != float("inf")) == top >= deadline
        assert "that misse." not in text and "Cache lookups answered from the cache." in text
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed: the lint was not run")
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
