"""The request handling of the encoder endpoint, engine-neutral: a plain request in, status/headers/body out.

Both engines call this one implementation: the aiohttp server (`aiohttp_app.py`) and the Ray Serve ingress
(`ray_serve.py`, both in `engines/`) turn their request into an `Incoming` and send back the `Reply`. Routing, auth,
the error model, the caps and the slow-upload rule (through `body.py`), deadlines, the cache, progress polls and the
request log all live here, so the two engines answer with the same statuses and the same bytes. So do the hooks of
the metrics (`metrics.py`: answers to `POST /v1/encode` by status and task, the `receive` and `send` phases, `GET
/metrics`), of readiness (503 `loading` until the models are loaded) and of the fair queue (the client key).

    Handler(service)(incoming) --(route, auth, caps, parse, cache lookup)--> compute() --> Reply
    compute(): here, the local service's queue and model thread; the Ray ingress overrides it to call an
    encoder replica, which runs this same `compute` on its own service.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from ... import __version__, rules
from ...progress import Cancelled
from .. import protocol, tracking
from ..protocol import ProtocolError
from . import body, ingest, metrics, request_schema
from .clock import Clock
from .ingest import Part
from .service import Abandoned, EncoderService, Job, QueueFull

log = logging.getLogger("h3_core.remote.server")

_PROGRESS_PATH = re.compile(r"/v1/encode/([^/]+)/progress")
_NOT_LOGGED = (protocol.HEALTH_PATH, metrics.PATH)  # probes and scrapes


@dataclass
class Incoming:
    """One HTTP request as any engine sees it. `content`: the body with aiohttp's StreamReader interface
    (already un-gzipped); `gone()`: the client has disconnected (engines that cancel the handler instead may
    leave the default)."""

    method: str
    path: str
    headers: Mapping[str, str]  # case-insensitive
    remote: str
    content: Any = None
    gone: Callable[[], bool] = lambda: False
    body_errors: tuple = ()  # the engine's own "the body could not be decoded" exceptions
    request_id: str = field(default_factory=lambda: secrets.token_hex(8))
    task: str | None = None  # the request's task once its JSON was read (the metrics' label)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: Any = b""  # bytes, or a conditioning's unjoined wire form (`contract.wire.Encoded`, len() = its size)
    content_type: str | None = None
    reason: str | None = None
    phases: tuple[tuple[str, float], ...] = ()  # a computed job's phase seconds (the Ray replica reports them)

    def cache_state(self) -> str | None:
        return self.headers.get(protocol.H_CACHE)


def json_reply(payload: dict, status: int = 200, headers: dict | None = None) -> Reply:
    out = {protocol.H_PROTOCOL: str(protocol.PROTOCOL_VERSION), **(headers or {})}
    data = json.dumps(payload, ensure_ascii=True).encode("ascii")
    return Reply(status, out, data, "application/json")


def error_reply(status: int, code: str, message: str, field: str | None = None, request_id: str | None = None,
                headers: dict | None = None) -> Reply:
    return json_reply(protocol.error_body(code, message, field, request_id), status=status, headers=headers)


def authorized(headers: Mapping[str, str], token: str) -> bool:
    header = headers.get("Authorization", "")
    scheme, _, supplied = header.partition(" ")
    if scheme.lower() != "bearer":
        supplied = ""
    # Compare fixed-length digests: constant time in the token's content and length.
    expected = hashlib.sha256(token.encode("utf-8")).digest()
    given = hashlib.sha256(supplied.strip().encode("utf-8", "surrogateescape")).digest()
    return hmac.compare_digest(expected, given) and bool(supplied)


def capabilities(service: EncoderService) -> dict[str, Any]:
    from ...contract import FORMAT_ID, WIRE_VERSION

    return {
        "protocol": {"name": protocol.PROTOCOL_NAME, "version": protocol.PROTOCOL_VERSION,
                     "versions": [protocol.PROTOCOL_VERSION], "features": list(protocol.FEATURES)},
        "server": {"name": "h3_core", "version": __version__},
        "model": {
            "fingerprint": service.fingerprint,
            "layout": service.model_info.get("layout"),
            "tiny": bool(service.model_info.get("tiny", False)),
            "dtype": service.model_info.get("dtype", "float32"),
            "device": service.model_info.get("device", "cpu"),
            # torch's thread count: CPU results are bitwise those of another run only at the same count
            "threads": int(service.model_info.get("threads") or service.threads),
            "components": list(service.components),
        },
        "conditioning": {"format": FORMAT_ID, "version": WIRE_VERSION,
                         "content_type": protocol.CONDITIONING_CONTENT_TYPE},
        "tasks": list(rules.TASKS),
        "media_types": {kind: ingest.allowed_content_types(kind) for kind in ("image", "video", "audio")},
        "limits": service.limits.to_json(),
        "queue": {"capacity": service.config.queue_size, "workers": 1},
        "deadline_s": {"default": service.config.default_deadline_s, "max": service.config.max_deadline_s},
        "cache": {"enabled": service.config.cache_bytes > 0, "max_bytes": service.config.cache_bytes},
        "auth": {"scheme": "bearer" if service.config.token else None},
        **({"progress": tracking.capability()} if service.config.track_progress else {}),
    }


def conditioning_reply(item: tuple[Any, str | None], service: EncoderService, rid: str, cache: str, queue_s: float,
                       encode_s: float, streamed: bool = False) -> Reply:
    """`item`: (the wire form - `Encoded`, or its form-2 bytes on the Ray ingress -, its xxh3 checksum if form 2).
    `streamed`: the client reads form 3 (`protocol.wants_streamed`); an `Encoded` is answered in that form, bytes
    always in form 2. Form 3's checksum is made as it is sent, so its answer has no `X-H3-Checksum` header."""
    data, checksum = item
    from ...contract import FORMAT_ID, WIRE_VERSION, wire

    version = WIRE_VERSION
    if isinstance(data, wire.Encoded):
        data = data.form(wire.STREAM_VERSION if streamed else WIRE_VERSION)
        version, checksum = data.version, data.checksum
    headers = {
        protocol.H_PROTOCOL: str(protocol.PROTOCOL_VERSION),
        protocol.H_MODEL: service.fingerprint,
        protocol.H_CACHE: cache,
        protocol.H_FORMAT: f"{FORMAT_ID}/{version}",
        protocol.H_REQUEST_ID: rid,
        protocol.H_QUEUE_S: f"{queue_s:.4f}",
        protocol.H_ENCODE_S: f"{encode_s:.4f}",
    }
    if checksum is not None:
        headers[protocol.H_CHECKSUM] = checksum
    return Reply(200, headers, data, protocol.CONDITIONING_CONTENT_TYPE)


