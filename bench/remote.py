"""Sections 3 and 4: the real encoder server (`python -m h3_core serve`) on loopback, driven by EncoderClient.

3. Remote vs local encode: the same requests through `EncoderStage.encode` in a fresh worker process and through the
   server (another subprocess with the same weights and thread count), interleaved; text-only and with references.
4. Server under load: 1, 4 and 16 concurrent clients (threads, one EncoderClient each) sending distinct prompts
   (every request a cache miss): throughput and latency; then identical requests (cache hits), alone, 16 at once,
   and while 4 other clients keep the model thread busy.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import common
from h3_core import testing
from h3_core.remote import protocol

PV = protocol.PROTOCOL_VERSION  # the request JSON's "protocol" field


class EncoderServer:
    """`python -m h3_core serve --models DIR --port 0` in a subprocess; the URL is read from its stdout."""

    def __init__(self, models: Path, threads: int, extra: list[str] | None = None, timeout: float = 180):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="h3-bench-server-", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "h3_core",
            "serve",
            "--models",
            str(models),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *(extra or []),
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=common.REPO, env=common.worker_env(threads), stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.url = None
        found: dict = {}

        def read():
            for line in self.proc.stdout:
                if "listening on" in line:
                    found["url"] = line.strip().rsplit(" ", 1)[-1]
                    break

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if "url" not in found:
            self.close()
            self.log.seek(0)
            raise RuntimeError(f"encoder server did not start within {timeout} s:\n{self.log.read()[-3000:]}")
        self.url = found["url"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def text_request(i: int, tag: str = "take"):
    from h3_core.request import EncodeRequest

    return EncodeRequest(
        prompt=f"A red fox trots through fresh snow at dawn, {tag} {i:05d}.", width=64, height=64, num_frames=124
    )


def ref_request(i: int):
    """The canonical ref2va request (h3_core.testing), its prompt made unique per `i` (distinct cache keys)."""
    request = testing.ref2va_request()
    request.prompt = f"{request.prompt} Take {i:05d}."
    return request


def cache_state(url: str, prompt: str) -> str | None:
    """X-H3-Cache of a plain-JSON encode of a text-only 64x64x124 request (same cache key as the client's)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"protocol": PV, "prompt": prompt, "width": 64, "height": 64, "num_frames": 124})
    conn.request("POST", "/v1/encode", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.getheader("X-H3-Cache")


# --- section 3 -------------------------------------------------------------------------------------


def remote_vs_local(server_url: str, models: Path, reps: dict[str, int], warmup: int = 2) -> dict:
    """Runs in a fresh worker process (see `run`), so the local arm's process is as fresh as the server's."""
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource
    from h3_core.remote.client import packing
    from h3_core.remote.client.encoder_client import EncoderClient

    stage = EncoderStage(ModelSource.from_path(models))
    client = EncoderClient(server_url, retries=0, read_timeout=300)
    client.capabilities()
    out = {}
    for kind, make, offset in (("text", text_request, 0), ("refs", ref_request, 50_000)):
        # built before timing; every index unique, so every remote encode is a cache miss
        requests = {i: make(offset + warmup + i) for i in range(-warmup, reps[kind])}
        results = {}

        def local(i, requests=requests, results=results):
            results.setdefault(("local", i), stage.encode(requests[i]))

        def remote(i, requests=requests, results=results):
            results.setdefault(("remote", i), client.encode(requests[i]))

        common.log(f"remote: {kind}: {reps[kind]} interleaved pairs (local EncoderStage vs server)")
        runs = common.interleaved({"local": local, "remote": remote}, reps[kind], warmup=warmup)
        same = all(results[("local", i)] == results[("remote", i)] for i in range(reps[kind]))
        _, parts = packing.request_to_wire(requests[0])
        req = requests[0]
        decoded = sum(x.nbytes for x in req.ref_images) + sum(
            v.frames.nbytes + (v.audio.nbytes if v.audio is not None else 0) for v in req.ref_videos
        )
        decoded += sum(a.waveform.nbytes for a in req.ref_audios)
        ratio = common.paired(runs["local"]["wall"], runs["remote"]["wall"])
        out[kind] = {
            "local_s": common.summary(runs["local"]["wall"]),
            "remote_s": common.summary(runs["remote"]["wall"]),
            "local_samples": runs["local"]["wall"],
            "remote_samples": runs["remote"]["wall"],
            "remote_over_local": ratio["median_ratio"],
            "remote_over_local_ci95": ratio["ci95"],
            "added_ms_median": 1000
            * (common.summary(runs["remote"]["wall"])["median"] - common.summary(runs["local"]["wall"])["median"]),
            "bit_identical": bool(same),
            "request_media_bytes": sum(len(p[3]) for p in parts),
            "decoded_media_bytes": decoded,
            "contract_bytes": len(results[("local", 0)].to_bytes()),
        }
        s = out[kind]
        common.log(
            f"remote: {kind}: local {s['local_s']['median'] * 1000:.0f} ms, remote "
            f"{s['remote_s']['median'] * 1000:.0f} ms (x{s['remote_over_local']:.2f}), identical={same}"
        )
    return out


# --- section 4 -------------------------------------------------------------------------------------


def _recording_client(url: str, server_times: list, lock: threading.Lock):
    """An EncoderClient that also records the server's X-H3-Queue-Seconds / X-H3-Encode-Seconds per answer."""
    from h3_core.remote import protocol
    from h3_core.remote.client.encoder_client import EncoderClient

    class Recording(EncoderClient):
        def _call(self, endpoint, method, path, *args, **kwargs):
            reply = super()._call(endpoint, method, path, *args, **kwargs)
            if path == protocol.ENCODE_PATH and reply.status == 200:
                try:
                    times = (
                        float(reply.headers.get(protocol.H_QUEUE_S)),
                        float(reply.headers.get(protocol.H_ENCODE_S)),
                    )
                except (TypeError, ValueError):
                    times = None
                if times is not None:
                    with lock:
                        server_times.append(times)
            return reply

    return Recording(url, retries=0, read_timeout=600)


def _drive(url: str, clients: int, per_client: int, make, start_index: int) -> dict:
    """`clients` threads, each with its own EncoderClient, each sending `per_client` requests back to back."""
    latencies, spans, errors, server_times = [], [], [], []
    by_client: dict[int, list[float]] = {k: [] for k in range(clients)}
    lock = threading.Lock()
    barrier = threading.Barrier(clients)
    workers = [_recording_client(url, server_times, lock) for _ in range(clients)]
    for w in workers:
        w.capabilities()

    def work(k: int) -> None:
        barrier.wait()
        for j in range(per_client):
            request = make(start_index + k * per_client + j)
            t0 = time.perf_counter()
            try:
                workers[k].encode(request)
            except Exception as error:  # noqa: BLE001 - counted, reported
                with lock:
                    errors.append(f"{type(error).__name__}: {error}")
                continue
            t1 = time.perf_counter()
            with lock:
                latencies.append(t1 - t0)
                spans.append((t0, t1))
                by_client[k].append(t1 - t0)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = (max(b for _, b in spans) - min(a for a, _ in spans)) if spans else float("nan")
    return {
        "latencies": latencies,
        "wall": wall,
        "done": len(latencies),
        "errors": errors,
        "server_times": server_times,
        "client_means": [sum(v) / len(v) for v in by_client.values() if v],
    }


def load_test(server_url: str, plan: dict[int, int], passes: int, hits: dict[str, int]) -> dict:
    """plan: clients -> requests per client per pass. Passes alternate the order (1,4,16 then 16,4,1)."""
    levels = sorted(plan)
    runs = {
        c: {"latencies": [], "wall": 0.0, "done": 0, "errors": [], "server_times": [], "client_spread": []}
        for c in levels
    }
    index = 200_000
    for p in range(passes):
        for c in levels if p % 2 == 0 else levels[::-1]:
            common.log(f"load: {c} client(s) x {plan[c]} distinct requests (pass {p + 1}/{passes})")
            r = _drive(server_url, c, plan[c], lambda i: text_request(i, "load"), index)
            index += c * plan[c]
            for key in ("latencies", "errors", "server_times"):
                runs[c][key] += r[key]
            runs[c]["wall"] += r["wall"]
            if r["client_means"]:
                runs[c]["client_spread"].append(max(r["client_means"]) / min(r["client_means"]))
            runs[c]["done"] += r["done"]
    out = {"levels": {}}
    for c in levels:
        r = runs[c]
        out["levels"][str(c)] = {
            "clients": c,
            "requests": r["done"],
            "errors": r["errors"][:5],
            "error_count": len(r["errors"]),
            "throughput_rps": r["done"] / r["wall"],
            "latency_s": common.summary(r["latencies"]),
            "latencies": r["latencies"],
            # model-thread time per job and time queued, as the server reports them (X-H3-*-Seconds)
            "server_encode_s": common.summary([e for _, e in r["server_times"]]),
            "server_queue_s": common.summary([q for q, _ in r["server_times"]]),
            # slowest / fastest client's mean latency within a pass (1.0 = every client served alike), worst pass
            "client_mean_spread": max(r["client_spread"]) if r["client_spread"] else None,
        }
    one = out["levels"][str(levels[0])]
    top = out["levels"][str(levels[-1])]
    out["throughput_ratio"] = top["throughput_rps"] / one["throughput_rps"]
    out["fair_share_limit_s"] = 1.2 * levels[-1] * one["latency_s"]["median"]
    out["p99_over_fair_share"] = top["latency_s"]["p99"] / (levels[-1] * one["latency_s"]["median"])
    # Fairness alone: the same p99 against N x the model-thread time per job measured at that load.
    out["p99_over_service_share"] = top["latency_s"]["p99"] / (levels[-1] * top["server_encode_s"]["median"])
    out["service_slowdown"] = top["server_encode_s"]["median"] / one["server_encode_s"]["median"]

    # cache hits
    warm = text_request(0, "cached")
    from h3_core.remote.client.encoder_client import EncoderClient

    EncoderClient(server_url, retries=0).encode(warm)
    out["cache_hit_confirmed"] = cache_state(server_url, warm.prompt) == "hit"
    common.log(f"load: cache hits: {hits['sequential']} sequential")
    seq = _drive(server_url, 1, hits["sequential"], lambda i: warm, 0)
    common.log(f"load: cache hits: 16 clients x {hits['concurrent']}")
    conc = _drive(server_url, 16, hits["concurrent"], lambda i: warm, 0)
    common.log(f"load: cache hits while 4 clients keep the model busy ({hits['under_load']} hits)")
    busy_result: dict = {}
    busy = threading.Thread(
        target=lambda: busy_result.update(
            _drive(server_url, 4, hits["busy_per_client"], lambda i: text_request(i, "busy"), 500_000)
        )
    )
    busy.start()
    time.sleep(0.3)
    under = _drive(server_url, 1, hits["under_load"], lambda i: warm, 0)
    busy.join()
    out["cache_hits"] = {
        "sequential": {"latency_s": common.summary(seq["latencies"]), "errors": len(seq["errors"])},
        "concurrent_16": {
            "latency_s": common.summary(conc["latencies"]),
            "errors": len(conc["errors"]),
            "throughput_rps": conc["done"] / conc["wall"],
        },
        "under_load": {
            "latency_s": common.summary(under["latencies"]),
            "errors": len(under["errors"]),
            "busy_misses_done": busy_result.get("done", 0),
        },
    }
    return out


def run(
    models: Path, *, reps: dict[str, int], plan: dict[int, int], passes: int, hits: dict[str, int], threads: int
) -> dict:
    out = {"loadavg_before": common.loadavg()}
    common.log("remote: starting `python -m h3_core serve` (loopback)")
    t0 = time.perf_counter()
    with EncoderServer(models, threads, ["--queue-size", "64"]) as server:
        out["server_start_s"] = time.perf_counter() - t0
        common.log(f"remote: local vs remote encode in a fresh worker process ({reps})")
        out["remote_vs_local"] = common.run_worker(
            "remote", {"url": server.url, "models": str(models), "reps": reps}, threads, timeout=1800
        )
        for kind, v in out["remote_vs_local"].items():
            common.log(
                f"remote: {kind}: local {1000 * v['local_s']['median']:.0f} ms, remote "
                f"{1000 * v['remote_s']['median']:.0f} ms (x{v['remote_over_local']:.2f}), "
                f"identical={v['bit_identical']}"
            )
        out["load"] = load_test(server.url, plan, passes, hits)
    out["loadavg_after"] = common.loadavg()
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    spec = json.loads(parser.parse_args().worker)
    common.set_threads(int(os.environ.get("H3_THREADS", "1")))
    print(json.dumps(remote_vs_local(spec["url"], Path(spec["models"]), spec["reps"])), flush=True)
