"""The client's progress poller: asks `GET /v1/encode/{id}/progress` while the encode's POST is pending.

It runs in its own thread from the moment the request body has been sent until the POST's answer is read (or the
call is cancelled, or its deadline passes), and turns the server's phases into the client's `progress(done, total)`
steps plus, for callers that want the detail, one event dict per phase passed. Polling never changes the encode:
every poll failure is swallowed (a 404 means "not registered yet" or "already answered"); a refusal that will not
change (400, 401, 403, 405) ends the polling.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ...progress import Cancelled
from .. import tracking
from .transport import RemoteEncodeError, Reply, Transient, loads

log = logging.getLogger("h3_core.remote.client")

# The client's steps (progress(done, STEPS)): 0 packing, 1 handshake done, 2 uploaded, 3..8 the server's phases
# queued, decode, text, video, audio, serialise, 9 answer received, 10 parsed and checked. A server that does not
# report progress goes straight from 2 to 9.
STEPS = 10
STEP_UPLOADED, STEP_ANSWERED = 2, 9
_SERVER_STEPS = {"receiving": 2, "queued": 3, "decode": 4, "text": 5, "video": 6, "audio": 7, "serialise": 8,
                 "sending": 8}
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 5.0
FIRST_POLL_S = 0.05
MAX_EVENTS = 256  # a server cannot make the client report without end
_PERMANENT = {400, 401, 403, 405}


class Monotonic:
    """A `progress(done, total)` that never goes backwards and is safe to call from two threads."""

    def __init__(self, report: Callable[[int, int], None] | None):
        self.report, self.done = report, -1
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            if done <= self.done or self.report is None:
                return
            self.done = done
            self.report(done, total)


def interval(capability: Any) -> float | None:
    """The poll interval a server's `capabilities["progress"]` asks for; None if it does not track progress."""
    if not isinstance(capability, dict) or capability.get("path") != tracking.PATH_TEMPLATE:
        return None
    asked = capability.get("poll_interval_s")
    if not isinstance(asked, (int, float)) or isinstance(asked, bool):
        asked = tracking.POLL_INTERVAL_S
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, float(asked)))


