"""Section "ray": the encoder endpoint on Ray Serve (`serve --engine ray`) against the aiohttp server.

1. Scaling: C concurrent clients send distinct text-only requests (every one a cache miss) to the Ray endpoint
   with 1, then 2 encoder replicas: throughput, median and p99 latency, and the 2/1 throughput ratio. One torch
   thread per replica, so the ratio says what a second model buys on this machine's cores (reported with them).
2. Per-request overhead: the same requests, one at a time, alternating (ABBA) between the aiohttp server
   (a subprocess, `python -m h3_core serve`) and the Ray endpoint with 1 replica; misses (distinct prompts: proxy
   -> ingress -> replica -> back) and hits (the same prompt: proxy -> ingress cache) separately. The overhead is
   the median of the per-pair differences.

Run: `python bench/run.py --quick --sections ray` (or `python -m bench.ray_bench [--quick]` for this section alone).
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import sys
import time
from pathlib import Path

from bench import common
from bench.remote import EncoderServer, text_request

QUICK = dict(clients=4, requests=48, pairs=20)
FULL = dict(clients=8, requests=160, pairs=60)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _deploy(models: Path, replicas: int, threads: int, port: int) -> str:
    from h3_core.remote.engines import ray_run
    from h3_core.remote.engines import ray_serve as ray_engine
    from h3_core.remote.server.config import ServerConfig

    settings = ray_engine.RaySettings(models=str(models), replicas=replicas, threads=threads,
                                      config=ServerConfig(threads=threads), max_ongoing_requests=2,
                                      max_queued_requests=256)
    return ray_run.start(settings, port, num_cpus=os.cpu_count())


def _load(url: str, clients: int, requests: int, tag: str) -> dict:
    from h3_core.remote.client.encoder_client import EncoderClient

    latencies: list[float] = []

    def one(i: int) -> None:
        client = EncoderClient(url, retries=8, read_timeout=300)
        t0 = time.perf_counter()
        client.encode(text_request(i, tag))
        latencies.append(time.perf_counter() - t0)

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(3 * clients)))  # warm-up: every replica has run the model
        latencies.clear()
        t0 = time.perf_counter()
        list(pool.map(one, range(3 * clients, 3 * clients + requests)))
        wall = time.perf_counter() - t0
    return {"clients": clients, "requests": requests, "wall_s": wall, "per_s": requests / wall,
            "latency_s": common.summary(latencies)}


def _overhead(aiohttp_url: str, ray_url: str, pairs: int) -> dict:
    from h3_core.remote.client.encoder_client import EncoderClient

    clients = {"aiohttp": EncoderClient(aiohttp_url), "ray": EncoderClient(ray_url)}
    out = {}
    for kind in ("miss", "hit"):
        samples: dict[str, list[float]] = {"aiohttp": [], "ray": []}
        for i in range(pairs + 2):
            order = ("aiohttp", "ray") if i % 2 == 0 else ("ray", "aiohttp")
            for arm in order:
                request = text_request(i if kind == "miss" else 0, f"overhead-{kind}-{arm}")
                t0 = time.perf_counter()
                clients[arm].encode(request)
                if i >= 2:  # the first two rounds warm both paths (and fill the hit arm's cache entry)
                    samples[arm].append(time.perf_counter() - t0)
        differences = sorted(r - a for a, r in zip(samples["aiohttp"], samples["ray"]))
        out[kind] = {"aiohttp_s": common.summary(samples["aiohttp"]), "ray_s": common.summary(samples["ray"]),
                     "overhead_ms": 1000 * differences[len(differences) // 2],
                     "overhead_ci_ms": [1000 * x for x in common.bootstrap_median_ci(differences)]}
    return out


def run(models: Path, threads: int = 1, quick: bool = False) -> dict:
    import ray

    from h3_core.remote.engines import ray_run

    plan = QUICK if quick else FULL
    result: dict = {"cores": os.cpu_count(), "threads_per_replica": threads, "plan": plan, "loadavg_start":
                    common.loadavg()}
    port = _free_port()
    t0 = time.perf_counter()
    try:
        url = _deploy(models, 1, threads, port)
        result["startup_s"] = time.perf_counter() - t0
        common.log(f"ray: 1 replica up in {result['startup_s']:.1f} s; load test")
        result["replicas_1"] = _load(url, plan["clients"], plan["requests"], "r1")
        with EncoderServer(models, threads) as server:
            common.log("ray: per-request overhead vs the aiohttp server")
            result["overhead"] = _overhead(server.url, url, plan["pairs"])
        t0 = time.perf_counter()
        url = _deploy(models, 2, threads, port)
        result["redeploy_2_s"] = time.perf_counter() - t0
        common.log("ray: 2 replicas; load test")
        result["replicas_2"] = _load(url, plan["clients"], plan["requests"], "r2")
    finally:
        try:
            ray_run.stop()
        finally:
            ray.shutdown()
    result["scaling"] = result["replicas_2"]["per_s"] / result["replicas_1"]["per_s"]
    result["loadavg_end"] = common.loadavg()
    common.log(summary_line(result))
    return result


def summary_line(result: dict) -> str:
    one, two, over = result["replicas_1"], result["replicas_2"], result["overhead"]
    return (f"ray on {result['cores']} cores: 1 replica {one['per_s']:.1f}/s (p99 {one['latency_s']['p99']:.2f} s), "
            f"2 replicas {two['per_s']:.1f}/s (p99 {two['latency_s']['p99']:.2f} s): x{result['scaling']:.2f}; "
            f"overhead vs aiohttp: miss {over['miss']['overhead_ms']:+.1f} ms, "
            f"hit {over['hit']['overhead_ms']:+.1f} ms")


if __name__ == "__main__":  # python -m bench.ray_bench [--quick] [--models DIR]
    import argparse
    import json

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=os.environ.get("H3_TINY_DIR"))
    parser.add_argument("--threads", type=int, default=1)
    parsed = parser.parse_args()
    if not parsed.models:
        sys.exit("--models DIR (or H3_TINY_DIR) is required when running this section alone")
    os.environ["OMP_NUM_THREADS"] = os.environ["H3_THREADS"] = str(parsed.threads)
    common.set_threads(parsed.threads)
    print(json.dumps(run(Path(parsed.models), parsed.threads, parsed.quick), default=str))
