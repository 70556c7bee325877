"""Progress of a remote encode while it runs: the server's phases polled by the client (docs/PROTOCOL.md "Progress").

Every server here is real (aiohttp on 127.0.0.1) around the tiny model's real `EncoderStage`. `PacedStage` holds each
encoder phase open for a moment (so that a poll every 0.25 s sees it); `SlowStage` delays the work before the
encoders run (queueing and cancel). An "old" server is the same server with `track_progress=False`: it publishes no
`progress` capability, has no poll route and ignores the progress header, exactly as servers did before.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.remote_cases import CASES, PacedStage, SlowStage
from support.remote_http import raw, wire

from h3_core.progress import Cancelled
from h3_core.remote import tracking
from h3_core.remote.client import polling
from h3_core.remote.client.encoder_client import EncoderClient
from h3_core.remote.engines import aiohttp_app as http_module
from h3_core.remote.engines.aiohttp_server import ServerThread
from h3_core.remote.server.config import ServerConfig
from h3_core.request import EncodeRequest
from h3_core.testing import SERVER_THREADS, wait_until

TOKEN = "progress-token-" + "y" * 24
ORDER = {phase: index for index, phase in enumerate(tracking.PHASES)}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Local reference encodes at the server's thread count (bitwise parity)."""


@pytest.fixture(scope="module")
def stage(encoder_stage):
    return encoder_stage  # conftest: loaded once per session


def _get(url, path, headers=None):
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("task", ["t2va", "ref2va"])
def test_server_phases_arrive_in_order_and_the_answer_is_unchanged(task, stage):
    request = CASES[task]
    local = stage.encode(request).to_bytes()
    with ServerThread(PacedStage(stage), ServerConfig(threads=SERVER_THREADS, cache_bytes=0)) as srv:
        events, steps = [], []
        t0 = time.perf_counter()
        cond = EncoderClient(srv.url).encode(request, progress=lambda d, t: steps.append((d, t)),
                                             on_server_progress=events.append)
        seconds = time.perf_counter() - t0
        assert srv.call(lambda: len(srv.app[http_module.TRACKERS_KEY])) == 0  # gone with its request
    assert cond.to_bytes() == local  # polling leaves the contract's bytes alone
    phases = [event["phase"] for event in events]
    assert [ORDER[p] for p in phases] == sorted(ORDER[p] for p in phases), phases  # in order
    assert {"queued", "decode", "text", "video", "audio"}.issubset(phases), phases
    assert phases[:2] == ["receiving", "queued"]
    done = [d for d, _ in steps]
    assert done == sorted(set(done)) and done[0] == 0 and done[-1] == polling.STEPS
    assert {3, 4, 5, 6, 7}.issubset(done), steps  # the server's phases moved the client's progress
    times = [event["at_s"] for event in events]
    assert times == sorted(times)
    print(f"\n[progress] {task}: {len(events)} server events {phases}, {len(steps)} progress calls, {seconds:.2f} s")


def test_queue_position_is_reported_while_waiting(stage):
    slow = SlowStage(stage, delay=1.5)
    with ServerThread(slow, ServerConfig(threads=SERVER_THREADS)) as srv:
        first = threading.Thread(target=EncoderClient(srv.url).encode,
                                 args=(EncodeRequest(prompt="First in line.", width=64, height=64),))
        first.start()
        assert wait_until(lambda: srv.call(lambda: srv.service.load()["running"]) == 1, 30)
        events = []
        EncoderClient(srv.url).encode(EncodeRequest(prompt="Second in line.", width=64, height=64),
                                      on_server_progress=events.append)
        first.join()
    queued = [event for event in events if event["phase"] == "queued"]
    assert queued and queued[0]["queue_position"] == 1, events  # one job (the running one) ahead
    assert [event["phase"] for event in events][-1] in ("decode", "text", "video", "audio", "serialise")