class Handler:
    """Everything between an engine's request and its response, around one `EncoderService`."""

    def __init__(self, service: EncoderService):
        self.service = service
        self.trackers: dict[str, tracking.Tracker] = {}  # progress id -> tracker, for open encode requests

    # --- routing, auth, errors, log ---------------------------------------------------------------

    def routes(self) -> dict[str, dict[str, Callable]]:
        """path -> {method: handler(incoming)}; the progress path is matched separately."""
        return {
            protocol.HEALTH_PATH: {"GET": self.health},
            protocol.CAPABILITIES_PATH: {"GET": self.capabilities},
            protocol.ENCODE_PATH: {"POST": self.encode},
            metrics.PATH: {"GET": self.scrape},
        }

    async def __call__(self, incoming: Incoming, send: Callable[[Reply], Awaitable[None]] | None = None) -> Reply:
        """The reply to `incoming`. `send`: the engine's way of handing a reply to the connection, where it has
        one (aiohttp); it is awaited here so the metrics time it (phase `send`, and the request's seconds).

        Every answer to `POST /v1/encode` is counted by status and task, refusals (401, 4xx) and clients that left
        (499) included.
        """
        started = time.monotonic()
        counted = incoming.path == protocol.ENCODE_PATH
        observe = self.service.metrics
        try:
            reply = await self._guarded(incoming)
            reply.headers.setdefault(protocol.H_REQUEST_ID, incoming.request_id)
            reply.headers.setdefault(protocol.H_PROTOCOL, str(protocol.PROTOCOL_VERSION))
            if send is not None:
                sending = time.monotonic()
                await send(reply)
                if counted and reply.status == 200:
                    observe.observe_phase("send", time.monotonic() - sending)
        except (asyncio.CancelledError, ConnectionError):
            if counted:
                observe.observe_request(499, incoming.task)
            raise
        except Exception:
            if counted:
                observe.observe_request(500, incoming.task)
            raise
        if counted:
            observe.observe_request(reply.status, incoming.task, time.monotonic() - started, reply.cache_state())
        # One line per request (never the prompt or the token): id, method, path, status, cache, seconds, bytes.
        if _PROGRESS_PATH.fullmatch(incoming.path):  # several polls a second per request: debug only, id not logged
            log.debug("%s GET %s -> %d", incoming.request_id, tracking.PATH_TEMPLATE, reply.status)
        elif incoming.path not in _NOT_LOGGED:
            cache = reply.cache_state()
            log.info("%s %s %s -> %d%s %.3f s %s B", incoming.request_id, incoming.method, incoming.path[:100],
                     reply.status, f" cache={cache}" if cache else "", time.monotonic() - started, len(reply.body))
        return reply

    def _route(self, incoming: Incoming) -> Callable:
        methods = self.routes().get(incoming.path)
        match = _PROGRESS_PATH.fullmatch(incoming.path)
        if methods is None and match is not None and self.service.config.track_progress:
            methods = {"GET": lambda request: self.progress(request, match.group(1))}
        if methods is None:
            raise _NoRoute(404, "not_found", f"no such endpoint {incoming.path[:100]!r}; see "
                                             f"{protocol.CAPABILITIES_PATH}")
        handler = methods.get(incoming.method) or (methods.get("GET") if incoming.method == "HEAD" else None)
        if handler is None:
            allowed = ",".join(sorted(set(methods) | ({"HEAD"} if "GET" in methods else set())))
            raise _NoRoute(405, "method_not_allowed", f"{incoming.method} is not allowed on "
                                                      f"{incoming.path[:100]!r}", {"Allow": allowed})
        return handler

    async def _guarded(self, incoming: Incoming) -> Reply:
        service, rid = self.service, incoming.request_id
        headers = {protocol.H_REQUEST_ID: rid}
        size = sum(len(name) + len(value) + 4 for name, value in incoming.headers.items())
        if size > protocol.MAX_REQUEST_HEADER_BYTES:
            return error_reply(431, "headers_too_large", f"the request's headers take {size} bytes, over the "
                               f"{protocol.MAX_REQUEST_HEADER_BYTES}-byte limit", None, rid, headers)
        try:
            if service.config.token is not None and incoming.path != protocol.HEALTH_PATH:
                if not authorized(incoming.headers, service.config.token):
                    service.counters["unauthorized"] += 1
                    return error_reply(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer "
                                       "<token>)", "Authorization", rid,
                                       {**headers, "WWW-Authenticate": 'Bearer realm="h3-encoder"'})
            if incoming.path not in (protocol.HEALTH_PATH, metrics.PATH):
                service.check_ready()  # 503 "loading" until the models are loaded
            return await self._route(incoming)(incoming)
        except _NoRoute as error:  # not counted: the transport's business, as aiohttp's router answers were
            return error_reply(error.status, error.code, str(error), None, rid, {**headers, **error.headers})
        except ProtocolError as error:
            service.counters[f"status_{error.status}"] += 1
            if error.status in (429, 503):
                headers["Retry-After"] = str(service.retry_after() if error.status == 429 else 5)
            return json_reply(error.body(rid), status=error.status, headers=headers)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:  # noqa: BLE001 - a bug must not kill the server; the client gets a JSON 500
            log.exception("request %s failed", rid)
            service.counters["status_500"] += 1
            return error_reply(500, "internal_error", f"internal server error (request id {rid}; see the server "
                                                      "log)", None, rid, headers)

    # --- small endpoints ------------------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        return self.service.load()

    def describe(self) -> dict[str, Any]:
        return capabilities(self.service)

    async def health(self, incoming: Incoming) -> Reply:
        """200 "ok"; 503 "loading" until the models are loaded, "draining" while shutting down (Retry-After)."""
        service = self.service
        status = "draining" if service.draining else "ok" if service.ready else "loading"
        payload = {"status": status, "protocol": protocol.PROTOCOL_VERSION, "load": self.load()}
        if status != "ok":
            code, message = (("shutting_down", "the server is shutting down") if service.draining else
                             ("loading", "the server is loading its models"))
            payload.update(protocol.error_body(code, message, None, incoming.request_id))
            return json_reply(payload, status=503, headers={"Retry-After": "5"})
        return json_reply(payload)

    async def scrape(self, incoming: Incoming) -> Reply:
        """`GET /metrics`: this process's metrics in Prometheus' text format (behind the token like the rest)."""
        data, content_type = self.service.metrics.render()
        return Reply(200, {"Cache-Control": "no-store"}, data, content_type)

    async def capabilities(self, incoming: Incoming) -> Reply:
        return json_reply(self.describe())

    async def progress(self, incoming: Incoming, progress_id: str) -> Reply:
        """`GET /v1/encode/{id}/progress`: the phases of the open encode request that sent this progress id."""
        if not tracking.is_id(progress_id):
            raise ProtocolError(400, "bad_request", "a progress id is 32 lowercase hex digits", "progress_id")
        tracker = self.trackers.get(progress_id)
        if tracker is None:
            raise ProtocolError(404, "not_found", "no open encode request has this progress id (not arrived yet, "
                                                  "or already answered)", "progress_id")
        position = self.service.queue_position(tracker.job) if isinstance(tracker.job, Job) else None
        return json_reply(tracker.answer(progress_id, position), headers={"Cache-Control": "no-store"})

    def _tracker(self, incoming: Incoming) -> tuple[str | None, tracking.Tracker | None]:
        """The request's progress tracker, registered under the id its `X-H3-Progress-Id` header names (if any)."""
        progress_id = incoming.headers.get(tracking.HEADER)
        if progress_id is None or not self.service.config.track_progress:
            return None, None
        if not tracking.is_id(progress_id):
            raise ProtocolError(400, "bad_request", f"{tracking.HEADER} must be 32 lowercase hex digits (128 "
                                                    "random bits)", tracking.HEADER)
        if progress_id in self.trackers:
            raise ProtocolError(400, "bad_request", f"{tracking.HEADER} is already used by an open request; pick "
                                                    "a new random id for every request", tracking.HEADER)
        tracker = self.trackers[progress_id] = tracking.Tracker()
        tracker.own.enter("receiving")
        return progress_id, tracker

    # --- encode ---------------------------------------------------------------------------------

    async def encode(self, incoming: Incoming) -> Reply:
        progress_id, tracker = self._tracker(incoming)
        try:
            return await self._encode(incoming, tracker)
        finally:
            if progress_id is not None:
                self.trackers.pop(progress_id, None)

    async def _encode(self, incoming: Incoming, tracker: tracking.Tracker | None) -> Reply:
        service, rid = self.service, incoming.request_id
        declared = body.declared_length(incoming.headers, service.limits)
        client = service.client_key(incoming.remote, incoming.headers.get("X-Forwarded-For"))
        async with service.admit(declared, client=client) as slot:
            try:
                async with asyncio.timeout(service.config.upload_timeout_s):
                    spec, raw, parts = await body.read_body(incoming.headers, incoming.content, service, slot,
                                                            passthrough=incoming.body_errors)
            except (*body.BODY_ERRORS, *incoming.body_errors) as error:  # e.g. corrupt gzip (Content-Encoding)
                first_line = (str(error).splitlines() or [""])[0][:200]
                raise ProtocolError(400, "bad_encoding", f"the request body could not be decoded: {first_line}",
                                    "Content-Encoding") from None
            except TimeoutError:
                return error_reply(408, "upload_timeout", f"the request body did not arrive within "
                                   f"upload_timeout_s={service.config.upload_timeout_s:g}", "body", rid)
            received = service.clock.monotonic()  # the deadline counts from here (on the scheduling clock)
            incoming.task = spec.resolved_task
            service.metrics.observe_phase("receive", received - slot.started)
            if spec.model is not None and spec.model != service.fingerprint:
                return error_reply(409, "model_mismatch", f"the request expects model {spec.model!r}; this server "
                                                          f"has {service.fingerprint!r}", "model", rid)
            digests = {name: part.sha256 for name, part in parts.items()}
            streamed = protocol.wants_streamed(incoming.headers.get(protocol.H_ACCEPT_FORMAT))
            key = request_schema.cache_key(spec, digests, service.fingerprint)
            hit = service.cache.get(key)
            if hit is not None:
                service.counters["cache_hits"] += 1
                if tracker is not None:
                    tracker.cache = "hit"
                    tracker.own.enter("sending")
                return conditioning_reply(hit, service, rid, "hit", 0.0, 0.0, streamed)
            seconds = spec.deadline_s or service.config.default_deadline_s
            reply = await self.compute(key, spec, raw, parts, received + seconds, seconds, rid, incoming.gone,
                                       tracker, client=client, streamed=streamed)
            if reply.status == 200 and reply.cache_state() == "miss":  # one count per computed answer, any engine
                service.metrics.observe_components(reply.headers.get(protocol.H_CACHE_COMPONENTS))
            if tracker is not None and reply.status == 200:
                tracker.own.enter("sending")
            return reply

    async def compute(self, key: str, spec: request_schema.RequestSpec, raw: bytes, parts: dict[str, Part],
                      deadline: float, seconds: float, rid: str, gone: Callable[[], bool] = lambda: False,
                      tracker: tracking.Tracker | None = None, client: str = "", streamed: bool = False) -> Reply:
        """The conditioning for a cache miss, from this process's queue and model thread, as a `Reply`.

        `deadline` is an instant on `service.clock` (clock.py); `seconds` the deadline the request asked for (for
        messages); `client` the client key (`EncoderService.client_key`: whose turn in the fair queue; the Ray
        ingress forwards it to the replica); `streamed`: answer in wire form 3 (`conditioning_reply`).
        """
        service = self.service
        try:
            job, joined = service.submit(key, spec, parts, client=client, seal=not streamed)
        except QueueFull as full:
            return error_reply(429, "queue_full", f"the encoder queue is full ({service.config.queue_size} "
                                                  f"requests); retry after {full.retry_after} s", None, rid,
                               {"Retry-After": str(full.retry_after)})
        del parts
        if tracker is not None:
            tracker.job, tracker.cache = job, "joined" if joined else "miss"
        job.waiters += 1
        try:
            outcome = await _wait(job, deadline, gone, service.clock)
        except asyncio.CancelledError:  # the engine cancels the handler when the client disconnects
            service.release(job)
            service.counters["client_gone"] += 1
            raise
        if outcome == "gone":
            service.release(job)
            service.counters["client_gone"] += 1
            log.info("request %s: client disconnected; work abandoned", rid)
            return Reply(499, {}, reason="Client Closed Request")  # nobody reads it
        if outcome == "deadline":
            service.release(job)
            service.counters["deadline"] += 1
            return deadline_reply(seconds, rid)
        job.waiters -= 1
        error = job.future.exception()
        if error is not None:
            return job_error_reply(error, rid, service)
        queue_s = (job.started or job.finished) - job.enqueued
        encode_s = job.finished - (job.started or job.finished)
        reply = conditioning_reply(job.future.result(), service, rid, "joined" if joined else "miss", queue_s,
                                   encode_s, streamed)
        if job.components.outcomes:  # which encoder parts came from the component cache (docs/PROTOCOL.md)
            reply.headers[protocol.H_CACHE_COMPONENTS] = job.components.header()
        if not joined:  # one report per job, as the service's own metrics count it
            reply.phases = tuple(metrics.job_phases(job))
        return reply


