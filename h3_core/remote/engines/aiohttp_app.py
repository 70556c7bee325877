"""HTTP in front of the encoder service (aiohttp): the adapter between aiohttp and the shared request handling.

    aiohttp request --Incoming--> handler.Handler (routes, auth, caps, parse, cache, queue) --Reply--> response

The request handling itself (`server/handler.py`, `server/body.py`) is engine-neutral: the Ray Serve ingress
(`ray_serve.py`) calls the same code. Every request body is read through its `Admission`: bytes are counted as they
arrive (per request, per client, server-wide) and an upload slower than the minimum rate is dropped with 408.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from .. import protocol
from ..server import handler as handling
from ..server.config import ServerConfig
from ..server.handler import Handler, Incoming, Reply
from ..server.service import EncoderService
from .sending import EncodedPayload

log = logging.getLogger("h3_core.remote.server")

SERVICE_KEY = web.AppKey("h3_service", EncoderService)
HANDLER_KEY = web.AppKey("h3_handler", Handler)
TRACKERS_KEY = web.AppKey("h3_trackers", dict)  # progress id -> tracking.Tracker, for open encode requests


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def incoming(request: web.Request) -> Incoming:
    """The engine-neutral view of an aiohttp request (the body stays aiohttp's stream, un-gzipped by aiohttp)."""
    return Incoming(method=request.method, path=request.path, headers=request.headers, remote=request.remote or "",
                    content=request.content, gone=lambda: _gone(request), body_errors=(web.RequestPayloadError,))


def response(reply: Reply) -> web.Response:
    headers = dict(reply.headers)
    if reply.content_type:  # as a header: aiohttp's content_type= refuses parameters (metrics' version=0.0.4)
        headers["Content-Type"] = reply.content_type
    body = reply.body
    if not isinstance(body, (bytes, bytearray)):  # a conditioning's wire form: header + storages, never joined
        body = EncodedPayload(body, reply.content_type or protocol.CONDITIONING_CONTENT_TYPE)
    return web.Response(status=reply.status, reason=reply.reason, body=body or None, headers=headers)


async def handle(request: web.Request) -> web.StreamResponse:
    sent: list[web.Response] = []

    async def send(reply: Reply) -> None:
        """A conditioning answer is written here, so the handler's metrics time it (phase `send`); the rest is
        left to aiohttp's own finishing steps (a no-op for a response already written)."""
        out = response(reply)
        sent.append(out)
        if reply.status == 200 and request.path == protocol.ENCODE_PATH:
            await out.prepare(request)
            await out.write_eof()

    await request.app[HANDLER_KEY](incoming(request), send)
    return sent[0]


def create_app(stage: Any, config: ServerConfig = ServerConfig(), model_info: dict | None = None) -> web.Application:
    """The aiohttp application around a loaded `EncoderStage` (or anything with .encode/.fingerprint); with
    `stage=None` the service is *loading* (503 `loading`) until `service.attach(stage)`.

    Usable in-process (tests, embedding) through `ServerThread`, or by `main` for the CLI.
    """
    # aiohttp's own body cap applies to request.read()/post(); we stream multipart with our own caps.
    app = web.Application(client_max_size=config.limits.max_json_bytes + 1)
    service = EncoderService(stage, config, model_info)
    app[SERVICE_KEY] = service
    app[HANDLER_KEY] = handling.Handler(service)
    app[TRACKERS_KEY] = app[HANDLER_KEY].trackers

    async def on_startup(app):
        await service.start()

    async def on_cleanup(app):
        await service.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_route("*", "/{path:.*}", handle)  # the shared handler routes (handler.Handler.routes)
    return app
