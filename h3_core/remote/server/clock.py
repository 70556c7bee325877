"""The one clock the server's scheduling rules read: real time in production, a hand-driven one in tests.

Every rule that decides by elapsed time takes it from `ServerConfig.clock` (the service holds it as
`service.clock`): the fair queue's share window and think times (`fair_queue.py`), the next-in-line wait
(`anticipate_s`), request deadlines and the upload-rate rule (`handler.py`, `admission.py`) and the connection
reaper (`connections.py`). So a test drives those decisions with `ManualClock` and asserts exact outcomes, however
slow the machine is: a text forward that takes two seconds under load has taken no time on a clock that only moves
when the test advances it.

What is *measured* rather than decided stays on `time.monotonic()`: phase timings for `/metrics`, the Retry-After
estimate, the sandboxed decoder's kill timer (a real child process), the client's socket deadlines.

A clock has three operations, all called on the event-loop thread:

    clock.monotonic()                      # seconds, only differences mean anything
    await clock.sleep(seconds)
    await clock.wait_for(awaitable, timeout)  # its result, or asyncio.TimeoutError once `timeout` s have passed
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Any, Awaitable, Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    async def wait_for(self, awaitable: Awaitable[Any], timeout: float) -> Any: ...


class SystemClock:
    """Real time: `time.monotonic` and asyncio's own timers (the production clock)."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_for(self, awaitable: Awaitable[Any], timeout: float) -> Any:
        return await asyncio.wait_for(awaitable, timeout)

    def __repr__(self) -> str:
        return "SystemClock()"


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only when `advance` is called; its sleeps and timeouts end when it passes their time.

    For tests of scheduling decisions: nothing the machine does (a slow forward, a descheduled thread) moves it, so
    "seen within the window" or "came back within anticipate_s" are decided by the test's own `advance` calls.
    `until_waiting(n)` returns once n sleeps or timeouts are pending: the point where advancing decides them.
    """

    def __init__(self, start: float = 1000.0):
        self.now = float(start)
        self._timers: list[tuple[float, int, asyncio.Future]] = []  # (due, order, future set when due)
        self._order = itertools.count()
        self._changed: asyncio.Event | None = None

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time on by `seconds` and end every sleep or timeout that is now due (oldest first)."""
        if seconds < 0:
            raise ValueError("a monotonic clock never goes back")
        self.now += seconds
        while self._timers and self._timers[0][0] <= self.now:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.done():
                timer.set_result(None)

    @property
    def waiting(self) -> int:
        """Sleeps and timeouts not yet due (ones whose waiter left are not counted)."""
        return sum(not timer.done() for _, _, timer in self._timers)

    async def until_waiting(self, count: int = 1) -> None:
        """Return once at least `count` sleeps or timeouts are pending on this clock."""
        while self.waiting < count:
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            await self._changed.wait()

    def _timer(self, seconds: float) -> asyncio.Future:
        timer = asyncio.get_running_loop().create_future()
        if seconds <= 0:
            timer.set_result(None)
            return timer
        heapq.heappush(self._timers, (self.now + seconds, next(self._order), timer))
        if self._changed is not None:
            self._changed.set()
        return timer

    async def sleep(self, seconds: float) -> None:
        timer = self._timer(seconds)
        try:
            await timer
        finally:
            timer.cancel()  # a cancelled sleeper no longer counts as waiting

    async def wait_for(self, awaitable: Awaitable[Any], timeout: float) -> Any:
        task = asyncio.ensure_future(awaitable)
        timer = self._timer(timeout)
        try:
            await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise asyncio.TimeoutError()
        finally:
            timer.cancel()
            if not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the awaitable was given up
                    pass