def test_a_server_without_progress_still_encodes(stage):
    """An older server: no capability, no poll route, the header ignored; the client does not poll it."""
    request = CASES["t2va"]
    with ServerThread(PacedStage(stage, 0.1), ServerConfig(threads=SERVER_THREADS, track_progress=False)) as srv:
        client = EncoderClient(srv.url)
        assert "progress" not in client.capabilities()
        events, steps = [], []
        cond = client.encode(request, progress=lambda d, t: steps.append((d, t)), on_server_progress=events.append)
        assert cond.to_bytes() == stage.encode(request).to_bytes()
        assert events == [] and [d for d, _ in steps] == [0, 1, 2, 9, 10]
        status, _ = _get(srv.url, tracking.path(tracking.new_id()))
        assert status == 404  # what a client polling an old server would see
        # A new client's header on an old server changes nothing.

        content_type, body = wire(EncodeRequest(prompt="Header ignored.", width=64, height=64))
        status, headers, data = raw(srv.url, "POST", "/v1/encode", body,
                                     {"Content-Type": content_type, tracking.HEADER: tracking.new_id()})
        assert status == 200 and data
        counters = srv.call(lambda: dict(srv.service.counters))
    assert not any(key.startswith("status_4") for key in counters), counters


def test_polls_need_the_token_and_an_open_request(stage):
    slow = SlowStage(stage, delay=2.0)
    with ServerThread(slow, ServerConfig(threads=SERVER_THREADS, token=TOKEN)) as srv:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        progress_id = tracking.new_id()
        client = EncoderClient(srv.url, token=TOKEN)
        original = tracking.new_id
        tracking.new_id = lambda: progress_id  # the test knows the id the client picks
        try:
            worker = threading.Thread(target=client.encode,
                                      args=(EncodeRequest(prompt="Watch me.", width=64, height=64),),
                                      kwargs={"on_server_progress": lambda event: None})
            worker.start()
            assert wait_until(lambda: _get(srv.url, tracking.path(progress_id), auth)[0] == 200, 20)
        finally:
            tracking.new_id = original
        status, body = _get(srv.url, tracking.path(progress_id))  # no token
        assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
        status, _ = _get(srv.url, tracking.path(progress_id), {"Authorization": "Bearer wrong-token-" + "z" * 20})
        assert status == 401
        status, body = _get(srv.url, tracking.path(progress_id), auth)
        answer = json.loads(body)
        assert status == 200 and answer["id"] == progress_id and answer["phase"] in tracking.PHASES
        assert [entry["phase"] for entry in answer["history"]][:2] == ["receiving", "queued"]
        status, _ = _get(srv.url, tracking.path(tracking.new_id()), auth)  # an id nobody sent
        assert status == 404
        status, body = _get(srv.url, "/v1/encode/not-an-id/progress", auth)
        assert status == 400 and json.loads(body)["error"]["field"] == "progress_id"
        # Reusing an id that is in flight is refused, naming the header.

        content_type, data = wire(EncodeRequest(prompt="Same id.", width=64, height=64))
        status, _, body = raw(srv.url, "POST", "/v1/encode", data,
                               {**auth, "Content-Type": content_type, tracking.HEADER: progress_id})
        assert status == 400 and json.loads(body)["error"]["field"] == tracking.HEADER
        status, _, body = raw(srv.url, "POST", "/v1/encode", data,
                               {**auth, "Content-Type": content_type, tracking.HEADER: "ABC"})
        assert status == 400 and json.loads(body)["error"]["field"] == tracking.HEADER
        worker.join(30)
        assert _get(srv.url, tracking.path(progress_id), auth)[0] == 404  # answered: forgotten


def test_cancel_with_progress_still_stops_the_servers_job(stage):
    slow = SlowStage(stage, delay=30.0)
    with ServerThread(slow, ServerConfig(threads=SERVER_THREADS)) as srv:
        cancel = threading.Event()
        events = []

        def on_event(event):
            events.append(event)
            if event["phase"] == "decode":  # the model thread has the job
                cancel.set()

        with pytest.raises(Cancelled):
            EncoderClient(srv.url).encode(EncodeRequest(prompt="Cancel me mid-way.", width=64, height=64),
                                          cancel=cancel, on_server_progress=on_event)
        cancelled_at = time.perf_counter()
        assert [event["phase"] for event in events][:3] == ["receiving", "queued", "decode"]
        assert wait_until(lambda: slow.cancelled == 1, 20)
        assert time.perf_counter() - cancelled_at < 10.0  # real time: at a checkpoint, not after the 30 s of work
        assert srv.call(lambda: srv.service.counters["client_gone"]) == 1
        assert wait_until(lambda: srv.call(lambda: len(srv.app[http_module.TRACKERS_KEY])) == 0, 5)
        assert wait_until(lambda: not [t for t in threading.enumerate() if t.name == "h3-encoder-progress"], 2)


