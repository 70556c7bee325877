"""Section 2: wire efficiency of the conditioning contract over the real encoder server, at the real 5120 width.

Bytes: exact bytes in each direction of one /v1/encode exchange (a counting TCP proxy sits between the real client
and the real server), against the raw tensor bytes of the contract.
Throughput: serialise (server: the safetensors header of wire form 3, which the client asks for) + HTTP send (the
header, then the tensor storages as they are, each 1 MiB piece hashed just before it is written, the xxh3-128 digest
last) + receive (client: one Content-Length buffer, each piece hashed as it lands) + deserialise (`from_buffer`:
tensors viewed out of the buffer, checked finite, the contract validated), i.e.
`EncoderClient.encode` end to end on a synthetic stage, against a raw loopback TCP transfer of the same bytes
(sendall / recv_into a fresh buffer of the same kind the client uses: uninitialised, `wire.new_buffer`), both
served by the same subprocess and measured interleaved in the same run. A third arm is the same client asking for
wire form 2 (the checksum in the header: the server's whole pass over the data before its first byte), what older
clients, curl and the Ray engine get; a fourth, a raw client that zero-fills a bytearray first, is the baseline the
protocol-1 figure (0.105) was measured against.

    python -m bench.wire [--quick]     this section alone: prints the ratio with its 95 % interval
"""

