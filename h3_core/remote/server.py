"""The H3 encoder server: `python -m h3_core serve --models DIR [--host 127.0.0.1] [--port 8190]`.

An aiohttp application in front of ONE `EncoderStage`:

    handler --(auth, JSON checks, parts read with caps, cache lookup)--> bounded queue --> one model thread
            <---------------- safetensors bytes, or a JSON error naming the constraint ------------------

* The model (and media decoding, which allocates the big arrays) runs in a single worker thread; requests wait
  in a bounded queue in front of it; a full queue answers 429 with Retry-After.
* Every request has a deadline (queue wait + decode + encode); past it the request gets 504 and its work is
  abandoned at the next checkpoint. A client that disconnects has its work abandoned the same way.
* Identical requests (same JSON numbers, prompt, media bytes and model) are answered from a content-addressed
  LRU cache; identical requests in flight at the same time share one computation.
* SIGTERM / SIGINT drain: the listener closes, new requests get 503, accepted requests finish, then the process
  exits.
* Binds 127.0.0.1 by default; refuses a non-loopback address unless a bearer token is set in the environment
  (H3_ENCODER_TOKEN, or the variable named by --token-env); tokens are compared in constant time. TLS is left
  to a reverse proxy (docs/DEPLOY.md).

No pickle, no eval, nothing written to disk: part and file names are never used as paths.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from .. import __version__
from ..progress import Cancelled
from . import protocol
from .protocol import Limits, Part, ProtocolError

log = logging.getLogger("h3_core.remote.server")

MIN_TOKEN_CHARS = 16


class ServerConfigError(ValueError):
    """The server was asked to start in an unsafe or impossible configuration."""


# --------------------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class ServerConfig:
    limits: Limits = field(default_factory=Limits)
    queue_size: int = 32  # requests waiting for, or in, the model thread
    default_deadline_s: float = 300.0
    max_deadline_s: float = 1800.0
    upload_timeout_s: float = 300.0  # to receive a whole request body
    max_buffered_bytes: int = 2048 * protocol.MiB  # request bodies held in memory at once (declared or capped)
    cache_bytes: int = 512 * protocol.MiB
    cache_entries: int = 4096
    token: str | None = None
    threads: int | None = None  # torch threads in the model thread (None: the creating thread's count)
    drain_timeout_s: float | None = None  # graceful shutdown; None: max_deadline_s + 5

    def __post_init__(self):
        if self.queue_size < 1:
            raise ServerConfigError(f"queue_size must be at least 1, got {self.queue_size}")
        if not 0 < self.default_deadline_s <= self.max_deadline_s:
            raise ServerConfigError("default_deadline_s must be positive and at most max_deadline_s")
        if self.token is not None:
            check_token(self.token)


def check_token(token: str) -> None:
    if len(token) < MIN_TOKEN_CHARS or token != token.strip() or not token.isprintable():
        raise ServerConfigError(
            f"the bearer token must be at least {MIN_TOKEN_CHARS} printable characters without surrounding "
            "whitespace (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )


def is_loopback(host: str) -> bool:
    """Only IP literals in 127.0.0.0/8 or ::1, and the name `localhost`, count as loopback (no DNS lookups)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, token_env: str = protocol.DEFAULT_TOKEN_ENV) -> None:
    """Refuse to listen beyond loopback without a bearer token."""
    if not is_loopback(host) and not token:
        raise ServerConfigError(
            f"refusing to bind {host!r} without a bearer token: anything that can reach this address could use "
            f"the encoder. Set the token in the environment variable {token_env} (never on the command line) "
            "and put a TLS reverse proxy in front (docs/DEPLOY.md), or bind 127.0.0.1."
        )
    if token is not None:
        check_token(token)


# --------------------------------------------------------------------------------------------------------------
# cache