class Poller:
    """Polls one progress id. `call(path, stop, deadline)` makes one GET and returns the `Reply`."""

    def __init__(self, call: Callable[[str, threading.Event, float], Reply], progress_id: str, interval_s: float,
                 report: Monotonic, on_event: Callable[[dict], None] | None, deadline: float):
        self.call, self.progress_id, self.interval_s = call, progress_id, interval_s
        self.report, self.on_event, self.deadline = report, on_event, deadline
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.seen = 0  # history entries already reported
        self.queue_position: int | None = None
        self.events: list[dict] = []

    def start(self) -> None:
        if self.thread is None and not self.stopped.is_set():
            self.thread = threading.Thread(target=self._run, name="h3-encoder-progress", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        """No more events from now on; the thread ends by itself (a poll in flight is aborted within 50 ms)."""
        self.stopped.set()

    def _run(self) -> None:
        path = tracking.path(self.progress_id)
        wait = min(FIRST_POLL_S, self.interval_s)  # short requests report their first phases too
        while not self.stopped.wait(wait):
            wait = self.interval_s
            deadline = min(self.deadline, time.monotonic() + 10.0)
            if deadline <= time.monotonic():
                return
            try:
                reply = self.call(path, self.stopped, deadline)
            except (Transient, RemoteEncodeError, Cancelled, OSError) as error:
                log.debug("progress poll failed: %s", error)
                continue
            if reply.status in _PERMANENT:
                log.info("progress polls refused (%d); the encode goes on without them", reply.status)
                return
            if reply.status != 200:
                continue
            try:
                self._take(loads(reply.body))
            except Exception as error:  # noqa: BLE001 - a poll must never break the encode
                if isinstance(error, (KeyboardInterrupt, SystemExit)):
                    raise
                log.debug("progress answer ignored: %s", error)
                if not isinstance(error, (ValueError, TypeError, KeyError, UnicodeDecodeError)):
                    return  # e.g. the caller's progress hook raised (an interrupt): stop reporting

    def _take(self, body: Any) -> None:
        """Report the phases passed since the previous poll, in order, and queue position changes."""
        if not isinstance(body, dict) or not isinstance(body.get("history"), list):
            return
        history = body["history"]
        position = body.get("queue_position")
        position = position if isinstance(position, int) and not isinstance(position, bool) else None
        for entry in history[self.seen:]:
            if not isinstance(entry, dict) or not isinstance(entry.get("phase"), str):
                continue
            phase = entry["phase"][:32]
            event = {"phase": phase, "at_s": _seconds(entry.get("at_s"))}
            for key in ("done", "total"):
                if isinstance(entry.get(key), int):
                    event[key] = entry[key]
            if phase == "queued" and position is not None:
                event["queue_position"] = self.queue_position = position
            self._emit(event)
        self.seen = max(self.seen, len(history))
        if body.get("phase") == "queued" and position is not None and position != self.queue_position:
            self.queue_position = position
            self._emit({"phase": "queued", "at_s": _seconds(body.get("elapsed_s")), "queue_position": position})

    def _emit(self, event: dict) -> None:
        if len(self.events) >= MAX_EVENTS or self.stopped.is_set():
            return
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(dict(event))
        step = _SERVER_STEPS.get(event["phase"])
        if step is not None:
            self.report(step, STEPS)


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# --- the same, in the user's words (the Remote Encode node's progress text; any client may show them) -----------

_SERVER_TEXT = {
    "receiving": "the server is checking the request",
    "decode": "decoding the media on the server",
    "text": "encoding text",
    "video": "encoding video",
    "audio": "encoding audio",
    "serialise": "the server is writing the conditioning",
    "sending": "receiving the conditioning",
}
_COMPONENT_ORDER = ("text", "video", "audio")


def megabytes(count: int) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 100_000 else f"{count / 1e3:.0f} kB"


def describe(event: dict) -> str | None:
    """One line for an event of `EncoderClient.encode`'s `on_server_progress` (a `phase`) or `on_status` (an
    `event`), or None for one that says nothing new (`done`: see `summary`)."""
    kind = event.get("event")
    if kind == "sending":
        return f"sending {megabytes(int(event.get('bytes') or 0))}"
    if kind == "receiving":
        return f"receiving the conditioning ({megabytes(int(event.get('bytes') or 0))})"
    if kind == "retrying":
        return f"retrying: {event.get('url')} failed ({event.get('reason')})"
    phase = event.get("phase")
    if phase == "queued":
        position = event.get("queue_position")
        # queue_position counts the jobs ahead, the running one included: 0 means next
        ahead = position if isinstance(position, int) and position > 0 else 0
        return "queued on the server" + (f" ({ahead} ahead)" if ahead else "")
    if phase not in _SERVER_TEXT:
        return None  # a phase a newer server added: the previous line stays
    done, total = event.get("done"), event.get("total")
    counted = isinstance(done, int) and isinstance(total, int) and total > 1
    if phase == "text" and counted:
        return f"encoding text: layer {done}/{total}"
    if phase in ("video", "audio") and counted:
        return f"encoding {phase} {done}/{total}"
    return _SERVER_TEXT[phase]


def summary(done: dict) -> str:
    """'encoded on http://host:port in 8.2 s (text: cache hit, video: miss)' from the `done` status event."""
    seconds = float(done.get("seconds") or 0)
    took = f"{seconds * 1000:.0f} ms" if seconds < 0.1 else f"{seconds:.1f} s"
    where = f"encoded on {done.get('url')} in {took}"
    cache, components = done.get("cache"), done.get("components") or {}
    if cache == "hit":
        return f"{where} (cache hit: the whole conditioning)"
    parts: dict[str, list[str]] = {}
    for label, outcome in components.items():
        parts.setdefault(label.partition(".")[0], []).append(outcome)
    words = []
    for kind in _COMPONENT_ORDER:
        outcomes = parts.get(kind)
        if not outcomes:
            continue
        hits = sum(outcome != "miss" for outcome in outcomes)
        words.append(f"{kind}: " + ("miss" if hits == 0 else "cache hit" if hits == len(outcomes)
                                    else f"{hits}/{len(outcomes)} from the cache"))
    if cache == "joined":
        words.insert(0, "joined an identical request")
    queue_s = done.get("queue_s")
    if isinstance(queue_s, float) and queue_s >= 0.05:
        words.append(f"queued {queue_s:.1f} s")
    return f"{where} ({', '.join(words)})" if words else where
