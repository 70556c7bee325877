"""Section 2: wire efficiency of the conditioning contract over the real encoder server, at the real 5120 width.

Bytes: exact bytes in each direction of one /v1/encode exchange (a counting TCP proxy sits between the real client
and the real server), against the raw tensor bytes of the contract.
Throughput: serialise (server: to_bytes + digest) + HTTP send + receive + deserialise (client: digest check +
from_bytes, which validates and re-hashes every tensor), i.e. `EncoderClient.encode` end to end on a synthetic
stage, against a raw loopback TCP transfer of the same bytes (sendall / recv_into a fresh buffer), both served
by the same subprocess and measured interleaved in the same run.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import threading
import time

from bench import common
from bench.synth import BYTES_PER_TOKEN, SIZES, raw_tensor_bytes, synth_conditioning


class WireServer:
    """The bench.wire_server subprocess (real h3 server + raw TCP server)."""

    def __init__(self, sizes: dict[str, int], threads: int):
        cmd = [sys.executable, "-m", "bench.wire_server", "--worker", json.dumps({"sizes": sizes, "threads": threads})]
        self.proc = subprocess.Popen(
            cmd,
            cwd=common.REPO,
            env=common.worker_env(threads),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            self.close()
            raise RuntimeError(f"wire server did not start: {line!r}")
        info = json.loads(line)
        self.url, self.raw_port, self.lean_port = info["h3"], info["raw_port"], info["lean_port"]
        self.bytes = info["bytes"]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def raw_fetch(port: int, name: str, size: int) -> bytearray:
    """Best-case loopback transfer: connect, ask, recv_into a fresh buffer until the sender closes."""
    buf = bytearray(size)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(name.encode() + b"\n")
        got = 0
        while got < size:
            n = sock.recv_into(view[got:], min(size - got, 1 << 20))
            if n == 0:
                break
            got += n
        extra = sock.recv(1)  # the sender closes after the payload
    if got != size or extra:
        raise RuntimeError(f"raw transfer got {got} of {size} bytes")
    return buf


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:], min(view.nbytes - got, 1 << 20))
        if n == 0:
            raise RuntimeError("connection closed early")
        got += n


def lean_fetch(port: int, name: str, checksum: bool = True):
    """The lean prototype's client: header, then recv_into one preallocated buffer (with a running CRC32 unless
    `checksum` is off), then tensors viewed out of that buffer and validated (bench/synth.py lean_parse)."""
    import zlib

    from bench.synth import lean_parse

    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(name.encode() + (b"\n" if checksum else b" nocrc\n"))
        length = bytearray(8)
        _recv_exact(sock, memoryview(length))
        header_bytes = bytearray(int.from_bytes(length, "little"))
        _recv_exact(sock, memoryview(header_bytes))
        header = json.loads(header_bytes)
        size = max((info["data_offsets"][1] for info in header["tensors"].values()), default=0)
        buf = bytearray(size)
        view = memoryview(buf)
        got, crc = 0, 0
        while got < size:
            n = sock.recv_into(view[got:], min(size - got, 1 << 20))
            if n == 0:
                raise RuntimeError("connection closed early")
            if checksum:
                crc = zlib.crc32(view[got : got + n], crc)
            got += n
        trailer = bytearray(4)
        _recv_exact(sock, memoryview(trailer))
    if int.from_bytes(trailer, "little") != crc:
        raise RuntimeError("lean transfer: CRC mismatch")
    return lean_parse(header, buf)


class CountingProxy:
    """Loopback TCP proxy that counts the bytes of every connection in each direction."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections: list[dict[str, int]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            record = {"to_server": 0, "to_client": 0, "done": 0}
            with self._lock:
                self.connections.append(record)
            threading.Thread(target=self._pump, args=(client, upstream, record, "to_server"), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, record, "to_client"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: dict, key: str) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                record[key] += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            with self._lock:
                record["done"] += 1

    def wait_closed(self, timeout: float = 10) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(r["done"] < 2 for r in self.connections):
            time.sleep(0.01)

    def close(self) -> None:
        self.listener.close()


