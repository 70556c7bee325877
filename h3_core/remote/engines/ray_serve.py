"""The encoder endpoint on Ray Serve: `serve --engine ray`, or `serve run h3_core.remote.engines.ray_serve:build`.

Same HTTP protocol, same bytes as the aiohttp server: both call `handler.Handler`. Two deployments:

    client --HTTP--> Ray's proxy --> H3Ingress (1 replica, no GPU)         --handle--> H3Encoder (N replicas)
                                     Handler: routes, auth, caps, parse,                 Handler.compute on its
                                     deadline; the shared cache and the                  own EncoderService: queue,
                                     in-flight joins (one per cache key)                 media decode, model thread

* The ingress reads and checks every request exactly as the single server does, computes the content address and
  answers repeats from ONE cache for all encoder replicas (and joins identical requests in flight), so a repeat is
  a hit whichever replica computed it first. Only misses travel on, as the raw JSON request and the media parts
  (plain bytes); the replica parses the JSON again, decodes the media in its sandbox and encodes.
* Backpressure: each replica takes `max_ongoing_requests` at a time and up to `max_queued_requests` more wait in
  front of them; beyond that (`RaySettings.capacity()` misses in flight) the ingress answers 429 `queue_full` with
  Retry-After. The ingress counts its own misses in flight for this, and Ray's queue in front of the replicas is
  unbounded: Ray's router checks its count before a request is counted in it, so a burst that arrives at once
  was all queued, and a request it retries counts twice, so others were refused early (Ray 2.60,
  `Router.wrap_request_assignment`). The replica count is the settings' (`replicas`, or `autoscale`'s most):
  autoscaling is one of the settings, not a deployment override, so the ingress knows it. The ingress's own
  queue, if it overflows, is answered 503 with Retry-After by Ray's proxy (`backpressure_config`).
* A replica that dies is restarted by Ray; its in-flight requests are answered 503 `replica_unavailable` with
  Retry-After, which the client retries.
* The ingress holds no model; the replicas hold one each (`--gpus-per-replica G`: G GPUs, the text encoder's
  layers spread over them, `sharding.py`). Ray is imported only here, only when this engine is asked for.
* `GET /metrics` is the ingress's: it counts every answer the clients got (status, task, seconds, the `receive`
  phase) and, per computed miss, the phases the replica reports with its answer (queue, media decode, encoders,
  serialise). Not on it: `send` (Ray's proxy writes the answer), text batch sizes, the replicas' queue gauges,
  load times and device memory (a replica's own registry; Ray's dashboard shows the replicas' resources).
* Internal traffic (ingress <-> replicas) is Ray's, inside the cluster: plain bytes, strings and numbers only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .. import protocol
from ..server import body, handler
from ..server.config import ServerConfig, check_bind
from ..server.handler import Handler, Incoming, Reply
from ..server.ingest import Part
from ..server.service import EncoderService
from .streams import ChunkReader

log = logging.getLogger("h3_core.remote.server")

APP_NAME = "h3-encoder"
_SANE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
INGRESS, ENCODER = "H3Ingress", "H3Encoder"


@dataclass(frozen=True)
class RaySettings:
    """What both deployments need; plain values (they travel to every replica). No secret: the ingress reads the
    token from its own environment (`token_env`)."""

    models: str
    layout: str | None = None
    components: tuple[str, ...] = ("text", "video", "audio")
    dtype: str = "auto"  # as `serve --dtype`: auto, float32, bfloat16 or float16 (dtypes.compute_dtype's rule)
    device: str = "cpu"
    gpus_per_replica: float = 0
    threads: int | None = None  # torch threads per replica (None: H3_THREADS, else torch's default, as the CLI)
    config: ServerConfig = field(default_factory=ServerConfig)  # token stripped
    token_env: str = protocol.DEFAULT_TOKEN_ENV
    host: str = "127.0.0.1"  # where Ray's proxy listens: a non-loopback address needs the token
    replicas: int = 1
    autoscale: tuple[int, int] | None = None
    max_ongoing_requests: int = 2  # per encoder replica: one encoding, one decoding ahead
    max_queued_requests: int = 64  # per caller (the ingress), beyond the replicas' own slots
    stage_wrapper: str | None = None  # "module:callable" applied to each replica's stage (tests, instrumentation)

    def capacity(self) -> int:
        most = self.autoscale[1] if self.autoscale else self.replicas
        return most * self.max_ongoing_requests + self.max_queued_requests

    def replica_config(self) -> ServerConfig:
        # The ingress holds the shared cache; a replica's queue needs only the requests Ray lets in at once.
        return replace(self.config, token=None, cache_bytes=0, track_progress=False,
                       queue_size=max(self.config.queue_size, self.max_ongoing_requests), threads=self.torch_threads())

    def torch_threads(self) -> int:
        """The CLI's rule (`cli.main`): H3_THREADS, else torch's own default. Bitwise results depend on it, so the
        capabilities publish it (`model.threads`). `settings_from_args` fixes it in the driver, so every replica
        uses the count the `serve` command itself would."""
        if self.threads:
            return int(self.threads)
        import torch

        return int(os.environ.get("H3_THREADS", "0") or 0) or torch.get_num_threads()

    def cpus_needed(self) -> int:
        """Logical CPUs the encoder replicas reserve (one per torch thread); the ingress reserves none."""
        return (self.autoscale[1] if self.autoscale else self.replicas) * self.torch_threads()


class _Described:
    """The ingress's stand-in for a stage: the identity its encoder replicas reported (it never encodes)."""

    def __init__(self, info: dict):
        self.fingerprint, self.components = info["fingerprint"], tuple(info["components"])
        self.pipeline_config = None

    def encode(self, *args, **kwargs):  # pragma: no cover - the ingress sends every miss to a replica
        raise RuntimeError("the Ray ingress does not encode")


