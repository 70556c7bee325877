"""Progress reporting and cooperative cancellation, shared by both stages and the server.

Long work takes an optional `progress(done, total)` callback and an optional `threading.Event`;
it checks the event between units of work and raises `Cancelled`, so a cancelled request never
returns partial output and never leaves a worker stuck.

Named phases. Work that is deep inside a call chain it does not own (weights read by the loaders,
encoders, decoders) reports `(phase, done, total)` to whatever sink the caller installed with
`reporting(sink)` for the duration of its call: the ComfyUI nodes map each phase to the running
node's progress bar, the CLI prints it. Without a sink, reporting costs one context-variable read.
Reports never touch the tensors being computed, so results are the same with or without a sink.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Callable, Iterator

ProgressFn = Callable[[int, int], None]  # (units done, total units)
PhaseFn = Callable[[str, int, int], None]  # (phase, units done, total units)

# phase -> what its units are (the CLI prints these; every phase any module reports is listed here)
PHASES = {
    "load": "bytes",  # weights read from safetensors files
    "text": "layers",  # text encoder forward, one unit per decoder layer
    "video_vae": "clips",  # video VAE encode, one unit per temporal clip (a keyframe / reference image: one)
    "audio_vae": "clips",  # audio VAE encode, one unit per soundtrack / reference audio
    "denoise": "steps",  # DiT forwards
    "decode_video": "tiles",  # video VAE decoder calls (one per spatial tile of each temporal chunk)
    "decode_audio": "clips",  # audio VAE decode
}

_SINK: contextvars.ContextVar[PhaseFn | None] = contextvars.ContextVar("h3_progress_sink", default=None)


class Cancelled(RuntimeError):
    """The caller's cancel flag was set; the work was abandoned at the next checkpoint."""


def check_cancel(cancel: threading.Event | None, where: str) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"cancelled {where}")


@contextlib.contextmanager
def reporting(sink: PhaseFn | None) -> Iterator[None]:
    """Send the named-phase reports made inside this block (in this thread) to `sink`."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def report(phase: str, done: int, total: int) -> None:
    if phase not in PHASES:
        raise ValueError(f"unknown progress phase {phase!r}; known: {sorted(PHASES)}")
    sink = _SINK.get()
    if sink is not None:
        sink(phase, int(done), int(total))


def active() -> bool:
    """Whether a sink listens (lets callers skip work done only to report, e.g. counting tiles)."""
    return _SINK.get() is not None


class Counter:
    """Counts units of one phase towards a total and reports each change (0 at construction).

    `total` may be an estimate: a count that passes it raises the total with it, so a bar never
    shows more than 100 %. Reports are thinned to whole percents (a checkpoint read tensor by tensor
    would otherwise send thousands of progress events); the last unit is always reported."""

    def __init__(self, phase: str, total: int):
        self.phase, self.total, self.done, self._percent = phase, max(int(total), 1), 0, 0
        report(self.phase, 0, self.total)

    def advance(self, units: int = 1) -> None:
        self.done += int(units)
        self.total = max(self.total, self.done)
        percent = self.done * 100 // self.total
        if percent != self._percent or self.done == self.total:
            self._percent = percent
            report(self.phase, self.done, self.total)

    def finish(self) -> None:
        if self.done < self.total:
            self.done = self.total
            report(self.phase, self.done, self.total)
