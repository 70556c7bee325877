"""The client's side of one HTTP exchange, and the errors a remote encode can end in.

`exchange` runs one request in the calling thread, registered with the client's one watchdog thread
(`watchdog.py`), which shuts the socket down when `cancel` is set or the monotonic deadline passes, in any phase
(name lookup, connect, TLS handshake, send, status line, headers, body): a prompt's Cancel reaches the server as a
closed connection at once, and a server trickling one byte at a time cannot hold the caller past its deadline. One
watchdog serves every exchange in flight, so an exchange costs no thread of its own. Every answer is read with a
cap on what it can legitimately be; a Content-Length over the cap is refused before reading.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from ...progress import Cancelled
from .. import protocol
from .watchdog import ABORTED, Watch

MAX_SMALL_RESPONSE_BYTES = 1024 * 1024  # capabilities, health and error answers
MAX_MESSAGE_CHARS = 300  # of a server's error message, as repeated in this client's exceptions
MAX_JSON_DEPTH = 32
READ_PIECE = 1 << 20  # bytes per read of an answer: the granularity at which an abort is noticed


class RemoteEncodeError(RuntimeError):
    """The remote encode failed. `str(error)` is the whole sentence (logs, the CLI); callers that build their own
    words (the Remote Encode node) read the fields:

    status:     the HTTP status the endpoint answered (None: it never answered, e.g. connection refused)
    code:       the server's error code (its JSON error), or this client's own for a refusal made here
    field:      the request field the server's error names (e.g. ``ref_videos[0]``), or None
    message:    the server's own message, as its JSON error gave it (cut short); None when it sent none
    url:        the endpoint
    request_id: the server's id for the request, when it gave one
    """

    def __init__(self, text: str, *, status: int | None = None, code: str | None = None,
                 field: str | None = None, url: str | None = None, request_id: str | None = None,
                 message: str | None = None):
        super().__init__(text)
        self.status, self.code, self.field, self.message = status, code, field, message
        self.url, self.request_id = url, request_id


class RemoteRequestError(RemoteEncodeError, ValueError):
    """The server refused the request itself (400/409/413/415/422): fix the inputs, retrying will not help."""


class RemoteAuthError(RemoteEncodeError):
    """401/403: no token, or the wrong one (set H3_ENCODER_TOKEN, or the variable the client was told to read)."""


class RemoteUnavailableError(RemoteEncodeError):
    """No endpoint answered usefully within the retries and timeouts (down, refusing, busy or timing out)."""


class ProtocolMismatchError(RemoteEncodeError):
    """The endpoint speaks another protocol version than this client."""


class ModelMismatchError(RemoteEncodeError):
    """The endpoint serves other weights than the ones pinned (by `expect_model` or the first handshake)."""


@dataclass
class Endpoint:
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
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: Any  # bytes-like; a 200 answer read through `on_body` is that receiver's buffer, the caller's to hand over
    receipt: Any = None  # the `on_body` receiver that filled a 200 answer's buffer

    def error(self) -> dict[str, Any]:
        try:
            body = json.loads(self.body.decode("utf-8"))
            error = body.get("error") if isinstance(body, dict) else None
            if isinstance(error, dict):
                # Only strings, each cut short: a hostile server cannot make the caller's messages huge.
                fields = {key: short(value) if isinstance(value := error.get(key), str) else None
                          for key in ("code", "message", "field", "request_id")}
                return dict(fields, json=True)
        except (UnicodeDecodeError, ValueError, RecursionError):
            pass
        text = self.body[:200].decode("utf-8", "replace").strip()
        return {"code": None, "message": text or http.client.responses.get(self.status, "error"), "field": None,
                "json": False}


# This client's codes for an endpoint that never answered usefully (`RemoteEncodeError.code` with status None).
CONNECTION_REFUSED = "connection_refused"
HOST_NOT_FOUND = "host_not_found"
TIMED_OUT = "timed_out"
CONNECTION_LOST = "connection_lost"
NETWORK_ERROR = "network_error"
MALFORMED_ANSWER = "malformed_answer"
TLS_UNTRUSTED = "tls_untrusted"


class Transient(Exception):
    """One attempt failed in a way another attempt (or endpoint) may not: `error` when the server answered,
    `code` (one of the codes above) when the network failed."""

    def __init__(self, message: str, retry_after: float | None = None, error: RemoteEncodeError | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.retry_after, self.error, self.code = retry_after, error, code


def parse_url(url: str) -> Endpoint:
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
    return Endpoint(url=f"{parts.scheme}://{parts.netloc}{prefix}", scheme=parts.scheme, host=parts.hostname,
                     port=port, prefix=prefix)


def exchange(conn: http.client.HTTPConnection, endpoint: Endpoint, method: str, path: str, body: list | None,
             headers: dict[str, str], cancel: threading.Event | None, connect_timeout: float, read_timeout: float,
             deadline: float, max_bytes: int, on_sent: Callable[[], None] | None = None,
             on_body: Callable[[int], Any] | None = None) -> Reply:
    """One HTTP exchange in the calling thread; the watchdog closes the socket when `cancel` is set or the
    monotonic `deadline` passes (whatever phase: connect, send, headers, body). `on_sent()` is called once the
    body is wholly sent, before the answer is read. A 200 answer may be at most `max_bytes`, any other at most
    MAX_SMALL_RESPONSE_BYTES. For a 200 answer with a Content-Length, `on_body(length)` returns an object holding
    the buffer to read into (`.buf`) whose `advance(end)` is called after each read (bytes [0, end) in place); it
    comes back as `Reply.receipt`, its buffer as `Reply.body`."""
    if deadline - time.monotonic() <= 0:
        raise Transient("deadline passed before the call", code=TIMED_OUT)
    conn.timeout = min(connect_timeout, max(0.01, deadline - time.monotonic()))
    buffers = [memoryview(b) for b in body] if body is not None else None
    failure: Exception | None = None
    with Watch(cancel, deadline) as watch:
        conn._create_connection = watch.connect  # connect(): resolution and connect under the watch
        try:
            try:
                send_error = _send(conn, watch, endpoint.path(path), method, headers, buffers, read_timeout)
            except Exception as error:
                failure = error
            else:
                if on_sent is not None and send_error is None:
                    on_sent()  # the caller's own: what it raises is not the network's
                try:
                    return _receive(conn, watch, endpoint.url, send_error, max_bytes, on_body)
                except Exception as error:
                    failure = error
        finally:
            conn.close()
    raise _failure(failure, watch, cancel, endpoint.url, connect_timeout, read_timeout)


def _send(conn: http.client.HTTPConnection, watch: Watch, target: str, method: str, headers: dict[str, str],
          buffers: list[memoryview] | None, read_timeout: float) -> OSError | None:
    """Connect, then send the request; the error that cut the body short (the server may have answered early:
    401, 413, 429), or None when all of it was sent."""
    conn.connect()
    if watch.aborted.is_set():
        raise ConnectionAbortedError(ABORTED)
    watch.phase = "send"
    conn.sock.settimeout(read_timeout)
    all_headers = dict(headers)
    if buffers is not None:
        all_headers["Content-Length"] = str(sum(b.nbytes for b in buffers))
    conn.putrequest(method, target, skip_accept_encoding=True)
    for key, value in all_headers.items():
        conn.putheader(key, value)
    conn.endheaders()
    send_error = None
    try:
        for buffer in buffers or ():
            for offset in range(0, buffer.nbytes, 1 << 20):
                if watch.aborted.is_set():
                    raise ConnectionAbortedError(ABORTED)
                conn.sock.sendall(buffer[offset:offset + (1 << 20)])
    except (BrokenPipeError, ConnectionResetError) as error:
        send_error = error  # the server may have answered early (401, 413, 429): read that answer
    watch.phase = "read"
    return send_error


def _receive(conn: http.client.HTTPConnection, watch: Watch, url: str, send_error: OSError | None, max_bytes: int,
             on_body: Callable[[int], Any] | None) -> Reply:
    try:
        response = conn.getresponse()
    except (http.client.HTTPException, OSError):
        if send_error is not None:
            raise send_error from None
        raise
    cap = max_bytes if response.status == 200 else MAX_SMALL_RESPONSE_BYTES
    declared = (response.getheader("Content-Length") or "").strip()
    if declared.isdigit() and (len(declared) > 18 or int(declared) > cap):
        raise RemoteEncodeError(f"{url}: the answer declares {short(declared, 24)} bytes, over the client's limit "
                                f"of {cap} bytes for it", url=url)
    # http.client's own reading of Content-Length (None when chunked or unparsable)
    length = None if response.chunked else response.length
    receipt: list = []
    watch_body = on_body if response.status == 200 else None
    data = _read_body(response, length, cap, watch.aborted, url, watch_body, receipt)
    if data is None or watch.aborted.is_set():
        raise ConnectionAbortedError(ABORTED)
    return Reply(response.status, response.headers, data, receipt[0] if receipt else None)


def _failure(error: Exception | None, watch: Watch, cancel: threading.Event | None, url: str,
             connect_timeout: float, read_timeout: float) -> BaseException:
    """What a failed exchange raises: the watchdog's abort, else the network's error as this client's own."""
    if watch.reason == "cancel":
        return Cancelled(f"cancelled; the connection to {url} was closed so the server abandons the work")
    if watch.reason == "deadline":
        return Transient(f"the call's deadline passed during {watch.phase_aborted} (connect + send + read are "
                         "bounded together by total_timeout)", code=TIMED_OUT)
    if cancel is not None and cancel.is_set():
        return Cancelled("cancelled")
    if isinstance(error, RemoteEncodeError):
        return error
    if isinstance(error, ssl.SSLCertVerificationError):
        return RemoteEncodeError(f"{url}: TLS certificate not trusted: {error}", url=url, code=TLS_UNTRUSTED)
    if isinstance(error, (socket.timeout, TimeoutError)):
        limit = connect_timeout if watch.phase == "connect" else read_timeout
        return Transient(f"{watch.phase} timeout after {limit:g} s", code=TIMED_OUT)
    if isinstance(error, ConnectionRefusedError):
        return Transient("connection refused (server down or not listening)", code=CONNECTION_REFUSED)
    if isinstance(error, (http.client.RemoteDisconnected, http.client.IncompleteRead, ConnectionError,
                          http.client.BadStatusLine)):
        return Transient(f"connection lost mid-request ({type(error).__name__}: {error})", code=CONNECTION_LOST)
    if isinstance(error, socket.gaierror):
        return Transient(f"host name not found ({error})", code=HOST_NOT_FOUND)
    if isinstance(error, OSError):
        return Transient(f"network error ({type(error).__name__}: {error})", code=NETWORK_ERROR)
    if isinstance(error, http.client.HTTPException):
        return Transient(f"malformed HTTP answer ({type(error).__name__}: {error})", code=MALFORMED_ANSWER)
    return error  # type: ignore[return-value]