# --------------------------------------------------------------------------------------------------------------
# encoder replicas


@serve.deployment(name=ENCODER)
class H3Encoder:
    """One model (and its queue, sandboxed media decoding and model thread): the single server's service."""

    def __init__(self, settings: RaySettings):
        import torch

        torch.set_num_threads(settings.torch_threads())
        self.settings = settings
        self.stage, self.model_info = load_stage(settings)
        self.service = EncoderService(self.stage, settings.replica_config(), self.model_info)
        self.handler = Handler(self.service)
        self._started: asyncio.Task | None = None
        context = serve.get_replica_context()
        replica_id = getattr(context, "replica_id", None)
        self.name = str(getattr(replica_id, "unique_id", None) or os.getpid())

    async def _start(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self.service.start())
        await asyncio.shield(self._started)

    async def describe(self) -> dict[str, Any]:
        return {"fingerprint": self.service.fingerprint, "components": list(self.service.components),
                "model_info": self.model_info, "replica": self.name, "pid": os.getpid()}

    async def encode(self, rid: str, key: str, raw: bytes, parts: list[tuple[str, str, bytes, str]],
                     seconds_left: float, seconds: float, client: str = ""
                     ) -> tuple[int, dict[str, str], bytes, str, list[tuple[str, float]]]:
        """One cache miss: (status, headers, body, this replica's name, the job's phase seconds for the ingress's
        metrics). Cancelled when the ingress gives up."""
        await self._start()
        spec = body.parse_spec(raw, self.service)
        received = {name: Part(name=name, content_type=content_type, data=data, sha256=digest)
                    for name, content_type, data, digest in parts}
        del parts
        deadline = self.service.clock.monotonic() + seconds_left
        reply = await self.handler.compute(key, spec, raw, received, deadline, seconds, rid, client=client)
        data = reply.body if isinstance(reply.body, bytes) else reply.body.tobytes()  # Ray moves bytes, not views
        return reply.status, reply.headers, data, self.name, list(reply.phases)

    def check_health(self) -> None:
        worker = getattr(self.service, "_worker", None)
        if worker is not None and worker.done():
            raise RuntimeError("the model queue stopped")


def load_stage(settings: RaySettings):
    """The replica's `EncoderStage`; over several GPUs when `gpus_per_replica` > 1 (the text encoder's layers)."""
    import torch

    from ... import dtypes
    from ...encoder import EncoderStage
    from ...models import ModelSource

    source = ModelSource.from_path(settings.models, layout=settings.layout)
    device = settings.device
    if settings.gpus_per_replica >= 1 and device == "cpu":
        device = "cuda"
    # The single server's rule (`dtypes`): "auto" (the CLI's default) is float32 on CPU, bfloat16 on CUDA.
    dtype = dtypes.compute_dtype("text_encoder", torch.device(device).type, settings.dtype)
    if settings.gpus_per_replica > 1:
        from .sharding import sharded_stage

        stage = sharded_stage(source, settings.components, dtype, int(settings.gpus_per_replica))
        device = "cuda"
    else:
        stage = EncoderStage(source, components=settings.components, dtype=dtype, device=torch.device(device))
    if settings.stage_wrapper:
        import importlib

        module, _, name = settings.stage_wrapper.partition(":")
        stage = getattr(importlib.import_module(module), name)(stage)
    info = {"layout": source.layout, "tiny": bool(source.tiny), "dtype": dtypes.name(dtype),
            "device": torch.device(device).type, "threads": torch.get_num_threads()}
    return stage, info


