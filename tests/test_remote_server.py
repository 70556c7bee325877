"""The encoder server and client on loopback, in-process: parity, load, auth, queue, deadline, cancel, hostility.

Every server here is real (aiohttp on 127.0.0.1, a free port) around the tiny model's real `EncoderStage`;
a few tests wrap the stage to make it slow, so queueing, deadlines and cancellation are deterministic.
The model thread and the local reference both run torch with one thread: bitwise equality between the two
holds at equal thread counts (torch reductions depend on it), and one thread is also the fastest on shared CI cores.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest
from support.remote_cases import CASES, SlowStage, hostile_cases, send_hostile
from support.remote_http import raw, wire

from h3_core.progress import Cancelled
from h3_core.remote import protocol
from h3_core.remote.client.encoder_client import (
    EncoderClient,
    ModelMismatchError,
    ProtocolMismatchError,
    RemoteAuthError,
    RemoteEncodeError,
    RemoteRequestError,
    RemoteUnavailableError,
)
from h3_core.remote.engines.aiohttp_server import ServerThread
from h3_core.remote.server import handler as handler_module
from h3_core.remote.server.config import ServerConfig
from h3_core.request import EncodeRequest
from h3_core.testing import SERVER_THREADS, wait_until

THREADS = SERVER_THREADS  # the server processes run with H3_THREADS=1; the local reference too
TOKEN = "test-token-" + "x" * 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here compares with local encodes at the servers' thread count (conftest.one_thread)."""


@pytest.fixture(scope="module")
def stage(encoder_stage):
    return encoder_stage  # conftest: loaded once per session


@pytest.fixture(scope="module")
def server(stage):
    with ServerThread(stage, ServerConfig(threads=THREADS), model_info={"layout": "diffusers", "tiny": True}) as s:
        yield s


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
    content_type, body = wire(request)
    status, headers, data = raw(server.url, "POST", protocol.ENCODE_PATH, body, {"Content-Type": content_type})
    assert status == 200 and headers[protocol.H_CACHE] == "hit" and data == first.to_bytes()
    print(f"\n[cache] miss {miss_s * 1000:.1f} ms, hit median {sorted(hits)[5] * 1000:.2f} ms "
          f"(client round trip incl. PNG/JSON packing and safetensors parsing)")


def test_form_3_when_asked_form_2_otherwise_computed_or_cached_in_either_order(stage, server, monkeypatch):
    """The client asks for wire form 3 (X-H3-Accept-Format) and gets it: the checksum after the data, hashed as it
    is sent, so no X-H3-Checksum header. Any other request gets form 2, byte for byte `to_bytes()`. Each answer
    names its form in X-H3-Format, and both read back as the local conditioning, computed or from the cache."""
    from h3_core.contract import H3Conditioning
    from h3_core.contract import wire as wire_form

    forms = []
    reply = handler_module.conditioning_reply
    monkeypatch.setattr(handler_module, "conditioning_reply",
                        lambda *args, **kwargs: forms.append(args[6]) or reply(*args, **kwargs))
    client_request = EncodeRequest(prompt="Form 3 for the client: a kingfisher dives.", width=64, height=64)
    assert EncoderClient(server.url).encode(client_request) == stage.encode(client_request)
    assert forms == [True]
    for prompt, order in (("Asked in form 3 first: a heron.", (3, 2, 3, 2)), ("Form 2 first: an egret.", (2, 3, 2))):
        request = EncodeRequest(prompt=prompt, width=64, height=64)
        local = stage.encode(request)
        content_type, body = wire(request)
        for version in order:  # a miss in the first form, then hits in both (converted once, then kept)
            headers = {"Content-Type": content_type}
            if version == 3:
                headers[protocol.H_ACCEPT_FORMAT] = f"application/json, {protocol.STREAMED_FORMAT}"
            status, answer, data = raw(server.url, "POST", protocol.ENCODE_PATH, body, headers)
            assert status == 200 and answer[protocol.H_FORMAT] == f"minimax-h3-conditioning/{version}"
            assert data == wire_form.encode(local, version).tobytes()
            assert (protocol.H_CHECKSUM in answer) == (version == 2)
            if version == 2:
                assert data == local.to_bytes() and answer[protocol.H_CHECKSUM] == local.to_wire().checksum
            assert H3Conditioning.from_bytes(data) == local


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
        content_type, body = wire(request)

        def send(_):
            return raw(srv.url, "POST", protocol.ENCODE_PATH, body, {"Content-Type": content_type})

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
            content_type, body = wire(EncodeRequest(prompt=f"Queue test {index}.", width=64, height=64))
            return raw(srv.url, "POST", protocol.ENCODE_PATH, body, {"Content-Type": content_type})

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
        content_type, body = wire(EncodeRequest(prompt="explode", width=64, height=64))
        status, _, data = raw(srv.url, "POST", protocol.ENCODE_PATH, body, {"Content-Type": content_type})
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
        content_type, body = wire(CASES["t2va"])
        for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {TOKEN}"},
                        {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": TOKEN}):
            status, reply_headers, data = raw(srv.url, "POST", protocol.ENCODE_PATH, body,
                                               {"Content-Type": content_type, **headers})
            assert status == 401 and reply_headers["WWW-Authenticate"].startswith("Bearer")
            assert json.loads(data)["error"]["code"] == "unauthorized"
        assert raw(srv.url, "GET", protocol.CAPABILITIES_PATH)[0] == 401
        assert raw(srv.url, "GET", protocol.HEALTH_PATH)[0] == 200  # liveness stays open, reveals nothing
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
    status, _, data = raw(server.url, "POST", protocol.ENCODE_PATH,
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


def test_500_hostile_requests_each_get_a_4xx_and_the_server_survives(server, stage):
    cases = hostile_cases()
    assert len(cases) >= 500, len(cases)
    before = server.service.counters["computed"]
    t0 = time.perf_counter()
    failures, statuses = send_hostile(server.url, cases)
    elapsed = time.perf_counter() - t0
    assert not failures, "\n".join(failures[:30])
    assert server.service.counters["computed"] == before  # nothing hostile reached the encoders
    print(f"\n[hostile] {len(cases)} requests in {elapsed:.1f} s, statuses {dict(sorted(statuses.items()))}")
    # Still alive and still correct.
    status, _, data = raw(server.url, "GET", protocol.HEALTH_PATH)
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
        "from h3_core.remote.client.encoder_client import EncoderClient, ProtocolMismatchError\n"
        "from h3_core.request import EncodeRequest\n"
        "try:\n"
        "    EncoderClient(sys.argv[1], retries=0).encode(EncodeRequest(prompt='A fox.', width=64, height=64))\n"
        "except ProtocolMismatchError as error:\n"
        "    print('MISMATCH', error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, server.url], capture_output=True, text=True, timeout=120)
    assert "MISMATCH" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "version(s) [2]; this client speaks version 1" in done.stdout
    status, _, data = raw(server.url, "POST", protocol.ENCODE_PATH,
                           json.dumps({"protocol": 1, "prompt": "x"}).encode(), {"Content-Type": "application/json"})
    error = json.loads(data)["error"]
    assert status == 400 and error["code"] == "protocol_mismatch"
    assert "speaks h3-encoder version 2; the request declares version 1" in error["message"]