class ConditioningCache:
    """LRU of conditioning bytes by content address, bounded in bytes and entries. Event-loop thread only."""

    def __init__(self, max_bytes: int, max_entries: int):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._items: collections.OrderedDict[str, tuple[bytes, str]] = collections.OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: str) -> tuple[bytes, str] | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item

    def put(self, key: str, data: bytes, digest: str) -> None:
        if self.max_bytes <= 0 or len(data) > self.max_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= len(old[0])
        self._items[key] = (data, digest)
        self.bytes += len(data)
        while self._items and (self.bytes > self.max_bytes or len(self._items) > self.max_entries):
            _, (evicted, _) = self._items.popitem(last=False)
            self.bytes -= len(evicted)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._items), "bytes": self.bytes, "hits": self.hits, "misses": self.misses}


# --------------------------------------------------------------------------------------------------------------
# jobs


@dataclass(eq=False)
class Job:
    key: str
    spec: protocol.RequestSpec
    parts: dict[str, Part] | None
    future: asyncio.Future
    cancel: threading.Event = field(default_factory=threading.Event)
    waiters: int = 0
    state: str = "queued"  # queued | running | done
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None


class _Abandoned(Exception):
    """The job lost all its waiters (disconnect or deadline) before it ran."""


class EncoderService:
    """The server's state: stage, queue, model thread, cache, counters. Create inside a running loop's app."""

    def __init__(self, stage: Any, config: ServerConfig = ServerConfig(), model_info: dict | None = None):
        self.stage = stage
        self.config = config
        self.model_info = dict(model_info or {})
        self.limits = config.limits
        self.fingerprint = str(stage.fingerprint)
        self.components = tuple(getattr(stage, "components", ("text", "video", "audio")))
        self.threads = config.threads
        if self.threads is None:
            import torch

            self.threads = torch.get_num_threads()
        self.cache = ConditioningCache(config.cache_bytes, config.cache_entries)
        self._pending: collections.deque[Job] = collections.deque()
        self._inflight: dict[str, Job] = {}
        self._running: Job | None = None
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="h3-model")
        self.draining = False
        self.active_requests = 0
        self._idle: asyncio.Event | None = None
        self.buffered_bytes = 0
        self.job_seconds = 1.0  # moving average of model-thread time per job, for Retry-After
        self.counters = collections.Counter()
        self.started_at = time.time()

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._worker = asyncio.get_running_loop().create_task(self._work_loop(), name="h3-model-queue")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        for job in list(self._pending):
            job.cancel.set()
            if not job.future.done():
                job.future.set_exception(ProtocolError(503, "shutting_down", "the server is shutting down"))
        self._pending.clear()
        if self._running is not None:
            self._running.cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests; wait until every accepted request has been answered. True if all finished."""
        self.draining = True
        timeout = self.config.drain_timeout_s if timeout is None else timeout
        if timeout is None:
            timeout = self.config.max_deadline_s + 5
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # --- load ------------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return int(self._running is not None)

    def load(self) -> dict[str, Any]:
        return {
            "queued": self.queued,
            "running": self.running,
            "capacity": self.config.queue_size,
            "active_requests": self.active_requests,
        }

    def retry_after(self) -> int:
        backlog = self.queued + self.running
        return int(min(120, max(1, math.ceil(self.job_seconds * backlog))))

    def _enter(self) -> None:
        self.active_requests += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self._idle.set()

    # --- the model thread ------------------------------------------------------------------------

    async def _work_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            job = self._pending.popleft()
            if job.cancel.is_set():
                self._finish(job, exception=_Abandoned())
                continue
            job.state, job.started = "running", time.monotonic()
            self._running = job
            try:
                data = await loop.run_in_executor(self._executor, self._run_job, job)
            except asyncio.CancelledError:
                job.cancel.set()
                raise
            except BaseException as error:  # noqa: BLE001 - every failure goes to the job's waiters
                self._finish(job, exception=error)
            else:
                self._finish(job, result=data)
            finally:
                self._running = None
                elapsed = time.monotonic() - job.started
                self.job_seconds = 0.8 * self.job_seconds + 0.2 * elapsed

    def _run_job(self, job: Job) -> tuple[bytes, str]:
        """Runs in the model thread: decode the media, encode, serialise."""
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        parts, job.parts = job.parts or {}, None  # drop the compressed bytes as soon as they are decoded
        request = protocol.build_request(job.spec, parts, self.limits, cancel=job.cancel)
        del parts
        conditioning = self.stage.encode(request, cancel=job.cancel)
        data = conditioning.to_bytes()
        return data, hashlib.sha256(data).hexdigest()

    def _finish(self, job: Job, result: tuple[bytes, str] | None = None, exception: BaseException | None = None):
        job.state, job.finished = "done", time.monotonic()
        self._forget(job)
        if result is not None:
            self.cache.put(job.key, *result)
            self.counters["computed"] += 1
        if not job.future.done():
            if exception is not None:
                job.future.set_exception(exception)
                job.future.exception()  # marked as retrieved: abandoned jobs have no reader
            else:
                job.future.set_result(result)

    def _forget(self, job: Job) -> None:
        """Stop offering `job` to identical requests (a newer job for the same key may have replaced it)."""
        if self._inflight.get(job.key) is job:
            del self._inflight[job.key]

    def submit(self, key: str, spec: protocol.RequestSpec, parts: dict[str, Part]) -> tuple[Job, bool]:
        """The job for `key`: joined if one is in flight, else queued. Raises 429 when the queue is full."""
        job = self._inflight.get(key)
        if job is not None and not job.cancel.is_set():
            return job, True
        if self.queued + self.running >= self.config.queue_size:
            self.counters["rejected_queue_full"] += 1
            raise QueueFull(self.retry_after())
        job = Job(key=key, spec=spec, parts=parts, future=asyncio.get_running_loop().create_future())
        self._inflight[key] = job
        self._pending.append(job)
        self._wakeup.set()
        return job, False

    def release(self, job: Job) -> None:
        """A waiter gave up (disconnect or deadline); the last one cancels the job."""
        job.waiters -= 1
        if job.waiters > 0 or job.state == "done":
            return
        job.cancel.set()
        self._forget(job)
        if job.state == "queued":
            try:
                self._pending.remove(job)
            except ValueError:
                pass
            self._finish(job, exception=_Abandoned())
        self.counters["abandoned"] += 1


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__("queue full")
        self.retry_after = retry_after


# --------------------------------------------------------------------------------------------------------------
# HTTP


SERVICE_KEY = web.AppKey("h3_service", EncoderService)
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
    if request.path != protocol.HEALTH_PATH:
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
    from ..contract import FORMAT_ID, FORMAT_VERSION

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
        "conditioning": {"format": FORMAT_ID, "version": FORMAT_VERSION,
                         "content_type": protocol.CONDITIONING_CONTENT_TYPE},
        "tasks": list(protocol.rules.TASKS),
        "media_types": {kind: protocol.allowed_content_types(kind) for kind in ("image", "video", "audio")},
        "limits": service.limits.to_json(),
        "queue": {"capacity": service.config.queue_size, "workers": 1},
        "deadline_s": {"default": service.config.default_deadline_s, "max": service.config.max_deadline_s},
        "cache": {"enabled": service.config.cache_bytes > 0, "max_bytes": service.config.cache_bytes},
        "auth": {"scheme": "bearer" if service.config.token else None},
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


async def _read_part_bytes(part, cap: int, where: str, budget: list[int], limits: Limits) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = await part.read_chunk(256 * 1024)
        if not chunk:
            break
        size += len(chunk)
        budget[0] += len(chunk)
        if size > cap:
            raise ProtocolError(413, "too_large", f"{where}: over the limit of {cap} bytes", where)
        if budget[0] > limits.max_body_bytes:
            raise ProtocolError(413, "too_large", f"the request body is over the limit of "
                                                  f"max_body_bytes={limits.max_body_bytes}", "body")
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_body(request: web.Request, service: EncoderService) -> tuple[protocol.RequestSpec, dict[str, Part]]:
    limits = service.limits
    content_type = request.content_type
    if content_type == "application/json":
        chunks, size = [], 0
        while True:
            chunk = await request.content.read(64 * 1024)
            if not chunk:
                break
            size += len(chunk)
            if size > limits.max_json_bytes:
                raise ProtocolError(413, "too_large", f"the JSON request is over the limit of max_json_bytes="
                                                      f"{limits.max_json_bytes}", protocol.REQUEST_PART)
            chunks.append(chunk)
        data = b"".join(chunks)
        spec = protocol.parse_request(protocol.parse_request_json(data, limits), limits, service.config.max_deadline_s)
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
    budget = [0]
    try:
        first = await reader.next()
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
        raw = await _read_part_bytes(first, limits.max_json_bytes, protocol.REQUEST_PART, budget, limits)
        spec = protocol.parse_request(protocol.parse_request_json(raw, limits), limits, service.config.max_deadline_s)
        wanted = spec.part_kinds()
        parts: dict[str, Part] = {}
        count = 1
        while True:
            item = await reader.next()
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
            protocol.check_filename(item.filename, where)
            content = item.headers.get("Content-Type")
            protocol.content_type_family(content, kind, where)
            data = await _read_part_bytes(item, protocol.max_part_bytes(kind, limits), where, budget, limits)
            if len(data) > 1 << 20:  # hashing hundreds of MB would stall the event loop; hashlib drops the GIL
                digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
            else:
                digest = hashlib.sha256(data).hexdigest()
            part = Part(name=name, content_type=content or "", data=data, sha256=digest)
            protocol.check_part(part, kind, where, limits)
            parts[name] = part
    except ProtocolError:
        raise
    except (asyncio.CancelledError, ConnectionError, asyncio.TimeoutError):
        raise
    except Exception as error:  # noqa: BLE001 - aiohttp raises assorted errors on hostile multipart framing
        raise ProtocolError(400, "bad_multipart", f"malformed multipart body ({type(error).__name__}: "
                                                  f"{str(error)[:200]})", "body") from None
    missing = sorted(set(wanted) - set(parts))
    if missing:
        raise ProtocolError(400, "missing_part", f"the request names part(s) {missing} that the body does not "
                                                 "contain", wanted[missing[0]][1])
    return spec, parts


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def handle_encode(request: web.Request) -> web.StreamResponse:
    service: EncoderService = request.app[SERVICE_KEY]
    rid = _request_id(request)
    if service.draining:
        return _error(503, "shutting_down", "the server is shutting down; retry on another endpoint", None, rid,
                      {"Retry-After": "5"})
    service._enter()
    reserved = 0
    try:
        declared = _declared_length(request, service.limits)
        if service.buffered_bytes + declared > service.config.max_buffered_bytes:
            service.counters["rejected_buffer_full"] += 1
            return _error(429, "busy", f"too many request bytes in flight (max_buffered_bytes="
                                       f"{service.config.max_buffered_bytes}); retry later", None, rid,
                          {"Retry-After": str(service.retry_after())})
        reserved = declared
        service.buffered_bytes += reserved
        try:
            async with asyncio.timeout(service.config.upload_timeout_s):
                spec, parts = await _read_body(request, service)
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
            return _conditioning(hit, service, rid, "hit", 0.0, 0.0)
        try:
            job, joined = service.submit(key, spec, parts)
        except QueueFull as full:
            return _error(429, "queue_full", f"the encoder queue is full ({service.config.queue_size} requests); "
                                             f"retry after {full.retry_after} s", None, rid,
                          {"Retry-After": str(full.retry_after)})
        del parts
        job.waiters += 1
        deadline = spec.deadline_s or service.config.default_deadline_s
        try:
            outcome = await _wait(request, job, received + deadline)
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
            return _error(504, "deadline_exceeded", f"not finished within the request deadline of {deadline:g} s "
                                                    f"(queue wait + decode + encode); the work was abandoned",
                          "deadline_s", rid)
        job.waiters -= 1
        error = job.future.exception()
        if error is not None:
            return _job_error(error, rid, service)
        queue_s = (job.started or job.finished) - job.enqueued
        encode_s = job.finished - (job.started or job.finished)
        return _conditioning(job.future.result(), service, rid, "joined" if joined else "miss", queue_s, encode_s)
    finally:
        service.buffered_bytes -= reserved
        service._leave()


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


def _conditioning(item: tuple[bytes, str], service: EncoderService, rid: str, cache: str, queue_s: float,
                  encode_s: float) -> web.Response:
    data, digest = item
    from ..contract import FORMAT_ID, FORMAT_VERSION

    return web.Response(
        body=data,
        content_type=protocol.CONDITIONING_CONTENT_TYPE,
        headers={
            protocol.H_PROTOCOL: str(protocol.PROTOCOL_VERSION),
            protocol.H_MODEL: service.fingerprint,
            protocol.H_CACHE: cache,
            protocol.H_SHA256: digest,
            protocol.H_FORMAT: f"{FORMAT_ID}/{FORMAT_VERSION}",
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
    log.error("request %s: encode failed", rid, exc_info=(type(error), error, error.__traceback__))
    service.counters["status_500"] += 1
    return _error(500, "internal_error", f"the encoder failed on this request: {type(error).__name__} "
                                         f"(request id {rid}; see the server log)", None, rid)


class _QuietBadRequests(logging.Filter):
    """aiohttp logs every malformed HTTP message (bad request line, Content-Length, ...) with a traceback at
    ERROR; its parser has already answered 400. Keep one debug line instead, so hostile traffic cannot flood the
    log. Handler errors are logged by this module's own logger and are not affected."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            log.debug("malformed HTTP request refused by the parser: %s", str(exc).splitlines()[0][:200])
            return False
        return True