def test_polling_overhead_is_small(stage):
    """Same requests with and without a listener (cache off): the polls cost little next to the encode.

    The tiny model encodes in about 0.1 s, so each phase is held 0.15 s to make a request last as long as several
    polls (the wall time then shows what polling adds to the server's and the client's work)."""
    with ServerThread(PacedStage(stage, 0.15), ServerConfig(threads=SERVER_THREADS, cache_bytes=0)) as srv:
        client = EncoderClient(srv.url)
        request = EncodeRequest(prompt="Overhead.", width=64, height=64)
        client.encode(request)  # warm-up
        plain, polled, counts = [], [], []
        for _ in range(3):
            t0 = time.perf_counter()
            client.encode(request)
            plain.append(time.perf_counter() - t0)
            events = []
            t0 = time.perf_counter()
            client.encode(request, on_server_progress=events.append)
            polled.append(time.perf_counter() - t0)
            counts.append(len(events))
    plain_s, polled_s = sorted(plain)[1], sorted(polled)[1]
    assert min(counts) >= 4
    print(f"\n[progress] overhead: median {plain_s * 1000:.0f} ms without polling, {polled_s * 1000:.0f} ms with "
          f"({counts} events per request)")
    # Real time, a sanity bound only (the figure above is the measurement): polling must not hold the encode up,
    # e.g. by serialising with it. 1 s of slack covers a loaded machine's noise (load average 8 on 2 cores).
    assert polled_s < plain_s * 1.5 + 1.0


