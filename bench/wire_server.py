"""Subprocess for section 2: the real encoder server (aiohttp app, remote/engines/) around a synthetic stage
that answers prebuilt contracts at the real 5120 width, plus a raw TCP server that sends the very same bytes.

    python -m bench.wire_server --worker '{"sizes": {"70MB": 6883, ...}}'
prints one JSON line {"h3": URL, "raw_port": N, "bytes": {...}} and serves until stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading

from bench.synth import synth_conditioning

FINGERPRINT = "5e17be0c000000aa"  # hex, like ModelSource.fingerprint()


class SyntheticStage:
    """Quacks like EncoderStage for the server: the prompt `size:NAME[:padding]` selects a prebuilt conditioning."""

    components = ("text", "video", "audio")
    fingerprint = FINGERPRINT

    def __init__(self, conditionings):
        self.conditionings = conditionings

    def encode(self, request, metadata=None, cancel=None, progress=None):
        return self.conditionings[request.prompt.split(":")[1]]


def _line_server(answer) -> int:
    """Blocking loopback TCP server: per connection, read one request line and call `answer(conn, line)`.
    Returns the port. The counting proxy's handshake is the only concurrent use, and it goes to the h3 server."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = listener.getsockname()[1]

    def serve_one(conn: socket.socket) -> None:
        with conn:
            line = b""
            while not line.endswith(b"\n"):
                chunk = conn.recv(64)
                if not chunk:
                    return
                line += chunk
            answer(conn, line.strip().decode())
            conn.shutdown(socket.SHUT_WR)

    def accept_loop() -> None:
        # One connection at a time, in this one long-lived thread (the bench asks one at a time): no thread start
        # per transfer, and the CPU it spends stays visible in /proc/PID/task (bench.wire's CPU per transfer).
        while True:
            conn, _ = listener.accept()
            serve_one(conn)

    threading.Thread(target=accept_loop, daemon=True).start()
    return port


def raw_server(payloads: dict[str, bytes]) -> int:
    """Blocking TCP server: read one line naming a payload, sendall() it, close. Returns the port."""
    return _line_server(lambda conn, name: conn.sendall(memoryview(payloads[name])))


def main(args: dict) -> None:
    from h3_core.remote.engines.aiohttp_app import create_app
    from h3_core.remote.engines.aiohttp_server import start_site
    from h3_core.remote.server.config import ServerConfig

    conditionings = {name: synth_conditioning(tokens, metadata={"model": FINGERPRINT})
                     for name, tokens in args["sizes"].items()}
    payloads = {name: cond.to_bytes() for name, cond in conditionings.items()}
    port = raw_server(payloads)
    # Cache off: every request pays the server's serialisation (to_wire: header + checksum), as a fresh encode would.
    config = ServerConfig(cache_bytes=0, threads=int(args.get("threads", 1)))

    async def serve():
        app = create_app(SyntheticStage(conditionings), config, {"synthetic": True})
        runner, _, bound = await start_site(app, "127.0.0.1", 0)
        print(json.dumps({"h3": f"http://127.0.0.1:{bound}", "raw_port": port,
                          "bytes": {name: len(data) for name, data in payloads.items()}}), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
        await runner.cleanup()

    asyncio.run(serve())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    main(json.loads(parser.parse_args().worker))