_aiohttp_server_log = logging.getLogger("aiohttp.server")
if not any(isinstance(f, _QuietBadRequests) for f in _aiohttp_server_log.filters):
    _aiohttp_server_log.addFilter(_QuietBadRequests())


def create_app(stage: Any, config: ServerConfig = ServerConfig(), model_info: dict | None = None) -> web.Application:
    """The aiohttp application around a loaded `EncoderStage` (or anything with .encode/.fingerprint).

    Usable in-process (tests, embedding) through `ServerThread`, or by `main` for the CLI.
    """
    # aiohttp's own body cap applies to request.read()/post(); we stream multipart with our own caps.
    app = web.Application(middlewares=[_request_log, _errors_and_auth],
                          client_max_size=config.limits.max_json_bytes + 1)
    service = EncoderService(stage, config, model_info)
    app[SERVICE_KEY] = service

    async def on_startup(app):
        await service.start()

    async def on_cleanup(app):
        await service.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get(protocol.HEALTH_PATH, handle_health)
    app.router.add_get(protocol.CAPABILITIES_PATH, handle_capabilities)
    app.router.add_post(protocol.ENCODE_PATH, handle_encode)
    return app


# --------------------------------------------------------------------------------------------------------------
# running


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, web.TCPSite, int]:
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                           shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, backlog=128)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, site, bound


