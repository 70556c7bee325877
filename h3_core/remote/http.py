"""HTTP in front of the encoder service (aiohttp): middleware, body reading with caps, handlers, `create_app`.

    handler --(auth, JSON checks, parts read with caps, cache lookup)--> service queue --> one model thread
            <---------------- safetensors bytes, or a JSON error naming the constraint ------------------

Every request body is read through its `Admission`: bytes are counted as they arrive (per request, per client,
server-wide) and an upload slower than the minimum rate is dropped with 408.
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
from functools import partial
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .. import __version__, rules
from ..progress import Cancelled
from . import ingest, protocol, tracking
from .connections import AcceptErrorLimiter, ConnectionReaper  # noqa: F401 - re-exported for server.py
from .ingest import Part
from .protocol import Limits, ProtocolError
from .sending import EncodedPayload
from .service import Admission, EncoderService, Job, QueueFull, ServerConfig, _Abandoned

if TYPE_CHECKING:
    from ..contract.wire import Encoded

log = logging.getLogger("h3_core.remote.server")

SERVICE_KEY = web.AppKey("h3_service", EncoderService)
TRACKERS_KEY = web.AppKey("h3_trackers", dict)  # progress id -> tracking.Tracker, for open encode requests
REQUEST_ID_KEY = web.RequestKey("h3_request_id", str) if hasattr(web, "RequestKey") else "h3_request_id"


def _json(body: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    out = {protocol.H_PROTOCOL: str(protocol.PROTOCOL_VERSION), **(headers or {})}
    return web.json_response(body, status=status, headers=out, dumps=lambda o: json.dumps(o, ensure_ascii=True))


def _error(status: int, code: str, message: str, field: str | None = None, request_id: str | None = None,
           headers: dict | None = None) -> web.Response:
    return _json(protocol.error_body(code, message, field, request_id), status=status, headers=headers)


def _request_id(request: web.Request) -> str:
    rid = request.get(REQUEST_ID_KEY)
    if rid is None:
        rid = request[REQUEST_ID_KEY] = secrets.token_hex(8)
    return rid


def _authorized(request: web.Request, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, supplied = header.partition(" ")
    if scheme.lower() != "bearer":
        supplied = ""
    # Compare fixed-length digests: constant time in the token's content and length.
    expected = hashlib.sha256(token.encode("utf-8")).digest()
    given = hashlib.sha256(supplied.strip().encode("utf-8", "surrogateescape")).digest()
    return hmac.compare_digest(expected, given) and bool(supplied)


@web.middleware
async def _errors_and_auth(request: web.Request, handler):
    service: EncoderService = request.app[SERVICE_KEY]
    rid = _request_id(request)
    headers = {protocol.H_REQUEST_ID: rid}
    try:
        if service.config.token is not None and request.path != protocol.HEALTH_PATH:
            if not _authorized(request, service.config.token):
                service.counters["unauthorized"] += 1
                return _error(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer <token>)",
                              "Authorization", rid, {**headers, "WWW-Authenticate": 'Bearer realm="h3-encoder"'})
        response = await handler(request)
    except ProtocolError as error:
        service.counters[f"status_{error.status}"] += 1
        if error.status in (429, 503):
            headers["Retry-After"] = str(service.retry_after() if error.status == 429 else 5)
        return _json(error.body(rid), status=error.status, headers=headers)
    except web.HTTPException as error:  # aiohttp's own 404 / 405 / 413, as JSON
        if error.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(error.status, "http_error")
        message = {404: f"no such endpoint {request.path[:100]!r}; see {protocol.CAPABILITIES_PATH}",
                   405: f"{request.method} is not allowed on {request.path[:100]!r}"}.get(error.status, error.reason)
        extra = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else {}
        return _error(error.status, code, message, None, rid, {**headers, **extra})
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:  # noqa: BLE001 - a bug must not kill the server; the client gets a JSON 500
        log.exception("request %s failed", rid)
        service.counters["status_500"] += 1
        return _error(500, "internal_error", f"internal server error (request id {rid}; see the server log)",
                      None, rid, headers)
    response.headers.setdefault(protocol.H_REQUEST_ID, rid)
    response.headers.setdefault(protocol.H_PROTOCOL, str(protocol.PROTOCOL_VERSION))
    return response


@web.middleware
async def _request_log(request: web.Request, handler):
    """One line per request (never the prompt or the token): id, method, path, status, cache, seconds, bytes."""
    started = time.monotonic()
    response = await handler(request)
    if "progress_id" in request.match_info:  # several polls a second per request: debug only, id not logged
        log.debug("%s GET %s -> %d", _request_id(request), tracking.PATH_TEMPLATE, response.status)
    elif request.path != protocol.HEALTH_PATH:
        log.info("%s %s %s -> %d%s %.3f s %s B", _request_id(request), request.method, request.path[:100],
                 response.status, f" cache={response.headers[protocol.H_CACHE]}" if protocol.H_CACHE in response.headers
                 else "", time.monotonic() - started, response.content_length or 0)
    return response


async def handle_health(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    body = {"status": "draining" if service.draining else "ok", "protocol": protocol.PROTOCOL_VERSION,
            "load": service.load()}
    if service.draining:
        body.update(protocol.error_body("shutting_down", "the server is shutting down", None, _request_id(request)))
        return _json(body, status=503, headers={"Retry-After": "5"})
    return _json(body)


def capabilities(service: EncoderService) -> dict[str, Any]:
    from ..contract import FORMAT_ID, WIRE_VERSION

    return {
        "protocol": {"name": protocol.PROTOCOL_NAME, "version": protocol.PROTOCOL_VERSION,
                     "versions": [protocol.PROTOCOL_VERSION]},
        "server": {"name": "h3_core", "version": __version__},
        "model": {
            "fingerprint": service.fingerprint,
            "layout": service.model_info.get("layout"),
            "tiny": bool(service.model_info.get("tiny", False)),
            "dtype": service.model_info.get("dtype", "float32"),
            "device": service.model_info.get("device", "cpu"),
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


async def handle_capabilities(request: web.Request) -> web.Response:
    return _json(capabilities(request.app[SERVICE_KEY]))


def _declared_length(request: web.Request, limits: Limits) -> int:
    raw = request.headers.get("Content-Length")
    if raw is None:
        return limits.max_body_bytes  # chunked: reserve the cap
    if not re.fullmatch(r"[0-9]{1,20}", raw):
        raise ProtocolError(400, "bad_request", "Content-Length must be a non-negative integer", "Content-Length")
    length = int(raw)
    if length > limits.max_body_bytes:
        raise ProtocolError(413, "too_large", f"the request body declares {length} bytes, over the limit of "
                                              f"max_body_bytes={limits.max_body_bytes}", "Content-Length")
    return length


async def _read_part_bytes(read, cap: int, where: str, slot: Admission) -> bytes:
    """All of one part (`read()` returns its next chunk, b"" at the end), counted into the body budget."""
    chunks, size = [], 0
    while True:
        chunk = await slot.read(read())
        if not chunk:
            break
        size += len(chunk)
        slot.budget.take(len(chunk))
        if size > cap:
            limit = "max_json_bytes" if where == protocol.REQUEST_PART else f"{cap} bytes"
            raise ProtocolError(413, "too_large", f"{where}: over the limit of {limit}={cap}"
                                if where == protocol.REQUEST_PART else f"{where}: over the limit of {cap} bytes", where)
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_spec(raw: bytes, service: EncoderService) -> protocol.RequestSpec:
    """The JSON request, validated; refused here (before any media is read) if an encoder it needs is missing."""
    limits = service.limits
    spec = protocol.parse_request(protocol.parse_request_json(raw, limits), limits, service.config.max_deadline_s)
    service.check_components(spec)
    return spec


async def _read_body(request: web.Request, service: EncoderService, slot: Admission
                     ) -> tuple[protocol.RequestSpec, dict[str, Part]]:
    limits = service.limits
    content_type = request.content_type
    if content_type == "application/json":
        raw = await _read_part_bytes(partial(request.content.read, 64 * 1024), limits.max_json_bytes,
                                     protocol.REQUEST_PART, slot)
        spec = _parse_spec(raw, service)
        missing = sorted(spec.part_kinds())
        if missing:
            raise ProtocolError(400, "bad_request", f"the request names media parts {missing[:8]} but was sent as "
                                                    "application/json; send multipart/form-data", "body")
        return spec, {}
    if content_type != "multipart/form-data":
        raise ProtocolError(415, "unsupported_media_type",
                            f"POST {protocol.ENCODE_PATH} takes multipart/form-data (a JSON part named "
                            f"{protocol.REQUEST_PART!r} then the media parts) or application/json (no media), got "
                            f"{content_type[:64]!r}", "Content-Type")
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError, KeyError, TypeError) as error:
        raise ProtocolError(400, "bad_multipart", f"malformed multipart body: {str(error)[:200]}", "body") from None
    try:
        first = await slot.read(reader.next())
        if first is None or getattr(first, "name", None) != protocol.REQUEST_PART:
            raise ProtocolError(400, "bad_request", f"the first part must be the JSON request named "
                                                    f"{protocol.REQUEST_PART!r}", "body")
        if isinstance(first, type(reader)):
            raise ProtocolError(400, "bad_multipart", "nested multipart bodies are not accepted", "body")
        declared = (first.headers.get("Content-Type") or "application/json").split(";")[0].strip().lower()
        if declared != "application/json":
            raise ProtocolError(415, "unsupported_media_type",
                                f"the {protocol.REQUEST_PART!r} part must be application/json, got {declared[:64]!r}",
                                protocol.REQUEST_PART)
        raw = await _read_part_bytes(partial(first.read_chunk, 64 * 1024), limits.max_json_bytes,
                                     protocol.REQUEST_PART, slot)
        spec = _parse_spec(raw, service)
        wanted = spec.part_kinds()
        parts: dict[str, Part] = {}
        count = 1
        while True:
            item = await slot.read(reader.next())
            if item is None:
                break
            count += 1
            if count > limits.max_parts:
                raise ProtocolError(413, "too_large", f"more than max_parts={limits.max_parts} parts", "body")
            if isinstance(item, type(reader)):
                raise ProtocolError(400, "bad_multipart", "nested multipart bodies are not accepted", "body")
            name = item.name
            if name is None or name not in wanted:
                shown = (name or "(unnamed)")[:80]
                raise ProtocolError(400, "unexpected_part", f"part {shown!r} is not named by the request "
                                                            f"(expected {sorted(wanted)[:16]})", "body")
            if name in parts:
                raise ProtocolError(400, "duplicate_part", f"part {name!r} appears twice", name)
            kind, where = wanted[name]
            ingest.check_filename(item.filename, where)
            content = item.headers.get("Content-Type")
            ingest.content_type_family(content, kind, where)
            data = await _read_part_bytes(partial(item.read_chunk, 256 * 1024), ingest.max_part_bytes(kind, limits),
                                          where, slot)
            if len(data) > 1 << 20:  # hashing hundreds of MB would stall the event loop; hashlib drops the GIL
                digest = await asyncio.to_thread(_sha256, data)
            else:
                digest = _sha256(data)
            part = Part(name=name, content_type=content or "", data=data, sha256=digest)
            ingest.check_part(part, kind, where, limits)
            parts[name] = part
    except ProtocolError:
        raise
    except (asyncio.CancelledError, ConnectionError, asyncio.TimeoutError, HttpProcessingError,
            web.RequestPayloadError):
        raise
    except Exception as error:  # noqa: BLE001 - aiohttp raises assorted errors on hostile multipart framing
        raise ProtocolError(400, "bad_multipart", f"malformed multipart body ({type(error).__name__}: "
                                                  f"{str(error)[:200]})", "body") from None
    missing = sorted(set(wanted) - set(parts))
    if missing:
        raise ProtocolError(400, "missing_part", f"the request names part(s) {missing} that the body does not "
                                                 "contain", wanted[missing[0]][1])
    return spec, parts


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def handle_progress(request: web.Request) -> web.Response:
    """`GET /v1/encode/{id}/progress`: the phases of the open encode request that sent this progress id."""
    progress_id = request.match_info["progress_id"]
    if not tracking.is_id(progress_id):
        raise ProtocolError(400, "bad_request", "a progress id is 32 lowercase hex digits", "progress_id")
    tracker = request.app[TRACKERS_KEY].get(progress_id)
    if tracker is None:
        raise ProtocolError(404, "not_found", "no open encode request has this progress id (not arrived yet, or "
                                              "already answered)", "progress_id")
    service = request.app[SERVICE_KEY]
    position = service.queue_position(tracker.job) if tracker.job is not None else None
    return _json(tracker.answer(progress_id, position), headers={"Cache-Control": "no-store"})


def _tracker(request: web.Request, service: EncoderService) -> tuple[str | None, tracking.Tracker | None]:
    """The request's progress tracker, registered under the id its `X-H3-Progress-Id` header names (if any)."""
    progress_id = request.headers.get(tracking.HEADER)
    if progress_id is None or not service.config.track_progress:
        return None, None
    if not tracking.is_id(progress_id):
        raise ProtocolError(400, "bad_request", f"{tracking.HEADER} must be 32 lowercase hex digits (128 random "
                                                "bits)", tracking.HEADER)
    trackers = request.app[TRACKERS_KEY]
    if progress_id in trackers:
        raise ProtocolError(400, "bad_request", f"{tracking.HEADER} is already used by an open request; pick a new "
                                                "random id for every request", tracking.HEADER)
    tracker = trackers[progress_id] = tracking.Tracker()
    tracker.own.enter("receiving")
    return progress_id, tracker