# --------------------------------------------------------------------------------------------------------------
# ingress


@dataclass(eq=False)
class _Flight:
    """A miss on its way to a replica, shared by every identical request that arrives meanwhile."""

    task: asyncio.Task
    waiters: int = 0


class RayHandler(Handler):
    """The shared handler, with misses computed by the encoder replicas behind a deployment handle."""

    def __init__(self, service: EncoderService, encoder, settings: RaySettings):
        super().__init__(service)
        self.encoder, self.settings = encoder, settings
        self.flights: dict[str, _Flight] = {}
        self.served_by: dict[str, int] = {}

    def load(self) -> dict[str, Any]:
        load = self.service.load()
        # `replicas` is always a number: the configured count, or the autoscaling maximum (`autoscale` gives both).
        autoscale = self.settings.autoscale
        load.update(queued=0, running=len(self.flights), capacity=self.settings.capacity(),
                    replicas=autoscale[1] if autoscale else self.settings.replicas,
                    autoscale={"min": autoscale[0], "max": autoscale[1]} if autoscale else None,
                    served_by=dict(self.served_by))
        return load

    def describe(self) -> dict[str, Any]:
        caps = handler.capabilities(self.service)
        caps["queue"] = {"capacity": self.settings.capacity(),
                         "workers": self.settings.autoscale[1] if self.settings.autoscale else self.settings.replicas}
        caps["engine"] = "ray"
        return caps

    async def compute(self, key, spec, raw, parts, deadline, seconds, rid, gone=lambda: False, tracker=None,
                      client: str = "", streamed: bool = False) -> Reply:
        # `streamed` is not honoured: the replicas hand the ingress form-2 bytes (Ray moves bytes, not views), and
        # every client reads form 2
        service = self.service
        flight = self.flights.get(key)
        joined = flight is not None
        if flight is None and len(self.flights) >= self.settings.capacity():  # every slot and queue place is taken
            return self._queue_full(rid)
        if flight is None:
            wire = [(part.name, part.content_type, part.data, part.sha256) for part in parts.values()]
            flight = _Flight(asyncio.ensure_future(self._remote(key, raw, wire, deadline, seconds, rid, client)))
            self.flights[key] = flight
            flight.task.add_done_callback(lambda task, flight=flight: self._landed(key, flight, task))
        del parts
        if tracker is not None:
            tracker.cache = "joined" if joined else "miss"
        flight.waiters += 1
        try:
            left = max(0.0, deadline - service.clock.monotonic())
            reply = await service.clock.wait_for(asyncio.shield(flight.task), left)
        except asyncio.TimeoutError:
            self._give_up(key, flight)
            service.counters["deadline"] += 1
            return handler.deadline_reply(seconds, rid)
        except asyncio.CancelledError:  # the client went away (Ray cancels the request)
            self._give_up(key, flight)
            service.counters["client_gone"] += 1
            raise
        flight.waiters -= 1
        if not joined:
            return reply
        headers = dict(reply.headers)
        headers[protocol.H_REQUEST_ID] = rid
        if reply.status == 200:
            headers[protocol.H_CACHE] = "joined"
        return Reply(reply.status, headers, reply.body, reply.content_type)

    def _give_up(self, key: str, flight: _Flight) -> None:
        """A waiter left (deadline or disconnect); the last one cancels the replica's work."""
        flight.waiters -= 1
        if flight.waiters <= 0 and not flight.task.done():
            flight.task.cancel()
            if self.flights.get(key) is flight:
                del self.flights[key]
            self.service.counters["abandoned"] += 1

    def _landed(self, key: str, flight: _Flight, task: asyncio.Task) -> None:
        if self.flights.get(key) is flight:
            del self.flights[key]
        if task.cancelled() or task.exception() is not None:
            return
        reply = task.result()
        if reply.status == 200:
            self.service.cache.put(key, reply.body, reply.headers[protocol.H_CHECKSUM])
            self.service.counters["computed"] += 1

    def _queue_full(self, rid: str) -> Reply:
        self.service.counters["rejected_queue_full"] += 1
        after = max(1, self.service.retry_after())
        return handler.error_reply(429, "queue_full", f"every encoder replica is busy and the queue in front of them "
                                                      f"is full ({self.settings.capacity()} requests in flight: "
                                                      f"max_ongoing_requests={self.settings.max_ongoing_requests} "
                                                      f"per replica, max_queued_requests="
                                                      f"{self.settings.max_queued_requests}); retry after {after} s",
                                   None, rid, {"Retry-After": str(after)})

    async def _remote(self, key: str, raw: bytes, wire: list, deadline: float, seconds: float, rid: str,
                      client: str) -> Reply:
        """One call to an encoder replica, its failures mapped onto the protocol's answers."""
        response = self.encoder.encode.remote(rid, key, raw, wire, deadline - self.service.clock.monotonic(), seconds,
                                              client)
        del wire
        try:
            status, headers, data, replica, phases = await response
        except asyncio.CancelledError:
            response.cancel()
            raise
        except BackPressureError:
            return self._queue_full(rid)
        except RayTaskError as error:  # the replica's code raised: a server fault, as on the single server
            log.error("request %s: encoder replica failed: %s", rid, str(error)[:500])
            self.service.counters["status_500"] += 1
            return handler.error_reply(500, "internal_error", f"the encoder failed on this request (request id "
                                                              f"{rid}; see the replica's log)", None, rid)
        except RayError as error:  # the replica died or cannot be reached: Ray restarts it; the client retries
            log.warning("request %s: encoder replica unavailable: %s", rid, type(error).__name__)
            self.service.counters["replica_unavailable"] += 1
            return handler.error_reply(503, "replica_unavailable", "the encoder replica serving this request "
                                                                   "stopped; retry", None, rid, {"Retry-After": "1"})
        self.served_by[replica] = self.served_by.get(replica, 0) + 1
        for phase, spent in phases:  # the replica's queue, decode and encoder seconds, on the ingress's /metrics
            self.service.metrics.observe_phase(phase, spent)
        content_type = protocol.CONDITIONING_CONTENT_TYPE if status == 200 else "application/json"
        return Reply(status, dict(headers), data, content_type if status != 499 else None)


