"""Client for the H3 encoder server (docs/PROTOCOL.md): `EncoderClient(urls).encode(request) -> H3Conditioning`.

* Capability handshake per endpoint before the first encode: protocol version, model fingerprint (pinned: every
  endpoint used must serve the same weights, or `expect_model`), the encoders the request needs, body size.
* Connect and read timeouts on every call; bounded retries with exponential backoff and jitter for `encode`
  (idempotent: the server's answer is a pure function of the request); several endpoints with failover.
* `cancel` (a `threading.Event`) aborts promptly, in any phase: the HTTP call runs in a helper thread and the
  caller's thread closes the socket when the event is set, which the server sees as a disconnect and answers by
  abandoning the work. `progress(done, total)` reports the phases (pack, upload, server work, download).
* The bearer token comes from the environment (H3_ENCODER_TOKEN by default), never from a workflow widget.

Errors are `RemoteEncodeError` (a RuntimeError) carrying the server's JSON error, with subclasses for the cases a
caller may treat differently; request problems the server refuses (4xx) are also `ValueError`s.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import random
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from ..contract import ContractError, H3Conditioning
from ..progress import Cancelled, ProgressFn, check_cancel
from ..request import EncodeRequest
from . import packing, protocol

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
MAX_SMALL_RESPONSE_BYTES = 1024 * 1024  # capabilities, health and error answers
MAX_MESSAGE_CHARS = 300  # of a server's error message, as repeated in this client's exceptions
MAX_JSON_DEPTH = 32
HANDSHAKE_TTL_S = 300.0
# Requests are re-validated here only to learn what they need; the server applies its own limits.
_CLIENT_LIMITS = protocol.Limits(max_prompt_chars=1 << 30, max_fps=1e9, max_canvas_edge=1 << 30,
                                 max_canvas_pixels=1 << 60, max_parts=1 << 20)


class RemoteEncodeError(RuntimeError):
    """The remote encode failed; `status`, `code`, `field` and `message` come from the server when it answered."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 field: str | None = None, url: str | None = None, request_id: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code, self.field = message, status, code, field
        self.url, self.request_id = url, request_id


class RemoteRequestError(RemoteEncodeError, ValueError):
    """The server refused the request itself (400/409/413/415/422): fix the inputs, retrying will not help."""


class RemoteAuthError(RemoteEncodeError):
    """401: no token, or the wrong one (set H3_ENCODER_TOKEN, or the variable the client was told to read)."""


class RemoteUnavailableError(RemoteEncodeError):
    """No endpoint answered usefully within the retries and timeouts (down, refusing, busy or timing out)."""


class ProtocolMismatchError(RemoteEncodeError):
    """The endpoint speaks another protocol version than this client."""


class ModelMismatchError(RemoteEncodeError):
    """The endpoint serves other weights than the ones pinned (by `expect_model` or the first handshake)."""


@dataclass
class _Endpoint:
    url: str
    scheme: str
    host: str
    port: int
    prefix: str
    capabilities: dict | None = None
    checked_at: float = 0.0

    def path(self, path: str) -> str:
        return self.prefix + path


@dataclass
class _Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def error(self) -> dict[str, Any]:
        try:
            body = json.loads(self.body.decode("utf-8"))
            error = body.get("error") if isinstance(body, dict) else None
            if isinstance(error, dict):
                return {key: _short(error.get(key)) for key in ("code", "message", "field", "request_id")}
        except (UnicodeDecodeError, ValueError, RecursionError):
            pass
        text = self.body[:200].decode("utf-8", "replace").strip()
        return {"code": None, "message": text or http.client.responses.get(self.status, "error"), "field": None}


class _Transient(Exception):
    """One attempt failed in a way another attempt (or endpoint) may not."""

    def __init__(self, message: str, retry_after: float | None = None, error: RemoteEncodeError | None = None):
        super().__init__(message)
        self.retry_after, self.error = retry_after, error


