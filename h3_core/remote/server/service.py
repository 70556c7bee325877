"""The encoder service without HTTP: admission, the fair queue, one model thread, the cache (settings: config.py).

Pure asyncio (no aiohttp): an engine (`engines/`) is the transport in front of it, and tests drive it directly.

    client = service.client_key(peer, forwarded_for)                  # whose turn a job takes (fair_queue.py)
    async with service.admit(declared_bytes, client=client) as slot:  # counts the request, owns its body budget
        ... read the body, calling slot.budget.take(n) as bytes arrive ...
        job, joined = service.submit(key, spec, parts, client=client) # joined: an identical job was in flight
        ... await job.future, or service.release(job) when the waiter gives up ...

The queue serves clients in turn (`fair_queue.FairQueue`); queued `t2va` requests whose prompts have the same token
count are encoded in one text-encoder forward where that is bitwise safe (`h3_core/text_batching.py`), a batch
holding at most a fair share of each client's jobs while several clients use the server (`FairQueue.take_batch`);
after such a batch the model thread waits a few ms for its owner's next request, next in line (`wait_for_next`).
A service created without a stage is *loading*: requests get 503 until `attach(stage)`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ... import component_cache
from ... import progress as progress_phases
from ...contract import wire
from .. import protocol
from ..protocol import ProtocolError, is_loopback
from ..tracking import PhaseLog
from . import ingest, request_schema
from .admission import Admission
from .cache import ComponentTiers, ConditioningCache
from .config import ServerConfig
from .fair_queue import FairQueue
from .ingest import Part
from .metrics import ServerMetrics, Timeline

__all__ = ["Abandoned", "EncoderService", "Job", "QueueFull"]

MAX_CLIENT_KEY_CHARS = 64


# --------------------------------------------------------------------------------------------------------------
# jobs


@dataclass(eq=False)
class Job:
    key: str
    spec: request_schema.RequestSpec
    parts: dict[str, Part] | None
    future: asyncio.Future
    cancel: threading.Event = field(default_factory=threading.Event)
    waiters: int = 0
    state: str = "queued"  # queued | running | done
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    phases: PhaseLog = field(default_factory=PhaseLog)  # what progress polls report (tracking.py)
    client: str = ""  # whose turn it takes in the fair queue
    # Seal the answer in wire form 2 in the model thread (its checksum pass), for a requester that reads form 2; one
    # that reads form 3 has it hashed while it is sent. A later requester of the other form converts it
    # (`Encoded.form`).
    seal: bool = True
    batch_key: tuple | None = None  # jobs with equal keys may share a text-encoder forward (text_batching.py)
    timeline: Timeline = field(default_factory=Timeline)  # phase timings for the metrics
    components: component_cache.CacheRecord = field(default_factory=component_cache.CacheRecord)  # parts found


class Abandoned(Exception):
    """The job lost all its waiters (disconnect or deadline) before it ran."""


_ENCODER_STEPS = ("text", "video_vae", "audio_vae")  # EncoderStage.encode's progress(done, 3), by index


class EncoderService:
    """The server's state: stage, queue, model thread, cache, counters. Create inside a running loop's app."""

    def __init__(self, stage: Any, config: ServerConfig = ServerConfig(), model_info: dict | None = None):
        self.config = config
        self.model_info = dict(model_info or {})
        self.limits = config.limits
        self.clock = config.clock  # what the scheduling rules read (clock.py); measurements use time.monotonic
        self.stage: Any = None
        self.fingerprint, self.components = "", ()
        self.batcher = None
        self.ready = False
        self.load_seconds: dict[str, float] = {}
        self.threads = config.threads
        if self.threads is None:
            import torch

            self.threads = torch.get_num_threads()
        self.cache = ConditioningCache(config.cache_bytes, config.cache_entries)
        self.component_cache = ComponentTiers.from_config(config)  # the encoder's parts (None: off)
        self._pending = FairQueue(config.share_window_s, self.clock)
        self._inflight: dict[str, Job] = {}
        self._running: list[Job] = []
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
        self.metrics = ServerMetrics(self)
        if stage is not None:
            self.attach(stage)

    def attach(self, stage: Any, load_seconds: float | None = None) -> None:
        """Serve with `stage` from now on (the models finished loading); `load_seconds`: the whole load."""
        from ...text_batching import TextBatcher

        self.stage = stage
        self.fingerprint = str(stage.fingerprint)
        self.components = tuple(getattr(stage, "components", ("text", "video", "audio")))
        self.batcher = TextBatcher.for_stage(stage, self.config.text_batch)
        if self.batcher is not None:
            self.batcher.on_forward = self.metrics.observe_text_batch
        self.load_seconds = dict(getattr(stage, "load_seconds", None) or {})
        if load_seconds is not None:
            self.load_seconds["total"] = float(load_seconds)
        self.ready = True

    def check_ready(self) -> None:
        """503 `loading` (the transport adds Retry-After) until the models are loaded."""
        if not self.ready:
            raise ProtocolError(503, "loading", "the server is loading its models; retry in a few seconds")

    def client_key(self, peer: str | None, forwarded_for: str | None = None) -> str:
        """The client a request belongs to (fair queue turns, per-client byte budget).

        With `client_key="forwarded"` and a loopback peer (the reverse proxy), the last X-Forwarded-For entry: the
        address that proxy saw. Earlier entries are whatever the client wrote and are never used.
        """
        peer = peer or ""
        if self.config.client_key == "forwarded" and forwarded_for and is_loopback(peer):
            last = forwarded_for.rsplit(",", 1)[-1].strip()
            if last and len(last) <= MAX_CLIENT_KEY_CHARS and last.isprintable():
                return last
        return peer

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
        for job in self._pending.clear():
            job.cancel.set()
            if not job.future.done():
                job.future.set_exception(ProtocolError(503, "shutting_down", "the server is shutting down"))
        for job in self._running:
            job.cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests; wait until every accepted request has been answered. True if all finished."""
        self.draining = True
        timeout = self.config.drain_timeout_s if timeout is None else timeout
        if timeout is None:
            timeout = self.config.max_deadline_s + 5
        try:
            await self.clock.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # --- load ------------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    def queued_clients(self) -> dict[str, int]:
        return self._pending.clients()

    def load(self) -> dict[str, Any]:
        return {
            "queued": self.queued,
            "running": self.running,
            "capacity": self.config.queue_size,
            "active_requests": self.active_requests,
        }

    def retry_after(self) -> int:
        backlog = self.queued + min(self.running, 1)
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

    def check_components(self, spec: request_schema.RequestSpec) -> None:
        """422 before the job is queued (or its media read) when this server lacks an encoder the request needs."""
        missing = [name for name in spec.needed_components() if name not in self.components]
        if missing:
            only_soundtracks = not spec.ref_audios and not any(guide.audio for guide in spec.guides)
            hint = (" (a reference video with soundtrack null may carry audio: send soundtrack false if it has "
                    "none)" if "audio" in missing and only_soundtracks else "")
            raise ProtocolError(422, "component_not_loaded",
                                f"this server runs the encoder(s) {list(self.components)} but the request needs "
                                f"{missing}{hint}")

    # --- the model thread ------------------------------------------------------------------------

    async def _work_loop(self) -> None:
        loop = asyncio.get_running_loop()
        owner = None  # the client whose turn ran last
        while True:
            while not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            if owner is not None and self.config.anticipate_s:  # its turn used others': it is next (fair_queue.py)
                arrived = await self._pending.wait_for_next(owner, self.config.anticipate_s)
                if arrived is not None:
                    self.counters["anticipated" if arrived else "anticipation_missed"] += 1
                owner = None
            job = self._pending.pop()
            if job.cancel.is_set():
                self._finish(job, exception=Abandoned())
                continue
            jobs = [job]
            if job.batch_key is not None and self.batcher is not None:
                jobs += self._pending.take_batch(functools.partial(_same_batch, job.batch_key),
                                                 self.batcher.max_batch, job.client)
            started = time.monotonic()
            for member in jobs:
                member.state, member.started = "running", started
            self._running = jobs
            try:
                if len(jobs) == 1:
                    outcomes = [await loop.run_in_executor(self._executor, self._run_one, job)]
                else:
                    outcomes = await loop.run_in_executor(self._executor, self._run_batch, jobs)
            except asyncio.CancelledError:
                for member in jobs:
                    member.cancel.set()
                raise
            except BaseException as error:  # noqa: BLE001 - every failure goes to the jobs' waiters
                outcomes = [error] * len(jobs)
            finally:
                self._running = []
                owner = job.client
                elapsed = time.monotonic() - started
                self.job_seconds = 0.8 * self.job_seconds + 0.2 * elapsed / len(jobs)
            for member, outcome in zip(jobs, outcomes):
                if isinstance(outcome, BaseException):
                    self._finish(member, exception=outcome)
                else:
                    self._finish(member, result=outcome)

    def _run_one(self, job: Job) -> tuple[Any, str] | BaseException:
        try:
            return self._run_job(job)
        except BaseException as error:  # noqa: BLE001 - handed to the job's waiters
            return error

    def _run_job(self, job: Job) -> tuple[Any, str]:
        """Runs in the model thread: decode the media, encode, serialise."""
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        request = self._build_request(job)
        coarse, fine_phases = self._progress_sinks(job)
        with progress_phases.reporting(fine_phases), component_cache.using(self.component_cache, job.components):
            conditioning = self.stage.encode(request, cancel=job.cancel, progress=coarse)
        if job.batch_key is not None and self.batcher is not None:
            self.metrics.observe_text_batch(1)
        return self._serialise(job, conditioning)

    def _run_batch(self, jobs: list[Job]) -> list[tuple[Any, str] | BaseException]:
        """Runs in the model thread: t2va jobs whose prompts have the same token count, one text forward."""
        import torch

        from ...progress import Cancelled, check_cancel
        from ...text_batching import progress_to_all

        if self.threads:
            torch.set_num_threads(self.threads)
        outcomes: list[Any] = [None] * len(jobs)
        prepared, members, sinks = [], [], []
        for index, job in enumerate(jobs):
            try:
                ready = self.stage.prepare(self._build_request(job))
                check_cancel(job.cancel, "before the text encoder")
            except BaseException as error:  # noqa: BLE001 - this job's own refusal; the others go on
                outcomes[index] = error
                continue
            prepared.append(ready)
            coarse, fine = self._progress_sinks(job)
            coarse(0, len(_ENCODER_STEPS))
            members.append(index)
            sinks.append(fine)
        if members:
            with progress_phases.reporting(progress_to_all(sinks)):
                conditionings = self.batcher.encode(prepared)
            for index, conditioning in zip(members, conditionings):
                job = jobs[index]
                if job.cancel.is_set():
                    outcomes[index] = Cancelled("cancelled after the text encoder")
                    continue
                coarse, _ = self._progress_sinks(job)
                coarse(len(_ENCODER_STEPS), len(_ENCODER_STEPS))
                outcomes[index] = self._serialise(job, conditioning)
        return outcomes

    def _build_request(self, job: Job):
        parts, job.parts = job.parts or {}, None  # drop the compressed bytes as soon as they are decoded
        job.phases.enter("decode")
        job.timeline.mark("media_decode" if parts else "prepare")
        return ingest.build_request(job.spec, parts, self.limits, cancel=job.cancel,
                                    settings=self._decode_settings(job))

    def _progress_sinks(self, job: Job):
        """(coarse, fine): EncoderStage.encode's progress(done, 3), and the named-phase sink of the encoders."""
        encoder_progress = job.phases.encoder_callback()
        timeline = job.timeline

        def coarse(done: int, total: int, *args: Any, **kwargs: Any) -> None:
            encoder_progress(done, total, *args, **kwargs)
            if total == len(_ENCODER_STEPS) and 0 <= done < total:
                timeline.mark(_ENCODER_STEPS[done])

        def fine(phase: str, done: int, total: int) -> None:
            # The encoders' named phases (text layers, VAE clips) refine the coarse per-encoder steps in the polls.
            if phase in _ENCODER_STEPS:
                encoder_progress(done, total, phase)
                timeline.mark(phase, worked=True)

        return coarse, fine

    def _serialise(self, job: Job, conditioning) -> tuple[Any, str | None]:
        job.phases.enter("serialise")
        job.timeline.mark("serialise")
        # header + the tensors' storages, never joined: form 2 sealed here by one checksum pass, form 3 unsealed
        encoded = wire.encode(conditioning, wire.WIRE_VERSION if job.seal else wire.STREAM_VERSION)
        return encoded, encoded.checksum

    def _decode_settings(self, job: Job) -> ingest.DecodeSettings:
        """Sandboxed (unless configured off), within the job's deadline, onto the stage's canvas rule."""
        deadline = job.spec.deadline_s or self.config.default_deadline_s
        left = deadline - (time.monotonic() - job.enqueued)
        return ingest.DecodeSettings.for_pipeline(
            getattr(self.stage, "pipeline_config", None), isolate=self.config.isolate_media,
            timeout_s=max(1.0, min(self.config.decode_timeout_s, left)))

    def _finish(self, job: Job, result: tuple[Any, str] | None = None, exception: BaseException | None = None):
        job.state, job.finished = "done", time.monotonic()
        self._pending.answered(job.client)  # its next request may be on its way: it still shares the server
        self._forget(job)
        if result is not None:
            self.cache.put(job.key, *result)
            self.counters["computed"] += 1
            self.metrics.observe_job(job)
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

    def submit(self, key: str, spec: request_schema.RequestSpec, parts: dict[str, Part], client: str = "",
               seal: bool = True) -> tuple[Job, bool]:
        """The job for `key`: joined if one is in flight, else queued in `client`'s turn.

        A full queue makes room by refusing the newest job of the client holding the most (429 to its waiters),
        when that client holds at least two more than `client`; otherwise this request gets 429 (`QueueFull`).
        """
        job = self._inflight.get(key)
        if job is not None and not job.cancel.is_set():
            self.counters["joined"] += 1
            return job, True
        if self.queued + self.running >= self.config.queue_size:
            victim = self._pending.push_out_for(client)
            if victim is None:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(self.retry_after())
            self.counters["pushed_out"] += 1
            victim.cancel.set()
            self._finish(victim, exception=ProtocolError(
                429, "queue_full", "the encoder queue is full and this client holds more of it than others; "
                                   "retry later"))
        job = Job(key=key, spec=spec, parts=parts, future=asyncio.get_running_loop().create_future(), client=client,
                  seal=seal)
        if self.batcher is not None and not parts:
            job.batch_key = self.batcher.key(spec.resolved_task, spec.prompt, bool(spec.media()))
        job.phases.enter("queued")
        job.timeline.mark("queue")
        self._inflight[key] = job
        self._pending.push(job)
        self._wakeup.set()
        return job, False

    def queue_position(self, job: Job) -> int | None:
        """Jobs ahead of `job` (the running ones included) while it is queued; None otherwise."""
        position = self._pending.position(job)
        return None if position is None else position + self.running

    def release(self, job: Job) -> None:
        """A waiter gave up (disconnect or deadline); the last one cancels the job."""
        job.waiters -= 1
        if job.waiters > 0 or job.state == "done":
            return
        job.cancel.set()
        self._forget(job)
        if job.state == "queued":
            self._pending.remove(job)
            self._finish(job, exception=Abandoned())
        self.counters["abandoned"] += 1


def _same_batch(key: tuple, job: Job) -> bool:
    return job.batch_key == key and not job.cancel.is_set()


def _without_frames(error: BaseException, job: Job) -> BaseException:
    """The exception with its traceback (and its chained ones') dropped, frames cleared.

    A traceback keeps every frame of the model thread alive, with their locals: the decoded frames of a refused
    video stay in memory for as long as anyone holds the exception. Server faults (unmapped errors) are logged
    with their traceback first, the only place it is wanted.
    """
    import logging
    import traceback

    if protocol.error_from_exception(error) is None and not isinstance(error, (Abandoned, asyncio.CancelledError)):
        from ...progress import Cancelled

        if not isinstance(error, Cancelled):
            logging.getLogger("h3_core.remote.server").error(
                "job %s: encode failed", job.key[:12], exc_info=(type(error), error, error.__traceback__))
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