async def _chunks(request: Request):
    """The body's raw chunks; a client that left mid-body is a connection error, as on the aiohttp server."""
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect:
        raise ConnectionResetError("the client disconnected while sending the body") from None


def _request_log() -> None:
    """The single server's request log (one line per request, `handler.Handler`) on this replica's stderr: Ray
    keeps it in the worker's log file and shows it in the terminal of a `serve --engine ray` that started Ray. Ray
    leaves loggers other than its own at WARNING, which would drop those INFO lines."""
    if not log.handlers:
        import sys

        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(stream)
        log.setLevel(logging.INFO)
        log.propagate = False


@serve.deployment(name=INGRESS)
class H3Ingress:
    """Ray Serve's HTTP entry: turns the Starlette request into an `Incoming` for the shared handler."""

    def __init__(self, encoder, settings: RaySettings):
        _request_log()
        token = os.environ.get(settings.token_env) or None
        check_bind(settings.host, token, settings.token_env)  # refuse to start open beyond loopback
        self.encoder, self.settings = encoder, settings
        # The replicas hold the component cache (their memory, and the shared --cache-dir); the ingress encodes nothing.
        self.config = replace(settings.config, token=token, track_progress=False, component_cache_bytes=0,
                              cache_dir=None)
        self._handler: asyncio.Task | None = None

    async def _build(self) -> RayHandler:
        info = await self.encoder.describe.remote()
        service = EncoderService(_Described(info), self.config, info["model_info"])
        await service.start()
        return RayHandler(service, self.encoder, self.settings)

    async def handler(self) -> RayHandler:
        if self._handler is None or (self._handler.done() and self._handler.exception() is not None):
            self._handler = asyncio.ensure_future(self._build())
        return await asyncio.shield(self._handler)

    async def __call__(self, request: Request) -> Response:
        shared = await self.handler()
        body = ChunkReader(_chunks(request), request.headers.get("Content-Encoding"))
        incoming = Incoming(method=request.method, path=request.url.path, headers=request.headers,
                            remote=request.client.host if request.client else "", content=body)
        # Ray's proxy adds its own X-Request-Id to every answer (a client's, if it sent a sane one): use that id
        # throughout (logs, error bodies), and leave the header to the proxy so it appears once.
        ray_id = request.headers.get(protocol.H_REQUEST_ID)
        if ray_id and _SANE_ID.fullmatch(ray_id):
            incoming.request_id = ray_id
        try:
            reply = await shared(incoming)
        finally:
            await body.close()
        headers = dict(reply.headers)
        if ray_id == incoming.request_id:
            headers.pop(protocol.H_REQUEST_ID, None)
        return Response(content=reply.body if request.method != "HEAD" else b"", status_code=reply.status,
                        headers=headers, media_type=reply.content_type)

    def check_health(self) -> None:
        if self._handler is not None and self._handler.done() and self._handler.exception() is not None:
            raise RuntimeError(f"the ingress could not describe the encoders: {self._handler.exception()}")


