"""Progress that says what the running node does: the bar per phase and a line of text under it.

h3_core reports named phases (`h3_core.progress.PHASES`); each gets the node's bar (restarted when the phase
changes) plus ComfyUI's progress-text line ("decoding audio (one pass) - 12 s"). A phase whose work has no
sub-steps (the audio decode is one call; building the embedded tiny H3 is one call) would sit at 0 % with nothing
moving, so a heartbeat refreshes the text with the elapsed time every second until the phase ticks or ends: no
phase stays silent for more than a second or two.
"""

from __future__ import annotations

import contextlib
import threading
import time

import comfy.utils

from ..h3_core import progress

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

    def __init__(self, node_id: str | None = None, heartbeat_s: float = HEARTBEAT_S):
        self.node_id = node_id if node_id is not None else _running_node()
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._line = ""
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def show(self, phase: str, done: int = 0, total: int = 1) -> None:
        percent = 100 * done // max(total, 1)
        line = PHASE_TEXT.get(phase, phase).format(done=done, total=total, percent=percent)
        with self._lock:
            changed = phase != self._phase or line != self._line
            if changed:
                self._since = time.monotonic()
            self._phase, self._line = phase, line
        if changed:  # the bytes of a load tick thousands of times; the text changes at most once a percent
            _send_text(line, self.node_id)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                line, quiet = self._line, time.monotonic() - self._since
            if line and quiet >= self.heartbeat_s:
                _send_text(f"{line} - {quiet:.0f} s", self.node_id)

    def __enter__(self) -> PhaseText:
        self._thread = threading.Thread(target=self._beat, name="h3-progress-text", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s)


@contextlib.contextmanager
def phases(node_id: str | None = None):
    """Inside: every h3_core phase drives the running node's bar (one per phase) and its progress text."""
    state = {"phase": None, "bar": None}
    with PhaseText(node_id) as text:

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
