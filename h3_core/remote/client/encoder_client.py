"""Client for the H3 encoder server (docs/PROTOCOL.md): `EncoderClient(urls).encode(request) -> H3Conditioning`.

* Capability handshake per endpoint before the first encode: protocol version, model fingerprint (pinned: every
  endpoint used must serve the same weights, or `expect_model`), the encoders the request needs, body size.
* Connect and read timeouts on every call; bounded retries with exponential backoff and jitter for `encode`
  (idempotent: the server's answer is a pure function of the request); several endpoints with failover.
* `cancel` (a `threading.Event`) aborts promptly, in any phase: the HTTP call runs in the caller's thread and the
  process's one watchdog thread (`watchdog.py`) shuts its socket down when the event is set, which the server sees
  as a disconnect and answers by abandoning the work. `progress(done, total)` reports the phases (pack, upload,
  the server's own phases while it works - polled from servers that publish them, docs/PROTOCOL.md "Progress" -
  and download).
* The bearer token comes from the environment (H3_ENCODER_TOKEN by default), never from a workflow widget.

Errors are `RemoteEncodeError` (a RuntimeError) carrying the server's JSON error, with subclasses for the cases a
caller may treat differently; request problems the server refuses (4xx) are also `ValueError`s.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import re
import ssl
import threading
import time
from typing import Any, Callable

from ...contract import ChecksumError, ContractError, H3Conditioning
from ...contract.wire import Receiving
from ...progress import Cancelled, ProgressFn, check_cancel
from ...request import EncodeRequest
from .. import protocol, tracking
from . import credentials, packing, polling
from .transport import (
    MAX_SMALL_RESPONSE_BYTES,
    Endpoint,
    ModelMismatchError,
    ProtocolMismatchError,
    RemoteAuthError,
    RemoteEncodeError,
    RemoteRequestError,
    RemoteUnavailableError,
    Reply,
    Transient,
    exchange,
    loads,
    parse_retry_after,
    parse_url,
    short,
)

log = logging.getLogger("h3_core.remote.client")

__all__ = [
    "EncoderClient",
    "RemoteEncodeError",
    "RemoteRequestError",
    "RemoteAuthError",
    "RemoteUnavailableError",
    "ProtocolMismatchError",
    "ModelMismatchError",
]

RETRYABLE_STATUS = {429, 502, 503}  # 504 is retried only when it is not this server's own deadline answer
# Every answer is read with a cap on what it can legitimately be: a hostile or broken server cannot make the
# client buffer more (a Content-Length over the cap is refused before reading; a chunked body is cut at the cap).
HANDSHAKE_TTL_S = 300.0



class EncoderClient:
    """Encode `EncodeRequest`s on one or more H3 encoder servers.

    urls:            one URL, a comma-separated string, or a list (failover in order, sticky to the last good one)
    token:           bearer token; None reads the environment variable `token_env`
    connect_timeout: seconds to open a connection
    read_timeout:    seconds the socket may stay silent (covers the server's queue + encode time)
    retries:         extra attempts of an encode after a transient failure (connection, 429/502/503, timeout)
    total_timeout:   one deadline for a whole call (connect + send + every read, all attempts and backoffs);
                     default connect_timeout + read_timeout, so a server trickling bytes cannot hold a call longer
    deadline_s:      server-side deadline sent with each request (default: read_timeout - 1 s)
    expect_model:    model fingerprint every endpoint must serve (default: pinned at the first handshake)
    lossless_video:  send reference videos losslessly (bit-identical to a local encode) or as H.264 CRF 18
    """

    # The answer forms beyond wire form 2 this client asks for (X-H3-Accept-Format): form 3, whose checksum follows
    # the data so the server hashes as it sends. Every server may answer form 2, which is always read; an empty
    # tuple asks for form 2 only (bench/wire.py's form-2 arm).
    accept_formats: tuple[str, ...] = (protocol.STREAMED_FORMAT,)

    def __init__(
        self,
        urls: str | list[str] | tuple[str, ...],
        token: str | None = None,
        *,
        token_env: str = protocol.DEFAULT_TOKEN_ENV,
        connect_timeout: float = 5.0,
        read_timeout: float = 300.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        total_timeout: float | None = None,
        deadline_s: float | None = None,
        expect_model: str | None = None,
        lossless_video: bool = True,
        ssl_context: ssl.SSLContext | None = None,
    ):
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u.strip()]
        if not urls:
            raise ValueError("EncoderClient needs at least one server URL")
        self.endpoints = [parse_url(u) for u in urls]
        if token is None:
            # A token from the environment goes only to the endpoints the environment binds it to
            # (H3_ENCODER_URLS / H3_ENCODER_TOKENS, client/credentials.py): a URL from elsewhere never collects it.
            env = dict(os.environ)
            if token_env != credentials.TOKEN_ENV:
                env[credentials.TOKEN_ENV] = os.environ.get(token_env, "")
            token = credentials.token_for(urls, env)
        self.token = token or None
        self.connect_timeout, self.read_timeout = float(connect_timeout), float(read_timeout)
        self.retries = max(0, int(retries))
        self.backoff_s, self.backoff_max_s = float(backoff_s), float(backoff_max_s)
        self.total_timeout = total_timeout
        self.deadline_s = deadline_s
        self.expect_model = expect_model
        self.lossless_video = lossless_video
        self.ssl_context = ssl_context
        self._lock = threading.Lock()
        self._preferred = 0
        self._pinned = expect_model
        self._pinned_dtype: str | None = None
        for endpoint in self.endpoints:
            if self.token and endpoint.scheme == "http" and not protocol.is_loopback(endpoint.host):
                log.warning("sending the bearer token to %s over plain HTTP: put a TLS proxy in front of the "
                            "server and use https:// (docs/DEPLOY.md)", endpoint.url)

    # --- public ----------------------------------------------------------------------------------

    @property
    def model(self) -> str | None:
        """The model fingerprint this client is pinned to (None before the first handshake)."""
        return self._pinned

    def health(self, url: str | None = None, cancel: threading.Event | None = None) -> dict[str, Any]:
        endpoint = self._endpoint(url)
        try:
            reply = self._call(endpoint, "GET", protocol.HEALTH_PATH, None, {}, cancel, self.connect_timeout + 5,
                               self._deadline(time.monotonic()), MAX_SMALL_RESPONSE_BYTES)
        except Transient as transient:
            raise RemoteUnavailableError(f"{endpoint.url}: {transient}", url=endpoint.url,
                                         code=transient.code) from None
        try:
            return loads(reply.body)
        except (UnicodeDecodeError, ValueError):
            raise RemoteEncodeError(f"{endpoint.url}: health answer is not JSON", status=reply.status,
                                    url=endpoint.url) from None

    def capabilities(self, url: str | None = None, refresh: bool = False,
                     cancel: threading.Event | None = None) -> dict[str, Any]:
        """The endpoint's capabilities after checking its protocol version and model fingerprint."""
        endpoint = self._endpoint(url)
        try:
            return self._handshake(endpoint, cancel, self._deadline(time.monotonic()), refresh=refresh)
        except Transient as transient:
            raise transient.error or RemoteUnavailableError(f"{endpoint.url}: {transient}", url=endpoint.url,
                                                            code=transient.code) from None

    def encode(self, request: EncodeRequest, cancel: threading.Event | None = None,
               progress: ProgressFn | None = None,
               on_server_progress: Callable[[dict], None] | None = None,
               on_status: Callable[[dict], None] | None = None) -> H3Conditioning:
        """Encode remotely; bit-identical to `EncoderStage.encode(request)` on the same weights (lossless media).

        `progress(done, 10)` counts the steps in `polling.STEPS` (never backwards; called from helper threads);
        `on_server_progress(event)` gets each server phase passed, as a dict (`phase`, `at_s`, `queue_position`
        while queued). Both are fed only by servers that publish progress; others go from step 2 to 9.
        `on_status(event)` gets what the client itself does, from any server: `{"event": "sending", "url",
        "bytes"}` before the upload, `{"event": "receiving", "url", "bytes"}` when the answer's body starts,
        `{"event": "retrying", "url", "reason"}` after a failed attempt, and last `{"event": "done", "url",
        "seconds", "bytes", "cache", "components", "queue_s", "encode_s"}` (the answer's X-H3-Cache,
        X-H3-Cache-Components as {part: tier or "miss"}, X-H3-Queue-Seconds and X-H3-Encode-Seconds; None where the
        server sent none). Called from helper threads too; an exception it raises is logged, never fatal.
        Raises `Cancelled` when `cancel` is set, `RemoteEncodeError` (or a subclass) on failure, and
        `h3_core.rules.H3InputError` for requests that break H3's rules (checked locally first).
        """
        task = request.validate()  # H3's rules, locally, before any upload
        steps = polling.STEPS
        report = polling.Monotonic(progress)
        report(0, steps)
        body_json, parts = packing.request_to_wire(request, lossless_video=self.lossless_video, cancel=cancel)
        content_type, buffers = packing.encode_multipart(body_json, parts)
        del parts
        # The same rule the server applies to the JSON sent (a soundtrack is sent exactly when the video has one).
        needs = request.needed_encoders()
        size = sum(len(buffer) for buffer in buffers)
        answer_cap = packing.conditioning_bound(request)
        started = time.monotonic()
        deadline = self._deadline(started)
        tried = _AttemptLog()
        status = _Status(on_status)
        for endpoint, delay in self._attempts(tried, deadline, cancel):
            self._sleep(delay, cancel, deadline)
            try:
                caps = self._handshake(endpoint, cancel, deadline)
                self._check_request_fits(endpoint, caps, needs, size, guided=bool(request.guides))
                report(1, steps)
                status(event="sending", url=endpoint.url, bytes=size)
                conditioning, headers = self._encode_once(endpoint, caps, body_json, content_type, buffers, cancel,
                                                          report, deadline, answer_cap, on_server_progress, status)
            except (ProtocolMismatchError, ModelMismatchError) as error:
                tried.skipped[endpoint.url] = error  # this endpoint can never serve it: no retry is used up
                continue
            except RemoteRequestError as error:
                if error.code not in ("component_not_loaded", "feature_not_supported"):
                    raise
                tried.skipped[endpoint.url] = error
                continue
            except Transient as transient:
                tried.failed(endpoint, transient)
                endpoint.capabilities = None  # re-handshake: a restarted server may serve other weights
                status(event="retrying", url=endpoint.url, reason=short(str(transient), 120))
                continue
            _check_geometry(conditioning, request, task, endpoint.url)
            with self._lock:
                self._preferred = self.endpoints.index(endpoint) if endpoint in self.endpoints else 0
            report(steps, steps)
            status(event="done", url=endpoint.url, seconds=round(time.monotonic() - started, 3), bytes=size,
                   **answer_facts(headers))
            return conditioning
        failures = tried.failures
        summary = "; ".join(failures[-4:]) or "no attempt made within total_timeout"
        last_error = tried.last_error
        # The last attempt's reason, as fields: the server's error when it answered, else the network's code.
        last = {name: getattr(last_error, name, None) for name in ("status", "code", "field", "message")}
        if last_error is None:
            last["code"] = tried.last_code
        raise RemoteUnavailableError(
            f"remote encode failed after {len(failures)} attempt(s) on {len(self.endpoints)} endpoint(s) in "
            f"{time.monotonic() - started:.1f} s: {summary}", url=tried.last_url, **last)

    def _attempts(self, tried: "_AttemptLog", deadline: float, cancel: threading.Event | None):
        """The retry schedule: ``(endpoint, delay before trying it)`` until the retries or the deadline run out.

        Endpoints rotate from the preferred one; a full round of failures backs off exponentially (with jitter);
        a server's Retry-After is honoured (capped). Endpoints that cannot serve the request (`tried.skipped`)
        leave the rotation without using up a retry; when none is left, the reason is raised.
        """
        order = self._order()
        attempts = self.retries + 1
        delay = 0.0
        while len(tried.failures) < attempts:
            check_cancel(cancel, "before contacting the encoder server")
            usable = [endpoint for endpoint in order if endpoint.url not in tried.skipped]
            if not usable:
                raise _no_endpoint(tried.skipped)
            used = len(tried.failures)
            if used and used % len(usable) == 0:
                delay = max(delay, self._backoff(used // len(usable)))
            if deadline - time.monotonic() - delay <= 0:
                return
            failures_before = len(tried.failures)
            yield usable[used % len(usable)], delay
            delay = 0.0
            if len(tried.failures) > failures_before and tried.retry_after is not None:
                delay = min(tried.retry_after, self.backoff_max_s * 4)

    # --- internals -------------------------------------------------------------------------------

    def _endpoint(self, url: str | None) -> Endpoint:
        if url is None:
            return self._order()[0]
        wanted = parse_url(url).url
        for endpoint in self.endpoints:
            if endpoint.url == wanted:
                return endpoint
        return parse_url(url)

    def _order(self) -> list[Endpoint]:
        with self._lock:
            start = self._preferred
        return self.endpoints[start:] + self.endpoints[:start]

    def _backoff(self, round_: int) -> float:
        delay = min(self.backoff_max_s, self.backoff_s * (2 ** max(0, round_ - 1)))
        return delay * (0.5 + random.random() / 2)

    def _deadline(self, started: float) -> float:
        total = self.total_timeout if self.total_timeout is not None else self.connect_timeout + self.read_timeout
        return started + total

    def _sleep(self, seconds: float, cancel: threading.Event | None, deadline: float) -> None:
        seconds = min(seconds, max(0.0, deadline - time.monotonic()))
        if seconds <= 0:
            return
        if cancel is not None:
            if cancel.wait(seconds):
                raise Cancelled("cancelled while waiting to retry the encoder server")
        else:
            time.sleep(seconds)

    def _headers(self) -> dict[str, str]:
        headers = {"User-Agent": "h3_core-encoder-client/1", "Accept": "application/octet-stream, application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _handshake(self, endpoint: Endpoint, cancel: threading.Event | None, deadline: float,
                   refresh: bool = False) -> dict:
        if not refresh and endpoint.capabilities is not None and \
                time.monotonic() - endpoint.checked_at < HANDSHAKE_TTL_S:
            return endpoint.capabilities
        reply = self._call(endpoint, "GET", protocol.CAPABILITIES_PATH, None, {}, cancel, self.connect_timeout + 10,
                           deadline, MAX_SMALL_RESPONSE_BYTES)
        if reply.status != 200:
            raise self._status_error(endpoint, reply)
        caps = _checked_capabilities(reply.body, endpoint.url)
        versions, fingerprint = caps["protocol"]["versions"], caps["model"]["fingerprint"]
        if protocol.PROTOCOL_VERSION not in versions:
            raise ProtocolMismatchError(
                f"{endpoint.url} speaks {protocol.PROTOCOL_NAME} version(s) {versions[:8]}; this client speaks "
                f"version {protocol.PROTOCOL_VERSION} - update the client or the server so they match",
                url=endpoint.url)
        dtype = caps["model"].get("dtype")
        with self._lock:
            if self._pinned is None:
                self._pinned = fingerprint
            if self._pinned_dtype is None:
                self._pinned_dtype = dtype
            pinned, pinned_dtype = self._pinned, self._pinned_dtype
        if fingerprint != pinned:
            raise ModelMismatchError(
                f"{endpoint.url} serves model {fingerprint}, but this client is pinned to {pinned}"
                f"{' (expect_model)' if self.expect_model else ' (the first endpoint it used)'}; every endpoint "
                "must serve the same weights for results to be consistent", url=endpoint.url)
        if dtype != pinned_dtype:
            raise ModelMismatchError(
                f"{endpoint.url} runs the text encoder in {dtype}, but this client's first endpoint ran it in "
                f"{pinned_dtype}; results would differ between endpoints", url=endpoint.url)
        endpoint.capabilities, endpoint.checked_at = caps, time.monotonic()
        return caps

    def _check_request_fits(self, endpoint: Endpoint, caps: dict, needs: tuple[str, ...], size: int,
                            guided: bool = False) -> None:
        if guided and protocol.FEATURE_GUIDES not in caps["protocol"]["features"]:
            raise RemoteRequestError(
                f"{endpoint.url}: this encoder server predates guides: update it, or encode the guides locally",
                status=None, code="feature_not_supported", field="guides", url=endpoint.url)
        loaded = caps["model"]["components"]
        missing = [name for name in needs if name not in loaded]
        if missing:
            raise RemoteRequestError(
                f"{endpoint.url} runs the encoder(s) {sorted(loaded)[:8]} but this request needs {missing} "
                "(start the server with all components, or encode those parts locally)",
                status=None, code="component_not_loaded", url=endpoint.url)
        cap = caps["limits"].get("max_body_bytes")
        if isinstance(cap, int) and size > cap:
            raise RemoteRequestError(
                f"the request is {size} bytes, over {endpoint.url}'s max_body_bytes={cap} (raise the server's "
                "--max-body-mb, send shorter or smaller reference videos, or use lossless_video=False)",
                status=413, code="too_large", field="body", url=endpoint.url)

    def _encode_once(self, endpoint: Endpoint, caps: dict, body_json: dict, content_type: str,
                     buffers: list[bytes], cancel: threading.Event | None, report: polling.Monotonic,
                     deadline: float, answer_cap: int, on_event: Callable[[dict], None] | None,
                     status: "_Status | None" = None) -> tuple[H3Conditioning, Any]:
        """One POST: the conditioning and the answer's headers."""
        server_deadline = self.deadline_s or max(1.0, self.read_timeout - 1.0)
        server_max = caps["deadline_s"].get("max")
        if isinstance(server_max, (int, float)) and server_max > 0:
            server_deadline = min(server_deadline, float(server_max))
        server_deadline = max(0.5, min(server_deadline, deadline - time.monotonic() - 0.5))
        fields = dict(body_json, model=self._pinned, deadline_s=round(server_deadline, 3))
        # The JSON part changes per attempt (deadline, model): only that buffer is rebuilt.
        payload = [buffers[0], packing.json_part(fields), *buffers[2:]]
        headers = {**self._headers(), "Content-Type": content_type}
        if self.accept_formats:
            headers[protocol.H_ACCEPT_FORMAT] = ", ".join(self.accept_formats)
        poller = self._poller(endpoint, caps, report, on_event, cancel, deadline)
        if poller is not None:
            headers[tracking.HEADER] = poller.progress_id

        def sent() -> None:
            report(polling.STEP_UPLOADED, polling.STEPS)
            if poller is not None:
                poller.start()

        def on_body(length: int):
            if status is not None:
                status(event="receiving", url=endpoint.url, bytes=length)
            return Receiving.new(length)

        try:
            reply = self._call(endpoint, "POST", protocol.ENCODE_PATH, payload, headers, cancel,
                               self.read_timeout, deadline, answer_cap, on_sent=sent, on_body=on_body)
        finally:
            if poller is not None:
                poller.stop()
        if reply.status != 200:
            raise self._status_error(endpoint, reply)
        report(polling.STEP_ANSWERED, polling.STEPS)
        body = reply.body if reply.receipt is not None else bytearray(reply.body)  # a chunked answer: a copy
        try:  # the tensors become views of the received buffer, checksummed once (piece by piece as it arrived)
            conditioning = H3Conditioning.from_buffer(body, reply.receipt)
        except ChecksumError:
            raise Transient("the conditioning arrived corrupted (checksum mismatch)") from None
        except ContractError as error:
            raise RemoteEncodeError(f"{endpoint.url} sent an invalid conditioning: {short(str(error))}",
                                    status=200, url=endpoint.url) from None
        model = conditioning.metadata.get("model")
        if self._pinned is not None and model is not None and model != self._pinned:
            raise ModelMismatchError(f"{endpoint.url} encoded with model {short(str(model))}, expected "
                                     f"{self._pinned}", url=endpoint.url)
        return conditioning, reply.headers

    def _poller(self, endpoint: Endpoint, caps: dict, report: polling.Monotonic,
                on_event: Callable[[dict], None] | None, cancel: threading.Event | None,
                deadline: float) -> polling.Poller | None:
        """A progress poller for one POST, when someone listens and the server publishes progress."""
        interval = polling.interval(caps.get("progress"))
        if interval is None or (report.report is None and on_event is None):
            return None

        def call(path: str, stop: threading.Event, poll_deadline: float) -> Reply:
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            return self._call(endpoint, "GET", path, None, {}, stop, min(5.0, self.read_timeout), poll_deadline,
                              MAX_SMALL_RESPONSE_BYTES)

        return polling.Poller(call, tracking.new_id(), interval, report, on_event, deadline)

    def _status_error(self, endpoint: Endpoint, reply: Reply) -> Exception:
        error = reply.error()
        message = str(error.get("message") or "")
        code, field, rid = error.get("code"), error.get("field"), error.get("request_id")
        text = f"{endpoint.url} answered {reply.status}" + (f" {code}" if code else "") + f": {message}"
        # Only a JSON error is the server's own message; any other body is kept out of the fields.
        kwargs = dict(status=reply.status, code=code, field=field, url=endpoint.url, request_id=rid,
                      message=message if error.get("json") else None)
        retry_after = parse_retry_after(reply.headers.get("Retry-After"))
        if reply.status in (401, 403):
            hint = ("the server refused the token sent: check it matches the server's" if self.token
                    else f"no token sent: set the token in {protocol.DEFAULT_TOKEN_ENV}")  # never the token itself
            return RemoteAuthError(text + f" ({hint})", **kwargs)
        if reply.status in RETRYABLE_STATUS or (reply.status == 504 and code != "deadline_exceeded") or \
                (reply.status == 503 and code == "abandoned"):
            return Transient(f"{reply.status} {code or ''} {message}".strip(), retry_after,
                              RemoteUnavailableError(text, **kwargs))
        if code == "protocol_mismatch":
            return ProtocolMismatchError(text, **kwargs)
        if code == "model_mismatch":
            return ModelMismatchError(text, **kwargs)
        if 400 <= reply.status < 500 and reply.status not in (404, 405, 408):
            return RemoteRequestError(text, **kwargs)
        if reply.status == 408:
            return Transient(text, None, RemoteUnavailableError(text, **kwargs))
        return RemoteEncodeError(text, **kwargs)

    def _connection(self, endpoint: Endpoint) -> http.client.HTTPConnection:
        if endpoint.scheme == "https":
            context = self.ssl_context or ssl.create_default_context()
            return http.client.HTTPSConnection(endpoint.host, endpoint.port, timeout=self.connect_timeout,
                                               context=context)
        return http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=self.connect_timeout)
    def _call(self, endpoint: Endpoint, method: str, path: str, body: list | None, headers: dict[str, str],
              cancel: threading.Event | None, read_timeout: float, deadline: float, max_bytes: int,
              on_sent: Callable[[], None] | None = None, on_body: Callable[[int], Any] | None = None) -> Reply:
        """One HTTP exchange (`transport.exchange`) with this client's connection, headers and connect timeout."""
        return exchange(self._connection(endpoint), endpoint, method, path, body, {**self._headers(), **headers},
                        cancel, self.connect_timeout, read_timeout, deadline, max_bytes, on_sent, on_body)



def _check_geometry(conditioning: H3Conditioning, request: EncodeRequest, task: str, url: str) -> None:
    """Refuse an answer for another request than the one sent: its task, frame count and (when the request set
    one) canvas must be the request's. Without an explicit canvas the server's canvas rule chose it; the contract
    has bounded it (facts.MAX_CANVAS_EDGE / MAX_CANVAS_PIXELS) already."""
    asked = {"task": task, "num_frames": request.num_frames}
    if request.width is not None:
        asked.update(width=request.width, height=request.height)
    got = {name: getattr(conditioning, name) for name in asked}
    if got != asked:
        wrong = ", ".join(f"{name} {got[name]!r} for {asked[name]!r}" for name in asked if got[name] != asked[name])
        raise RemoteEncodeError(f"{url}: the server's conditioning does not answer this request ({wrong})",
                                status=200, url=url)


def _checked_capabilities(body: bytes, url: str) -> dict:
    """The capabilities JSON with the shapes this client relies on checked; ProtocolMismatchError otherwise."""
    def fail(why: str) -> ProtocolMismatchError:
        return ProtocolMismatchError(f"{url} is not an H3 encoder server (capabilities are not "
                                     f"{protocol.PROTOCOL_NAME} JSON: {why})", url=url)

    try:
        caps = loads(body)
    except (UnicodeDecodeError, ValueError) as error:
        raise fail(short(str(error), 120)) from None
    if not isinstance(caps, dict):
        raise fail("not an object")
    for key in ("protocol", "model"):
        if not isinstance(caps.get(key), dict):
            raise fail(f"{key!r} is not an object")
    version, versions = caps["protocol"].get("version"), caps["protocol"].get("versions")
    if versions is None:
        versions = [version]
    if not isinstance(versions, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in versions):
        raise fail("protocol.versions is not a list of integers")
    features = caps["protocol"].get("features", [])  # absent: a server that predates every optional feature
    if not isinstance(features, list) or not all(isinstance(name, str) for name in features):
        raise fail("protocol.features is not a list of names")
    fingerprint = caps["model"].get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint or len(fingerprint) > 128:
        raise fail("model.fingerprint is not a short string")
    components = caps["model"].get("components", [])
    if not isinstance(components, list) or not all(isinstance(name, str) for name in components):
        raise fail("model.components is not a list of names")
    dtype = caps["model"].get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise fail("model.dtype is not a string")
    for key in ("limits", "deadline_s"):
        if not isinstance(caps.get(key, {}), dict):
            raise fail(f"{key!r} is not an object")
    model = dict(caps["model"], components=components, fingerprint=fingerprint)
    protocol_info = dict(caps["protocol"], versions=versions, features=features)
    return dict(caps, protocol=protocol_info, model=model, limits=caps.get("limits", {}),
                deadline_s=caps.get("deadline_s", {}))


class _Status:
    """The caller's `on_status` hook, or nothing; a hook that raises is logged, so it never breaks an encode (it
    also runs inside the HTTP exchange, from `on_sent` and the body's first read, where an exception would be taken
    for the answer's failure)."""

    def __init__(self, hook: Callable[[dict], None] | None):
        self.hook = hook

    def __call__(self, **event: Any) -> None:
        if self.hook is None:
            return
        try:
            self.hook(event)
        except Exception as error:  # noqa: BLE001 - reporting must not change the encode
            log.debug("on_status hook failed: %s", error)


MAX_COMPONENTS = 64  # parts listed from one X-H3-Cache-Components header (a server cannot make the summary grow)
_TOKEN = re.compile(r"[a-z][a-z0-9_.]{0,31}")


def answer_facts(headers: Any) -> dict[str, Any]:
    """What an answer's headers say about how it was made (docs/PROTOCOL.md, headers): the whole answer's cache
    outcome, each encoder part's tier or miss, the server's queue and encode seconds. Whatever does not parse is
    None: these are informative only, and come from the server, so nothing is taken as it came."""
    def header(name: str) -> str:
        value = headers.get(name) if headers is not None else None
        return value.strip() if isinstance(value, str) else ""

    cache = header(protocol.H_CACHE).lower()
    components: dict[str, str] = {}
    for item in header(protocol.H_CACHE_COMPONENTS).split(",")[:MAX_COMPONENTS]:
        label, _, outcome = (part.strip().lower() for part in item.partition("="))
        if _TOKEN.fullmatch(label) and _TOKEN.fullmatch(outcome):
            components[label] = outcome
    return {"cache": cache if _TOKEN.fullmatch(cache) else None, "components": components or None,
            "queue_s": _number(header(protocol.H_QUEUE_S)), "encode_s": _number(header(protocol.H_ENCODE_S))}


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value < 1e7 else None  # also refuses nan and inf


class _AttemptLog:
    """What the attempts of one encode found: transient failures (they use up retries) and skipped endpoints."""

    def __init__(self):
        self.failures: list[str] = []
        self.skipped: dict[str, RemoteEncodeError] = {}
        self.last_error: RemoteEncodeError | None = None
        self.last_url: str | None = None
        self.last_code: str | None = None
        self.retry_after: float | None = None

    def failed(self, endpoint: Endpoint, transient: Transient) -> None:
        self.failures.append(f"{endpoint.url}: {short(str(transient))}")
        self.last_url, self.last_code = endpoint.url, transient.code
        self.last_error, self.retry_after = transient.error, transient.retry_after
        log.info("encode attempt %d on %s failed: %s", len(self.failures), endpoint.url, short(str(transient)))


def _no_endpoint(skipped: dict[str, RemoteEncodeError]) -> RemoteEncodeError:
    first = next(iter(skipped.values()))
    if len(skipped) == 1:
        return first
    reasons = "; ".join(short(str(error), 200) for error in list(skipped.values())[:4])
    return type(first)(f"no endpoint can serve this request ({len(skipped)}): {reasons}", status=first.status,
                       code=first.code, field=first.field, url=first.url, message=first.message)
