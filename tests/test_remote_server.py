"""The encoder server and client on loopback, in-process: parity, load, auth, queue, deadline, cancel, hostility.

Every server here is real (aiohttp on 127.0.0.1, a free port) around the tiny model's real `EncoderStage`;
a few tests wrap the stage to make it slow, so queueing, deadlines and cancellation are deterministic.
The model thread and the local reference both run torch with one thread: bitwise equality between the two
holds at equal thread counts (torch reductions depend on it), and one thread is also the fastest on shared CI cores.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import threading
import time

import numpy as np
import pytest

from h3_core import media
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.progress import Cancelled
from h3_core.remote import handler as handler_module
from h3_core.remote import packing, protocol
from h3_core.remote.client import (
    EncoderClient,
    ModelMismatchError,
    ProtocolMismatchError,
    RemoteAuthError,
    RemoteEncodeError,
    RemoteRequestError,
    RemoteUnavailableError,
)
from h3_core.remote.config import ServerConfig
from h3_core.remote.server import ServerThread
from h3_core.request import AudioInput, EncodeRequest, VideoInput
from h3_core.testing import SERVER_THREADS, png_bomb, wait_until

THREADS = SERVER_THREADS  # the server processes run with H3_THREADS=1; the local reference too
TOKEN = "test-token-" + "x" * 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here compares with local encodes at the servers' thread count (conftest.one_thread)."""


@pytest.fixture(scope="module")
def stage(tiny_dir):
    return EncoderStage(ModelSource.from_path(tiny_dir))


@pytest.fixture(scope="module")
def server(stage):
    with ServerThread(stage, ServerConfig(threads=THREADS), model_info={"layout": "diffusers", "tiny": True}) as s:
        yield s


def _image(seed, height, width):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    return np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)


def _tone(seconds, rate=32000, freq=440.0):
    t = np.arange(int(seconds * rate)) / rate
    return np.stack([0.3 * np.sin(2 * np.pi * freq * t), 0.3 * np.sin(2 * np.pi * freq * 1.5 * t)]).astype(np.float32)


def _video(seconds, rate=44100):
    frames = np.stack([np.roll(_image(7, 64, 64), 3 * i, axis=1) for i in range(int(seconds * 24))])
    return VideoInput(frames=frames, fps=24.0, audio=_tone(seconds, rate, 220.0), sample_rate=rate)


CASES = {
    "t2va": EncodeRequest(prompt="A red fox in the snow.", width=64, height=64, num_frames=124),
    "fl2va": EncodeRequest(prompt="The door opens.", first_frame=_image(1, 64, 96), last_frame=_image(2, 80, 96),
                           num_frames=124),
    "ref2va": EncodeRequest(
        prompt="<Picture 1> walks in, <Video 1> moves, <Audio 2> plays.",
        ref_images=[_image(3, 64, 96)],
        ref_videos=[_video(2.0)],  # 44.1 kHz soundtrack: resampled on the server exactly as locally
        ref_audios=[AudioInput(_tone(3.0), 32000)],
        num_frames=124,
    ),
}


class SlowStage:
    """The real stage behind a cancellable delay: makes queueing, deadlines and cancel deterministic."""

    def __init__(self, stage, delay):
        self.stage, self.delay = stage, delay
        self.fingerprint, self.components = stage.fingerprint, stage.components
        self.calls = self.cancelled = 0

    def encode(self, request, metadata=None, cancel=None, progress=None):
        self.calls += 1
        end = time.monotonic() + self.delay
        while time.monotonic() < end:
            if cancel is not None and cancel.is_set():
                self.cancelled += 1
                raise Cancelled("cancelled during the test delay")
            time.sleep(0.005)
        return self.stage.encode(request, metadata=metadata, cancel=cancel, progress=progress)


