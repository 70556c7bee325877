"""The loopback channel between a host process and its sequence-parallel workers (sequence_parallel_workers.py).

One message is a JSON header plus an optional byte payload (a safetensors string when it carries tensors), framed
by their two lengths. Nothing is ever unpickled: the workers are separate interpreters (`python -m`), so neither side
trusts the other's objects, only its JSON and safetensors.

**Who may talk.** The host listens on loopback while its workers start, so any local process can connect. A worker
proves it was started by this host with the token the host put in its environment (never on its command line, which
other users can read). The token comes first, in a fixed-size preamble, before any length or JSON: the host reads
exactly those bytes into a buffer of that size, compares them in constant time, and only then reads the hello (a
bounded header, no payload). Connections are read side by side without blocking (`accept_hellos`), each with one
deadline for its whole hello, so a peer that trickles a byte every few seconds, declares a 2**63-byte payload or
sends garbage is dropped as a lost connection while the real workers are accepted, and the host's own cancel flag and
start deadline are checked at every poll.
"""

from __future__ import annotations

import hmac
import json
import select
import selectors
import socket
import struct
import time

import torch

_FRAME = struct.Struct(">IQ")  # header bytes, payload bytes
_MAX_HEADER = 1 << 20  # headers are a few hundred bytes of JSON; more is not ours
# The largest payload an authenticated peer may declare: the conditioning's wire bytes out, previews and latents back
# are megabytes to a few GB for the released model. Past it the frame is not this protocol (and 2**63 must never reach
# an allocation, where it is a raw OverflowError).
MAX_PAYLOAD = 1 << 36
_CHUNK = 1 << 24  # payloads are received into buffers of at most this size: memory follows the bytes that arrived
TOKEN_ENV = "H3_SP_TOKEN"
TOKEN_BYTES = 32  # secrets.token_hex(TOKEN_BYTES): 64 hex characters
_MAGIC = b"H3SP-HELLO-1\n"
PREAMBLE_SIZE = len(_MAGIC) + 2 * TOKEN_BYTES
HELLO_MAX_HEADER = 4096  # a hello is {"kind", "rank", "pid"}: tens of bytes
HELLO_TIMEOUT_S = 10.0  # from accept to the hello's last byte; a worker sends its hello in one write on connecting
MAX_PENDING = 64  # connections being read at once; past it the oldest is dropped (a worker's hello takes one read)
POLL_S = 0.2


class ChannelClosed(ConnectionError):
    """The other end closed the connection (a worker that died, or a host that went away), or broke the protocol."""


class Channel:
    """Framed messages over one connected TCP socket (blocking; `readable` polls)."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # small messages (a step's progress) go out at once
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def send(self, header: dict, payload: bytes = b"") -> None:
        text = json.dumps(header).encode()
        try:
            self.sock.sendall(_FRAME.pack(len(text), len(payload)) + text)
            if payload:
                self.sock.sendall(payload)
        except ChannelClosed:
            raise
        except ConnectionError as error:  # a reset or a broken pipe: the other end is gone, as a clean close says
            raise ChannelClosed(f"the other end went away ({error})") from error

    def send_hello(self, token: str, hello: dict) -> None:
        """A worker's first words: the preamble with its token, then its hello (no payload)."""
        self.sock.sendall(preamble(token))
        self.send(hello)

    def recv(self, max_payload: int = MAX_PAYLOAD) -> tuple[dict, bytes]:
        head_len, payload_len = _FRAME.unpack(self._exactly(_FRAME.size))
        if head_len > _MAX_HEADER:
            raise ChannelClosed(f"a {head_len}-byte message header (at most {_MAX_HEADER}): not this protocol")
        if payload_len > max_payload:
            raise ChannelClosed(f"a {payload_len}-byte message payload (at most {max_payload}): not this protocol")
        header = parse_header(self._exactly(head_len))
        return header, self._exactly(payload_len)

    def readable(self, timeout_s: float = 0.0) -> bool:
        return bool(select.select([self.sock], [], [], timeout_s)[0])

    def peer_closed(self) -> bool:
        """Whether the other end has closed (or reset) the connection, with nothing left unread before that."""
        try:
            if not self.readable(0.0):
                return False
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except ConnectionError:
            return True
        except OSError:  # this end is closed: nobody to talk to either
            return True

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _exactly(self, size: int) -> bytes:
        # Filled one bounded buffer at a time: a declared size is only a promise, so memory grows with what arrives.
        parts, left = [], size
        while left:
            buffer = bytearray(min(left, _CHUNK))
            view, done = memoryview(buffer), 0
            while done < len(buffer):
                try:
                    got = self.sock.recv_into(view[done:])
                except ConnectionError as error:  # e.g. a host killed with unread bytes resets the connection
                    raise ChannelClosed(f"the other end went away ({error})") from error
                if got == 0:
                    raise ChannelClosed("the other end closed the connection")
                done += got
            parts.append(buffer)
            left -= len(buffer)
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)


