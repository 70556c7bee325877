"""`GET /metrics` and the middleware that counts `POST /v1/encode` answers, for the aiohttp transport.

The metrics themselves are engine-neutral (`metrics.py`); this is the aiohttp glue. Authentication is the
server's: with a bearer token configured, `/metrics` needs it like every endpoint but `/v1/health` (Prometheus
sends it with `authorization: {credentials_file: ...}`); without one the server listens on loopback only.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from . import protocol
from .metrics import PATH  # noqa: F401 - the route, re-exported for http.py

TASK_KEY = web.RequestKey("h3_task", str) if hasattr(web, "RequestKey") else "h3_task"


def middleware(service_key):
    """Counts every answer to POST /v1/encode (status, task) and times the successful ones, `send` included.

    Sits outside the error middleware, so it sees the final status of refusals (401, 4xx) too. A client that
    disconnects before its answer is counted as 499, as the request log does.
    """

    @web.middleware
    async def count_encodes(request: web.Request, handler):
        if request.path != protocol.ENCODE_PATH:
            return await handler(request)
        metrics = request.app[service_key].metrics
        started = time.monotonic()
        try:
            response = await handler(request)
            if response.status == 200 and not response.prepared:
                sending = time.monotonic()
                await response.prepare(request)  # aiohttp's own finishing steps are no-ops afterwards
                await response.write_eof()
                metrics.observe_phase("send", time.monotonic() - sending)
        except (asyncio.CancelledError, ConnectionError):
            metrics.observe_request(499, request.get(TASK_KEY))
            raise
        except Exception:
            metrics.observe_request(500, request.get(TASK_KEY))
            raise
        metrics.observe_request(response.status, request.get(TASK_KEY), time.monotonic() - started,
                                response.headers.get(protocol.H_CACHE))
        return response

    return count_encodes


def handler(service_key):
    async def handle_metrics(request: web.Request) -> web.Response:
        body, content_type = request.app[service_key].metrics.render()
        response = web.Response(body=body, headers={"Cache-Control": "no-store"})
        response.headers["Content-Type"] = content_type  # with its version parameter, which content_type= refuses
        return response

    return handle_metrics
