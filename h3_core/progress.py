"""Progress reporting and cooperative cancellation, shared by both stages and the server.

Long work takes an optional `progress(done, total)` callback and an optional `threading.Event`;
it checks the event between units of work and raises `Cancelled`, so a cancelled request never
returns partial output and never leaves a worker stuck.
"""

from __future__ import annotations

import threading
from typing import Callable

ProgressFn = Callable[[int, int], None]  # (units done, total units)


class Cancelled(RuntimeError):
    """The caller's cancel flag was set; the work was abandoned at the next checkpoint."""


def check_cancel(cancel: threading.Event | None, where: str) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"cancelled {where}")