def parse_header(text: bytes) -> dict:
    try:
        header = json.loads(text)
    except ValueError:
        raise ChannelClosed("a message header that is not JSON: not this protocol") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise ChannelClosed("a message without a kind: not this protocol")
    return header


def preamble(token: str) -> bytes:
    """The fixed-size bytes that open a worker's connection: the magic and the token, padded or cut to size."""
    return _MAGIC + token.encode("ascii", "replace")[: 2 * TOKEN_BYTES].ljust(2 * TOKEN_BYTES, b"\0")


class _Pending:
    """One accepted connection whose hello is being read: preamble, then frame, then header, each into a buffer of
    its exact, bounded size."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.stage = "preamble"
        self.buffer, self.done = bytearray(PREAMBLE_SIZE), 0

    def expect(self, stage: str, size: int) -> None:
        self.stage, self.buffer, self.done = stage, bytearray(size), 0


def accept_hellos(listener: socket.socket, token: str, wanted: int, admit, poll, clock=time.monotonic,
                  hello_timeout_s: float = HELLO_TIMEOUT_S, max_pending: int = MAX_PENDING,
                  on_accepted=None) -> dict[int, Channel]:
    """Accept connections on `listener` until `wanted` of them said a hello that `admit(hello)` maps to a rank.

    Every connection must open with `preamble(token)` (compared in constant time before anything else is read),
    then one hello frame with a header of at most HELLO_MAX_HEADER bytes and no payload, all within
    `hello_timeout_s` of its accept (on `clock`); any other connection is closed and the wait goes on. `admit`
    returns the hello's rank, or None to drop it. `poll()` runs at least every POLL_S and raises to stop the wait
    (the caller's cancel flag, its own deadline, a worker process gone). `on_accepted(count)` hears each admitted
    hello (the host's start progress). Returns rank -> channel (blocking)."""
    expected = preamble(token)
    accepted: dict[int, Channel] = {}
    pending: dict[socket.socket, _Pending] = {}  # insertion order: oldest first
    # A selector, not select(): a host such as ComfyUI may hold more than FD_SETSIZE (1024) descriptors.
    selector = selectors.DefaultSelector()

    def drop(sock: socket.socket) -> None:
        if pending.pop(sock, None) is not None:
            selector.unregister(sock)
        try:
            sock.close()
        except OSError:
            pass

    def add(sock: socket.socket, deadline: float) -> None:
        pending[sock] = _Pending(sock, deadline)
        selector.register(sock, selectors.EVENT_READ)

    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)
    try:
        while len(accepted) < wanted:
            poll()
            now = clock()
            for sock in [s for s, p in pending.items() if now >= p.deadline]:
                drop(sock)  # one deadline for the whole hello: a trickle of bytes does not extend it
            for key, _ in selector.select(POLL_S):
                sock = key.fileobj
                if sock is listener:
                    _accept_all(listener, pending, clock() + hello_timeout_s, max_pending, add, drop)
                    continue
                if sock not in pending:
                    continue
                rank = _read_hello(pending[sock], expected, admit, accepted)
                if rank is None:
                    continue
                if rank is False:
                    drop(sock)
                else:
                    del pending[sock]
                    selector.unregister(sock)
                    accepted[rank] = Channel(sock)
                    if on_accepted is not None:
                        on_accepted(len(accepted))
    except BaseException:
        for channel in accepted.values():
            channel.close()
        raise
    finally:
        for sock in list(pending):
            drop(sock)
        selector.close()
    return accepted


def _accept_all(listener, pending, deadline, max_pending, add, drop) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # e.g. out of file descriptors: the next poll tries again
            return
        sock.setblocking(False)
        while len(pending) >= max_pending:
            drop(next(iter(pending)))  # the oldest: a real worker's hello arrives with its connection
        add(sock, deadline)


def _read_hello(entry: _Pending, expected: bytes, admit, accepted):
    """Read what has arrived for `entry`. None: not complete yet; False: drop it; an int: the admitted rank."""
    try:
        got = entry.sock.recv_into(memoryview(entry.buffer)[entry.done:])
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return False
    if got == 0:
        return False
    entry.done += got
    if entry.done < len(entry.buffer):
        return None
    if entry.stage == "preamble":
        if not hmac.compare_digest(bytes(entry.buffer), expected):
            return False
        entry.expect("frame", _FRAME.size)
        return None
    if entry.stage == "frame":
        head_len, payload_len = _FRAME.unpack(entry.buffer)
        if payload_len != 0 or not 0 < head_len <= HELLO_MAX_HEADER:  # a hello is a small header and nothing else
            return False
        entry.expect("header", head_len)
        return None
    try:
        hello = parse_header(bytes(entry.buffer))
    except ChannelClosed:
        return False
    rank = admit(hello) if hello["kind"] == "hello" else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank in accepted:
        return False
    return rank


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()})


def tensors_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def token_matches(expected: str, given) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())
