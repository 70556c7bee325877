"""The client's exchanges run in their callers' threads; one watchdog thread aborts them (transport.py, watchdog.py).

Local sockets only: a listener that never accepts (the kernel completes the handshake, nobody answers), one whose
backlog is full (a connect stays in SYN_SENT), one that trickles an answer, one that answers.
"""

import contextlib
import http.client
import socket
import ssl
import threading
import time

import pytest

from h3_core.progress import Cancelled
from h3_core.remote.client import watchdog
from h3_core.remote.client.transport import TIMED_OUT, Transient, exchange, parse_url

WATCHDOG = "h3-encoder-watchdog"


def _listener(backlog: int = 16) -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(backlog)
    return server


def _call(url: str, cancel=None, deadline_s: float = 10.0, connect_timeout: float = 5.0, read_timeout: float = 5.0,
          body=None, on_sent=None, host: str | None = None):
    endpoint = parse_url(url)
    kind = http.client.HTTPSConnection if endpoint.scheme == "https" else http.client.HTTPConnection
    extra = {"context": ssl.create_default_context()} if endpoint.scheme == "https" else {}
    conn = kind(host or endpoint.host, endpoint.port, timeout=connect_timeout, **extra)
    method = "GET" if body is None else "POST"
    return exchange(conn, endpoint, method, "/v1/health", body, {}, cancel, connect_timeout, read_timeout,
                    time.monotonic() + deadline_s, 1 << 20, on_sent)


def _cancel_after(seconds: float, cancel: threading.Event, record: dict) -> threading.Timer:
    def fire():
        record["at"] = time.monotonic()
        cancel.set()

    timer = threading.Timer(seconds, fire)
    timer.start()
    return timer


def _in_flight(count: int, phase: str, within: float = 3.0) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end:
        with watchdog._watchdog.lock:
            phases = [watch.phase for watch in watchdog._watchdog.watches]
        if len(phases) >= count and all(p == phase for p in phases):
            return
        time.sleep(0.01)
    raise AssertionError(f"expected {count} exchanges in {phase}, saw {phases}")


def test_concurrent_exchanges_make_no_thread_but_the_one_watchdog():
    server = _listener()  # never accepts: each exchange waits for its status line
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    cancel = threading.Event()
    before = {thread.ident for thread in threading.enumerate()}
    outcomes: list = []

    def caller():
        try:
            _call(url, cancel, body=[b"x" * 1000])
        except BaseException as error:  # noqa: BLE001 - checked below
            outcomes.append((error, time.monotonic()))

    callers = [threading.Thread(target=caller, name=f"caller-{i}") for i in range(8)]
    try:
        for thread in callers:
            thread.start()
        _in_flight(8, "read")
        new = {thread.name for thread in threading.enumerate() if thread.ident not in before} - \
            {thread.name for thread in callers}
        assert new <= {WATCHDOG}, new
        assert [thread.name for thread in threading.enumerate()].count(WATCHDOG) == 1
        cancelled_at = time.monotonic()
        cancel.set()
        for thread in callers:
            thread.join(2.0)
    finally:
        cancel.set()
        server.close()
    assert len(outcomes) == 8
    for error, at in outcomes:
        assert isinstance(error, Cancelled) and "connection to" in str(error), error
        assert at - cancelled_at < 0.5
    assert not watchdog._watchdog.watches


@contextlib.contextmanager
def _full_listener():
    """The port of a listener whose accept queue is full: the kernel drops further SYNs, a connect stays in
    SYN_SENT."""
    server = _listener(0)
    address = server.getsockname()
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            fillers.append(filler)
            filler.setblocking(False)
            filler.connect_ex(address)
        probe = socket.socket()
        probe.settimeout(0.2)
        try:
            probe.connect(address)
        except (TimeoutError, socket.timeout):
            pass
        except OSError as error:
            pytest.skip(f"this kernel does not leave a connect to a full backlog pending ({error})")
        else:
            pytest.skip("this kernel accepted a connect beyond a full backlog")
        finally:
            probe.close()
        yield address[1]
    finally:
        for filler in fillers:
            filler.close()
        server.close()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_cancel_during_connect_returns_at_once(scheme):
    cancel, record = threading.Event(), {}
    with _full_listener() as port:
        timer = _cancel_after(0.2, cancel, record)
        try:
            with pytest.raises(Cancelled, match="the connection to .* was closed"):
                _call(f"{scheme}://127.0.0.1:{port}", cancel)
            assert time.monotonic() - record["at"] < 0.5
        finally:
            timer.cancel()