def _read_body(response: http.client.HTTPResponse, length: int | None, cap: int, aborted: threading.Event,
               url: str, on_body: Callable[[int], Any] | None = None, receipt: list | None = None) -> Any:
    """The whole body in one buffer (None if aborted). With a Content-Length, the buffer is allocated once at that
    size (by `on_body(length)`, whose `.buf` it is, when given) and filled in place (`readinto`: the socket writes
    straight into it), so the answer's bytes are copied only by the kernel; without one, it grows up to `cap`.
    A short body raises `IncompleteRead`."""
    if length is not None:
        watcher = on_body(length) if on_body is not None else None
        data = watcher.buf if watcher is not None else bytearray(length)
        if receipt is not None and watcher is not None:
            receipt.append(watcher)
        view, got = memoryview(data), 0
        while got < length:
            n = response.readinto(view[got:got + READ_PIECE])
            if not n:
                raise http.client.IncompleteRead(bytes(0), length - got)
            got += n
            if watcher is not None:
                watcher.advance(got)  # e.g. the checksum of the piece just read, while it is in the CPU's cache
                if getattr(watcher, "refusal", None) is not None:
                    return data  # the header is refused (too long, malformed): the caller reports it, unread rest
            if aborted.is_set():
                return None
        return data
    data = bytearray()
    while True:
        chunk = response.read(min(READ_PIECE, cap + 1 - len(data)))
        if not chunk:
            return data
        data += chunk
        if len(data) > cap:
            raise RemoteEncodeError(f"{url}: the answer is over the client's limit of {cap} bytes for it", url=url)
        if aborted.is_set():
            return None


def parse_retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def short(value: Any, limit: int = MAX_MESSAGE_CHARS) -> Any:
    """A server-supplied string cut to `limit` characters (non-strings pass through, None stays None)."""
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return value


def loads(data: bytes) -> Any:
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
