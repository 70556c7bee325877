"""The loopback channel between a host process and its sequence-parallel workers (sequence_parallel_workers.py).

One message is a JSON header plus an optional byte payload (a safetensors string when it carries tensors), framed
by their two lengths. Nothing is ever unpickled: the workers are separate interpreters (`python -m`), so neither side
trusts the other's objects, only its JSON and safetensors. A worker proves it was started by this host with the
token the host put in its environment (never on its command line, which other users can read); the host compares it
in constant time and drops any other connection.
"""

from __future__ import annotations

import hmac
import json
import select
import socket
import struct

import torch

_FRAME = struct.Struct(">IQ")  # header bytes, payload bytes
_MAX_HEADER = 1 << 20  # headers are a few hundred bytes of JSON; more is not ours
TOKEN_ENV = "H3_SP_TOKEN"


class ChannelClosed(ConnectionError):
    """The other end closed the connection (a worker that died, or a host that went away)."""


class Channel:
    """Framed messages over one connected TCP socket (blocking; `readable` polls)."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # small messages (a step's progress) go out at once
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def send(self, header: dict, payload: bytes = b"") -> None:
        text = json.dumps(header).encode()
        self.sock.sendall(_FRAME.pack(len(text), len(payload)) + text)
        if payload:
            self.sock.sendall(payload)

    def recv(self) -> tuple[dict, bytes]:
        head_len, payload_len = _FRAME.unpack(self._exactly(_FRAME.size))
        if head_len > _MAX_HEADER:
            raise ChannelClosed(f"a {head_len}-byte message header (at most {_MAX_HEADER}): not this protocol")
        try:
            header = json.loads(self._exactly(head_len))
        except ValueError:
            raise ChannelClosed("a message header that is not JSON: not this protocol") from None
        if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
            raise ChannelClosed("a message without a kind: not this protocol")
        return header, self._exactly(payload_len)

    def readable(self, timeout_s: float = 0.0) -> bool:
        return bool(select.select([self.sock], [], [], timeout_s)[0])

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _exactly(self, size: int) -> bytes:
        buffer = bytearray(size)
        view, done = memoryview(buffer), 0
        while done < size:
            got = self.sock.recv_into(view[done:])
            if got == 0:
                raise ChannelClosed("the other end closed the connection")
            done += got
        return bytes(buffer)


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()})


def tensors_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def token_matches(expected: str, given) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())
