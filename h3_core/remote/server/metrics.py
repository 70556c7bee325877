"""Prometheus metrics of one encoder server: `GET /metrics` in the text exposition format.

Every server instance has its own `CollectorRegistry` (never prometheus-client's global one), so tests and several
servers in one process do not share counters. Two kinds of metric:

* events, counted as they happen: answers to `POST /v1/encode` by status and task, seconds per phase of a job
  (histograms), whole-request seconds, text batch sizes;
* state, read at scrape time from the service (nothing to keep in sync): queue depth and capacity, jobs in the
  model thread, admitted requests, buffered bytes, clients waiting, readiness, cache entries/bytes/hits/misses,
  the service's event counters (refusals, abandons, ...), model load seconds, device memory (torch.cuda when the
  encoders run on CUDA; the process's resident set always, from prometheus-client's process collector).

Phases (label `phase`): `receive` (request body upload), `queue` (waiting for the model thread), `media_decode`
(sandboxed media decode and diffusers' media normalisation; requests with media only), `text` (text encoder),
`video_vae` / `audio_vae` (only requests that used them), `serialise` (the safetensors answer built), `send` (the
answer handed to the connection). They are the progress phases of `tracking.PHASES` under the names of
`progress.PHASES` where those exist.

Engine-neutral: the aiohttp transport and the Ray Serve engine report through the same calls
(`observe_request`, `observe_phase`); the service reports jobs itself.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from ...component_cache import COMPONENTS, TIERS

if TYPE_CHECKING:
    from .service import EncoderService, Job

PATH = "/metrics"
# The classic text format every Prometheus reads (the metric names here need none of the newer format's escaping).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "h3_encoder"
PHASES = ("receive", "queue", "media_decode", "text", "video_vae", "audio_vae", "serialise", "send")
UNKNOWN_TASK = "unknown"  # refused before its JSON was read (auth, size, malformed body)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
TOTAL_LOAD = "total"  # the service's key for the whole load (its own gauge: a label value would double `sum()`)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
# The service's own counters exported as events; the per-status ones are already in requests_total.
_EVENT_PREFIXES_SKIPPED = ("status_",)


class Timeline:
    """When each phase of one job started (model thread writes, event loop reads after the job finished)."""

    def __init__(self):
        self.marks: list[tuple[str, float]] = []
        self.worked: set[str] = set()  # phases that reported units of work (a VAE that encoded at least one clip)

    def mark(self, phase: str, worked: bool = False) -> None:
        if not self.marks or self.marks[-1][0] != phase:
            self.marks.append((phase, time.monotonic()))
        if worked:
            self.worked.add(phase)

    def spans(self, end: float) -> list[tuple[str, float]]:
        """(phase, seconds) for every phase marked, each ending where the next one starts (the last at `end`)."""
        out = []
        for (phase, start), following in zip(self.marks, self.marks[1:] + [("", end)]):
            out.append((phase, max(0.0, following[1] - start)))
        return out


class ServerMetrics:
    """The metrics of one `EncoderService`; `render()` is the body of `GET /metrics`."""

    def __init__(self, service: "EncoderService"):
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        buckets = latency_buckets(service.config.max_deadline_s)
        self.requests = Counter(f"{PREFIX}_requests", "Answers to POST /v1/encode, by HTTP status and task "
                                "(task 'unknown': refused before the request JSON was read).",
                                ["status", "task"], registry=self.registry)
        self.request_seconds = Histogram(f"{PREFIX}_request_seconds", "Seconds from request arrival to the "
                                         "answer handed to the connection, successful encodes, by task and cache "
                                         "outcome (hit, miss, joined).", ["task", "cache"],
                                         buckets=buckets, registry=self.registry)
        self.phase_seconds = Histogram(f"{PREFIX}_phase_seconds", "Seconds spent in each phase of a request "
                                       f"({', '.join(PHASES)}).", ["phase"], buckets=buckets,
                                       registry=self.registry)
        self.text_batch = Histogram(f"{PREFIX}_text_batch_size", "Requests per text-encoder forward in the "
                                    "server's batches of equal-length t2va prompts (1: encoded alone).",
                                    buckets=BATCH_BUCKETS, registry=self.registry)
        self.component_hits = Counter(f"{PREFIX}_cache_component_hits", "Encoder parts of computed answers found in "
                                      "the component cache, by component (text, video, audio) and tier (memory, "
                                      "disk).", ["component", "tier"], registry=self.registry)
        self.component_misses = Counter(f"{PREFIX}_cache_component_misses", "Encoder parts of computed answers "
                                        "that were encoded (not in the component cache), by component.",
                                        ["component"], registry=self.registry)
        self.registry.register(_StateCollector(service))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, cpu seconds, open fds (Linux)

    # --- events ----------------------------------------------------------------------------------

    def observe_request(self, status: int, task: str | None, seconds: float | None = None,
                        cache: str | None = None) -> None:
        task = task or UNKNOWN_TASK
        self.requests.labels(status=str(int(status)), task=task).inc()
        if seconds is not None and status == 200:
            self.request_seconds.labels(task=task, cache=cache or "miss").observe(seconds)

    def observe_phase(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; known: {PHASES}")
        self.phase_seconds.labels(phase=phase).observe(max(0.0, seconds))

    def observe_job(self, job: "Job") -> None:
        """The phases a finished job passed (queue wait, decode, encoders, serialise)."""
        for phase, seconds in job_phases(job):
            self.phase_seconds.labels(phase=phase).observe(seconds)

    def observe_text_batch(self, size: int) -> None:
        self.text_batch.observe(size)

    def observe_components(self, header: str | None) -> None:
        """Count a computed answer's encoder parts from its `X-H3-Cache-Components` header (`text=miss, video.0=disk,
        ...`): the Ray ingress counts what its replicas found the same way."""
        for item in (header or "").split(","):
            label, _, outcome = item.strip().partition("=")
            component = label.partition(".")[0]
            if component not in COMPONENTS:
                continue
            if outcome == "miss":
                self.component_misses.labels(component=component).inc()
            elif outcome in TIERS:
                self.component_hits.labels(component=component, tier=outcome).inc()

    # --- exposition ------------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """(body, content type) in Prometheus' text format 0.0.4."""
        return generate_latest(self.registry), CONTENT_TYPE


def latency_buckets(max_deadline_s: float) -> tuple[float, ...]:
    """The latency buckets, the top one at least the longest deadline a client may ask for (a request that ran
    to its deadline lands in a bucket of its own, not only in +Inf)."""
    if max_deadline_s <= LATENCY_BUCKETS[-1]:
        return LATENCY_BUCKETS
    return (*LATENCY_BUCKETS, float(max_deadline_s))


def job_phases(job: "Job") -> list[tuple[str, float]]:
    """(phase, seconds) of the phases a finished job passed, as `observe_job` records them (the Ray engine's
    replicas send them to the ingress, whose `/metrics` the clients' requests reach)."""
    timeline, end = job.timeline, job.finished or time.monotonic()
    out = []
    for phase, seconds in timeline.spans(end):
        if phase not in PHASES:
            continue
        if phase in ("video_vae", "audio_vae") and phase not in timeline.worked:
            continue  # the step ran but had nothing to encode
        out.append((phase, seconds))
    return out


class _StateCollector:
    """Gauges and counters read from the service at scrape time."""

    def __init__(self, service: "EncoderService"):
        self.service = service

    def describe(self) -> Iterable[Any]:
        return []  # collected lazily: the families depend on what is loaded

    def collect(self) -> Iterable[Any]:
        service = self.service

        def gauge(name: str, help_text: str, value: float, labels: dict[str, str] | None = None):
            family = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=list(labels or {}))
            family.add_metric(list((labels or {}).values()), float(value))
            return family

        yield gauge("ready", "1 once the models are loaded and requests are served; 0 while loading.",
                    int(service.ready))
        yield gauge("draining", "1 while shutting down (new requests get 503).", int(service.draining))
        yield gauge("queue_depth", "Jobs waiting for the model thread.", service.queued)
        yield gauge("queue_capacity", "Jobs the queue holds (waiting + running) before answering 429.",
                    service.config.queue_size)
        yield gauge("in_flight", "Jobs in the model thread (a text batch counts each of its requests).",
                    service.running)
        yield gauge("active_requests", "Admitted HTTP requests not yet answered (uploading, queued, running).",
                    service.active_requests)
        yield gauge("queued_clients", "Clients with at least one job waiting (the fair queue's turns).",
                    len(service.queued_clients()))
        yield gauge("buffered_bytes", "Request body bytes held in memory, all clients.", service.buffered_bytes)
        stats = service.cache.stats()
        yield gauge("cache_entries", "Conditioning answers in the cache.", stats["entries"])
        yield gauge("cache_bytes", "Bytes of conditioning in the cache.", stats["bytes"])
        for name, value, help_text in (("hits", stats["hits"], "Cache lookups answered from the cache."),
                                       ("misses", stats["misses"], "Cache lookups that found nothing.")):
            family = CounterMetricFamily(f"{PREFIX}_cache_{name}", help_text)
            family.add_metric([], value)
            yield family
        yield from _component_tiers(service)
        events = CounterMetricFamily(f"{PREFIX}_events", "Server events by name (refusals: rejected_*, "
                                     "pushed_out; abandoned, deadline, client_gone, joined, computed, ...).",
                                     labels=["event"])
        for name, value in sorted(service.counters.items()):
            if not name.startswith(_EVENT_PREFIXES_SKIPPED):
                events.add_metric([name], value)
        yield events
        load = GaugeMetricFamily(f"{PREFIX}_model_load_seconds", "Seconds each encoder took to load (text, video, "
                                 "audio); the whole load is h3_encoder_load_seconds.", labels=["component"])
        for component, seconds in sorted(service.load_seconds.items()):
            if component != TOTAL_LOAD:
                load.add_metric([component], seconds)
        yield load
        if TOTAL_LOAD in service.load_seconds:
            yield gauge("load_seconds", "Seconds from the start of loading to ready (every encoder and what surrounds "
                        "them).", service.load_seconds[TOTAL_LOAD])
        yield from _device_memory(service)


def _component_tiers(service: "EncoderService") -> Iterable[Any]:
    """Bytes, entries, evictions and faults of each tier of the encoder's component cache (none when it is off)."""
    tiers = service.component_cache.stats() if getattr(service, "component_cache", None) is not None else {}
    sizes = GaugeMetricFamily(f"{PREFIX}_cache_component_bytes", "Bytes of encoder parts in each tier of the "
                              "component cache (disk: the whole shared directory, as of this process's last write).",
                              labels=["tier"])
    evictions = CounterMetricFamily(f"{PREFIX}_cache_component_evictions", "Component cache entries evicted to stay "
                                    "within a tier's bytes (disk: by this process).", labels=["tier"])
    faults = CounterMetricFamily(f"{PREFIX}_cache_component_faults", "Disk tier problems, each survived: "
                                 "corrupt (an unreadable entry, deleted and recomputed), write_errors (full or "
                                 "read-only disk).",
                                 labels=["kind"])
    for tier, stats in tiers.items():
        sizes.add_metric([tier], stats["bytes"])
        evictions.add_metric([tier], stats["evictions"])
    if "disk" in tiers:
        for kind in ("corrupt", "write_errors"):
            faults.add_metric([kind], tiers["disk"][kind])
    yield sizes
    yield evictions
    yield faults


def _device_memory(service: "EncoderService") -> Iterable[Any]:
    """torch.cuda's allocator figures for the encoders' CUDA device; on CPU the process's resident set."""
    family = GaugeMetricFamily(f"{PREFIX}_device_memory_bytes", "Memory of the device the encoders run on: "
                               "allocated / reserved / peak_allocated (CUDA caching allocator), or resident (CPU: "
                               "the process's resident set).", labels=["device", "kind"])
    device = str(service.model_info.get("device") or getattr(getattr(service.stage, "device", None), "type", "cpu"))
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            index = torch.device(getattr(service.stage, "device", "cuda")).index or 0
            name = f"cuda:{index}"
            family.add_metric([name, "allocated"], torch.cuda.memory_allocated(index))
            family.add_metric([name, "reserved"], torch.cuda.memory_reserved(index))
            family.add_metric([name, "peak_allocated"], torch.cuda.max_memory_allocated(index))
    else:
        rss = _resident_bytes()
        if rss is not None:
            family.add_metric(["cpu", "resident"], rss)
    yield family


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, not current: the best there is
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")