async def handle_encode(request: web.Request) -> web.StreamResponse:
    service: EncoderService = request.app[SERVICE_KEY]
    progress_id, tracker = _tracker(request, service)
    try:
        return await _encode(request, service, tracker)
    finally:
        if progress_id is not None:
            request.app[TRACKERS_KEY].pop(progress_id, None)


async def _encode(request: web.Request, service: EncoderService, tracker: tracking.Tracker | None
                  ) -> web.StreamResponse:
    rid = _request_id(request)
    declared = _declared_length(request, service.limits)
    async with service.admit(declared, client=request.remote or "") as slot:
        try:
            async with asyncio.timeout(service.config.upload_timeout_s):
                spec, parts = await _read_body(request, service, slot)
        except (HttpProcessingError, web.RequestPayloadError) as error:  # e.g. corrupt gzip (Content-Encoding)
            first_line = (str(error).splitlines() or [""])[0][:200]
            raise ProtocolError(400, "bad_encoding", f"the request body could not be decoded: {first_line}",
                                "Content-Encoding") from None
        except TimeoutError:
            return _error(408, "upload_timeout", f"the request body did not arrive within "
                                                 f"upload_timeout_s={service.config.upload_timeout_s:g}", "body", rid)
        received = time.monotonic()
        if spec.model is not None and spec.model != service.fingerprint:
            return _error(409, "model_mismatch", f"the request expects model {spec.model!r}; this server has "
                                                 f"{service.fingerprint!r}", "model", rid)
        digests = {name: part.sha256 for name, part in parts.items()}
        key = protocol.cache_key(spec, digests, service.fingerprint)
        hit = service.cache.get(key)
        if hit is not None:
            service.counters["cache_hits"] += 1
            if tracker is not None:
                tracker.cache = "hit"
                tracker.own.enter("sending")
            return _conditioning(hit, service, rid, "hit", 0.0, 0.0)
        try:
            job, joined = service.submit(key, spec, parts)
        except QueueFull as full:
            return _error(429, "queue_full", f"the encoder queue is full ({service.config.queue_size} requests); "
                                             f"retry after {full.retry_after} s", None, rid,
                          {"Retry-After": str(full.retry_after)})
        del parts
        if tracker is not None:
            tracker.job, tracker.cache = job, "joined" if joined else "miss"
        seconds = spec.deadline_s or service.config.default_deadline_s
        response = await _answer(request, service, job, joined, received, seconds, rid)
        if tracker is not None and response.status == 200:
            tracker.own.enter("sending")
        return response


