"""The CLI's weight-loading progress bar on stderr (the `load` progress phase, h3_core.progress).

On a terminal the bar is redrawn in place; into a file or a pipe it prints one line per tenth, so logs
stay short. Every other phase goes to the CLI's own printer unchanged.
"""

from __future__ import annotations

import sys

WIDTH = 30


def _bar(done: int, total: int) -> str:
    total = max(total, 1)
    filled = done * WIDTH // total
    return (f"load [{'#' * filled}{'.' * (WIDTH - filled)}] {done * 100 // total:3d}% "
            f"{done / 1e9:.2f}/{total / 1e9:.2f} GB")


def wrap(other, stream=None):
    """A progress sink drawing `load` as a bar and passing every other phase to `other`."""
    state = {"tenth": None}

    def sink(phase: str, done: int, total: int) -> None:
        if phase != "load":
            other(phase, done, total)
            return
        out = stream or sys.stderr
        if out.isatty():
            out.write("\r" + _bar(done, total) + ("\n" if done >= total else ""))
            out.flush()
            return
        tenth = done * 10 // max(total, 1)
        if tenth != state["tenth"] or done >= total:
            state["tenth"] = tenth
            print(_bar(done, total), file=out, flush=True)
        if done >= total:
            state["tenth"] = None

    return sink
