"""Hostile local peers against the multi-GPU worker pool (h3_core/sequence_parallel_workers.py and
sequence_parallel_channel.py) and the ranks' rendezvous (sequence_parallel.init_rank).

While a pool starts, its host listens on a loopback port that any local process can read from a worker's command
line. Such a peer must not hold the start (a byte every few seconds), make the host allocate what it declares, nor
crash it; the real workers are admitted meanwhile. The pool's rank launcher is a stand-in here (`_Sleeper`: the
real command line, a process that reports a pid for each rank, as the launcher does before the rank may connect, and
waits), and the test plays the ranks' part of the protocol, so no model is loaded.
Every socket the ranks' process group listens on is loopback.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc

import pytest
from support.listening import external_interface, ipv4_of, is_loopback, listening

from h3_core import sequence_parallel
from h3_core import sequence_parallel_workers as workers
from h3_core.progress import Cancelled
from h3_core.sequence_parallel_channel import (
    HELLO_TIMEOUT_S,
    TOKEN_ENV,
    Channel,
    ChannelClosed,
    accept_hellos,
    preamble,
)

RECIPE = workers.DiTRecipe(component="transformer", path="/nonexistent/dit.safetensors", root="/nonexistent",
                           weights_layout="comfyui", tiny=True, dtype="float32", pipeline_config="{}", fingerprint="")
LAYOUT = sequence_parallel.Layout(2)
OLD_HELLO = b'{"kind":"hello"}'  # with its 12-byte frame: the 28-byte hello of the old protocol
MiB = 1 << 20
_LAUNCHER = textwrap.dedent("""
    import json, os, sys
    argv = sys.argv[1:]
    fd, ranks = int(argv[argv.index("--status-fd") + 1]), int(argv[argv.index("--ranks") + 1])
    for rank in range(ranks):
        os.write(fd, (json.dumps({"kind": "forked", "rank": rank, "pid": os.getpid()}) + "\\n").encode())
    sys.stdin.read()
""")


class _Sleeper(subprocess.Popen):
    """A rank launcher that forks nothing: the pool's own command line (so its --host port is public, as it is for a
    real launcher), running a Python that reports its own pid as every rank's on the status pipe (the stand-in ranks
    are the test's threads) and waits until the pool stops it (its stdin closes)."""

    started: list[_Sleeper] = []

    def __init__(self, args, **kwargs):
        self.argv, self.env = list(args), dict(kwargs.get("env") or {})
        kwargs["stdin"] = subprocess.PIPE
        super().__init__([sys.executable, "-c", _LAUNCHER, *args[1:]], **kwargs)
        _Sleeper.started.append(self)

    @property
    def port(self) -> int:
        return int(self.argv[self.argv.index("--host") + 1].rsplit(":", 1)[1])

    def wait(self, timeout=None):
        if self.stdin is not None and not self.stdin.closed:
            self.stdin.close()
        return super().wait(timeout)


@pytest.fixture
def sleepers(monkeypatch):
    _Sleeper.started = []
    monkeypatch.setattr(workers.subprocess, "Popen", _Sleeper)
    yield _Sleeper.started
    for proc in _Sleeper.started:
        proc.kill()
        proc.wait()