async def _answer(request: web.Request, service: EncoderService, job: Job, joined: bool, received: float,
                  seconds: float, rid: str) -> web.StreamResponse:
    """Wait for the job (or the deadline, or the client leaving) and answer."""
    job.waiters += 1
    try:
        outcome = await _wait(request, job, received + seconds)
    except asyncio.CancelledError:  # aiohttp cancels the handler when the client disconnects
        service.release(job)
        service.counters["client_gone"] += 1
        raise
    if outcome == "gone":
        service.release(job)
        service.counters["client_gone"] += 1
        log.info("request %s: client disconnected; work abandoned", rid)
        return web.Response(status=499, reason="Client Closed Request")  # nobody reads it
    if outcome == "deadline":
        service.release(job)
        service.counters["deadline"] += 1
        return _error(504, "deadline_exceeded", f"not finished within the request deadline of {seconds:g} s "
                                                f"(queue wait + decode + encode); the work was abandoned",
                      "deadline_s", rid)
    job.waiters -= 1
    error = job.future.exception()
    if error is not None:
        return _job_error(error, rid, service)
    queue_s = (job.started or job.finished) - job.enqueued
    encode_s = job.finished - (job.started or job.finished)
    return _conditioning(job.future.result(), service, rid, "joined" if joined else "miss", queue_s, encode_s)