from __future__ import annotations

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
        self.url, self.raw_port = info["h3"], info["raw_port"]
        self.bytes = info["bytes"]

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far, all threads (Linux /proc; 0.0 elsewhere)."""
        import glob

        total = 0
        for path in glob.glob(f"/proc/{self.proc.pid}/task/*/schedstat"):
            try:
                with open(path) as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return total / 1e9

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


def raw_fetch(port: int, name: str, size: int, zeroed: bool = False):
    """Best-case loopback transfer: connect, ask, recv_into a fresh buffer until the sender closes. The buffer is
    the same uninitialised allocation the h3 client reads into; `zeroed` uses a bytearray instead (zero-filled
    first), as the baseline behind the protocol-1 figure did."""
    from h3_core.contract.wire import new_buffer

    buf = bytearray(size) if zeroed else new_buffer(size)
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


# The last published value (bench/results/results.md before protocol 2: four SHA-256 passes, three copies).
PREVIOUS = {"throughput_ratio": 0.1047, "ci95": [0.097, 0.114], "h3_mb_s": 134, "raw_mb_s": 1282}
TARGET = 0.85


def _breakdown(cond, reps: int) -> dict:
    """In-process CPU cost of the pieces the h3 path adds on top of moving bytes (no sockets): the server's
    serialisation before its first byte can leave (`to_wire_3`: form 3's header only, what answers the client;
    `to_wire`: form 2's header + checksum pass, what a file or a client that does not ask gets), the client's
    `from_buffer` done whole (checksum pass + views + validation; the client hashes as bytes arrive instead) and, for
    scale, one bare xxh3-128 pass and one copy of the same bytes into a fresh buffer."""
    import xxhash

    from h3_core.contract import H3Conditioning, wire

    times = {"to_wire_3": [], "to_wire": [], "from_buffer": [], "xxh3": [], "copy": []}
    joined = bytearray(cond.to_wire().tobytes())
    for _ in range(reps):
        buf = bytearray(joined)  # a fresh buffer, as the client receives into one (outside the timings)
        t = [time.perf_counter()]
        wire.encode(cond, wire.STREAM_VERSION)
        t.append(time.perf_counter())
        cond.to_wire()
        t.append(time.perf_counter())
        H3Conditioning.from_buffer(buf)
        t.append(time.perf_counter())
        xxhash.xxh3_128(joined).hexdigest()
        t.append(time.perf_counter())
        bytes(joined)
        t.append(time.perf_counter())
        for i, key in enumerate(times):
            times[key].append(t[i + 1] - t[i])
        del buf
    return {key: float(sorted(v)[len(v) // 2]) for key, v in times.items()}


def _request(name: str, answer_bytes: int):
    """The request naming a prebuilt contract, its prompt padded just enough that the client's answer bound
    (`packing.conditioning_bound`, which follows the prompt's length) admits the synthetic answer."""
    from h3_core.remote.client.packing import conditioning_bound
    from h3_core.request import EncodeRequest

    prompt = f"size:{name}:"
    while conditioning_bound(EncodeRequest(prompt=prompt)) < answer_bytes:
        prompt += "." * 16
    return EncodeRequest(prompt=prompt)


def run(*, reps: dict[str, int], threads: int, sizes: dict[str, int] = SIZES) -> dict:
    import torch

    from h3_core.remote.client.encoder_client import EncoderClient

    out = {"loadavg_before": common.loadavg(), "sizes": {}}
    common.log("wire: starting the synthetic encoder server + raw TCP server")
    with WireServer(sizes, threads) as server:
        client = EncoderClient(server.url, retries=0, read_timeout=120)
        client.capabilities()  # handshake once, as a long-lived client does (re-done every 5 minutes)
        # The same client asking for wire form 2 only (the checksum in the header: one pass before the first byte
        # leaves), what older clients, curl and the Ray engine get: the gain of form 3, side by side in this run
        form2_client = EncoderClient(server.url, retries=0, read_timeout=120)
        form2_client.accept_formats = ()
        form2_client.capabilities()
        for name, tokens in sizes.items():
            cond = synth_conditioning(tokens)
            raw_bytes = raw_tensor_bytes(cond)
            contract_bytes = server.bytes[name]
            request = _request(name, contract_bytes)

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

            server_cpu: dict[str, list[float]] = {"raw": [], "h3": []}

            def raw(i, name=name, size=contract_bytes, server_cpu=server_cpu):
                before = server.cpu_s()
                raw_fetch(server.raw_port, name, size)  # dropped, like h3's answer: no arm keeps 70 MB per round
                server_cpu["raw"].append(server.cpu_s() - before)

            def raw_zeroed(i, name=name, size=contract_bytes):
                raw_fetch(server.raw_port, name, size, zeroed=True)

            def h3_timed(i, request=request, server_cpu=server_cpu):
                before = server.cpu_s()
                client.encode(request)
                server_cpu["h3"].append(server.cpu_s() - before)

            def h3_form2(i, request=request):
                form2_client.encode(request)

            check = h3(0)
            assert check.prompt_embeds.view(torch.int16).equal(cond.prompt_embeds.view(torch.int16))
            assert check.text_token_tags.equal(cond.text_token_tags) and check.task == cond.task
            del check
            common.log(f"wire: {name}: {reps[name]} interleaved rounds (h3 client/server, raw socket)")
            runs = common.interleaved({"raw": raw, "h3": h3_timed, "h3_form2": h3_form2, "raw_zeroed": raw_zeroed},
                                      reps[name], warmup=1)
            # CPU both processes spent per transfer (client: the whole bench process; server: its threads), which
            # wall time follows when the machine has more runnable threads than cores
            cpu = {arm: [c + s for c, s in zip(runs[arm]["cpu"], server_cpu[arm][-reps[name]:])] for arm in server_cpu}
            zeroed_s = runs["raw_zeroed"]["wall"]
            h3_s, raw_s = runs["h3"]["wall"], runs["raw"]["wall"]
            ratio = common.paired(h3_s, raw_s)  # raw/h3 per pair = h3 throughput / raw throughput
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
                "h3_cpu_s": common.summary(cpu["h3"]),
                "raw_cpu_s": common.summary(cpu["raw"]),
                "cpu_ratio": common.paired(cpu["raw"], cpu["h3"])["median_ratio"],  # h3 CPU / raw CPU
                # continuity with the protocol-1 figure, whose raw client zero-filled a bytearray first (flatters h3,
                # which no longer does): h3 throughput / that raw's
                "raw_zeroed_s": common.summary(zeroed_s),
                "raw_zeroed_mb_s": contract_bytes / common.summary(zeroed_s)["median"] / common.MB,
                "throughput_ratio_vs_zeroed": common.paired(h3_s, zeroed_s)["median_ratio"],
                "throughput_ratio_vs_zeroed_ci95": common.paired(h3_s, zeroed_s)["ci95"],
                "throughput_ratio": ratio["median_ratio"],
                "throughput_ratio_ci95": ratio["ci95"],
                # the same client asking for form 2 (checksum in the header), against the same raw transfers
                "form2_s": common.summary(runs["h3_form2"]["wall"]),
                "form2_throughput_ratio": common.paired(runs["h3_form2"]["wall"], raw_s)["median_ratio"],
                "form2_throughput_ratio_ci95": common.paired(runs["h3_form2"]["wall"], raw_s)["ci95"],
                "breakdown_s": _breakdown(cond, 3 if tokens > 1000 else 7),
            }
            r = out["sizes"][name]
            common.log(
                f"wire: {name}: wire {r['wire_ratio']:.4f}x raw tensors; h3 {r['h3_mb_s']:.0f} MB/s vs raw "
                f"{r['raw_mb_s']:.0f} MB/s: {r['throughput_ratio']:.3f} (95 % CI {r['throughput_ratio_ci95'][0]:.3f} "
                f".. {r['throughput_ratio_ci95'][1]:.3f})"
            )
    out["bytes_per_token_model"] = BYTES_PER_TOKEN
    out["previous"] = PREVIOUS
    out["target"] = TARGET
    out["loadavg_after"] = common.loadavg()
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="section 2 alone: the contract over HTTP vs a raw loopback socket")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated subset of {','.join(SIZES)}")
    parser.add_argument("--reps", type=int, help="interleaved rounds per size (overrides --quick)")
    args = parser.parse_args(argv)

    reps = dict((common.RUN_QUICK if args.quick else common.RUN_FULL)["wire"]["reps"])
    if args.reps:
        reps = {name: args.reps for name in reps}
    sizes = {name: SIZES[name] for name in args.sizes.split(",") if name}
    common.set_threads(args.threads)
    out = run(reps=reps, threads=args.threads, sizes=sizes)
    for name, r in out["sizes"].items():
        lo, hi = r["throughput_ratio_ci95"]
        print(f"{name}: h3/raw {r['throughput_ratio']:.3f} (95 % CI {lo:.3f} .. {hi:.3f}), h3 {r['h3_mb_s']:.0f} MB/s "
              f"vs raw {r['raw_mb_s']:.0f} MB/s; CPU per transfer (client + server) h3 "
              f"{1000 * r['h3_cpu_s']['median']:.1f} ms vs raw {1000 * r['raw_cpu_s']['median']:.1f} ms; vs a raw "
              f"client that zero-fills a bytearray first {r['throughput_ratio_vs_zeroed']:.3f} "
              f"({r['throughput_ratio_vs_zeroed_ci95'][0]:.3f} .. {r['throughput_ratio_vs_zeroed_ci95'][1]:.3f}); "
              f"form 2 (checksum in the header) {r['form2_throughput_ratio']:.3f} "
              f"({r['form2_throughput_ratio_ci95'][0]:.3f} .. {r['form2_throughput_ratio_ci95'][1]:.3f}); breakdown ms "
              + ", ".join(f"{k} {1000 * v:.1f}" for k, v in r["breakdown_s"].items()))
    print(f"load average before / after: {out['loadavg_before']} / {out['loadavg_after']}")
    print(f"previous (protocol 1) 70MB: {PREVIOUS['throughput_ratio']:.3f} (95 % CI {PREVIOUS['ci95'][0]:.3f} .. "
          f"{PREVIOUS['ci95'][1]:.3f}); target >= {TARGET}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