async def shutdown(app: web.Application, runner: web.AppRunner, site: web.TCPSite,
                   timeout: float | None = None) -> bool:
    """Graceful stop: close the listener, answer accepted requests (new ones get 503), then clean up."""
    service = app[SERVICE_KEY]
    service.draining = True
    if site._server is not None:  # noqa: SLF001 - stop accepting connections, keep the open ones
        site._server.close()
    finished = await service.drain(timeout)
    await runner.cleanup()
    return finished


class ServerThread:
    """Run the app on its own event loop in a background thread (tests, embedding). Loopback by default.

        with ServerThread(stage, config) as server:
            EncoderClient(server.url).encode(request)
    """

    def __init__(self, stage: Any, config: ServerConfig = ServerConfig(), host: str = "127.0.0.1", port: int = 0,
                 model_info: dict | None = None):
        check_bind(host, config.token)
        self.stage, self.config, self.host, self.port = stage, config, host, port
        self.model_info = model_info
        self.app: web.Application | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._runner = self._site = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def service(self) -> EncoderService:
        return self.app[SERVICE_KEY]

    def start(self) -> "ServerThread":
        def run():
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                self.app = create_app(self.stage, self.config, self.model_info)
                self._runner, self._site, self.port = loop.run_until_complete(
                    start_site(self.app, self.host, self.port))
            except BaseException as error:  # noqa: BLE001
                self._error = error
                self._started.set()
                loop.close()
                return
            self._started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="h3-encoder-server", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn, timeout: float | None = 30):
        """Run `fn()` on the server loop (for inspecting state from tests)."""

        async def wrapper():
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result(timeout)

    def stop(self, drain_timeout: float | None = 30) -> bool:
        if self._loop is None or not self._loop.is_running():
            return True
        future = asyncio.run_coroutine_threadsafe(
            shutdown(self.app, self._runner, self._site, drain_timeout), self._loop)
        finished = future.result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        return finished

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def config_from_args(args, token: str | None) -> ServerConfig:
    limits = Limits()
    if getattr(args, "max_body_mb", None):
        limits = replace(limits, max_body_bytes=int(args.max_body_mb * protocol.MiB))
    kwargs: dict[str, Any] = {"limits": limits, "token": token}
    if getattr(args, "queue_size", None):
        kwargs["queue_size"] = args.queue_size
    if getattr(args, "deadline", None):
        kwargs["default_deadline_s"] = float(args.deadline)
        kwargs["max_deadline_s"] = max(float(args.deadline), ServerConfig.max_deadline_s)
    if getattr(args, "cache_mb", None) is not None:
        kwargs["cache_bytes"] = int(args.cache_mb * protocol.MiB)
    return ServerConfig(**kwargs)


