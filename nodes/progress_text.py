"""Progress that says what the running node does: the bar per phase and a line of text under it.

h3_core reports named phases (`h3_core.progress.PHASES`); each gets the node's bar (restarted when the phase
changes) plus ComfyUI's progress-text line ("decoding audio (one pass) - 12 s"). A phase whose work has no
sub-steps (the audio decode is one call; building the embedded tiny H3 is one call) would sit at 0 % with nothing
moving, so a heartbeat refreshes the text with the elapsed time every second until the phase ticks or ends: no
phase stays silent for more than a second or two. Given the node's cancel flag, the same thread acknowledges an
interrupt within CANCEL_POLL_S ("cancelling after the current layer"): the work itself stops at its next checkpoint.

Every line fits one line of a node (`fit`, MAX_TEXT_CHARS): frontend 1.32.9 gives the text one line's height under
the widgets, so a second line ran under the next node's badges. A phase that ends well leaves a short summary
("weights read in 2.1 s") instead of its last step, and web/progress_text.js clears the pack's lines when the next
run starts (1.32.9 kept them until that node ran again; 1.58 clears them itself).
"""

from __future__ import annotations

import contextlib
import threading
import time

import comfy.model_management
import comfy.utils

from ..h3_core import progress
from ..h3_core.progress import Cancelled
from ..h3_core.remote.client import polling

# What each phase's units are, in the user's words.
PHASE_TEXT = {
    "load": "reading the weights: {percent}%",
    "text": "text encoder: layer {done}/{total}",
    "video_vae": "video VAE: encoding clip {done}/{total}",
    "audio_vae": "audio VAE: encoding clip {done}/{total}",
    "denoise": "DiT forward {done}/{total}",
    "decode_video": "decoding video: tile {done}/{total}",
    "decode_audio": "decoding audio (one pass)",
    "build_tiny": "building tiny H3 (first use, ~30 s)",
}
# What the last phase of a node's work did, for the summary left when it ends well ("decoded in 48 s").
PHASE_DONE = {
    "load": "weights read",
    "text": "encoded",
    "video_vae": "encoded",
    "audio_vae": "encoded",
    "denoise": "sampled",
    "decode_video": "decoded",
    "decode_audio": "decoded",
    "build_tiny": "tiny H3 built",
}
# One line under a node of the default width in frontend 1.32.9 (text-xs, about 48 characters under a loader of the
# templates' width; a second line is cut by the widget's one-line height and scrolls).
MAX_TEXT_CHARS = 46
ELLIPSIS = "\u2026"
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


def fit(line: str, suffix: str = "", limit: int | None = MAX_TEXT_CHARS) -> str:
    """`line` + `suffix` in at most `limit` characters: the line is cut (at a word end when one is near) and marked
    with an ellipsis, the suffix (the heartbeat's " - 12 s") always kept. No limit: unchanged."""
    line = " ".join(line.split())  # one line: no newline or run of spaces survives
    if limit is None or len(line) + len(suffix) <= limit:
        return line + suffix
    room = max(limit - len(suffix) - len(ELLIPSIS), 1)
    cut = line[:room]
    space = cut.rfind(" ")
    if space >= room - 12 and space > 0:  # a word end close by reads better than half a word
        cut = cut[:space]
    return cut.rstrip(" ,;:-(") + ELLIPSIS + suffix


def seconds(value: float) -> str:
    """A duration as the summaries say it: "0.4 s", "8.2 s", "48 s"."""
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def summary(phase: str | None, elapsed_s: float) -> str:
    """The line a node's work leaves when it ends well: what its last phase did and how long the node took."""
    return f"{PHASE_DONE.get(phase or '', 'done')} in {seconds(elapsed_s)}"


def sampler_summary(elapsed_s: float, forwards: int, skipped_percent: int | None = None) -> str:
    """The Sampler's last line: its DiT forwards and time, and with a step cache how much of the DiT it skipped (in
    a user's words: the share of the DiT's block runs it did not compute; h3_core.step_cache.Passes)."""
    if skipped_percent is None:
        return f"done: {forwards} DiT forwards in {seconds(elapsed_s)}"
    return f"done in {seconds(elapsed_s)}, cache skipped {skipped_percent}% of DiT blocks"


