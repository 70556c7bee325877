"""Running the Ray Serve engine: `python -m h3_core serve --engine ray` (flags in `options.py`), tests, benchmarks.

`start` connects to (or starts) Ray, starts Serve's HTTP proxy and deploys `ray_engine.application`; `stop` takes
it down; `main` is the CLI command, serving until SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import os
import time

from ray import serve

from .. import protocol
from ..server.config import check_bind
from .ray_serve import APP_NAME, RaySettings, application, parse_autoscale

log = logging.getLogger("h3_core.remote.server")


def settings_from_args(args, host: str) -> RaySettings:
    from .aiohttp_server import config_from_args

    autoscale = parse_autoscale(args.autoscale) if getattr(args, "autoscale", None) else None
    replicas = getattr(args, "replicas", None) or 1
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    gpus = float(getattr(args, "gpus_per_replica", None) or 0)
    device = getattr(args, "device", None) or "cpu"
    if gpus and device == "cpu":  # GPUs asked for: the replica's GPUs, whatever --device defaulted to
        device = "cuda"
    return RaySettings(
        threads=_threads(), models=os.path.abspath(args.models), layout=getattr(args, "layout", None),
        components=tuple(getattr(args, "components", None) or ("text", "video", "audio")),
        dtype=_dtype(getattr(args, "dtype", None)), device=device, gpus_per_replica=gpus,
        config=config_from_args(args, None), token_env=getattr(args, "token_env", None) or protocol.DEFAULT_TOKEN_ENV,
        host=host, replicas=replicas, autoscale=autoscale)


def _threads() -> int:
    """The torch threads this command would encode with (`cli.main`: H3_THREADS, else torch's default), fixed
    here so the replicas match it (Ray sets OMP_NUM_THREADS in its workers, which would decide otherwise)."""
    import torch

    return int(os.environ.get("H3_THREADS", "0") or 0) or torch.get_num_threads()


def _dtype(value: str | None) -> str:
    """`--dtype` as the replicas take it; a misspelling fails here, before Ray starts (`dtypes.parse`)."""
    from ... import dtypes

    dtypes.parse(value)
    return value or "auto"


def start(settings: RaySettings, port: int, address: str | None = None, num_cpus: int | None = None) -> str:
    """Connect to (or start) Ray, start Serve's proxy on `settings.host:port` and deploy; the endpoint's URL."""
    import ray

    if not ray.is_initialized():
        if not address:  # a local Ray's workers inherit this environment: let them import this h3_core
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            os.environ["PYTHONPATH"] = os.pathsep.join([root, *[p for p in paths if p != root]])
        if not address and num_cpus is None:  # room for every replica's threads, as the CLI's threads share cores
            num_cpus = max(os.cpu_count() or 1, settings.cpus_needed())
        import signal
        import threading

        main_thread = threading.current_thread() is threading.main_thread()
        kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
        ray.init(address=address or None, num_cpus=None if address else num_cpus, include_dashboard=False,
                 log_to_driver=True)
        # Ray's driver installs a C++ handler that aborts the process on SIGTERM (with a stack on stderr): keep the
        # caller's, so a signal while the replicas deploy stops the command as it would once it serves.
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)
    serve.start(http_options={"host": settings.host, "port": port})
    serve.run(application(settings), name=APP_NAME, route_prefix="/", blocking=False)
    shown = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{shown}:{port}"


def stop() -> None:
    try:
        serve.delete(APP_NAME)
    finally:
        serve.shutdown()


def main(args) -> int:
    """Deploy on Ray Serve, serve until SIGTERM/SIGINT, then take the application down (Ray drains replicas)."""
    import signal
    import socket
    import sys
    import threading

    from ..server.config import ServerConfigError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    host, port = args.host, args.port
    token_env = getattr(args, "token_env", None) or protocol.DEFAULT_TOKEN_ENV
    try:
        check_bind(host, os.environ.get(token_env) or None, token_env)
        settings = settings_from_args(args, host)
        if getattr(args, "cache_dir", None):  # refused here, before any replica starts, as the aiohttp engine does
            from ..server.disk_cache import check_dir

            check_dir(args.cache_dir)
    except (ServerConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if port == 0:  # Ray's proxy needs a concrete port: pick a free one
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    stopping, starting = threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        if starting.is_set() and stopping.is_set():  # a second signal while the replicas deploy: stop now
            raise KeyboardInterrupt
        stopping.set()

    # Before Ray starts: a signal while the replicas deploy (a service manager, or `kill %1` as soon as /v1/health
    # answers) stops the command once `start` returns, the way it stops a serving one.
    starting.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    url = start(settings, port, getattr(args, "address", None))
    starting.clear()
    print(f"h3 encoder listening on {url} (Ray Serve: {settings.autoscale or settings.replicas} encoder "
          f"replica(s))", flush=True)
    stopping.wait()
    log.info("shutting down: Ray finishes the replicas' requests (graceful_shutdown_timeout_s)")
    # A service manager may signal Ray's own processes too (the whole process group): never wait on a dead
    # cluster for long. A second signal stops at once.
    stopping.clear()
    stopper = threading.Thread(target=stop, name="h3-ray-stop", daemon=True)
    stopper.start()
    deadline = time.monotonic() + 45
    while stopper.is_alive() and time.monotonic() < deadline and not stopping.is_set():
        stopper.join(0.2)
    if stopper.is_alive():
        log.warning("Ray did not stop in time; exiting")
        logging.shutdown()
        sys.stdout.flush()
        os._exit(1)
    if not getattr(args, "address", None):
        import ray

        ray.shutdown()  # the local Ray this command started
    return 0