async def _wait(request: web.Request, job: Job, deadline: float) -> str:
    """'done', 'gone' (client disconnected) or 'deadline'; polls the connection every 100 ms."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "deadline"
        done, _ = await asyncio.wait({job.future}, timeout=min(0.1, remaining))
        if done:
            return "done"
        if _gone(request):
            return "gone"


def _conditioning(item: tuple[Encoded, str], service: EncoderService, rid: str, cache: str, queue_s: float,
                  encode_s: float) -> web.Response:
    encoded, checksum = item
    from ..contract import FORMAT_ID, WIRE_VERSION

    return web.Response(
        body=EncodedPayload(encoded, protocol.CONDITIONING_CONTENT_TYPE),  # header + tensor storages, unjoined
        headers={
            protocol.H_PROTOCOL: str(protocol.PROTOCOL_VERSION),
            protocol.H_MODEL: service.fingerprint,
            protocol.H_CACHE: cache,
            protocol.H_CHECKSUM: checksum,
            protocol.H_FORMAT: f"{FORMAT_ID}/{WIRE_VERSION}",
            protocol.H_REQUEST_ID: rid,
            protocol.H_QUEUE_S: f"{queue_s:.4f}",
            protocol.H_ENCODE_S: f"{encode_s:.4f}",
        },
    )


def _job_error(error: BaseException, rid: str, service: EncoderService) -> web.Response:
    mapped = protocol.error_from_exception(error)
    if mapped is not None:
        service.counters[f"status_{mapped.status}"] += 1
        return _json(mapped.body(rid), status=mapped.status, headers={protocol.H_REQUEST_ID: rid})
    if isinstance(error, (_Abandoned, Cancelled)):
        return _error(503, "abandoned", "the work was abandoned", None, rid, {"Retry-After": "1"})
    log.error("request %s: encode failed: %s: %s (traceback logged with the job)", rid, type(error).__name__,
              str(error)[:200])
    service.counters["status_500"] += 1
    return _error(500, "internal_error", f"the encoder failed on this request: {type(error).__name__} "
                                         f"(request id {rid}; see the server log)", None, rid)


def create_app(stage: Any, config: ServerConfig = ServerConfig(), model_info: dict | None = None) -> web.Application:
    """The aiohttp application around a loaded `EncoderStage` (or anything with .encode/.fingerprint).

    Usable in-process (tests, embedding) through `ServerThread`, or by `main` for the CLI.
    """
    # aiohttp's own body cap applies to request.read()/post(); we stream multipart with our own caps.
    app = web.Application(middlewares=[_request_log, _errors_and_auth],
                          client_max_size=config.limits.max_json_bytes + 1)
    service = EncoderService(stage, config, model_info)
    app[SERVICE_KEY] = service
    app[TRACKERS_KEY] = {}

    async def on_startup(app):
        await service.start()

    async def on_cleanup(app):
        await service.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get(protocol.HEALTH_PATH, handle_health)
    app.router.add_get(protocol.CAPABILITIES_PATH, handle_capabilities)
    app.router.add_post(protocol.ENCODE_PATH, handle_encode)
    if config.track_progress:
        app.router.add_get(tracking.ROUTE, handle_progress)
    return app