def main(args) -> int:
    """`python -m h3_core serve`: check the bind, load the encoders, serve until SIGTERM/SIGINT, drain, exit."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    token_env = getattr(args, "token_env", None) or protocol.DEFAULT_TOKEN_ENV
    token = os.environ.get(token_env) or None
    host, port = args.host, args.port
    try:
        check_bind(host, token, token_env)
        config = config_from_args(args, token)
    except ServerConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not is_loopback(host):
        log.warning("listening on %s beyond loopback: bearer token required; terminate TLS in a reverse proxy "
                    "(docs/DEPLOY.md) - plain HTTP exposes the token and the prompts", host)

    from ..encoder import ENCODER_COMPONENTS, EncoderStage
    from ..models import ModelSource

    import torch

    components = tuple(getattr(args, "components", None) or ENCODER_COMPONENTS)
    dtype_name = getattr(args, "dtype", None) or "float32"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    try:
        device = torch.device(getattr(args, "device", None) or "cpu")
    except RuntimeError as error:
        print(f"error: --device: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    source = ModelSource.from_path(args.models, layout=getattr(args, "layout", None))
    stage = EncoderStage(source, components=components, dtype=dtype, device=device)
    log.info("loaded encoders %s (model %s, %s on %s) in %.1f s", ",".join(stage.components), stage.fingerprint,
             dtype_name, device, time.perf_counter() - start)
    model_info = {"layout": source.layout, "tiny": bool(source.tiny), "dtype": dtype_name, "device": device.type}
    return asyncio.run(_serve(stage, config, host, port, model_info))


async def _serve(stage, config: ServerConfig, host: str, port: int, model_info: dict | None = None) -> int:
    app = create_app(stage, config, model_info)
    runner, site, bound = await start_site(app, host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"h3 encoder listening on http://{shown}:{bound}", flush=True)
    log.info("auth: %s; queue %d; deadline %g s (max %g s); cache %d MiB",
             "bearer token" if config.token else "none (loopback only)", config.queue_size,
             config.default_deadline_s, config.max_deadline_s, config.cache_bytes // protocol.MiB)
    loop = asyncio.get_running_loop()

    def on_signals(event: asyncio.Event) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, event.set)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - Windows
                signal.signal(sig, lambda *_: loop.call_soon_threadsafe(event.set))

    stop, force = asyncio.Event(), asyncio.Event()
    on_signals(stop)
    await stop.wait()
    on_signals(force)  # a second SIGTERM/SIGINT stops without waiting
    service = app[SERVICE_KEY]
    log.info("shutting down: finishing %d accepted request(s); signal again to stop at once",
             service.active_requests)
    drain = asyncio.ensure_future(shutdown(app, runner, site))
    forced = asyncio.ensure_future(force.wait())
    await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        log.warning("second signal: stopping now, abandoning %d request(s)", service.active_requests)
        drain.cancel()
        await runner.cleanup()
        return 1
    forced.cancel()
    finished = drain.result()
    log.info("stopped (%s)", "all accepted requests answered" if finished else "drain timed out")
    return 0 if finished else 1
