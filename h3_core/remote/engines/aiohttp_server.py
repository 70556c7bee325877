"""The H3 encoder server: `python -m h3_core serve --models DIR [--host 127.0.0.1] [--port 8190]`.

Running the aiohttp application (`aiohttp_app.py`) around ONE `EncoderStage` (`server/service.py`): in a background
thread for tests and embedding (`ServerThread`), or as the CLI's process with signal handling (`main`).

* The model (and media decoding, which allocates the big arrays) runs in a single worker thread; requests wait
  in a bounded queue in front of it; a full queue answers 429 with Retry-After.
* Every request has a deadline (queue wait + decode + encode); past it the request gets 504 and its work is
  abandoned at the next checkpoint. A client that disconnects has its work abandoned the same way.
* Identical requests (same JSON numbers, prompt, media bytes and model) are answered from a content-addressed
  LRU cache; identical requests in flight at the same time share one computation.
* The port opens before the encoders load: `/v1/health` answers 503 "loading" (Retry-After) until they are
  ready, every other endpoint but `/metrics` 503 too; "listening on URL" is printed on stdout once ready.
* `/metrics`: Prometheus text format (metrics.py), behind the bearer token when one is set.
* SIGTERM / SIGINT drain: the listener closes, new requests get 503, accepted requests finish, then the process
  exits.
* Binds 127.0.0.1 by default; refuses a non-loopback address unless a bearer token is set in the environment
  (H3_ENCODER_TOKEN, or the variable named by --token-env); tokens are compared in constant time. TLS is left
  to a reverse proxy (docs/DEPLOY.md).

No pickle, no eval; nothing written to disk but the optional component cache directory (`--cache-dir`,
`server/disk_cache.py`): part and file names are never used as paths.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from aiohttp import web

from .. import protocol
from ..protocol import Limits, is_loopback
from ..server.config import ServerConfig, ServerConfigError, check_bind, limits_from_args
from ..server.service import EncoderService
from .aiohttp_app import SERVICE_KEY, create_app
from .connections import AcceptErrorLimiter, ConnectionReaper

__all__ = ["ServerThread", "config_from_args", "start_site", "shutdown", "main"]

log = logging.getLogger("h3_core.remote.server")


# --------------------------------------------------------------------------------------------------------------
# running


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, web.TCPSite, int]:
    service = app[SERVICE_KEY]
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                           shutdown_timeout=5.0, keepalive_timeout=service.config.keepalive_timeout_s)
    await runner.setup()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(AcceptErrorLimiter(loop.get_exception_handler(), clock=service.clock))
    service.background.append(loop.create_task(
        ConnectionReaper(runner.server, service).run(), name="h3-connection-reaper"))
    site = web.TCPSite(runner, host, port, reuse_address=True, backlog=128)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, site, bound


def _close_listener(site: web.TCPSite) -> None:
    """Stop accepting connections but keep the open ones (their requests are being answered).

    aiohttp has no public call for this: `site.stop()` also closes every open connection. The listening
    `asyncio.Server` is the site's private `_server`; this is the one place that reaches for it.
    """
    server = getattr(site, "_server", None)
    if server is not None:
        server.close()


async def shutdown(app: web.Application, runner: web.AppRunner, site: web.TCPSite,
                   timeout: float | None = None) -> bool:
    """Graceful stop: close the listener, answer accepted requests (new ones get 503), then clean up."""
    service = app[SERVICE_KEY]
    service.draining = True
    _close_listener(site)
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
    if getattr(args, "max_decoded_mb", None):
        limits = replace(limits, max_request_decoded_bytes=int(args.max_decoded_mb * protocol.MiB))
    limits = limits_from_args(args, limits)  # --max-frames
    kwargs: dict[str, Any] = {"limits": limits, "token": token}
    if getattr(args, "queue_size", None):
        kwargs["queue_size"] = args.queue_size
    if getattr(args, "deadline", None):  # the operator's deadline is also the most a client may ask for
        kwargs["default_deadline_s"] = kwargs["max_deadline_s"] = float(args.deadline)
    if getattr(args, "cache_mb", None) is not None:
        kwargs["cache_bytes"] = int(args.cache_mb * protocol.MiB)
    if getattr(args, "decode_timeout", None):
        kwargs["decode_timeout_s"] = float(args.decode_timeout)
    if getattr(args, "decode_in_process", False):
        kwargs["isolate_media"] = False
    if getattr(args, "client_key", None):
        kwargs["client_key"] = args.client_key
    if getattr(args, "text_batch", None) is not None:
        kwargs["text_batch"] = args.text_batch
    if getattr(args, "component_cache_mb", None) is not None:
        kwargs["component_cache_bytes"] = int(args.component_cache_mb * protocol.MiB)
    if getattr(args, "cache_dir", None):
        kwargs["cache_dir"] = os.path.abspath(args.cache_dir)  # Ray replicas run elsewhere
    if getattr(args, "cache_disk_bytes", None) is not None:
        kwargs["cache_disk_bytes"] = int(args.cache_disk_bytes)
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

    from ...devices import DeviceError, Placement
    from ...dtypes import name as dtype_label
    from ...encoder import ENCODER_COMPONENTS, EncoderStage
    from ...models import ModelSource

    components = tuple(getattr(args, "components", None) or ENCODER_COMPONENTS)
    try:
        placement = Placement.from_args(args)
    except (DeviceError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    device, dtype = placement.device, placement.dtype_of("text_encoder")
    dtype_name = dtype_label(dtype)
    source = ModelSource.from_path(args.models, layout=getattr(args, "layout", None))
    model_info = {"layout": source.layout, "tiny": bool(source.tiny), "dtype": dtype_name, "device": device.type}

    def load():
        stage = EncoderStage(source, components=components, dtype=dtype, device=device, offload=placement.offload)
        log.info("loaded encoders %s (model %s, %s on %s)", ",".join(stage.components), stage.fingerprint,
                 dtype_name, device)
        return stage

    return asyncio.run(_serve(load, config, host, port, model_info))


async def _load_in_background(load, service: EncoderService, stop: asyncio.Event) -> bool:
    """Load the encoders in a daemon thread while the port answers health checks with 503 "loading".

    False if a signal came first (the load is left to die with the process) or the load failed (logged).
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(outcome, value) -> None:  # on the loop
        if not done.done():
            outcome(value)

    def run():
        start = time.perf_counter()
        try:
            stage = load()
        except BaseException as error:  # noqa: BLE001 - reported on the loop
            loop.call_soon_threadsafe(settle, done.set_exception, error)
        else:
            loop.call_soon_threadsafe(settle, done.set_result, (stage, time.perf_counter() - start))

    threading.Thread(target=run, name="h3-model-load", daemon=True).start()
    stopped = loop.create_task(stop.wait())
    await asyncio.wait({done, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not done.done():
        return False
    if done.exception() is not None:
        error = done.exception()
        log.error("loading the encoders failed: %s: %s", type(error).__name__, error,
                  exc_info=(type(error), error, error.__traceback__))
        return False
    stage, seconds = done.result()
    service.attach(stage, load_seconds=seconds)
    log.info("encoders ready after %.1f s", seconds)
    return True


async def _serve(load, config: ServerConfig, host: str, port: int, model_info: dict | None = None) -> int:
    """Bind, load the encoders (`load()`, in a thread; /v1/health says "loading" meanwhile), serve, drain."""
    app = create_app(None, config, model_info)
    runner, site, bound = await start_site(app, host, port)
    shown = f"[{host}]" if ":" in host else host
    log.info("bound http://%s:%d; loading the encoders (health answers 503 loading until ready)", shown, bound)
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
    if not await _load_in_background(load, app[SERVICE_KEY], stop):
        await shutdown(app, runner, site, timeout=5)
        return 0 if stop.is_set() else 1
    # Printed once requests are served (scripts wait for this line before sending work).
    print(f"h3 encoder listening on http://{shown}:{bound}", flush=True)
    await stop.wait()
    on_signals(force)  # a second SIGTERM/SIGINT stops without waiting
    service = app[SERVICE_KEY]
    log.info("shutting down: finishing %d accepted request(s); signal again to stop at once",
             service.active_requests)
    drain = asyncio.ensure_future(shutdown(app, runner, site))
    forced = asyncio.ensure_future(force.wait())
    await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        # Stop now: the running encode is in a model thread nothing can interrupt, and a normal interpreter exit
        # would wait for it (and for aiohttp's shutdown timeout). Its client sees the connection drop.
        log.warning("second signal: stopping now, abandoning %d request(s)", service.active_requests)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(1)
    forced.cancel()
    finished = drain.result()
    log.info("stopped (%s)", "all accepted requests answered" if finished else "drain timed out")
    return 0 if finished else 1
