"""Progress of an encode while its POST is pending: phase names, progress ids, the poll's answer. Both sides.

A client that wants progress picks a random 128-bit id, sends it with `POST /v1/encode` in the `X-H3-Progress-Id`
header, and polls `GET /v1/encode/{id}/progress` while the POST is pending. The POST's answer is unchanged, byte
for byte. A server advertises the feature in its capabilities (`"progress": {...}`); a client polls only servers
that do, so an older server (which ignores the header) is simply not polled. See docs/PROTOCOL.md "Progress".

The server keeps one `Tracker` per open encode request that sent an id; it lives exactly as long as the request
handler, so the number of trackers is bounded by the requests admitted.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

HEADER = "X-H3-Progress-Id"
PATH_TEMPLATE = "/v1/encode/{id}/progress"
POLL_INTERVAL_S = 0.25  # what the server suggests; the client polls no faster than this

# The phases of one request, in order. `receiving`: the body is arriving; `queued`: waiting for the model thread;
# `decode`: media decoded (sandboxed); `text` / `video` / `audio`: the three encoders; `serialise`: the safetensors
# bytes are being written; `sending`: the answer is on its way (also straight after `receiving` for a cache hit).
PHASES = ("receiving", "queued", "decode", "text", "video", "audio", "serialise", "sending")
ENCODER_PHASES = ("text", "video", "audio")  # EncoderStage.encode's progress(done, 3): done = index of the next
_ID = re.compile(r"[0-9a-f]{32}")
MAX_HISTORY = 64  # phase changes kept per job (encoders reporting sub-steps could otherwise grow it)


def new_id() -> str:
    """A fresh progress id: 128 random bits as 32 lowercase hex digits (unguessable, so only its sender polls)."""
    return secrets.token_hex(16)


def is_id(value: str | None) -> bool:
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def path(progress_id: str) -> str:
    return PATH_TEMPLATE.format(id=progress_id)


def capability() -> dict[str, Any]:
    """What a server that tracks progress publishes under `capabilities["progress"]`."""
    return {"header": HEADER, "path": PATH_TEMPLATE, "phases": list(PHASES), "poll_interval_s": POLL_INTERVAL_S}


@dataclass
class PhaseLog:
    """Phases passed, in order, with seconds since the log started; shared by a job and every request joined to it.

    Written by the model thread (one writer), read by the event loop: appending to a list is atomic under the GIL
    and readers copy it, so no lock is needed.
    """

    started: float = field(default_factory=time.monotonic)
    entries: list[dict[str, Any]] = field(default_factory=list)

    def enter(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        entry: dict[str, Any] = {"phase": phase, "at_s": round(time.monotonic() - self.started, 4)}
        if done is not None and total is not None:
            entry["done"], entry["total"] = int(done), int(total)
        last = self.entries[-1] if self.entries else None
        if last is not None and last["phase"] == phase and last.get("done") == entry.get("done"):
            return
        if len(self.entries) < MAX_HISTORY:
            self.entries.append(entry)
        else:
            self.entries[-1] = entry

    @property
    def phase(self) -> str | None:
        entries = self.entries
        return entries[-1]["phase"] if entries else None

    def encoder_callback(self):
        """A `progress(done, total)` for `EncoderStage.encode`: done is the index of the encoder about to run.

        Extra arguments (a phase name, if a later encoder passes one) are accepted; a name starting with one of
        the encoder phases picks that phase, otherwise the index decides.
        """

        def report(done: int, total: int, *args: Any, **kwargs: Any) -> None:
            name = kwargs.get("phase") or next((a for a in args if isinstance(a, str)), None)
            named = next((p for p in ENCODER_PHASES if isinstance(name, str) and name.startswith(p)), None)
            if named is not None:
                self.enter(named, done, total)
            elif total == len(ENCODER_PHASES) and type(done) is int and 0 <= done < total:
                self.enter(ENCODER_PHASES[done])

        return report


@dataclass
class Tracker:
    """One open encode request with a progress id: its own phases, then its job's (if it got one)."""

    own: PhaseLog = field(default_factory=PhaseLog)
    job: Any = None  # service.Job once submitted (its `phases` is a PhaseLog, `state` queued/running/done)
    cache: str | None = None

    def answer(self, progress_id: str, queue_position: int | None) -> dict[str, Any]:
        """The poll's JSON: the current phase, the queue position while queued, and every phase passed so far."""
        history = list(self.own.entries[:1])  # receiving
        if self.job is not None:
            offset = self.job.phases.started - self.own.started
            history += [dict(entry, at_s=round(entry["at_s"] + offset, 4)) for entry in list(self.job.phases.entries)]
        history += list(self.own.entries[1:])  # sending
        current = history[-1] if history else {"phase": "receiving", "at_s": 0.0}
        body: dict[str, Any] = {
            "id": progress_id,
            "phase": current["phase"],
            "step": PHASES.index(current["phase"]) if current["phase"] in PHASES else None,
            "steps": len(PHASES),
            "elapsed_s": round(time.monotonic() - self.own.started, 4),
            "history": history,
        }
        if current.get("total") is not None:
            body["done"], body["total"] = current["done"], current["total"]
        if current["phase"] == "queued" and queue_position is not None:
            body["queue_position"] = queue_position
        if self.cache is not None:
            body["cache"] = self.cache
        return body
