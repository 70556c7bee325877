"""One thread for the whole client that shuts an exchange's socket down when its cancel is set or its deadline passes.

`transport.exchange` runs each HTTP exchange in the calling thread, inside `with Watch(cancel, deadline)`. A blocked
socket call cannot be interrupted from its own thread, so the watchdog (one daemon thread, started by the first
exchange, shared by all) does it: it sleeps until the earliest deadline in flight, waking every 50 ms while an
exchange with a cancel event is in flight (an event has no waiters to tell it), and shuts the exchange's socket down
(`shutdown(SHUT_RDWR)`): a blocked connect (SYN_SENT), TLS handshake, send or read returns at once with an error,
which the exchange reports as cancelled or timed out. Only the calling thread closes its sockets, so the watchdog
never touches a descriptor the kernel may have given to another socket.

Connect stays abortable: http.client connects through `Watch.connect`, which registers each socket before its
`connect()`. The watchdog holds a duplicate descriptor of it (`socket.dup`): the same kernel socket, reachable
while `ssl.wrap_socket` moves the original descriptor into the TLS socket and after (`conn.sock` is then a new
object). A host name that is not a numeric address nor `localhost` is resolved by one of two resolver threads (for
the whole process: `getaddrinfo` cannot be interrupted), which the exchange waits on until the answer, its cancel
or its deadline.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import socket
import threading
import time
from typing import Any

POLL_S = 0.05  # how often a cancel event is looked at while an exchange that has one is in flight
RESOLVERS = 2  # threads resolving host names, for the whole process
MAX_SLEEP_S = 60.0  # the longest sleep while an exchange is in flight (a far or infinite deadline)
ABORTED = "closed by the client's watchdog"


class Watch:
    """One exchange in flight, watched from `with Watch(cancel, deadline)` to the block's end. Once aborted,
    `reason` is "cancel" or "deadline", `phase_aborted` the `phase` the exchange was in, and `aborted` is set."""

    def __init__(self, cancel: Any, deadline: float):
        self.cancel, self.deadline = cancel, deadline  # cancel: anything with `is_set()` (threading.Event), or None
        self.phase = "connect"  # the exchange's own record: connect, send, read
        self.reason: str | None = None
        self.phase_aborted: str | None = None
        self.aborted = threading.Event()
        self.woken = threading.Event()  # set on abort, and when a name lookup the exchange waits on ends
        self.sockets: list[socket.socket] = []  # the watchdog's duplicates; changed under the watchdog's lock

    def __enter__(self) -> Watch:
        _watchdog.add(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _watchdog.discard(self)

    def connect(self, address: tuple[str, int], timeout: Any, source_address: Any = None) -> socket.socket:
        """`socket.create_connection` (each address in turn, the last error raised), each socket registered with
        the watchdog before its connect; http.client calls it as `conn._create_connection`."""
        host, port = address
        error: OSError | None = None
        for family, kind, proto, _, sockaddr in self._resolve(host, port):
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(timeout)
                if source_address:
                    sock.bind(source_address)
                _watchdog.adopt(self, sock)
                sock.connect(sockaddr)
                return sock
            except OSError as failure:
                sock.close()
                if self.aborted.is_set():
                    raise
                error = failure
        raise error if error is not None else OSError("getaddrinfo returns an empty list")

    def _resolve(self, host: str, port: int) -> list:
        try:  # a numeric address: no lookup
            return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
        except socket.gaierror:
            pass
        if host == "localhost":  # the hosts file
            return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        lookup = _resolver.submit(host, port)
        lookup.add_done_callback(lambda _: self.woken.set())
        self.woken.wait()  # the answer, or the watchdog's abort
        if self.aborted.is_set():
            lookup.cancel()  # if it is still queued; a lookup under way ends in its resolver thread, unread
            raise ConnectionAbortedError(ABORTED)
        return lookup.result()


def _shut(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected (yet, or any more)


class _Watchdog:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.watches: set[Watch] = set()
        self.thread: threading.Thread | None = None

    def add(self, watch: Watch) -> None:
        with self.changed:
            self.watches.add(watch)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self.run, name="h3-encoder-watchdog", daemon=True)
                self.thread.start()
            self.changed.notify()  # its deadline may be the earliest; a cancel event to look at

    def discard(self, watch: Watch) -> None:
        with self.lock:
            self.watches.discard(watch)
            sockets, watch.sockets = watch.sockets, []
        for sock in sockets:
            sock.close()

    def adopt(self, watch: Watch, sock: socket.socket) -> None:
        duplicate = sock.dup()
        with self.lock:
            if watch.reason is None:
                watch.sockets.append(duplicate)
                return
        duplicate.close()
        raise ConnectionAbortedError(ABORTED)

    def run(self) -> None:
        with self.changed:
            while True:
                now, wait = time.monotonic(), None
                for watch in self.watches:
                    if watch.reason is None:
                        if _is_set(watch.cancel):
                            self.abort(watch, "cancel")
                        elif now >= watch.deadline:
                            self.abort(watch, "deadline")
                    if watch.reason is not None:
                        # Again at each look while it is in flight: a connect begun just after a shutdown (which
                        # does nothing to a socket not yet connecting) is caught by the next one.
                        _shut(watch.sockets)
                        wait = POLL_S
                    else:
                        due = min(watch.deadline - now, POLL_S) if watch.cancel is not None else watch.deadline - now
                        wait = due if wait is None else min(wait, due)
                self.changed.wait(None if wait is None else min(wait, MAX_SLEEP_S))

    def abort(self, watch: Watch, reason: str) -> None:
        watch.reason, watch.phase_aborted = reason, watch.phase
        watch.aborted.set()
        watch.woken.set()


def _is_set(cancel: Any) -> bool:
    try:
        return cancel is not None and bool(cancel.is_set())
    except Exception:  # noqa: BLE001 - a broken flag must not stop the watchdog; the exchange itself will see it
        return False


class _Resolver:
    """`getaddrinfo` on up to RESOLVERS daemon threads, started as needed (a lookup that hangs must not hold the
    interpreter's exit, as a ThreadPoolExecutor's threads would)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads = 0

    def submit(self, host: str, port: int) -> concurrent.futures.Future:
        lookup: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((lookup, host, port))
        with self.lock:
            if self.threads < RESOLVERS:
                self.threads += 1
                threading.Thread(target=self.run, name=f"h3-encoder-resolve-{self.threads}", daemon=True).start()
        return lookup

    def run(self) -> None:
        while True:
            lookup, host, port = self.jobs.get()
            if not lookup.set_running_or_notify_cancel():
                continue
            try:
                lookup.set_result(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
            except Exception as error:  # noqa: BLE001 - handed to the exchange waiting on it
                lookup.set_exception(error)


_watchdog = _Watchdog()
_resolver = _Resolver()


def _after_fork() -> None:
    """A forked child has none of the parent's threads, and its locks may have been held at the fork."""
    global _watchdog, _resolver
    _watchdog, _resolver = _Watchdog(), _Resolver()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
