"""Connection-level guards of the server: idle and slow-header connections reaped, accept() error storms and
malformed-request tracebacks kept out of the log. Moved out of aiohttp_app.py, which keeps the request handlers."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..server.clock import SYSTEM_CLOCK, Clock
from ..server.service import EncoderService

log = logging.getLogger("h3_core.remote.server")


class ConnectionReaper:
    """Closes connections that hold a slot without sending a request: slow headers (slowloris) or idle.

    A connection must deliver complete request headers within `header_timeout_s` of opening or of its previous
    answer being sent; aiohttp itself has no such deadline (it waits for headers forever and keeps idle
    connections an hour). Connections with a request in progress are left to the request's own deadlines.
    Timed on `service.clock` (clock.py).
    """

    def __init__(self, server: web.Server, service: EncoderService, interval_s: float = 0.25):
        self.server, self.service, self.interval_s = server, service, interval_s
        self.timeout_s = service.config.header_timeout_s
        self.clock = service.clock

    async def run(self) -> None:
        idle_since: dict[Any, float] = {}
        while True:
            await self.clock.sleep(self.interval_s)
            now = self.clock.monotonic()
            live = self.server.connections
            for handler in live:
                # aiohttp sets `_request_in_progress` from a request's headers until its answer is written;
                # if a future version drops it, nothing is reaped (the default True).
                if getattr(handler, "_request_in_progress", True):
                    idle_since.pop(handler, None)
                    continue
                since = idle_since.setdefault(handler, now)
                if now - since > self.timeout_s:
                    handler.force_close()
                    idle_since.pop(handler, None)
                    self.service.counters["connections_reaped"] += 1
            for handler in set(idle_since) - set(live):
                del idle_since[handler]


class AcceptErrorLimiter:
    """The event loop's exception handler, with accept() failures (EMFILE, ENFILE, ENOBUFS storms) logged at most
    once per `every_s` seconds of `clock`, with the count of the ones not logged. asyncio retries the accept by
    itself."""

    def __init__(self, previous=None, every_s: float = 30.0, clock: Clock = SYSTEM_CLOCK):
        self.previous, self.every_s, self.clock = previous, every_s, clock
        self.last, self.suppressed = -math.inf, 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if not str(context.get("message", "")).startswith("socket.accept()"):
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = self.clock.monotonic()
        if now - self.last < self.every_s:
            self.suppressed += 1
            return
        error = context.get("exception")
        log.error("accepting connections fails: %s (%d more since the last report); raise the file-descriptor limit "
                  "(LimitNOFILE, docs/DEPLOY.md) or lower the load", error, self.suppressed)
        self.last, self.suppressed = now, 0


class _QuietBadRequests(logging.Filter):
    """aiohttp logs every malformed HTTP message (bad request line, Content-Length, ...) with a traceback at
    ERROR; its parser has already answered 400. Keep one debug line instead, so hostile traffic cannot flood the
    log. Handler errors are logged by this module's own logger and are not affected."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            log.debug("malformed HTTP request refused by the parser: %s", str(exc).splitlines()[0][:200])
            return False
        return True


_aiohttp_server_log = logging.getLogger("aiohttp.server")
if not any(isinstance(f, _QuietBadRequests) for f in _aiohttp_server_log.filters):
    _aiohttp_server_log.addFilter(_QuietBadRequests())