class HostileProgressFront(ThreadingHTTPServer):
    """A front for a real server: capabilities and encodes are forwarded unchanged, progress polls get `answer`."""

    daemon_threads = True

    def __init__(self, backend: str, answer):
        self.backend, self.answer, self.polls = backend, answer, 0
        super().__init__(("127.0.0.1", 0), _FrontHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FrontHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _forward(self):
        front: HostileProgressFront = self.server  # type: ignore[assignment]
        if self.path.endswith("/progress"):
            front.polls += 1
            status, body = front.answer()
        else:
            length = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(length) if length else None
            host, port = front.backend.split("//", 1)[1].rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            conn.request(self.command, self.path, body=data, headers=headers)
            response = conn.getresponse()
            status, body = response.status, response.read()
            if self.path == "/v1/capabilities":
                body = json.dumps(dict(json.loads(body), progress=tracking.capability())).encode()
            conn.close()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if self.path.endswith("/progress") or
                         self.command == "GET" else "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _forward


HOSTILE_ANSWERS = {
    "deep": lambda: (200, b"[" * 100_000 + b"]" * 100_000),
    "not_json": lambda: (200, b"\xff\xfe<html>"),
    "wrong_shapes": lambda: (200, json.dumps({"history": [1, None, {"phase": ["x"]}, {"phase": "text", "at_s": [1]},
                                                          {"phase": "p" * 10_000, "done": True}],
                                              "phase": "queued", "queue_position": "many"}).encode()),
    "endless_history": lambda: (200, json.dumps({"history": [{"phase": f"x{i}"} for i in range(20_000)]}).encode()),
    "error": lambda: (500, b"{}"),
}


@pytest.mark.parametrize("mode", sorted(HOSTILE_ANSWERS))
def test_hostile_progress_answers_never_break_the_encode(mode, stage):
    request = EncodeRequest(prompt=f"Hostile progress {mode}.", width=64, height=64)
    with ServerThread(PacedStage(stage, 0.2), ServerConfig(threads=SERVER_THREADS)) as srv:
        front = HostileProgressFront(srv.url, HOSTILE_ANSWERS[mode])
        try:
            events, steps = [], []
            cond = EncoderClient(front.url).encode(request, progress=lambda d, t: steps.append(d),
                                                   on_server_progress=events.append)
        finally:
            front.shutdown()
    assert cond.to_bytes() == stage.encode(request).to_bytes()
    assert front.polls >= 2  # it was polled while the encode ran
    assert len(events) <= polling.MAX_EVENTS
    assert all(isinstance(e["phase"], str) and len(e["phase"]) <= 32 for e in events)
    assert all(e["at_s"] is None or isinstance(e["at_s"], float) for e in events)
    assert steps == sorted(set(steps)) and steps[-1] == polling.STEPS


# --- what the client itself reports, and the words a UI shows (the Remote Encode node's progress text) ----------


def test_status_events_say_what_was_sent_and_how_the_answer_was_made(stage):
    """`on_status`: sending (bytes), receiving (bytes), done (where, how long, the cache's answer per part); the
    words `polling.describe` / `polling.summary` make of them, for a computed answer and then a cached one."""
    request = EncodeRequest(prompt=f"Status words {time.time()}.", width=64, height=64)
    with ServerThread(PacedStage(stage, 0.2), ServerConfig(threads=SERVER_THREADS)) as srv:
        client = EncoderClient(srv.url)
        first, second, phases = [], [], []
        cond = client.encode(request, on_status=first.append, on_server_progress=phases.append)
        again = client.encode(request, on_status=second.append)
    assert cond.to_bytes() == again.to_bytes() == stage.encode(request).to_bytes()  # reporting changes nothing
    assert [event["event"] for event in first] == ["sending", "receiving", "done"], first
    sending, receiving, done = first
    assert sending["url"] == srv.url and sending["bytes"] > 0 and receiving["bytes"] > 0
    assert done["url"] == srv.url and done["bytes"] == sending["bytes"] and done["seconds"] > 0
    assert done["cache"] == "miss" and done["components"] == {"text": "miss"}, done
    assert isinstance(done["queue_s"], float) and isinstance(done["encode_s"], float)
    assert polling.describe(sending).startswith("sending ") and polling.describe(sending).endswith("kB")
    assert polling.describe(receiving).startswith("receiving the conditioning (")
    lines = [polling.describe(event) for event in phases]
    # (the server's own "sending" is over before a poll sees it here: the client's "receiving" event says it)
    assert {"queued on the server", "encoding text", "encoding video", "encoding audio"}.issubset(lines), \
        sorted(set(lines))
    summary = polling.summary(done)
    assert summary.startswith(f"encoded on {srv.url} in ") and " s (text: miss" in summary, summary
    assert second[-1]["cache"] == "hit" and second[-1]["components"] is None, second
    assert polling.summary(second[-1]).endswith("(cache hit: the whole conditioning)")
    print(f"\n[progress] summaries: {summary!r}; {polling.summary(second[-1])!r}")


def test_the_words_for_every_phase_and_cache_outcome():
    assert polling.describe({"phase": "queued", "queue_position": 2}) == "queued on the server (2 ahead)"
    assert polling.describe({"phase": "queued", "queue_position": 0}) == "queued on the server"
    assert polling.describe({"phase": "video", "done": 1, "total": 2}) == "encoding video 1/2"
    assert polling.describe({"phase": "text", "done": 3, "total": 8}) == "encoding text: layer 3/8"
    assert polling.describe({"phase": "audio"}) == "encoding audio"
    assert polling.describe({"event": "sending", "bytes": 3_100_000}) == "sending 3.1 MB"
    assert polling.describe({"phase": "from-a-newer-server"}) is None  # the line before it stays
    done = {"event": "done", "url": "http://h:1", "seconds": 8.24, "cache": "miss", "queue_s": 0.0,
            "components": {"text": "memory", "video.0": "miss", "video.1": "disk", "audio.0": "miss"}}
    assert polling.summary(done) == "encoded on http://h:1 in 8.2 s (text: cache hit, video: 1/2 from the cache, " \
                                    "audio: miss)"
    assert polling.summary(dict(done, cache="joined", components={"text": "miss"}, queue_s=2.5)) == \
        "encoded on http://h:1 in 8.2 s (joined an identical request, text: miss, queued 2.5 s)"
    assert polling.summary(dict(done, components=None)) == "encoded on http://h:1 in 8.2 s"