def leave(node_id: str | None, line: str, limit: int | None = MAX_TEXT_CHARS) -> None:
    """`line` (fitted) stays on the node after its work: sent outside any PhaseText, so no heartbeat rewrites it."""
    _send_text(fit(line, limit=limit), node_id if node_id is not None else _running_node())


def _send_text(text: str, node_id: str | None) -> None:
    # PromptServer.send_progress_text, as core's own nodes send theirs: core 0.33's comfy_api has no public
    # equivalent (its Execution.set_progress replaces PROGRESS_BAR_HOOK, the bar, which the pack drives through
    # comfy.utils.ProgressBar).
    from server import PromptServer

    server = getattr(PromptServer, "instance", None)
    if server is not None and node_id is not None:
        server.send_progress_text(text, node_id)


class PhaseText:
    """The running node's progress text for the phases reported to `sink`, with a heartbeat while one is quiet."""

    limit: int | None = MAX_TEXT_CHARS  # `fit`'s limit for every line (RemoteText: none, its URLs stay whole)

    def __init__(self, node_id: str | None = None, heartbeat_s: float = HEARTBEAT_S, cancel=None,
                 suffix=None, summarize: bool = True):
        self.node_id = node_id if node_id is not None else _running_node()
        self.summarize = summarize  # False: the node's own next line follows at once (the Sampler's steps)
        self.suffix = suffix  # a callable adding to each step's line (the Sampler's ", cache skipped 35%")
        self.heartbeat_s = heartbeat_s
        self.cancel = cancel  # an `is_set()` flag (ComfyUI's interrupt): seen, it replaces the line at once
        self._cancelling = False
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._line = ""
        self._since = self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def show(self, phase: str, done: int = 0, total: int = 1) -> None:
        percent = 100 * done // max(total, 1)
        line = PHASE_TEXT.get(phase, phase).format(done=done, total=total, percent=percent)
        self.say(line + (self.suffix() if self.suffix is not None else ""), phase)

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
            _send_text(fit(line, limit=self.limit), self.node_id)

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
                _send_text(fit(line, f" - {quiet:.0f} s", self.limit), self.node_id)

    def _notice_cancel(self) -> None:
        """Say at once that the cancel arrived: the work stops at its next checkpoint, which may be a while."""
        with self._lock:
            self._cancelling = True
            phase = self._phase or ""
        line = CANCEL_NOW.get(phase) or CANCEL_TEXT.format(unit=CANCEL_UNIT.get(phase, "step"))
        _send_text(fit(line, limit=self.limit), self.node_id)

    def __enter__(self) -> PhaseText:
        self._started = time.monotonic()
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
            _send_text(fit(f"cancelled: {line}" if line else "cancelled", limit=self.limit), self.node_id)
        elif exc_type is None and self.summarize:
            self.finish()

    def finish(self) -> None:
        """The work ended well: its last step's line becomes a summary ("decoded in 48 s"), not left as if still
        running. Nothing when no line was shown (a cached load said nothing)."""
        with self._lock:
            phase, shown = self._phase, bool(self._line) and not self._cancelling
        if shown:
            _send_text(fit(summary(phase, time.monotonic() - self._started), limit=self.limit), self.node_id)


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


def with_text(report, node_id: str | None, phase: str, suffix=None):
    """A (done, total, preview) progress callback that also shows `phase`'s text (the Sampler's DiT forwards), each
    line ending with `suffix()` when given."""
    text = PhaseText(node_id, suffix=suffix)

    def both(done: int, total: int, preview=None) -> None:
        text.show(phase, done, total)
        report(done, total, preview)

    return both


class RemoteText(PhaseText):
    """The Remote Encode node's text: what the client does and the server's phases (h3_core.remote.client.polling's
    words), with the heartbeat's elapsed time while a phase lasts; `summary()` is the line left after the run."""

    limit = None  # its lines name the endpoint's URL, which a cut would hide (the node is wide: its endpoint widget)

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

    def finish(self) -> None:
        if self.done is None:  # with `done`, the node leaves polling's summary ("encoded on URL in 8.2 s ...")
            super().finish()

    @staticmethod
    def leave(node_id: str | None, line: str) -> None:
        """`line` stays on the node: sent outside the context, so no heartbeat rewrites it."""
        leave(node_id, line, limit=RemoteText.limit)
