"""The encoder service without HTTP: configuration, admission, the bounded queue, one model thread, the cache.

Pure asyncio (no aiohttp): `http.py` is the transport in front of it, and tests drive it directly.

    async with service.admit(declared_bytes, client=peer) as slot:   # counts the request, owns its body budget
        ... read the body, calling slot.budget.take(n) as bytes arrive ...
        job, joined = service.submit(key, spec, parts)                # joined: an identical job was in flight
        ... await job.future, or service.release(job) when the waiter gives up ...
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from .. import progress as progress_phases
from . import ingest, protocol
from .ingest import Part
from .protocol import Limits, ProtocolError, is_loopback
from .tracking import PhaseLog

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
    # Request bytes held in memory, counted as they arrive (not as declared, so slow uploads reserve nothing).
    max_buffered_bytes: int = 2048 * protocol.MiB  # all clients together
    max_client_bytes: int = 1024 * protocol.MiB  # one client (peer address) across its concurrent requests
    # An upload averaging fewer bytes per second than this after the grace period is dropped with 408.
    min_upload_bytes_per_s: int = 64 * 1024
    upload_grace_s: float = 5.0
    # Connections: complete request headers must arrive within header_timeout_s of the connection opening or of
    # the previous answer; an idle keep-alive connection is closed after keepalive_timeout_s.
    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 15.0
    cache_bytes: int = 512 * protocol.MiB
    cache_entries: int = 4096
    token: str | None = None
    threads: int | None = None  # torch threads in the model thread (None: the creating thread's count)
    drain_timeout_s: float | None = None  # graceful shutdown; None: max_deadline_s + 5
    # Media is decoded in a sandboxed child process (ingest.DecodeSettings); False decodes in the server process,
    # for debugging only. One decode runs at most decode_timeout_s, and never past the request's deadline.
    isolate_media: bool = True
    decode_timeout_s: float = 120.0
    # Progress polls (tracking.py, `GET /v1/encode/{id}/progress`); False serves as a server without them did.
    track_progress: bool = True

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
# admission: one request's lifetime and the bytes its body holds


class BodyBudget:
    """The bytes one request body holds in memory, counted as they arrive, against three caps.

    Per request (`max_body_bytes`, 413), per client (`max_client_bytes`, 429) and server-wide
    (`max_buffered_bytes`, 429). Everything taken is given back when the request ends.
    """

    def __init__(self, service: "EncoderService", client: str):
        self.service, self.client = service, client
        self.bytes = 0

    def take(self, n: int) -> None:
        service, config = self.service, self.service.config
        self.bytes += n
        service.buffered_bytes += n
        service.client_bytes[self.client] += n
        limit = config.limits.max_body_bytes
        if self.bytes > limit:
            raise ProtocolError(413, "too_large", f"the request body is over the limit of max_body_bytes={limit}",
                                "body")
        if service.client_bytes[self.client] > config.max_client_bytes:
            service.counters["rejected_client_busy"] += 1
            raise ProtocolError(429, "client_busy", f"this client has too many request bytes in flight "
                                                    f"(max_client_bytes={config.max_client_bytes}); retry later")
        if service.buffered_bytes > config.max_buffered_bytes:
            service.counters["rejected_buffer_full"] += 1
            raise ProtocolError(429, "busy", f"too many request bytes in flight (max_buffered_bytes="
                                             f"{config.max_buffered_bytes}); retry later")

    def release(self) -> None:
        service = self.service
        service.buffered_bytes -= self.bytes
        left = service.client_bytes[self.client] - self.bytes
        if left > 0:
            service.client_bytes[self.client] = left
        else:
            service.client_bytes.pop(self.client, None)
        self.bytes = 0


class Admission:
    """An admitted request: its body budget and its upload clock (the minimum-rate rule)."""

    def __init__(self, service: "EncoderService", client: str):
        self.service = service
        self.budget = BodyBudget(service, client)
        self.started = time.monotonic()

    def read_timeout(self) -> float:
        """Seconds the next read may wait before the upload's average rate is under `min_upload_bytes_per_s`."""
        config = self.service.config
        due = config.upload_grace_s
        if config.min_upload_bytes_per_s > 0:
            due = max(due, self.budget.bytes / config.min_upload_bytes_per_s)
        else:
            due = max(due, config.upload_timeout_s)
        return self.started + due - time.monotonic()

    async def read(self, awaitable):
        """Await one read of the body; 408 once the upload's average rate is under the minimum."""
        try:
            return await asyncio.wait_for(awaitable, max(0.0, self.read_timeout()))
        except asyncio.TimeoutError:
            pass
        config = self.service.config
        self.service.counters["slow_upload"] += 1
        raise ProtocolError(408, "upload_too_slow",
                            f"the request body arrived slower than min_upload_bytes_per_s="
                            f"{config.min_upload_bytes_per_s} (averaged after upload_grace_s="
                            f"{config.upload_grace_s:g} s)", "body")


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
    logged: bool = False  # a server fault already logged with its traceback
    phases: PhaseLog = field(default_factory=PhaseLog)  # what progress polls report (tracking.py)


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
        self.buffered_bytes = 0  # request bytes in memory, all clients
        self.client_bytes: collections.Counter[str] = collections.Counter()  # the same, per client
        self.background: list[asyncio.Task] = []  # helpers of the transport (connection reaper), stopped with us
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
        for task in self.background:
            task.cancel()
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

    @contextlib.asynccontextmanager
    async def admit(self, declared_bytes: int, client: str = "") -> AsyncIterator[Admission]:
        """Count a request from arrival to answer (drain waits for it); its body budget is freed at the end.

        503 while draining; 429 when the declared body cannot fit the server-wide or per-client budget even now.
        """
        if self.draining:
            raise ProtocolError(503, "shutting_down", "the server is shutting down; retry on another endpoint")
        if self.buffered_bytes + declared_bytes > self.config.max_buffered_bytes:
            self.counters["rejected_buffer_full"] += 1
            raise ProtocolError(429, "busy", f"too many request bytes in flight (max_buffered_bytes="
                                             f"{self.config.max_buffered_bytes}); retry later")
        if self.client_bytes[client] + declared_bytes > self.config.max_client_bytes:
            self.counters["rejected_client_busy"] += 1
            raise ProtocolError(429, "client_busy", f"this client has too many request bytes in flight "
                                                    f"(max_client_bytes={self.config.max_client_bytes}); retry later")
        self.active_requests += 1
        self._idle.clear()
        slot = Admission(self, client)
        try:
            yield slot
        finally:
            slot.budget.release()
            self.active_requests -= 1
            if self.active_requests == 0:
                self._idle.set()

    def check_components(self, spec: protocol.RequestSpec) -> None:
        """422 before the job is queued (or its media read) when this server lacks an encoder the request needs."""
        missing = [name for name in spec.needed_components() if name not in self.components]
        if missing:
            hint = (" (a reference video with soundtrack null may carry audio: send soundtrack false if it has "
                    "none)" if "audio" in missing and not spec.ref_audios else "")
            raise ProtocolError(422, "component_not_loaded",
                                f"this server runs the encoder(s) {list(self.components)} but the request needs "
                                f"{missing}{hint}")

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
        job.phases.enter("decode")
        request = ingest.build_request(job.spec, parts, self.limits, cancel=job.cancel,
                                       settings=self._decode_settings(job))
        del parts
        encoder_progress = job.phases.encoder_callback()

        def fine_phases(phase: str, done: int, total: int) -> None:
            # The encoders' named phases (text layers, VAE clips) refine the coarse per-encoder steps in the polls.
            if phase in ("text", "video_vae", "audio_vae"):
                encoder_progress(done, total, phase)

        with progress_phases.reporting(fine_phases):
            conditioning = self.stage.encode(request, cancel=job.cancel, progress=encoder_progress)
        job.phases.enter("serialise")
        encoded = conditioning.to_wire()  # header + the tensors' storages, sealed by one checksum; never joined
        return encoded, encoded.checksum

    def _decode_settings(self, job: Job) -> ingest.DecodeSettings:
        """Sandboxed (unless configured off), within the job's deadline, onto the stage's canvas rule."""
        deadline = job.spec.deadline_s or self.config.default_deadline_s
        left = deadline - (time.monotonic() - job.enqueued)
        return ingest.DecodeSettings.for_pipeline(
            getattr(self.stage, "pipeline_config", None), isolate=self.config.isolate_media,
            timeout_s=max(1.0, min(self.config.decode_timeout_s, left)))

    def _finish(self, job: Job, result: tuple[bytes, str] | None = None, exception: BaseException | None = None):
        job.state, job.finished = "done", time.monotonic()
        self._forget(job)
        if result is not None:
            self.cache.put(job.key, *result)
            self.counters["computed"] += 1
        if not job.future.done():
            if exception is not None:
                job.future.set_exception(_without_frames(exception, job))
                job.future.exception()  # marked as retrieved: abandoned jobs have no reader
            else:
                job.future.set_result(result)
        job.parts = None

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
        job.phases.enter("queued")
        self._inflight[key] = job
        self._pending.append(job)
        self._wakeup.set()
        return job, False

    def queue_position(self, job: Job) -> int | None:
        """Jobs ahead of `job` (the running one included) while it is queued; None otherwise."""
        try:
            return self._pending.index(job) + self.running
        except ValueError:
            return None

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


def _without_frames(error: BaseException, job: Job) -> BaseException:
    """The exception with its traceback (and its chained ones') dropped, frames cleared.

    A traceback keeps every frame of the model thread alive, with their locals: the decoded frames of a refused
    video stay in memory for as long as anyone holds the exception. Server faults (unmapped errors) are logged
    with their traceback first, the only place it is wanted.
    """
    import logging
    import traceback

    if protocol.error_from_exception(error) is None and not isinstance(error, (_Abandoned, asyncio.CancelledError)):
        from ..progress import Cancelled

        if not isinstance(error, Cancelled):
            logging.getLogger("h3_core.remote.server").error(
                "job %s: encode failed", job.key[:12], exc_info=(type(error), error, error.__traceback__))
            job.logged = True
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
        current.with_traceback(None)
        current = current.__cause__ or current.__context__
    return error


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__("queue full")
        self.retry_after = retry_after