def _breakdown(cond, reps: int) -> dict:
    """In-process CPU cost of the pieces the h3 path adds on top of moving bytes (no sockets)."""
    from h3_core.contract import H3Conditioning

    times = {"to_bytes": [], "sha256": [], "from_bytes": [], "copy": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        data = cond.to_bytes()
        t1 = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        t2 = time.perf_counter()
        H3Conditioning.from_bytes(data)
        t3 = time.perf_counter()
        bytes(bytearray(data))
        t4 = time.perf_counter()
        for key, a, b in (("to_bytes", t0, t1), ("sha256", t1, t2), ("from_bytes", t2, t3), ("copy", t3, t4)):
            times[key].append(b - a)
        del data
    return {key: float(sorted(v)[len(v) // 2]) for key, v in times.items()}


def run(*, reps: dict[str, int], threads: int, sizes: dict[str, int] = SIZES) -> dict:
    import torch

    from h3_core.remote.client import EncoderClient
    from h3_core.request import EncodeRequest

    out = {"loadavg_before": common.loadavg(), "sizes": {}}
    common.log("wire: starting the synthetic encoder server + raw TCP server")
    with WireServer(sizes, threads) as server:
        client = EncoderClient(server.url, retries=0, read_timeout=120)
        client.capabilities()  # handshake once, as a long-lived client does (re-done every 5 minutes)
        for name, tokens in sizes.items():
            cond = synth_conditioning(tokens)
            raw_bytes = raw_tensor_bytes(cond)
            contract_bytes = server.bytes[name]
            request = EncodeRequest(prompt=f"size:{name}")

            # exact bytes of one exchange, through the counting proxy
            proxy = CountingProxy(int(server.url.rsplit(":", 1)[1]))
            counted = EncoderClient(f"http://127.0.0.1:{proxy.port}", retries=0, read_timeout=120)
            received = counted.encode(request)
            proxy.wait_closed()
            proxy.close()
            handshake, exchange = proxy.connections[0], proxy.connections[-1]
            assert received.prompt_embeds.shape == cond.prompt_embeds.shape

            def h3(i, request=request):
                return client.encode(request)

            def raw(i, name=name, size=contract_bytes):
                return raw_fetch(server.raw_port, name, size)

            def lean(i, name=name):
                return lean_fetch(server.lean_port, name)

            def lean_nocrc(i, name=name):
                return lean_fetch(server.lean_port, name, checksum=False)

            check = lean(0)
            assert check.prompt_embeds.view(torch.int16).equal(cond.prompt_embeds.view(torch.int16))
            assert check.text_token_tags.equal(cond.text_token_tags) and check.task == cond.task
            common.log(f"wire: {name}: {reps[name]} interleaved rounds (h3 client/server, raw socket, lean prototype)")
            runs = common.interleaved(
                {"raw": raw, "h3": h3, "lean": lean, "lean_nocrc": lean_nocrc}, reps[name], warmup=1
            )
            h3_s, raw_s, lean_s = runs["h3"]["wall"], runs["raw"]["wall"], runs["lean"]["wall"]
            nocrc_s = runs["lean_nocrc"]["wall"]
            ratio = common.paired(h3_s, raw_s)  # raw/h3 per pair = h3 throughput / raw throughput
            lean_ratio = common.paired(lean_s, raw_s)
            nocrc_ratio = common.paired(nocrc_s, raw_s)
            wire_total = exchange["to_server"] + exchange["to_client"]
            out["sizes"][name] = {
                "tokens": tokens,
                "raw_tensor_bytes": raw_bytes,
                "contract_bytes": contract_bytes,
                "request_bytes": exchange["to_server"],
                "response_bytes": exchange["to_client"],
                "wire_bytes": wire_total,
                "wire_ratio": wire_total / raw_bytes,
                "contract_ratio": contract_bytes / raw_bytes,
                "handshake_bytes": handshake["to_server"] + handshake["to_client"],
                "wire_bytes_per_token": wire_total / tokens,
                "h3_s": common.summary(h3_s),
                "raw_s": common.summary(raw_s),
                "h3_mb_s": contract_bytes / common.summary(h3_s)["median"] / common.MB,
                "raw_mb_s": contract_bytes / common.summary(raw_s)["median"] / common.MB,
                "throughput_ratio": ratio["median_ratio"],
                "throughput_ratio_ci95": ratio["ci95"],
                "lean_s": common.summary(lean_s),
                "lean_mb_s": contract_bytes / common.summary(lean_s)["median"] / common.MB,
                "lean_throughput_ratio": lean_ratio["median_ratio"],
                "lean_throughput_ratio_ci95": lean_ratio["ci95"],
                "lean_nocrc_s": common.summary(nocrc_s),
                "lean_nocrc_mb_s": contract_bytes / common.summary(nocrc_s)["median"] / common.MB,
                "lean_nocrc_throughput_ratio": nocrc_ratio["median_ratio"],
                "lean_nocrc_throughput_ratio_ci95": nocrc_ratio["ci95"],
                "breakdown_s": _breakdown(cond, 3 if tokens > 1000 else 7),
            }
            r = out["sizes"][name]
            common.log(
                f"wire: {name}: wire {r['wire_ratio']:.4f}x raw tensors; h3 {r['h3_mb_s']:.0f} MB/s vs raw "
                f"{r['raw_mb_s']:.0f} MB/s ({r['throughput_ratio']:.2f}); lean prototype {r['lean_mb_s']:.0f} MB/s "
                f"({r['lean_throughput_ratio']:.2f}), without CRC {r['lean_nocrc_mb_s']:.0f} MB/s "
                f"({r['lean_nocrc_throughput_ratio']:.2f})"
            )
    out["bytes_per_token_model"] = BYTES_PER_TOKEN
    out["loadavg_after"] = common.loadavg()
    return out