# --------------------------------------------------------------------------------------------------------------
# the application


def application(settings: RaySettings):
    """The Serve application: ingress bound to the encoder deployment, options from `settings`."""
    actor: dict[str, Any] = {"num_cpus": settings.torch_threads()}
    if settings.gpus_per_replica:
        actor["num_gpus"] = settings.gpus_per_replica
    encoder_options: dict[str, Any] = {"ray_actor_options": actor,
                                       "max_ongoing_requests": settings.max_ongoing_requests,
                                       # The ingress, the only caller, bounds the queue itself (RayHandler.compute):
                                       # Ray's check lets a burst through whole, or refuses early.
                                       "max_queued_requests": -1,
                                       "health_check_period_s": 5, "graceful_shutdown_timeout_s": 30}
    if settings.autoscale:
        low, high = settings.autoscale
        encoder_options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high,
                                                 "target_ongoing_requests": 1}
    else:
        encoder_options["num_replicas"] = settings.replicas
    encoder = H3Encoder.options(**encoder_options).bind(settings)
    # The ingress waits on replicas and the network; it needs no core of its own.
    ingress = H3Ingress.options(num_replicas=1, ray_actor_options={"num_cpus": 0},
                                max_ongoing_requests=max(64, settings.capacity() * 2),
                                max_queued_requests=max(64, settings.capacity()),
                                backpressure_config={"status_code": 503, "retry_after_s": 5})
    return ingress.bind(encoder, settings)


def build(args: dict[str, Any]):
    """Application builder for `serve run` / `serve deploy` (deploy/ray_serve.yaml): `args` as in the YAML."""
    from .aiohttp_server import config_from_args

    class _Args:  # the CLI's names, so both entry points build the same configuration
        def __init__(self, values):
            self.__dict__.update(values)

        def __getattr__(self, name):
            return None

    values = dict(args or {})
    if not values.get("models"):
        raise ValueError("args.models is required (the model folder, readable on every node)")
    components = values.get("components") or "text,video,audio"
    if isinstance(components, str):
        components = tuple(c for c in components.split(",") if c)
    autoscale = values.get("autoscale")
    settings = RaySettings(
        models=str(values["models"]), layout=values.get("layout"), components=tuple(components),
        dtype=str(values.get("dtype") or "auto"), device=str(values.get("device") or "cpu"),
        gpus_per_replica=float(values.get("gpus_per_replica") or 0), threads=values.get("threads"),
        config=config_from_args(_Args(values), None), token_env=str(values.get("token_env") or
                                                                     protocol.DEFAULT_TOKEN_ENV),
        host=str(values.get("host") or "0.0.0.0"), replicas=int(values.get("replicas") or 1),
        autoscale=parse_autoscale(autoscale) if autoscale else None,
        max_ongoing_requests=int(values.get("max_ongoing_requests") or 2),
        max_queued_requests=int(values.get("max_queued_requests") or 64))
    return application(settings)


def parse_autoscale(text: str) -> tuple[int, int]:
    low, sep, high = str(text).partition(":")
    if not sep or not low.isdigit() or not high.isdigit() or not 0 <= int(low) <= int(high) or int(high) < 1:
        raise ValueError(f"--autoscale takes MIN:MAX replicas with 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return int(low), int(high)