def _raw(url, method, path, body=b"", headers=None, timeout=30.0):
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        headers = dict(headers or {})
        if body is not None and "Content-Length" not in headers and (body or method in ("POST", "PUT")):
            headers["Content-Length"] = str(len(body))
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders()
        if body:
            try:
                conn.send(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered early (e.g. 413 on the declared size) and closed
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def _wire(request: EncodeRequest, **extra) -> tuple[str, bytes]:
    body, parts = packing.request_to_wire(request)
    body.update(extra)
    content_type, buffers = packing.encode_multipart(body, parts)
    return content_type, b"".join(buffers)


# --- parity --------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", sorted(CASES))
def test_remote_equals_local_bit_for_bit(task, stage, server):
    request = CASES[task]
    local = stage.encode(request)
    steps = []
    remote = EncoderClient(server.url).encode(request, progress=lambda done, total: steps.append((done, total)))
    assert remote.task == task
    assert remote.to_bytes() == local.to_bytes()  # tensors, header and metadata, byte for byte
    assert remote == local
    done = [d for d, _ in steps]
    assert steps[0] == (0, 10) and steps[-1] == (10, 10) and done == sorted(set(done))  # never backwards
    assert {1, 2, 9}.issubset(done) and {total for _, total in steps} == {10}


def test_cache_answers_repeats_without_recomputing(stage, server):
    request = EncodeRequest(prompt="Cache me: a heron lands.", width=64, height=64)
    client = EncoderClient(server.url)
    before = dict(server.service.counters)
    t0 = time.perf_counter()
    first = client.encode(request)
    miss_s = time.perf_counter() - t0
    hits = []
    for _ in range(10):
        t0 = time.perf_counter()
        again = client.encode(request)
        hits.append(time.perf_counter() - t0)
        assert again.to_bytes() == first.to_bytes()
    after = server.service.counters
    assert after["computed"] - before.get("computed", 0) == 1
    assert after["cache_hits"] - before.get("cache_hits", 0) == 10
    content_type, body = _wire(request)
    status, headers, data = _raw(server.url, "POST", protocol.ENCODE_PATH, body, {"Content-Type": content_type})
    assert status == 200 and headers[protocol.H_CACHE] == "hit" and data == first.to_bytes()
    print(f"\n[cache] miss {miss_s * 1000:.1f} ms, hit median {sorted(hits)[5] * 1000:.2f} ms "
          f"(client round trip incl. PNG/JSON packing and safetensors parsing)")


def test_capabilities_and_health(server, stage):
    client = EncoderClient(server.url)
    caps = client.capabilities()
    assert caps["protocol"]["version"] == protocol.PROTOCOL_VERSION
    assert caps["model"] == {"fingerprint": stage.fingerprint, "layout": "diffusers", "tiny": True,
                             "dtype": "float32", "device": "cpu", "threads": THREADS,
                             "components": ["text", "video", "audio"]}
    assert caps["limits"]["max_body_bytes"] > 0 and caps["limits"]["max_ref_images"] == 9
    assert client.model == stage.fingerprint
    health = client.health()
    assert health["status"] == "ok" and health["load"]["capacity"] == 32


# --- load ----------------------------------------------------------------------------------------


def test_16_clients_x_20_requests_all_correct(stage, server):
    shapes = [(64, 64, 124), (96, 64, 124), (64, 96, 141), (64, 64, 158)]

    def request_for(client_id, index):
        width, height, frames = shapes[(client_id + index) % len(shapes)]
        number = client_id * 20 + index
        prompt = f"Client {client_id} asks for shot {index}: a lantern drifts over water number {number}."
        return EncodeRequest(prompt=prompt, width=width, height=height, num_frames=frames)

    before = dict(server.service.counters)
    results: dict[tuple[int, int], bytes] = {}

    def run_client(client_id):
        client = EncoderClient(server.url, retries=3, read_timeout=120)
        for index in range(20):
            results[(client_id, index)] = client.encode(request_for(client_id, index)).to_bytes()

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for future in [pool.submit(run_client, c) for c in range(16)]:
            future.result()
    wall = time.perf_counter() - t0
    assert len(results) == 320  # none lost
    computed = server.service.counters["computed"] - before.get("computed", 0)
    assert computed == 320  # distinct prompts: every answer was computed, none came from another's cache entry

    t0 = time.perf_counter()
    for (client_id, index), data in results.items():
        assert data == stage.encode(request_for(client_id, index)).to_bytes(), (client_id, index)
    local = time.perf_counter() - t0
    print(f"\n[16x20] {wall:.1f} s wall, {320 / wall:.1f} requests/s through one model thread; "
          f"local sequential re-encode of the same 320: {local:.1f} s ({320 / local:.1f}/s)")


def test_identical_concurrent_requests_share_one_computation(stage):
    slow = SlowStage(stage, delay=1.0)
    request = EncodeRequest(prompt="Shared: two clients, one encode.", width=64, height=64)
    with ServerThread(slow, ServerConfig(threads=THREADS)) as srv:
        content_type, body = _wire(request)

        def send(_):
            return _raw(srv.url, "POST", protocol.ENCODE_PATH, body, {"Content-Type": content_type})

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            first = pool.submit(send, 0)
            assert wait_until(lambda: srv.call(lambda: srv.service.load()["running"]) == 1, 30)
            others = [pool.submit(send, i) for i in range(3)]
            replies = [first.result()] + [future.result() for future in others]
    assert [status for status, _, _ in replies] == [200] * 4
    assert len({data for _, _, data in replies}) == 1
    assert slow.calls == 1
    assert replies[0][1][protocol.H_CACHE] == "miss"
    later = [headers[protocol.H_CACHE] for _, headers, _ in replies[1:]]
    assert set(later) <= {"joined", "hit"} and "joined" in later, later


def test_full_queue_answers_429_with_retry_after(stage):
    slow = SlowStage(stage, delay=0.6)
    with ServerThread(slow, ServerConfig(threads=THREADS, queue_size=1)) as srv:
        def raw_encode(index):
            content_type, body = _wire(EncodeRequest(prompt=f"Queue test {index}.", width=64, height=64))
            return _raw(srv.url, "POST", protocol.ENCODE_PATH, body, {"Content-Type": content_type})

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(raw_encode, 0)
            assert wait_until(lambda: srv.call(lambda: srv.service.load()["running"]) == 1, 30)
            refused = [pool.submit(raw_encode, i) for i in range(1, 3)]  # the one slot is taken by the running job
            refused = [future.result() for future in refused]
            assert first.result()[0] == 200
        for status, headers, data in refused:
            assert status == 429
            assert int(headers["Retry-After"]) >= 1
            assert json.loads(data)["error"]["code"] == "queue_full"
        # The client backs off (honouring Retry-After) and gets through.
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            done = list(pool.map(lambda i: EncoderClient(srv.url, retries=8).encode(
                EncodeRequest(prompt=f"Queue retry {i}.", width=64, height=64)), range(3)))
        assert len(done) == 3
        assert srv.service.counters["rejected_queue_full"] >= 2


# --- deadlines, cancel, faults -------------------------------------------------------------------


def test_deadline_gives_504_and_abandons_the_work(stage):
    slow = SlowStage(stage, delay=30.0)
    with ServerThread(slow, ServerConfig(threads=THREADS)) as srv:
        client = EncoderClient(srv.url, deadline_s=0.5, retries=2)
        t0 = time.perf_counter()
        with pytest.raises(RemoteEncodeError) as info:
            client.encode(EncodeRequest(prompt="Too slow.", width=64, height=64))
        elapsed = time.perf_counter() - t0
        assert info.value.status == 504 and info.value.code == "deadline_exceeded"
        assert "deadline" in str(info.value)
        assert srv.call(lambda: srv.service.counters["deadline"]) == 1  # not retried (the same deadline would fail)
        assert elapsed < 15  # real time: answered at the 0.5 s deadline, not after the 30 s of work (loaded: 8/2)
        assert wait_until(lambda: slow.cancelled == 1, 20)  # the model thread stopped at its next checkpoint
        slow.delay = 0.0
        assert EncoderClient(srv.url).encode(CASES["t2va"]).to_bytes() == stage.encode(CASES["t2va"]).to_bytes()


def test_client_cancel_closes_the_connection_and_server_abandons(stage):
    slow = SlowStage(stage, delay=30.0)
    with ServerThread(slow, ServerConfig(threads=THREADS)) as srv:
        cancel = threading.Event()

        def cancel_once_running():
            if wait_until(lambda: srv.call(lambda: srv.service.load()["running"]) == 1, 30):
                cancel.set()

        watcher = threading.Thread(target=cancel_once_running)
        watcher.start()
        with pytest.raises(Cancelled):
            EncoderClient(srv.url).encode(EncodeRequest(prompt="Cancel me.", width=64, height=64), cancel=cancel)
        cancelled_at = time.perf_counter()
        watcher.join()
        assert cancel.is_set()
        assert wait_until(lambda: slow.cancelled == 1, 20)  # the model thread stopped at its next checkpoint
        abandoned_after = time.perf_counter() - cancelled_at
        assert abandoned_after < 10.0, abandoned_after  # real time: promptly, not after the 30 s of work
        assert srv.call(lambda: srv.service.counters["client_gone"]) == 1
        assert wait_until(lambda: srv.call(lambda: srv.service.load()["running"]) == 0, 10)
        print(f"\n[cancel] server abandoned the job {abandoned_after * 1000:.0f} ms after the client's cancel")



def test_encoder_failure_is_a_json_500_and_the_worker_survives(stage):
    class Flaky(SlowStage):
        def encode(self, request, metadata=None, cancel=None, progress=None):
            if "explode" in request.prompt:
                raise RuntimeError("simulated encoder bug")
            return super().encode(request, metadata, cancel, progress)

    with ServerThread(Flaky(stage, 0.0), ServerConfig(threads=THREADS)) as srv:
        content_type, body = _wire(EncodeRequest(prompt="explode", width=64, height=64))
        status, _, data = _raw(srv.url, "POST", protocol.ENCODE_PATH, body, {"Content-Type": content_type})
        assert status == 500 and json.loads(data)["error"]["code"] == "internal_error"
        with pytest.raises(RemoteEncodeError, match="500 internal_error"):
            EncoderClient(srv.url).encode(EncodeRequest(prompt="explode", width=64, height=64))
        assert EncoderClient(srv.url).encode(CASES["t2va"]).task == "t2va"


def test_graceful_stop_finishes_in_flight_work(stage):
    slow = SlowStage(stage, delay=1.0)
    srv = ServerThread(slow, ServerConfig(threads=THREADS)).start()
    requests = [EncodeRequest(prompt=f"Drain {i}.", width=64, height=64) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(EncoderClient(srv.url, retries=0).encode, r) for r in requests]
        assert wait_until(lambda: srv.call(lambda: srv.service.active_requests) == 3, 30)
        assert srv.stop(drain_timeout=30) is True
        results = [future.result(timeout=30) for future in futures]
    assert [r.to_bytes() for r in results] == [stage.encode(r).to_bytes() for r in requests]
    with pytest.raises(RemoteUnavailableError):  # the listener is closed
        EncoderClient(srv.url, retries=0, connect_timeout=1).encode(requests[0])


# --- auth and handshake --------------------------------------------------------------------------


def test_token_required_when_configured(stage, monkeypatch):
    with ServerThread(stage, ServerConfig(threads=THREADS, token=TOKEN)) as srv:
        monkeypatch.delenv(protocol.DEFAULT_TOKEN_ENV, raising=False)
        with pytest.raises(RemoteAuthError, match="401"):
            EncoderClient(srv.url).encode(CASES["t2va"])
        with pytest.raises(RemoteAuthError):
            EncoderClient(srv.url, token=TOKEN[:-1] + "y").capabilities()
        content_type, body = _wire(CASES["t2va"])
        for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {TOKEN}"},
                        {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": TOKEN}):
            status, reply_headers, data = _raw(srv.url, "POST", protocol.ENCODE_PATH, body,
                                               {"Content-Type": content_type, **headers})
            assert status == 401 and reply_headers["WWW-Authenticate"].startswith("Bearer")
            assert json.loads(data)["error"]["code"] == "unauthorized"
        assert _raw(srv.url, "GET", protocol.CAPABILITIES_PATH)[0] == 401
        assert _raw(srv.url, "GET", protocol.HEALTH_PATH)[0] == 200  # liveness stays open, reveals nothing
        monkeypatch.setenv(protocol.DEFAULT_TOKEN_ENV, TOKEN)  # the client reads the token from the environment,
        with pytest.raises(ValueError, match="H3_ENCODER_URLS"):  # but sends it only where the environment binds it
            EncoderClient(srv.url)
        monkeypatch.setenv("H3_ENCODER_URLS", srv.url)
        assert EncoderClient(srv.url).encode(CASES["t2va"]).to_bytes() == stage.encode(CASES["t2va"]).to_bytes()
        assert srv.service.counters["unauthorized"] >= 7


def test_handshake_rejects_protocol_and_model_mismatch(server, stage, monkeypatch):
    with pytest.raises(ModelMismatchError, match="pinned"):
        EncoderClient(server.url, expect_model="0123456789abcdef").encode(CASES["t2va"])
    real = handler_module.capabilities

    def other_version(service):
        caps = real(service)
        caps["protocol"] = {"name": protocol.PROTOCOL_NAME, "version": 99, "versions": [99]}
        return caps

    monkeypatch.setattr(handler_module, "capabilities", other_version)
    with pytest.raises(ProtocolMismatchError, match="version"):
        EncoderClient(server.url).encode(CASES["t2va"])
    monkeypatch.setattr(handler_module, "capabilities", real)
    # The JSON request carries its version too: a server refuses a client of another version outright.
    status, _, data = _raw(server.url, "POST", protocol.ENCODE_PATH,
                           json.dumps({"protocol": 1, "prompt": "x"}).encode(), {"Content-Type": "application/json"})
    assert status == 400 and json.loads(data)["error"]["code"] == "protocol_mismatch"


def test_failover_and_missing_components(server, stage):
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    client = EncoderClient([dead, server.url], retries=2, connect_timeout=1)
    assert client.encode(CASES["t2va"]).to_bytes() == stage.encode(CASES["t2va"]).to_bytes()
    assert client.encode(CASES["t2va"]).task == "t2va"  # sticky: the good endpoint is tried first now

    class TextOnly(SlowStage):
        pass

    text_only = TextOnly(stage, 0.0)
    text_only.components = ("text",)
    with ServerThread(text_only, ServerConfig(threads=THREADS)) as srv:
        with pytest.raises(RemoteRequestError, match="needs \\['video'\\]"):
            EncoderClient(srv.url).encode(CASES["fl2va"])
        # With a full server behind it, the client fails over to the endpoint that has the component.
        result = EncoderClient([srv.url, server.url]).encode(CASES["fl2va"])
        assert result.to_bytes() == stage.encode(CASES["fl2va"]).to_bytes()


def test_local_rules_fail_before_upload(server):
    with pytest.raises(ValueError, match="17k\\+5"):
        EncoderClient(server.url).encode(EncodeRequest(prompt="x", num_frames=125))


# --- hostile input -------------------------------------------------------------------------------


def _multipart(parts, boundary="hostileBoundary123"):
    out = []
    for headers, data in parts:
        out.append(b"--" + boundary.encode() + b"\r\n" + "\r\n".join(headers).encode("latin-1") + b"\r\n\r\n"
                   + data + b"\r\n")
    out.append(b"--" + boundary.encode() + b"--\r\n")
    return b"".join(out), f"multipart/form-data; boundary={boundary}"


def _json_part(obj_or_raw):
    raw = obj_or_raw if isinstance(obj_or_raw, bytes) else json.dumps(obj_or_raw).encode()
    return (['Content-Disposition: form-data; name="request"', "Content-Type: application/json"], raw)


def _media_part(name, content_type, data, filename=None):
    disposition = f'Content-Disposition: form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return ([disposition, f"Content-Type: {content_type}"], data)


def _hostile_cases():
    rng = random.Random(1234)
    png = media.encode_png_bytes(_image(5, 64, 96))
    wav = media.encode_wav_bytes(_tone(2.5), 32000)
    fl2va = {"protocol": 2, "prompt": "The door opens.", "first_frame": {"part": "kf"}}
    cases = []  # (label, method, path, headers, body)

    def post(label, body, content_type, extra=None, path=protocol.ENCODE_PATH):
        headers = {"Content-Type": content_type} if content_type is not None else {}
        cases.append((label, "POST", path, {**headers, **(extra or {})}, body))

    # 1. garbage bodies
    for i in range(40):
        blob = rng.randbytes(rng.randint(0, 3000))
        post(f"garbage multipart {i}", blob, "multipart/form-data; boundary=hostileBoundary123")
    for i in range(25):
        post(f"garbage json {i}", rng.randbytes(rng.randint(1, 500)), "application/json")
    for i in range(30):  # garbage that starts like a multipart body
        post(f"garbage after boundary {i}", b"--hostileBoundary123\r\n" + rng.randbytes(rng.randint(0, 800)),
             "multipart/form-data; boundary=hostileBoundary123")
    # 2. wrong content types / methods / paths
    good_json = json.dumps({"protocol": 2, "prompt": "hi"}).encode()
    for content_type in ("text/plain", "application/xml", "application/x-www-form-urlencoded", "image/png",
                         "application/octet-stream", "multipart/mixed; boundary=x", "multipart/form-data",
                         "multipart/form-data; boundary=", "audio/wav", "video/mp4", "text/html; charset=utf-8",
                         "application/jsonx", "*/*", "application/json-patch+json"):
        post(f"content type {content_type}", good_json, content_type)
        post(f"content type {content_type} (multipart body)", _multipart([_json_part(good_json)])[0], content_type)
    post("no content type", good_json, None)
    body, content_type = _multipart([_json_part(fl2va), _media_part("kf", "image/png", png)])
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        cases.append((f"method {method}", method, protocol.ENCODE_PATH, {"Content-Type": content_type}, body))
    for path in ("/", "/v1", "/v2/encode", "/v1/encode/../capabilities", "/v1/encode%00", "/v1/ENCODE",
                 "/v1/capabilities/x", "/admin", "/%2e%2e/etc/passwd"):
        cases.append((f"path {path}", "POST", path, {"Content-Type": content_type}, body))
    # 3. truncated multipart: a valid fl2va request cut anywhere before the end of the image data
    end = body.index(png) + len(png) - 13
    for cut in sorted(rng.sample(range(1, end), 100)):
        post(f"truncated at {cut}", body[:cut], content_type)
    # 4. huge declared sizes
    for declared in (10**12, 2**63 - 1, 512 * 1024 * 1024 + 1, 10**15, 2**40):
        for payload in (b"", b"x" * 10, body[:100]):
            post(f"declares {declared} bytes", payload, content_type, {"Content-Length": str(declared)})
    for declared in ("-1", "1e9", "0x10", "12 34", "99999999999999999999999"):
        post(f"bad Content-Length {declared}", good_json, "application/json", {"Content-Length": declared})
    # 5. bad JSON (alone and as the multipart request part)
    bad_json = [b"", b"{", b"}", b"[]", b"null", b"1", b'"str"', b"{'protocol': 1}", b'{"protocol": 2,}',
                b'{"protocol": 2 "prompt": "x"}', b'{"protocol": NaN, "prompt": "x"}',
                b'{"protocol": 2, "prompt": Infinity}', b'{"protocol": 2, "prompt": "x", "protocol": 2}',
                b"\xef\xbb\xbf" + good_json, b"\xff\xfe{}", b'{"protocol": 2, "prompt": "\\ud800"}',
                b"[" * 3000 + b"]" * 3000, b'{"a":' * 2000 + b"1" + b"}" * 2000, b'{"protocol": 1e999}',
                b'{"protocol": 2, "prompt": "x"} trailing', b'{"protocol": 2, "prompt": "x\x00"}',
                b"/* comment */ " + good_json, b'{"protocol": 2, "prompt": "x", "num_frames": 1' + b"0" * 5000 + b"}",
                b" " * 70000, b'{"protocol": 2, "prompt": "' + b"y" * 70000 + b'"}']
    bad_json += [good_json[:i] for i in range(1, len(good_json), 2)]
    for i, raw in enumerate(bad_json):
        post(f"bad json {i}", raw, "application/json")
        post(f"bad json part {i}", _multipart([_json_part(raw)])[0], content_type)
    # 6. out-of-range and ill-typed values
    bad_fields = {
        "num_frames": [0, -1, 1, 5, 123, 125, 346, 362, 10**9, 10**30, 1.5, "124", [124], {"n": 1}, True],
        "width": [0, -64, 33, 65, 10**6, 64.0, "64", True],
        "task": ["", "T2VA", "i2v", 1, ["t2va"], "fl2va", "ref2va"],
        "protocol": [0, 1, 3, -1, "2", 2.0, None, True, [2]],
        "prompt": ["", "   ", 123, None, ["x"], {"t": "x"}, "x" * 20000],
        "deadline_s": [0, -5, 10**7, "10", True, [1]],
        "model": ["XYZ", "0" * 65, 12, ["a"]],
        "ref_images": ["a", [1], [{"part": 1}], [{}], [{"part": "a", "x": 1}], [{"part": f"i{i}"} for i in range(10)],
                       {"part": "a"}],
        "ref_videos": [[{"part": "v", "fps": 0}], [{"part": "v", "fps": -24}], [{"part": "v", "fps": 10**6}],
                       [{"part": "v", "fps": "24"}], [{"part": "v", "soundtrack": True}],
                       [{"part": "v", "soundtrack": 3}], [{"part": f"v{i}"} for i in range(4)]],
        "ref_audios": [[{"part": "a"}], [{"part": f"a{i}"} for i in range(4)]],
        "first_frame": ["kf", 1, [], {"part": ""}, {"part": None}],
        "extra_field": [1, "x"],
    }
    for name, values in bad_fields.items():
        for value in values:
            obj = {"protocol": 2, "prompt": "A fox.", name: value}
            if name == "width":
                obj["height"] = 64
            post(f"{name}={str(value)[:40]}", json.dumps(obj).encode(), "application/json")
            if name in ("num_frames", "width", "task", "prompt"):
                raw = json.dumps(obj).encode()
                post(f"{name}={str(value)[:40]} (multipart)", _multipart([_json_part(raw)])[0], content_type)
    for obj in ({"protocol": 2, "prompt": "x", "width": 64},  # width without height
                {"protocol": 2, "prompt": "x", "width": 128, "height": 16},  # aspect 8:1
                {"protocol": 2, "prompt": "x", "task": "t2va", "first_frame": {"part": "kf"}},
                {"protocol": 2, "prompt": "x", "first_frame": {"part": "a"}, "last_frame": {"part": "b"},
                 "ref_images": [{"part": "c"}]},
                {"protocol": 2, "prompt": "x", "ref_images": [{"part": f"i{i}"} for i in range(9)],
                 "ref_videos": [{"part": f"v{i}"} for i in range(3)], "ref_audios": [{"part": "a"}]}):
        post(f"rule {sorted(obj)}", json.dumps(obj).encode(), "application/json")
    # 7. unsafe part and file names
    for name in ("../kf", "/etc/passwd", "a b", "..", "a/../b", "x" * 65, "ü", "C:\\kf", "kf\n", "", ".kf", "-kf"):
        obj = dict(fl2va, first_frame={"part": name})
        post(f"part name {name!r}", *_multipart([_json_part(obj), _media_part("kf", "image/png", png)]))
    for filename in ("../../etc/passwd", "/abs/x.png", "a\\\\b.png", "x\x01.png", "..", ".htaccess",
                     "a/b.png", "x" * 300, "ok/../x.png", "C:/x.png"):
        post(f"filename {filename[:30]!r}",
             *_multipart([_json_part(fl2va), _media_part("kf", "image/png", png, filename)]))
    for name in ("../../x", "other", "kf2", "request", "KF"):
        post(f"undeclared part {name!r}",
             *_multipart([_json_part(fl2va), _media_part("kf", "image/png", png), _media_part(name, "image/png", png)]))
    post("duplicate part", *_multipart([_json_part(fl2va), _media_part("kf", "image/png", png),
                                        _media_part("kf", "image/png", png)]))
    post("missing part", *_multipart([_json_part(fl2va)]))
    post("media before request", *_multipart([_media_part("kf", "image/png", png), _json_part(fl2va)]))
    post("request part not json", *_multipart([(['Content-Disposition: form-data; name="request"',
                                                  "Content-Type: text/plain"], json.dumps(fl2va).encode())]))
    # 8. media that lies about itself
    bomb = png_bomb(60000, 60000)  # a valid header claiming 3.6 gigapixels
    media_cases = [("image/jpeg", png), ("image/gif", png), ("text/plain", png), ("application/octet-stream", png),
                   ("image/png", rng.randbytes(2000)), ("image/png", png[:8] + rng.randbytes(500)),
                   ("image/png", png[: len(png) // 2]), ("image/png", bomb), ("image/png", png_bomb(20000, 20000)),
                   ("image/png", b""),
                   ("image/png", wav), ("image/webp", b"RIFF\x00\x00\x00\x00WEBPVP8 garbage"),
                   ("image/jpeg", b"\xff\xd8\xff" + rng.randbytes(300)), ("image/png", png[:40]),
                   ("audio/wav", png), ("video/mp4", png), ("image/png; charset=x", b"\x89PNG\r\n\x1a\n")]
    for i, (media_type, data) in enumerate(media_cases):
        post(f"keyframe {i} as {media_type}", *_multipart([_json_part(fl2va), _media_part("kf", media_type, data)]))
    ref2va = {"protocol": 2, "prompt": "<Picture 1> <Audio 2>", "ref_images": [{"part": "img"}],
              "ref_audios": [{"part": "snd"}]}
    riff = bytearray(wav)
    riff[24:28] = (10**9).to_bytes(4, "little")  # absurd sample rate
    long_wav = media.encode_wav_bytes(_tone(40.0, 8000), 8000)
    for i, (media_type, data) in enumerate([("audio/wav", bytes(riff)), ("audio/wav", wav[:44]),
                                            ("audio/wav", b"RIFF\xff\xff\xff\xffWAVEfmt " + rng.randbytes(200)),
                                            ("audio/flac", b"fLaC" + rng.randbytes(300)), ("audio/wav", long_wav),
                                            ("audio/mpeg", png), ("audio/ogg", b"OggS" + rng.randbytes(100)),
                                            ("audio/wav", media.encode_wav_bytes(_tone(0.5), 32000))]):
        post(f"audio {i}", *_multipart([_json_part(ref2va), _media_part("img", "image/png", png),
                                        _media_part("snd", media_type, data)]))
    video_ref = {"protocol": 2, "prompt": "<Video 1>", "ref_videos": [{"part": "vid"}]}
    for i, data in enumerate([b"\x00\x00\x00\x18ftypisom" + rng.randbytes(1000), b"\x00\x00\x00\x18ftypmp42",
                              b"\x1a\x45\xdf\xa3" + rng.randbytes(500)]):
        post(f"video {i}", *_multipart([_json_part(video_ref),
                                        _media_part("vid", "video/webm" if i == 2 else "video/mp4", data)]))
    return cases


def test_500_hostile_requests_each_get_a_4xx_and_the_server_survives(server, stage):
    cases = _hostile_cases()
    assert len(cases) >= 500, len(cases)
    before = server.service.counters["computed"]
    t0 = time.perf_counter()
    failures, statuses = [], {}
    for label, method, path, headers, body in cases:
        try:
            status, reply_headers, data = _raw(server.url, method, path, body, headers, timeout=20)
        except Exception as error:  # noqa: BLE001
            failures.append(f"{label}: no answer ({type(error).__name__}: {error})")
            continue
        statuses[status] = statuses.get(status, 0) + 1
        if not 400 <= status < 500:
            failures.append(f"{label}: {status} {data[:200]!r}")
            continue
        if label.startswith("bad Content-Length"):
            # HTTP framing: aiohttp's parser refuses these (plain-text 400) before the application runs.
            if status != 400:
                failures.append(f"{label}: {status}")
            continue
        try:
            error = json.loads(data)["error"]
            assert error["code"] and error["message"]
        except Exception:  # noqa: BLE001
            failures.append(f"{label}: {status} without a JSON error body: {data[:120]!r}")
    elapsed = time.perf_counter() - t0
    assert not failures, "\n".join(failures[:30])
    assert server.service.counters["computed"] == before  # nothing hostile reached the encoders
    print(f"\n[hostile] {len(cases)} requests in {elapsed:.1f} s, statuses {dict(sorted(statuses.items()))}")
    # Still alive and still correct.
    status, _, data = _raw(server.url, "GET", protocol.HEALTH_PATH)
    assert status == 200 and json.loads(data)["status"] == "ok"
    for task in ("t2va", "fl2va"):
        assert EncoderClient(server.url).encode(CASES[task]).to_bytes() == stage.encode(CASES[task]).to_bytes()


def test_a_version_1_client_gets_a_version_error(server):
    """A fake client of the previous protocol (this code with its version set to 1, in its own process) against
    this server: the handshake stops it with a version error; without the handshake, the request is refused."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from h3_core.remote import protocol\n"
        "protocol.PROTOCOL_VERSION = 1\n"
        "from h3_core.remote.client import EncoderClient, ProtocolMismatchError\n"
        "from h3_core.request import EncodeRequest\n"
        "try:\n"
        "    EncoderClient(sys.argv[1], retries=0).encode(EncodeRequest(prompt='A fox.', width=64, height=64))\n"
        "except ProtocolMismatchError as error:\n"
        "    print('MISMATCH', error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, server.url], capture_output=True, text=True, timeout=120)
    assert "MISMATCH" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "version(s) [2]; this client speaks version 1" in done.stdout
    status, _, data = _raw(server.url, "POST", protocol.ENCODE_PATH,
                           json.dumps({"protocol": 1, "prompt": "x"}).encode(), {"Content-Type": "application/json"})
    error = json.loads(data)["error"]
    assert status == 400 and error["code"] == "protocol_mismatch"
    assert "speaks h3-encoder version 2; the request declares version 1" in error["message"]
