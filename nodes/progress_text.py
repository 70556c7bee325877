"""Progress that says what the running node does: the bar per phase and a line of text under it.

h3_core reports named phases (`h3_core.progress.PHASES`); each gets the node's bar (restarted when the phase
changes) plus ComfyUI's progress-text line ("decoding audio (one pass) - 12 s"). A phase whose work has no
sub-steps (the audio decode is one call; building the embedded tiny H3 is one call) would sit at 0 % with nothing
moving, so a heartbeat refreshes the text with the elapsed time every second until the phase ticks or ends: no
phase stays silent for more than a second or two. Given the node's cancel flag, the same thread acknowledges an
interrupt within CANCEL_POLL_S ("cancelling after the current layer"): the work itself stops at its next checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
import time

import comfy.model_management
import comfy.utils

from ..h3_core import progress
from ..h3_core.progress import Cancelled
from ..h3_core.remote import polling

# What each phase's units are, in the user's words.
PHASE_TEXT = {
    "load": "reading the weights: {percent}%",
    "text": "text encoder: layer {done}/{total}",
    "video_vae": "video VAE: encoding clip {done}/{total}",
    "audio_vae": "audio VAE: encoding clip {done}/{total}",
    "denoise": "DiT forward {done}/{total}",
    "decode_video": "decoding video: tile {done}/{total}",
    "decode_audio": "decoding audio (one pass)",
    "build_tiny": "building the embedded tiny H3 (first use only, about 30 s on a CPU)",
}
HEARTBEAT_S = 1.0
_CANCELS = (Cancelled, comfy.model_management.InterruptProcessingException)
CANCEL_POLL_S = 0.1  # how soon an interrupt is acknowledged on the node (one flag read per tick)
CANCEL_TEXT = "cancelling after the current {unit}"
# What a cancel waits for in each phase: the checkpoint the work reaches next (h3_core checks its cancel there).
CANCEL_UNIT = {"decode_video": "tile", "decode_audio": "layer", "text": "layer", "denoise": "step"}
CANCEL_NOW = {"remote": "cancelling: closing the connection, so the server drops the work"}


def _running_node() -> str | None:
    from comfy_execution.utils import get_executing_context

    context = get_executing_context()
    return None if context is None else context.node_id


def _send_text(text: str, node_id: str | None) -> None:
    from server import PromptServer

    server = getattr(PromptServer, "instance", None)
    if server is not None and node_id is not None:
        server.send_progress_text(text, node_id)


class PhaseText:
    """The running node's progress text for the phases reported to `sink`, with a heartbeat while one is quiet."""

    def __init__(self, node_id: str | None = None, heartbeat_s: float = HEARTBEAT_S, cancel=None):
        self.node_id = node_id if node_id is not None else _running_node()
        self.heartbeat_s = heartbeat_s
        self.cancel = cancel  # an `is_set()` flag (ComfyUI's interrupt): seen, it replaces the line at once
        self._cancelling = False
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._line = ""
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def show(self, phase: str, done: int = 0, total: int = 1) -> None:
        percent = 100 * done // max(total, 1)
        self.say(PHASE_TEXT.get(phase, phase).format(done=done, total=total, percent=percent), phase)

    def say(self, line: str, phase: str | None = None) -> None:
        """Show `line` now (unless it is already shown); the heartbeat adds its age while nothing replaces it."""
        with self._lock:
            if self._cancelling:  # the cancel notice stays until the node ends
                return
            changed = phase != self._phase or line != self._line
            if changed:
                self._since = time.monotonic()
            self._phase, self._line = phase, line
        if changed:  # the bytes of a load tick thousands of times; the text changes at most once a percent
            _send_text(line, self.node_id)

    def _beat(self) -> None:
        # Wakes often only to see a cancel (a flag read); the elapsed-time line still changes once a second.
        tick = min(CANCEL_POLL_S, self.heartbeat_s) if self.cancel is not None else self.heartbeat_s
        last_beat = time.monotonic()
        while not self._stop.wait(tick):
            if self.cancel is not None and not self._cancelling and self.cancel.is_set():
                self._notice_cancel()
                continue
            now = time.monotonic()
            if now - last_beat < self.heartbeat_s - tick / 2:  # a wait may end a hair early
                continue
            last_beat = now
            with self._lock:
                line, quiet, cancelling = self._line, now - self._since, self._cancelling
            if line and quiet >= self.heartbeat_s and not cancelling:
                _send_text(f"{line} - {quiet:.0f} s", self.node_id)

    def _notice_cancel(self) -> None:
        """Say at once that the cancel arrived: the work stops at its next checkpoint, which may be a while."""
        with self._lock:
            self._cancelling = True
            phase = self._phase or ""
        line = CANCEL_NOW.get(phase) or CANCEL_TEXT.format(unit=CANCEL_UNIT.get(phase, "step"))
        _send_text(line, self.node_id)

    def __enter__(self) -> PhaseText:
        self._thread = threading.Thread(target=self._beat, name="h3-progress-text", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s)
        if self.cancel is not None and exc_type is not None and issubclass(exc_type, _CANCELS):
            # The work may stop before the heartbeat sees the flag (ComfyUI clears it while raising): say it anyway.
            with self._lock:
                line = self._line
            _send_text(f"cancelled: {line}" if line else "cancelled", self.node_id)


@contextlib.contextmanager
def phases(node_id: str | None = None, cancel=None):
    """Inside: every h3_core phase drives the running node's bar (one per phase) and its progress text; with
    `cancel` (the flag the work checks), an interrupt is acknowledged on the node at once."""
    state = {"phase": None, "bar": None}
    with PhaseText(node_id, cancel=cancel) as text:

        def sink(phase: str, done: int, total: int) -> None:
            if state["phase"] != phase:
                state["phase"], state["bar"] = phase, comfy.utils.ProgressBar(total, node_id=node_id)
            state["bar"].update_absolute(done, total)
            text.show(phase, done, total)

        with progress.reporting(sink):
            yield text


def with_text(report, node_id: str | None, phase: str):
    """A (done, total, preview) progress callback that also shows `phase`'s text (the Sampler's DiT forwards)."""
    text = PhaseText(node_id)

    def both(done: int, total: int, preview=None) -> None:
        text.show(phase, done, total)
        report(done, total, preview)

    return both


class RemoteText(PhaseText):
    """The Remote Encode node's text: what the client does and the server's phases (h3_core.remote.polling's
    words), with the heartbeat's elapsed time while a phase lasts; `summary()` is the line left after the run."""

    def __init__(self, node_id: str | None, endpoint: str, cancel=None):
        super().__init__(node_id, cancel=cancel)
        self.done: dict | None = None
        self.say(f"contacting {endpoint}", "remote")

    def event(self, event: dict) -> None:
        """`on_server_progress` and `on_status` of EncoderClient.encode (both: the events differ by key)."""
        if event.get("event") == "done":
            self.done = dict(event)
            return
        line = polling.describe(event)
        if line is not None:
            self.say(line, "remote")

    @staticmethod
    def leave(node_id: str | None, line: str) -> None:
        """`line` stays on the node: sent outside the context, so no heartbeat rewrites it."""
        _send_text(line, node_id if node_id is not None else _running_node())