def _parse_url(url: str) -> _Endpoint:
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"encoder URL must start with http:// or https://, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("do not put credentials in the encoder URL; set the token in the environment "
                         f"({protocol.DEFAULT_TOKEN_ENV})")
    if parts.query or parts.fragment:
        raise ValueError(f"encoder URL must not have a query or fragment: {url!r}")
    if not parts.hostname:
        raise ValueError(f"encoder URL has no host: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    prefix = parts.path.rstrip("/")
    return _Endpoint(url=f"{parts.scheme}://{parts.netloc}{prefix}", scheme=parts.scheme, host=parts.hostname,
                     port=port, prefix=prefix)


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
        self.endpoints = [_parse_url(u) for u in urls]
        self.token = token if token is not None else (os.environ.get(token_env) or None)
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
        except _Transient as transient:
            raise RemoteUnavailableError(f"{endpoint.url}: {transient}", url=endpoint.url) from None
        try:
            return _loads(reply.body)
        except (UnicodeDecodeError, ValueError):
            raise RemoteEncodeError(f"{endpoint.url}: health answer is not JSON", status=reply.status,
                                    url=endpoint.url) from None

    def capabilities(self, url: str | None = None, refresh: bool = False,
                     cancel: threading.Event | None = None) -> dict[str, Any]:
        """The endpoint's capabilities after checking its protocol version and model fingerprint."""
        endpoint = self._endpoint(url)
        try:
            return self._handshake(endpoint, cancel, self._deadline(time.monotonic()), refresh=refresh)
        except _Transient as transient:
            raise transient.error or RemoteUnavailableError(f"{endpoint.url}: {transient}", url=endpoint.url) from None

    def encode(self, request: EncodeRequest, cancel: threading.Event | None = None,
               progress: ProgressFn | None = None) -> H3Conditioning:
        """Encode remotely; bit-identical to `EncoderStage.encode(request)` on the same weights (lossless media).

        Raises `Cancelled` when `cancel` is set, `RemoteEncodeError` (or a subclass) on failure, and
        `h3_core.rules.H3InputError` for requests that break H3's rules (checked locally first).
        """
        task = request.validate()  # H3's rules, locally, before any upload
        steps = 4
        report = progress or (lambda done, total: None)
        report(0, steps)
        body_json, parts = packing.request_to_wire(request, lossless_video=self.lossless_video, cancel=cancel)
        content_type, buffers = packing.encode_multipart(body_json, parts)
        del parts
        needs = protocol.parse_request(body_json, _CLIENT_LIMITS).needed_components()
        size = sum(len(buffer) for buffer in buffers)
        answer_cap = packing.conditioning_bound(request)
        started = time.monotonic()
        deadline = self._deadline(started)
        tried = _AttemptLog()
        for endpoint, delay in self._attempts(tried, deadline, cancel):
            self._sleep(delay, cancel, deadline)
            try:
                caps = self._handshake(endpoint, cancel, deadline)
                self._check_request_fits(endpoint, caps, needs, size)
                report(1, steps)
                conditioning = self._encode_once(endpoint, caps, body_json, content_type, buffers, cancel, report,
                                                 steps, deadline, answer_cap)
            except (ProtocolMismatchError, ModelMismatchError) as error:
                tried.skipped[endpoint.url] = error  # this endpoint can never serve it: no retry is used up
                continue
            except RemoteRequestError as error:
                if error.code != "component_not_loaded":
                    raise
                tried.skipped[endpoint.url] = error
                continue
            except _Transient as transient:
                tried.failed(endpoint, transient)
                endpoint.capabilities = None  # re-handshake: a restarted server may serve other weights
                continue
            if conditioning.task != task:
                raise RemoteEncodeError(f"{endpoint.url}: the server encoded task {conditioning.task!r} for a "
                                        f"{task!r} request", url=endpoint.url)
            with self._lock:
                self._preferred = self.endpoints.index(endpoint) if endpoint in self.endpoints else 0
            report(steps, steps)
            return conditioning
        failures = tried.failures
        summary = "; ".join(failures[-4:]) or "no attempt made within total_timeout"
        last_error = tried.last_error
        status = last_error.status if last_error is not None else None
        code = last_error.code if last_error is not None else None
        raise RemoteUnavailableError(
            f"remote encode failed after {len(failures)} attempt(s) on {len(self.endpoints)} endpoint(s) in "
            f"{time.monotonic() - started:.1f} s: {summary}", status=status, code=code,
            url=failures[-1].split(": ", 1)[0] if failures else None)

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

    def _endpoint(self, url: str | None) -> _Endpoint:
        if url is None:
            return self._order()[0]
        wanted = _parse_url(url).url
        for endpoint in self.endpoints:
            if endpoint.url == wanted:
                return endpoint
        return _parse_url(url)

    def _order(self) -> list[_Endpoint]:
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

    def _handshake(self, endpoint: _Endpoint, cancel: threading.Event | None, deadline: float,
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

    def _check_request_fits(self, endpoint: _Endpoint, caps: dict, needs: tuple[str, ...], size: int) -> None:
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

    def _encode_once(self, endpoint: _Endpoint, caps: dict, body_json: dict, content_type: str,
                     buffers: list[bytes], cancel: threading.Event | None, report: ProgressFn, steps: int,
                     deadline: float, answer_cap: int) -> H3Conditioning:
        server_deadline = self.deadline_s or max(1.0, self.read_timeout - 1.0)
        server_max = caps["deadline_s"].get("max")
        if isinstance(server_max, (int, float)) and server_max > 0:
            server_deadline = min(server_deadline, float(server_max))
        server_deadline = max(0.5, min(server_deadline, deadline - time.monotonic() - 0.5))
        fields = dict(body_json, model=self._pinned, deadline_s=round(server_deadline, 3))
        # The JSON part changes per attempt (deadline, model): only that buffer is rebuilt.
        payload = [buffers[0], packing.json_part(fields), *buffers[2:]]
        headers = {**self._headers(), "Content-Type": content_type}
        reply = self._call(endpoint, "POST", protocol.ENCODE_PATH, payload, headers, cancel,
                           self.read_timeout, deadline, answer_cap, on_sent=lambda: report(2, steps))
        if reply.status != 200:
            raise self._status_error(endpoint, reply)
        report(3, steps)
        digest = reply.headers.get(protocol.H_SHA256)
        if digest and hashlib.sha256(reply.body).hexdigest() != digest:
            raise _Transient("the conditioning arrived corrupted (sha256 mismatch)")
        try:
            conditioning = H3Conditioning.from_bytes(reply.body)
        except ContractError as error:
            raise RemoteEncodeError(f"{endpoint.url} sent an invalid conditioning: {_short(str(error))}",
                                    status=200, url=endpoint.url) from None
        model = conditioning.metadata.get("model")
        if self._pinned is not None and model is not None and model != self._pinned:
            raise ModelMismatchError(f"{endpoint.url} encoded with model {_short(str(model))}, expected "
                                     f"{self._pinned}", url=endpoint.url)
        return conditioning

    def _status_error(self, endpoint: _Endpoint, reply: _Reply) -> Exception:
        error = reply.error()
        message = str(error.get("message") or "")
        code, field, rid = error.get("code"), error.get("field"), error.get("request_id")
        text = f"{endpoint.url} answered {reply.status}" + (f" {code}" if code else "") + f": {message}"
        kwargs = dict(status=reply.status, code=code, field=field, url=endpoint.url, request_id=rid)
        retry_after = _retry_after(reply.headers.get("Retry-After"))
        if reply.status == 401:
            return RemoteAuthError(text + f" (set the token in {protocol.DEFAULT_TOKEN_ENV})", **kwargs)
        if reply.status in RETRYABLE_STATUS or (reply.status == 504 and code != "deadline_exceeded") or \
                (reply.status == 503 and code == "abandoned"):
            return _Transient(f"{reply.status} {code or ''} {message}".strip(), retry_after,
                              RemoteUnavailableError(text, **kwargs))
        if code == "protocol_mismatch":
            return ProtocolMismatchError(text, **kwargs)
        if code == "model_mismatch":
            return ModelMismatchError(text, **kwargs)
        if 400 <= reply.status < 500 and reply.status not in (404, 405, 408):
            return RemoteRequestError(text, **kwargs)
        if reply.status == 408:
            return _Transient(text, None, RemoteUnavailableError(text, **kwargs))
        return RemoteEncodeError(text, **kwargs)

    def _connection(self, endpoint: _Endpoint) -> http.client.HTTPConnection:
        if endpoint.scheme == "https":
            context = self.ssl_context or ssl.create_default_context()
            return http.client.HTTPSConnection(endpoint.host, endpoint.port, timeout=self.connect_timeout,
                                               context=context)
        return http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=self.connect_timeout)

    def _call(self, endpoint: _Endpoint, method: str, path: str, body: list | None, headers: dict[str, str],
              cancel: threading.Event | None, read_timeout: float, deadline: float, max_bytes: int,
              on_sent: Callable[[], None] | None = None) -> _Reply:
        """One HTTP exchange in a helper thread; the calling thread closes the socket when `cancel` is set or
        the monotonic `deadline` passes (whatever phase: connect, send, headers, body). A 200 answer may be at
        most `max_bytes`, any other at most MAX_SMALL_RESPONSE_BYTES."""
        if deadline - time.monotonic() <= 0:
            raise _Transient("deadline passed before the call")
        conn = self._connection(endpoint)
        conn.timeout = min(self.connect_timeout, max(0.01, deadline - time.monotonic()))
        outcome: dict[str, Any] = {"phase": "connect"}
        aborted = threading.Event()
        buffers = [memoryview(b) for b in body] if body is not None else None

        def run() -> None:
            try:
                conn.connect()
                if aborted.is_set():
                    return
                outcome["phase"] = "send"
                conn.sock.settimeout(read_timeout)
                all_headers = {**self._headers(), **headers}
                if buffers is not None:
                    all_headers["Content-Length"] = str(sum(b.nbytes for b in buffers))
                conn.putrequest(method, endpoint.path(path), skip_accept_encoding=True)
                for key, value in all_headers.items():
                    conn.putheader(key, value)
                conn.endheaders()
                send_error = None
                try:
                    for buffer in buffers or ():
                        for offset in range(0, buffer.nbytes, 1 << 20):
                            if aborted.is_set():
                                return
                            conn.sock.sendall(buffer[offset:offset + (1 << 20)])
                except (BrokenPipeError, ConnectionResetError) as error:
                    send_error = error  # the server may have answered early (401, 413, 429): read that answer
                outcome["sent"] = send_error is None  # reported by the calling thread, not this one
                outcome["phase"] = "read"
                try:
                    response = conn.getresponse()
                except (http.client.HTTPException, OSError):
                    if send_error is not None:
                        raise send_error from None
                    raise
                cap = max_bytes if response.status == 200 else MAX_SMALL_RESPONSE_BYTES
                length = response.getheader("Content-Length")
                if length is not None and length.strip().isdigit() and int(length) > cap:
                    raise RemoteEncodeError(f"{endpoint.url}: the answer declares {_short(length, 24)} bytes, over "
                                            f"the client's limit of {cap} bytes for it", url=endpoint.url)
                data = bytearray()
                while True:
                    chunk = response.read(min(1 << 20, cap + 1 - len(data)))
                    if not chunk:
                        break
                    data += chunk
                    if len(data) > cap:
                        raise RemoteEncodeError(f"{endpoint.url}: the answer is over the client's limit of {cap} "
                                                "bytes for it", url=endpoint.url)
                    if aborted.is_set():
                        return
                data = bytes(data)
                outcome["reply"] = _Reply(response.status, response.headers, data)
            except BaseException as error:  # noqa: BLE001 - handed to the calling thread
                outcome["error"] = error
            finally:
                conn.close()

        worker = threading.Thread(target=run, name="h3-encoder-client", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.05)
            if on_sent is not None and outcome.get("sent"):
                on_sent()
                on_sent = None
            if cancel is not None and cancel.is_set() and worker.is_alive():
                aborted.set()
                _abort(conn)
                worker.join(2.0)
                raise Cancelled(f"cancelled; the connection to {endpoint.url} was closed so the server abandons "
                                "the work")
            if time.monotonic() >= deadline and worker.is_alive():
                aborted.set()
                _abort(conn)
                worker.join(2.0)
                raise _Transient(f"the call's deadline passed during {outcome['phase']} (connect + send + read are "
                                 "bounded together by total_timeout)")
        if on_sent is not None and outcome.get("sent"):
            on_sent()
        if "reply" in outcome:
            return outcome["reply"]
        error = outcome.get("error")
        if cancel is not None and cancel.is_set():
            raise Cancelled("cancelled")
        if isinstance(error, RemoteEncodeError):
            raise error
        if isinstance(error, ssl.SSLCertVerificationError):
            raise RemoteEncodeError(f"{endpoint.url}: TLS certificate not trusted: {error}", url=endpoint.url)
        if isinstance(error, (socket.timeout, TimeoutError)):
            phase = outcome["phase"]
            limit = self.connect_timeout if phase == "connect" else read_timeout
            raise _Transient(f"{phase} timeout after {limit:g} s")
        if isinstance(error, ConnectionRefusedError):
            raise _Transient("connection refused (server down or not listening)")
        if isinstance(error, (http.client.RemoteDisconnected, http.client.IncompleteRead, ConnectionError,
                              http.client.BadStatusLine)):
            raise _Transient(f"connection lost mid-request ({type(error).__name__}: {error})")
        if isinstance(error, OSError):
            raise _Transient(f"network error ({type(error).__name__}: {error})")
        if isinstance(error, http.client.HTTPException):
            raise _Transient(f"malformed HTTP answer ({type(error).__name__}: {error})")
        raise error  # type: ignore[misc]


def _abort(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _short(value: Any, limit: int = MAX_MESSAGE_CHARS) -> Any:
    """A server-supplied string cut to `limit` characters (non-strings pass through, None stays None)."""
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return value


def _loads(data: bytes) -> Any:
    """JSON from a server, with nesting bounded before parsing (a deep document would raise RecursionError)."""
    text = data.decode("utf-8")
    depth = deepest = 0
    for char in text:  # brackets inside strings count too: a bound, not a parser
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        elif char in "]}":
            depth -= 1
    return json.loads(text)


def _checked_capabilities(body: bytes, url: str) -> dict:
    """The capabilities JSON with the shapes this client relies on checked; ProtocolMismatchError otherwise."""
    def fail(why: str) -> ProtocolMismatchError:
        return ProtocolMismatchError(f"{url} is not an H3 encoder server (capabilities are not "
                                     f"{protocol.PROTOCOL_NAME} JSON: {why})", url=url)

    try:
        caps = _loads(body)
    except (UnicodeDecodeError, ValueError) as error:
        raise fail(_short(str(error), 120)) from None
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
    protocol_info = dict(caps["protocol"], versions=versions)
    return dict(caps, protocol=protocol_info, model=model, limits=caps.get("limits", {}),
                deadline_s=caps.get("deadline_s", {}))


class _AttemptLog:
    """What the attempts of one encode found: transient failures (they use up retries) and skipped endpoints."""

    def __init__(self):
        self.failures: list[str] = []
        self.skipped: dict[str, RemoteEncodeError] = {}
        self.last_error: RemoteEncodeError | None = None
        self.retry_after: float | None = None

    def failed(self, endpoint: _Endpoint, transient: _Transient) -> None:
        self.failures.append(f"{endpoint.url}: {_short(str(transient))}")
        self.last_error, self.retry_after = transient.error, transient.retry_after
        log.info("encode attempt %d on %s failed: %s", len(self.failures), endpoint.url, _short(str(transient)))


def _no_endpoint(skipped: dict[str, RemoteEncodeError]) -> RemoteEncodeError:
    first = next(iter(skipped.values()))
    if len(skipped) == 1:
        return first
    reasons = "; ".join(_short(str(error), 200) for error in list(skipped.values())[:4])
    return type(first)(f"no endpoint can serve this request ({len(skipped)}): {reasons}", status=first.status,
                       code=first.code)
