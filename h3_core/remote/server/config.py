"""The encoder server's configuration and its safety checks (token strength, binding beyond loopback)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ... import facts
from .. import protocol
from ..protocol import Limits, is_loopback
from .clock import SYSTEM_CLOCK, Clock

MIN_TOKEN_CHARS = 16
CLIENT_KEYS = ("peer", "forwarded")


class ServerConfigError(ValueError):
    """The server was asked to start in an unsafe or impossible configuration."""


# --------------------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class ServerConfig:
    limits: Limits = field(default_factory=Limits)
    queue_size: int = 32  # requests waiting for, or in, the model thread
    # The most a client may ask for is the default unless the operator raises it (`serve --deadline`): a unit's
    # TimeoutStopSec (docs/DEPLOY.md) is sized on it, so a drain never outlasts the service manager's patience.
    default_deadline_s: float = 300.0
    max_deadline_s: float = 300.0
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
    # The encoder's per-component cache (h3_core/component_cache.py): text, each reference's latents, in memory
    # (0 disables), and on disk when cache_dir is set, bounded by cache_disk_bytes (remote/server/disk_cache.py).
    component_cache_bytes: int = 512 * protocol.MiB
    cache_dir: str | None = None
    cache_disk_bytes: int = 10 * 1024 * protocol.MiB
    token: str | None = None
    threads: int | None = None  # torch threads in the model thread (None: the creating thread's count)
    drain_timeout_s: float | None = None  # graceful shutdown; None: max_deadline_s + 5
    # Media is decoded in a sandboxed child process (ingest.DecodeSettings); False decodes in the server process,
    # for debugging only. One decode runs at most decode_timeout_s, and never past the request's deadline.
    isolate_media: bool = True
    decode_timeout_s: float = 120.0
    # Progress polls (tracking.py, `GET /v1/encode/{id}/progress`); False serves as a server without them did.
    track_progress: bool = True
    # Who a request belongs to, for the fair queue and the per-client byte budget: "peer" (the TCP peer address) or
    # "forwarded" (behind a reverse proxy on loopback: the last X-Forwarded-For entry, which that proxy appended).
    client_key: str = "peer"
    # Most t2va requests of equal token count encoded in one text-encoder forward (1: never batch).
    text_batch: int = 8
    # A client seen this many seconds ago still shares the server: while several share it, a batch holds at most
    # text_batch // (clients sharing) jobs of each (fair_queue.FairQueue.fair_share). 0: only queued clients count.
    share_window_s: float = 0.25
    # After a batch in a client's turn took others' next jobs early, the model thread waits up to this long for that
    # client's next request, if its last one came this soon after its answer (FairQueue.wait_for_next). 0: never wait.
    anticipate_s: float = 0.01
    # The time every scheduling rule above reads (windows, waits, deadlines, reaping; clock.py): real time, or a
    # test's clock.ManualClock so that its decisions do not depend on how fast the machine is.
    clock: Clock = field(default=SYSTEM_CLOCK, compare=False, repr=False)

    def __post_init__(self):
        if self.queue_size < 1:
            raise ServerConfigError(f"queue_size must be at least 1, got {self.queue_size}")
        if self.client_key not in CLIENT_KEYS:
            raise ServerConfigError(f"client_key must be one of {CLIENT_KEYS}, got {self.client_key!r}")
        if self.text_batch < 1:
            raise ServerConfigError(f"text_batch must be at least 1, got {self.text_batch}")
        if not 0 <= self.share_window_s < float("inf"):
            raise ServerConfigError(f"share_window_s must be a finite number >= 0, got {self.share_window_s}")
        if not 0 <= self.anticipate_s <= 1:
            raise ServerConfigError(f"anticipate_s must be between 0 and 1 second, got {self.anticipate_s}")
        if self.cache_dir is not None and self.cache_disk_bytes < 1:
            raise ServerConfigError(f"cache_disk_bytes must be at least 1 with a cache directory, got "
                                    f"{self.cache_disk_bytes}")
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


def add_scheduling_args(serve) -> None:
    """`serve` flags of the fair queue and text batching (read back by `server.config_from_args`)."""
    serve.add_argument("--client-key", choices=CLIENT_KEYS, default=None,
                       help="who a request belongs to for fair turns and per-client limits: peer (the TCP peer, "
                       "default) or forwarded (behind a reverse proxy on loopback: the last X-Forwarded-For entry)")
    serve.add_argument("--text-batch", type=int, default=None,
                       help="most t2va requests of equal token count encoded in one text forward, where bitwise "
                       "equal to encoding each alone (default 8; 1 disables)")


def add_cache_args(serve) -> None:
    """`serve` flags of the per-component cache (read back by `server.config_from_args`)."""
    serve.add_argument("--component-cache-mb", type=float, default=None,
                       help="in-memory cache of encoder parts (text, each reference's latents) in MiB (default "
                       "512; 0 disables)")
    serve.add_argument("--cache-dir", default=None,
                       help="directory of the on-disk tier of the encoder parts' cache, kept across restarts and "
                       "shared by every server process that names it (created 0700; nothing outside it is touched)")
    serve.add_argument("--cache-disk-bytes", type=int, default=None,
                       help="most bytes the --cache-dir tier holds, least recently used entries deleted first "
                       "(default 10737418240 = 10 GiB)")


def add_limit_args(serve) -> None:
    """`serve` flags of the request limits an operator may change (read back by `limits_from_args`)."""
    serve.add_argument("--max-frames", type=int, default=None,
                       help=f"longest output (frames, 17k+5) a request may ask for: default "
                       f"{protocol.Limits.max_num_frames} (H3's trained 15 s), at most {facts.MAX_FRAMES} "
                       f"({facts.MAX_FRAMES / facts.FPS:.0f} s, ComfyUI core's longest); longer requests get 422")
    serve.add_argument("--max-canvas-edge", type=int, default=None,
                       help=f"longest canvas edge (px) a request may ask for: default {facts.TRAINED_CANVAS_EDGE} "
                       f"(H3's trained size), at most {facts.MAX_CANVAS_EDGE} (the bound the contract holds every "
                       "conditioning to); larger requests get 413")
    serve.add_argument("--max-canvas-pixels", type=int, default=None,
                       help=f"largest canvas area (px) a request may ask for: default {facts.TRAINED_CANVAS_PIXELS} "
                       f"(H3's trained size), at most {facts.MAX_CANVAS_PIXELS}; larger requests get 413")


def limits_from_args(args, limits: protocol.Limits) -> protocol.Limits:
    """`limits` with the operator's `add_limit_args` settings applied; ServerConfigError names a bad one."""
    most = getattr(args, "max_frames", None)
    if most is not None:
        if not facts.MIN_FRAMES <= most <= facts.MAX_FRAMES:
            raise ServerConfigError(f"--max-frames must be within {facts.MIN_FRAMES}-{facts.MAX_FRAMES} (H3's "
                                    f"lengths), got {most}")
        limits = replace(limits, max_num_frames=most)
    for flag, name, ceiling in (("max_canvas_edge", "--max-canvas-edge", facts.MAX_CANVAS_EDGE),
                                ("max_canvas_pixels", "--max-canvas-pixels", facts.MAX_CANVAS_PIXELS)):
        value = getattr(args, flag, None)
        if value is None:
            continue
        if not facts.CANVAS_MULTIPLE <= value <= ceiling:  # the contract refuses larger canvases on every read
            raise ServerConfigError(f"{name} must be within {facts.CANVAS_MULTIPLE}-{ceiling} (the most a "
                                    f"conditioning holds; H3's trained size is the default), got {value}")
        limits = replace(limits, **{flag: value})
    return limits