def _port(sleepers, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not sleepers:
        assert time.monotonic() < deadline, "the pool did not start its rank launcher"
        time.sleep(0.01)
    return sleepers[0].port


class _Start(threading.Thread):
    """`pool.start(...)` in a thread: what it returned or raised, and when."""

    def __init__(self, pool, **kwargs):
        super().__init__(daemon=True)
        self.pool, self.kwargs, self.error, self.ended = pool, kwargs, None, None
        self.start()

    def run(self):
        try:
            self.pool.start(**self.kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            self.error = error
        self.ended = time.monotonic()


class _Trickler(threading.Thread):
    """Connects and sends, one byte every `every_s`, an old-protocol frame declaring the largest header the old code
    read (1 MiB): for ever, until stopped."""

    def __init__(self, port: int, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.every_s, self.stop, self.sent = every_s, threading.Event(), 0
        self.start()

    def run(self):
        data = struct.pack(">IQ", 1 << 20, 0) + b" " * (1 << 20)
        for byte in data:
            if self.stop.wait(self.every_s):
                break
            try:
                self.sock.sendall(bytes([byte]))
            except OSError:
                return
            self.sent += 1
        self.sock.close()


def _fake_worker(port: int, token: str, rank: int, pid: int, stop: threading.Event) -> threading.Thread:
    """A worker's side of the start: the hello, then `ready` for the setup, then wait until the pool closes."""

    def run():
        channel = Channel(socket.create_connection(("127.0.0.1", port)))
        channel.send_hello(token, {"kind": "hello", "rank": rank, "pid": pid})
        try:
            setup, _ = channel.recv()
            assert setup["kind"] == "setup"
            channel.send({"kind": "ready"})
            channel.sock.settimeout(60)
            channel.recv()
        except (OSError, ChannelClosed):
            pass
        finally:
            channel.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# --- the pool's start ------------------------------------------------------------------------------------------------


def test_a_trickling_connection_does_not_hold_the_start_past_its_deadline(sleepers):
    """Old code: the host read the trickler's hello with a 10 s timeout per byte, so one byte every 0.2 s held the
    start for ever (neither the 1 s start limit nor anything else was checked)."""
    pool = workers.WorkerPool(RECIPE, LAYOUT)
    began = time.monotonic()
    start = _Start(pool, timeout_s=1.0)
    trickler = _Trickler(_port(sleepers))
    try:
        start.join(timeout=30.0)
        assert not start.is_alive(), f"the start is still held by a trickling peer ({trickler.sent} bytes sent)"
    finally:
        trickler.stop.set()
        start.join(timeout=30.0)
    assert isinstance(start.error, workers.WorkerError) and "not done starting in time" in str(start.error)
    assert start.ended - began < 15.0  # 1 s of start limit; the rest is a busy machine starting two Pythons
    assert pool.closed and all(proc.poll() is not None for proc in sleepers)


def test_cancel_during_the_start_stops_it_while_a_peer_trickles(sleepers):
    cancel = threading.Event()
    pool = workers.WorkerPool(RECIPE, LAYOUT)
    start = _Start(pool, cancel=cancel)  # the default 1800 s start limit
    trickler = _Trickler(_port(sleepers))
    try:
        while trickler.sent < 3:  # the host is now reading (or not) the trickler's connection
            time.sleep(0.05)
        cancel.set()
        cancelled_at = time.monotonic()
        start.join(timeout=30.0)
        assert not start.is_alive(), "ComfyUI's interrupt was not honoured while a peer trickled a hello"
    finally:
        trickler.stop.set()
        start.join(timeout=30.0)
    assert isinstance(start.error, Cancelled) and "cancelled while starting" in str(start.error)
    assert start.ended - cancelled_at < 10.0  # one poll, then stopping two waiting Pythons
    assert all(proc.poll() is not None for proc in sleepers)


@pytest.mark.parametrize("declared", [1 << 40, 1 << 63])
def test_a_28_byte_hello_declaring_a_huge_payload_is_dropped_and_the_workers_start(sleepers, declared):
    """Old code: 2**63 failed the start with a raw OverflowError, 2**40 with MemoryError (and what fits in memory,
    e.g. 2**30, was allocated: +1 GiB from 28 bytes). Now the peer is dropped and the real workers start the pool."""
    pool = workers.WorkerPool(RECIPE, LAYOUT)
    start = _Start(pool, timeout_s=120.0)
    port = _port(sleepers)
    hostile = socket.create_connection(("127.0.0.1", port))
    hostile.sendall(struct.pack(">IQ", len(OLD_HELLO), declared) + OLD_HELLO)
    time.sleep(0.3)  # the host's turn to read it (it must not matter)
    stop = threading.Event()
    token = sleepers[0].env[TOKEN_ENV]
    fakes = [_fake_worker(port, token, rank, sleepers[0].pid, stop) for rank in range(LAYOUT.degree)]
    start.join(timeout=60.0)
    hostile.close()
    try:
        assert not start.is_alive() and start.error is None, f"the start failed: {start.error!r}"
        assert sorted(pool.channels) == [0, 1] and pool.alive()
    finally:
        pool.close()
        for fake in fakes:
            fake.join(timeout=30.0)


# --- the gate itself (no processes) ----------------------------------------------------------------------------------


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Gate(threading.Thread):
    """accept_hellos on a fresh loopback listener in a thread, admitting hellos whose rank is 0 or 1."""

    def __init__(self, clock=time.monotonic, wanted: int = 2, token: str = "a" * 64, **kwargs):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.token, self.clock, self.wanted, self.kwargs = self.listener.getsockname()[1], token, clock, \
            wanted, kwargs
        self.cancel, self.result, self.error, self.peak = threading.Event(), None, None, None
        self.start()

    def run(self):
        def poll():
            if self.cancel.is_set():
                raise Cancelled("cancelled")

        tracemalloc.start()
        try:
            self.result = accept_hellos(self.listener, self.token, self.wanted,
                                        lambda hello: hello.get("rank") if hello.get("rank") in (0, 1) else None,
                                        poll, clock=self.clock, **self.kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            self.error = error
        finally:
            self.peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            self.listener.close()

    def hello(self, rank: int, token: str | None = None) -> Channel:
        channel = Channel(socket.create_connection(("127.0.0.1", self.port)))
        channel.send_hello(self.token if token is None else token, {"kind": "hello", "rank": rank, "pid": 1})
        return channel


def _closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def test_one_deadline_for_the_whole_hello_on_the_gates_clock_and_workers_pass_meanwhile():
    clock = _Clock()
    admitted = threading.Event()
    gate = _Gate(clock=clock, on_accepted=lambda count: admitted.set())
    trickler = socket.create_connection(("127.0.0.1", gate.port))
    sent = 0
    for byte in preamble(gate.token)[:20]:  # a right-looking start, a byte at a time
        trickler.sendall(bytes([byte]))
        sent += 1
        clock.now += HELLO_TIMEOUT_S / 40  # well within the deadline so far (half of it after 20 bytes)
        time.sleep(0.02)
    assert not _closed_by_peer(trickler, 0.5)  # still pending: its deadline has not passed
    first = gate.hello(0)  # a real worker is admitted while the trickler is pending
    # Only once the gate has admitted it is the clock moved on: on a busy machine its hello could otherwise still be
    # unread when the clock passes its own deadline too (which the gate then rightly enforces).
    assert admitted.wait(60.0), "the real worker's hello was not admitted"
    clock.now += HELLO_TIMEOUT_S  # past the trickler's deadline (it was accepted by half of it), bytes or not
    trickler.sendall(preamble(gate.token)[sent:sent + 1])
    assert _closed_by_peer(trickler, 10.0)
    second = gate.hello(1)
    gate.join(timeout=30.0)
    assert gate.error is None and sorted(gate.result) == [0, 1]
    for channel in (first, second, *gate.result.values()):
        channel.close()


def test_a_wrong_token_is_dropped_before_its_hello_is_read_and_duplicates_too():
    gate = _Gate(wanted=1)
    wrong = gate.hello(0, token="b" * 64)
    assert _closed_by_peer(wrong.sock, 10.0)
    good = gate.hello(0)
    gate.join(timeout=30.0)
    assert gate.error is None and list(gate.result) == [0]
    for channel in (wrong, good, *gate.result.values()):
        channel.close()


@pytest.mark.parametrize("declared", [1 << 30, 1 << 40, 1 << 63])
@pytest.mark.parametrize("knows_token", [False, True])
def test_declared_sizes_allocate_nothing_before_and_after_the_token(declared, knows_token):
    """The 28 bytes of the old hello (frame + header) declaring a huge payload, sent by a peer without the token (read
    as a wrong preamble) or with it (a hello must have no payload): dropped, with no allocation of its size."""
    gate = _Gate(wanted=1)
    peer = socket.create_connection(("127.0.0.1", gate.port))
    if knows_token:
        peer.sendall(preamble(gate.token))
    peer.sendall(struct.pack(">IQ", len(OLD_HELLO), declared) + OLD_HELLO + bytes(100))
    assert _closed_by_peer(peer, 10.0)
    good = gate.hello(0)
    gate.join(timeout=30.0)
    assert gate.error is None and list(gate.result) == [0]
    assert gate.peak < 1 * MiB, f"{gate.peak} bytes allocated while reading hellos"
    for channel in (good, *gate.result.values()):
        channel.close()
    peer.close()


def test_cancel_stops_the_gate_while_a_connection_is_pending():
    gate = _Gate()
    pending = socket.create_connection(("127.0.0.1", gate.port))
    pending.sendall(b"H")
    time.sleep(0.3)
    gate.cancel.set()
    gate.join(timeout=10.0)
    assert not gate.is_alive() and isinstance(gate.error, Cancelled)
    assert _closed_by_peer(pending, 10.0)  # nothing left open behind it
    pending.close()


def test_more_connections_than_the_gate_reads_at_once_drop_the_oldest():
    gate = _Gate(wanted=1, max_pending=4)
    idle = [socket.create_connection(("127.0.0.1", gate.port)) for _ in range(8)]
    good = gate.hello(0)
    gate.join(timeout=30.0)
    assert gate.error is None and list(gate.result) == [0]
    for sock in idle:
        sock.close()
    for channel in (good, *gate.result.values()):
        channel.close()


def test_an_authenticated_channel_bounds_what_a_frame_may_declare():
    """After the hello, a frame declaring more than MAX_PAYLOAD (2**63: a raw OverflowError in the old code) closes
    the channel; one declaring 1 GiB and sending 10 bytes allocates what arrived, in bounded buffers."""
    for declared in (1 << 40, 1 << 63):
        left, right = socket.socketpair()
        left.sendall(struct.pack(">IQ", len(OLD_HELLO), declared) + OLD_HELLO)
        with pytest.raises(ChannelClosed, match="payload .*not this protocol"):
            Channel(right).recv()
        left.close(), right.close()
    left, right = socket.socketpair()
    channel = Channel(right)
    left.sendall(struct.pack(">IQ", len(OLD_HELLO), 1 << 30) + OLD_HELLO + bytes(10))
    left.close()
    tracemalloc.start()
    try:
        with pytest.raises(ChannelClosed, match="closed"):
            channel.recv()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * MiB  # one 16 MiB receive buffer at most, not the declared GiB
    channel.close()


# --- the ranks' process group listens on loopback only ---------------------------------------------------------------

_RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from h3_core import sequence_parallel as sp
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    sp.init_rank(sp.Layout(2), rank, port, timeout_s=120)
    t = torch.ones(1); dist.all_reduce(t)
    print("joined", flush=True)
    sys.stdin.read()
    import os; os._exit(0)
""")


def test_every_socket_of_the_ranks_process_group_listens_on_loopback():
    """Old code: rank 0's TCPStore (torch's tcp:// rendezvous) listened on every interface for the group's life;
    gloo's pair sockets followed GLOO_SOCKET_IFNAME, which a machine-wide environment may point at a real interface
    (set here when this machine has one: the pack replaces it unless H3_SP_INTERFACE names one)."""
    port = sequence_parallel.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(sequence_parallel.INTERFACE_ENV, None)
    outside = external_interface()
    if outside is not None:
        env["GLOO_SOCKET_IFNAME"] = outside
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(port)], cwd=root, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        for proc in ranks:
            assert proc.stdout.readline().strip() == "joined", "a rank did not join its process group"
        found = {proc.pid: listening(proc.pid) for proc in ranks}
        assert (port in [p for _, p in found[ranks[0].pid]]), f"rank 0's store is not on port {port}: {found}"
        outward = {pid: [a for a in addresses if not is_loopback(a[0])] for pid, addresses in found.items()}
        assert not any(outward.values()), f"ranks listening beyond loopback: {outward}"
        if outside is not None:  # what another machine would try: the store's port on this machine's address
            with pytest.raises(OSError):
                socket.create_connection((ipv4_of(outside), port), timeout=5).close()
    finally:
        for proc in ranks:
            proc.stdin.close()
        for proc in ranks:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_the_interface_is_loopback_unless_h3_sp_interface_names_one():
    assert sequence_parallel.interface_env({}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}
    machine_wide = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert sequence_parallel.interface_env(machine_wide)["GLOO_SOCKET_IFNAME"] == "lo"  # not taken as consent
    chosen = {sequence_parallel.INTERFACE_ENV: "eth1"}
    assert sequence_parallel.interface_env(chosen) == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
