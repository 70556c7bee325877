"""A hostile encoder endpoint for client tests: a real TCP server on 127.0.0.1 that speaks just enough HTTP.

`HostileServer` answers GET /v1/capabilities with `CAPS` (or given bytes, or a writer) and POST /v1/encode with
a test's `encode(server, conn)`, counting the bytes it sent: gigabyte Content-Lengths, endless chunked bodies, one
byte a second.
"""

from __future__ import annotations

import json
import socket
import threading
import time

from h3_core.request import EncodeRequest

REQUEST = EncodeRequest(prompt="A red fox in the snow.", width=64, height=64, num_frames=124)
CAPS = {
    "protocol": {"name": "h3-encoder", "version": 2, "versions": [2]},
    "model": {"fingerprint": "abc123", "components": ["text", "video", "audio"], "dtype": "float32"},
    "limits": {"max_body_bytes": 1 << 30},
    "deadline_s": {"default": 300, "max": 1800},
}
MiB = 1 << 20


class HostileServer:
    """Answers GET /v1/capabilities with `caps` (bytes) and POST /v1/encode with `encode(conn)`; counts bytes sent."""

    def __init__(self, encode=None, caps: bytes | None = None, caps_writer=None):
        self.encode, self.caps, self.caps_writer = encode, caps, caps_writer
        self.sent = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket):
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            length = next((int(line.split(":", 1)[1]) for line in lines[1:] if line.lower().startswith(
                "content-length:")), 0)
            left = length - len(rest)
            while left > 0:
                chunk = conn.recv(min(left, 1 << 20))
                if not chunk:
                    return
                left -= len(chunk)
            if path.endswith("/v1/capabilities"):
                if self.caps_writer is not None:
                    self.caps_writer(self, conn)
                else:
                    body = self.caps if self.caps is not None else json.dumps(CAPS).encode()
                    self.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                              + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            elif self.encode is not None:
                self.encode(self, conn)
        except OSError:
            pass
        finally:
            conn.close()

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def stream(self, conn: socket.socket, total: int, chunked: bool = False) -> None:
        """Send up to `total` bytes of zeros as fast as the client reads them (stops when it hangs up)."""
        block = bytes(MiB)
        for _ in range(total // MiB):
            if self.stop.is_set():
                return
            self.send(conn, (b"%x\r\n" % MiB + block + b"\r\n") if chunked else block)

    def trickle(self, conn: socket.socket, data: bytes, every_s: float) -> None:
        for byte in data:
            if self.stop.is_set():
                return
            self.send(conn, bytes([byte]))
            time.sleep(every_s)

    def close(self):
        self.stop.set()
        self.sock.close()