def test_cancel_during_the_tls_handshake_returns_at_once():
    server = _listener()  # the handshake's TCP part completes; no ServerHello ever comes
    cancel, record = threading.Event(), {}
    timer = _cancel_after(0.2, cancel, record)
    try:
        with pytest.raises(Cancelled):
            _call(f"https://127.0.0.1:{server.getsockname()[1]}", cancel)
        assert time.monotonic() - record["at"] < 0.5
    finally:
        timer.cancel()
        server.close()


def test_the_deadline_cuts_a_connect_that_hangs():
    with _full_listener() as port:
        started = time.monotonic()
        with pytest.raises(Transient, match="deadline passed during connect") as caught:
            _call(f"http://127.0.0.1:{port}", deadline_s=0.3)
    assert caught.value.code == TIMED_OUT
    assert time.monotonic() - started < 0.6


def _serve_once(server: socket.socket, answer, stop: threading.Event) -> threading.Thread:
    def run():
        conn, _ = server.accept()
        try:
            received = b""
            while b"\r\n\r\n" not in received:
                received += conn.recv(65536)
            head, _, body = received.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")]
            while len(body) < sum(length):  # the whole request read: closing on unread bytes would be a reset
                body += conn.recv(65536)
            answer(conn, stop)
        except OSError:
            pass
        finally:
            conn.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_trickling_server_is_cut_at_the_deadline():
    def trickle(conn, stop):
        for byte in b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n" * 100:
            if stop.wait(0.02):
                return
            conn.sendall(bytes([byte]))

    server, stop = _listener(), threading.Event()
    thread = _serve_once(server, trickle, stop)
    started = time.monotonic()
    try:
        with pytest.raises(Transient, match="deadline passed during read") as caught:
            _call(f"http://127.0.0.1:{server.getsockname()[1]}", threading.Event(), deadline_s=0.5, read_timeout=5)
    finally:
        stop.set()
        thread.join(2)
        server.close()
    assert caught.value.code == TIMED_OUT
    assert 0.45 < time.monotonic() - started < 0.8


def test_an_answer_comes_back_after_on_sent(monkeypatch):
    """A host name goes through the resolver threads (never more than two), and the answer is read as before."""
    def answer(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    real = socket.getaddrinfo

    def lookup(host, port, family=0, kind=0, proto=0, flags=0):
        if host == "encoder.test":
            if flags & socket.AI_NUMERICHOST:
                raise socket.gaierror(socket.EAI_NONAME, "not numeric")
            assert threading.current_thread().name.startswith("h3-encoder-resolve-")
            host = "127.0.0.1"
        return real(host, port, family, kind, proto, flags)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    server, stop = _listener(), threading.Event()
    thread = _serve_once(server, answer, stop)
    sent = []
    try:
        reply = _call(f"http://encoder.test:{server.getsockname()[1]}", threading.Event(), body=[b"abc"],
                      on_sent=lambda: sent.append(True))
    finally:
        thread.join(2)
        server.close()
    assert (reply.status, bytes(reply.body), sent) == (200, b"ok", [True])
    names = [thread.name for thread in threading.enumerate()]
    assert 1 <= sum(name.startswith("h3-encoder-resolve-") for name in names) <= watchdog.RESOLVERS


def test_cancel_during_a_name_lookup_returns_at_once(monkeypatch):
    release = threading.Event()
    real = socket.getaddrinfo

    def lookup(host, port, family=0, kind=0, proto=0, flags=0):
        if host == "hangs.test":
            if flags & socket.AI_NUMERICHOST:
                raise socket.gaierror(socket.EAI_NONAME, "not numeric")
            release.wait(5)  # a resolver that does not answer
            raise socket.gaierror(socket.EAI_NONAME, "never mind")
        return real(host, port, family, kind, proto, flags)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    cancel, record = threading.Event(), {}
    timer = _cancel_after(0.2, cancel, record)
    try:
        with pytest.raises(Cancelled):
            _call("http://hangs.test:9", cancel)
        assert time.monotonic() - record["at"] < 0.5
        with pytest.raises(Transient, match="deadline passed during connect"):
            _call("http://hangs.test:9", deadline_s=0.2)
    finally:
        timer.cancel()
        release.set()