class _NoRoute(Exception):
    """404 / 405 from routing."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.headers = status, code, dict(headers or {})


async def _wait(job: Job, deadline: float, gone: Callable[[], bool], clock: Clock) -> str:
    """'done', 'gone' (client disconnected) or 'deadline' (`deadline` passed on `clock`); polls the connection
    every 100 ms of real time."""
    while True:
        remaining = deadline - clock.monotonic()
        if remaining <= 0:
            return "deadline"
        done, _ = await asyncio.wait({job.future}, timeout=min(0.1, remaining))
        if done:
            return "done"
        if gone():
            return "gone"


def deadline_reply(seconds: float, rid: str) -> Reply:
    return error_reply(504, "deadline_exceeded", f"not finished within the request deadline of {seconds:g} s "
                                                 f"(queue wait + decode + encode); the work was abandoned",
                       "deadline_s", rid)


def job_error_reply(error: BaseException, rid: str, service: EncoderService) -> Reply:
    mapped = protocol.error_from_exception(error)
    if mapped is not None:
        service.counters[f"status_{mapped.status}"] += 1
        retry = ({"Retry-After": str(service.retry_after())} if mapped.status == 429  # pushed out of the queue
                 else {"Retry-After": "1"} if mapped.status == 503 else {})  # the decoder was stopped: retry
        return json_reply(mapped.body(rid), status=mapped.status, headers={protocol.H_REQUEST_ID: rid, **retry})
    if isinstance(error, (Abandoned, Cancelled)):
        return error_reply(503, "abandoned", "the work was abandoned", None, rid, {"Retry-After": "1"})
    log.error("request %s: encode failed: %s: %s (traceback logged with the job)", rid, type(error).__name__,
              str(error)[:200])
    service.counters["status_500"] += 1
    return error_reply(500, "internal_error", f"the encoder failed on this request: {type(error).__name__} "
                                              f"(request id {rid}; see the server log)", None, rid)
