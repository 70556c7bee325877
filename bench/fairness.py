"""Fairness and batching of the encoder server: `python -m bench.fairness [--quick] [--models DIR] [--out DIR]`.

The real server (`python -m h3_core serve`, loopback, tiny H3) measured in one run, arms interleaved pass by pass:

* single client: requests back to back; its median latency L1 and throughput T1 are the reference;
* 16 clients: each sends requests back to back; p99 latency / (16 x L1) (target <= 1.2) and throughput / T1
  (target >= 1.0, >= 1.5 where batching applies);
* flood: one client keeps 100 requests outstanding (100 connections from one address, each sending its next
  request as soon as the previous is answered, in a separate process) while another client sends requests one at
  a time; the light client's median latency / L1 (target <= 2).

Clients are told apart by their peer address (the server's default `--client-key peer`): every simulated client
connects from its own loopback address (127.0.0.x; Linux routes all of 127/8 to lo). Arms:

* `fair`: distinct addresses, text batching on (the server's defaults);
* `fifo`: every client from 127.0.0.1, the same server: one client key, so the queue is one FIFO (as before the
  fair queue), with batching still on;
* `fair_nobatch`: distinct addresses on a second server started with `--text-batch 1`.

All prompts have the same token count (digits are single tokens), so batching applies whenever several are queued;
every prompt is distinct (no cache hits). Intervals are 95 % percentile-bootstrap intervals of each ratio
(resampling requests for latencies, passes for throughput). How much batches comes from the server's own
`/metrics` (`h3_encoder_text_batch_size`), scraped before and after each scenario; where the light client's time
goes from the server's own X-H3-Queue-Seconds / X-H3-Encode-Seconds answer headers.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import common  # noqa: E402
from bench.remote import EncoderServer  # noqa: E402
from h3_core.remote import protocol  # noqa: E402

PV = protocol.PROTOCOL_VERSION  # the request JSON's "protocol" field

FULL = dict(passes=4, single=24, per_client=6, clients=16, flood=100, light=6)
QUICK = dict(passes=2, single=12, per_client=3, clients=16, flood=100, light=4)
PREVIOUS = {  # bench/results/results.md before the fair queue (one FIFO, no batching), full run
    "p99_over_fair_share": 1.3855, "throughput_ratio": 1.0205, "single_latency_ms": 33.6, "p99_16_ms": 745.6,
}
SHARED = "127.0.0.1"
WAITS = ("anticipated", "anticipation_missed")  # the model thread's waits for a client next in line (fair_queue.py)


def _address(arm: str, k: int) -> str:
    """The source address of simulated client `k` (k=0 the single/light client)."""
    return SHARED if arm == "fifo" else f"127.0.{10 + k // 200}.{1 + k % 200}"


class Client:
    """One keep-alive connection from a given loopback source address, posting JSON encode requests."""

    def __init__(self, url: str, source: str):
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=300, source_address=(source, 0))
        self.server_s: list[tuple[float, float]] = []  # (queue, encode) seconds the server reported per request

    def encode(self, prompt: str) -> float:
        body = json.dumps({"protocol": PV, "prompt": prompt, "width": 64, "height": 64, "num_frames": 124})
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/encode", body=body, headers={"Content-Type": "application/json"})
        response = self.conn.getresponse()
        response.read()
        elapsed = time.perf_counter() - t0
        if response.status != 200:
            raise RuntimeError(f"encode answered {response.status}")
        self.server_s.append((float(response.getheader(protocol.H_QUEUE_S, "nan")),
                              float(response.getheader(protocol.H_ENCODE_S, "nan"))))
        return elapsed

    def close(self) -> None:
        self.conn.close()


def _prompt(tag: str, i: int) -> str:
    return f"A red fox trots through fresh snow at dawn, {tag} {i % 100_000:05d}."


def _scrape(url: str) -> dict[str, float]:
    """The server's text-batch histogram and queue depth (prometheus-client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "h3_encoder_text_batch_size_sum":
                out["batched_requests"] = sample.value
            elif sample.name == "h3_encoder_text_batch_size_count":
                out["forwards"] = sample.value
            elif sample.name == "h3_encoder_text_batch_size_bucket" and sample.labels.get("le") == "1.0":
                out["alone"] = sample.value
            elif sample.name == "h3_encoder_queue_depth":
                out["queue_depth"] = sample.value
            elif sample.name == "h3_encoder_events_total" and sample.labels.get("event") in WAITS:
                out[sample.labels["event"]] = sample.value
    return out


def _batching(before: dict, after: dict) -> dict[str, float]:
    requests = after.get("batched_requests", 0) - before.get("batched_requests", 0)
    forwards = after.get("forwards", 0) - before.get("forwards", 0)
    alone = after.get("alone", 0) - before.get("alone", 0)
    waits = {name: after.get(name, 0) - before.get(name, 0) for name in WAITS}
    return {**waits, "requests": requests, "forwards": forwards,
            "requests_per_forward": requests / forwards if forwards else float("nan"),
            "share_batched": (requests - alone) / requests if requests else float("nan")}


# --- scenarios ---------------------------------------------------------------------------------------------------


def _parallel(work: list[Callable[[], Any]]) -> tuple[list[Any], float]:
    """Run each callable in its own thread, started together; (results, wall seconds)."""
    results: list[Any] = [None] * len(work)
    barrier = threading.Barrier(len(work) + 1)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = work[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def single(url: str, arm: str, n: int, counter: list[int]) -> dict:
    client = Client(url, _address(arm, 0))
    latencies = []
    t0 = time.perf_counter()
    for _ in range(n):
        counter[0] += 1
        latencies.append(client.encode(_prompt("single", counter[0])))
    wall = time.perf_counter() - t0
    client.close()
    return {"latencies": latencies, "throughput": n / wall}


def many(url: str, arm: str, clients: int, per_client: int, counter: list[int]) -> dict:
    base = counter[0]
    counter[0] += clients * per_client

    def client_work(k: int) -> Callable[[], list[float]]:
        def work() -> list[float]:
            client = Client(url, _address(arm, k + 1))
            try:
                return [client.encode(_prompt("many", base + k * per_client + j)) for j in range(per_client)]
            finally:
                client.close()

        return work

    before = _scrape(url)
    results, wall = _parallel([client_work(k) for k in range(clients)])
    latencies = [x for r in results for x in r]
    return {"latencies": latencies, "throughput": len(latencies) / wall, "batching": _batching(before, _scrape(url))}


def flood(url: str, arm: str, size: int, light: int, counter: list[int], threads: int = 1) -> dict:
    """`size` requests kept outstanding by one client (another process) while a light client sends `light`.

    The flooding client runs in its own process, so its 100 threads do not compete with the light client's
    thread for this process's interpreter lock: the light client's latency is the server's doing.
    """
    base = counter[0]
    counter[0] += 100_000  # the flood draws prompts from its own range
    spec = {"url": url, "source": _address(arm, 500), "size": size, "base": base}
    cmd = [sys.executable, "-m", "bench.fairness", "--flood-worker", json.dumps(spec)]
    before = _scrape(url)
    proc = subprocess.Popen(cmd, cwd=REPO, env=common.worker_env(threads), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline()
        if not ready.startswith("ready"):
            raise RuntimeError(f"flood worker did not start: {ready!r}")
        time.sleep(0.3)  # the last bodies parsed and queued
        depth = _scrape(url).get("queue_depth", float("nan"))
        client = Client(url, _address(arm, 0))
        latencies = [client.encode(_prompt("light", counter[0] + j)) for j in range(light)]
        counter[0] += light
        client.close()
        server_s = client.server_s
        depth_after = _scrape(url).get("queue_depth", float("nan"))
    finally:
        proc.stdin.close()  # the flood stops sending; its outstanding requests are answered
        summary = proc.stdout.read()
        proc.wait(600)
    done = json.loads(summary.strip().splitlines()[-1]) if summary.strip() else {}
    if done.get("errors"):
        raise RuntimeError(f"flood requests failed: {done['errors'][:3]}")
    return {"light_latencies": latencies, "light_queue_s": [q for q, _ in server_s],
            "light_encode_s": [e for _, e in server_s], "queue_depth_at_start": depth,
            "queue_depth_at_end": depth_after, "flood_done": done.get("done"),
            "batching": _batching(before, _scrape(url))}


def flood_worker(spec: dict) -> None:
    """`size` threads, each sending requests back to back from one source address, until stdin closes."""
    stop = threading.Event()
    started = threading.Semaphore(0)
    counts, errors = [0] * spec["size"], []

    def work(k: int) -> None:
        client = Client(spec["url"], spec["source"])
        i = 0
        while not stop.is_set():
            body = json.dumps({"protocol": PV, "prompt": _prompt("flood", spec["base"] + k * 1000 + i), "width": 64,
                               "height": 64, "num_frames": 124})
            client.conn.request("POST", "/v1/encode", body=body, headers={"Content-Type": "application/json"})
            if i == 0:
                started.release()
            response = client.conn.getresponse()
            response.read()
            if response.status != 200:
                errors.append(response.status)
            counts[k] += 1
            i += 1
        client.close()

    workers = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(spec["size"])]
    for w in workers:
        w.start()
    for _ in workers:
        started.acquire()
    print("ready", flush=True)
    sys.stdin.read()
    stop.set()
    for w in workers:
        w.join(300)
    print(json.dumps({"done": sum(counts), "errors": errors[:10]}), flush=True)


# --- statistics -------------------------------------------------------------------------------------------------


def _boot(stat: Callable[..., float], *samples: list[float], iters: int = 2000, seed: int = 0) -> list[float]:
    """95 % percentile-bootstrap interval of stat(*samples), each sample list resampled independently."""
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(s, dtype=float) for s in samples]
    values = [stat(*(a[rng.integers(0, a.size, a.size)] for a in arrays)) for _ in range(iters)]
    lo, hi = np.percentile(values, [2.5, 97.5])
    return [float(lo), float(hi)]


def _ratios(arm: dict, clients: int) -> dict[str, Any]:
    one, multi, light = arm["single_latencies"], arm["many_latencies"], arm["light_latencies"]

    def p99_share(a, b):
        return float(np.percentile(b, 99) / (clients * np.median(a)))

    def light_ratio(a, c):
        return float(np.median(c) / np.median(a))

    def throughput(t1, t16):
        return float(np.mean(t16) / np.mean(t1))

    return {
        "single_latency_s": common.summary(one),
        "many_latency_s": common.summary(multi),
        "light_latency_s": common.summary(light),
        "p99_over_fair_share": p99_share(one, multi), "p99_over_fair_share_ci95": _boot(p99_share, one, multi),
        "light_over_single": light_ratio(one, light), "light_over_single_ci95": _boot(light_ratio, one, light),
        "light_max_over_single": float(np.max(light) / np.median(one)),
        "throughput_ratio": throughput(arm["single_throughput"], arm["many_throughput"]),
        "throughput_ratio_ci95": _boot(throughput, arm["single_throughput"], arm["many_throughput"]),
    }


# --- the run ------------------------------------------------------------------------------------------------------


def run(models: Path, *, threads: int = 1, quick: bool = False, out: Path | None = None, plan: dict | None = None
        ) -> dict:
    plan = dict(plan or (QUICK if quick else FULL))
    arms = {name: {"single_latencies": [], "many_latencies": [], "light_latencies": [], "single_throughput": [],
                   "many_throughput": [], "batching_many": [], "batching_flood": [], "queue_depth": [],
                   "light_queue_s": [], "light_encode_s": []}
            for name in ("fair", "fifo", "fair_nobatch")}
    counter = [0]
    queue = ["--queue-size", str(plan["flood"] + plan["clients"] * 2 + 16)]
    out_results: dict[str, Any] = {"plan": plan, "loadavg_before": common.loadavg(), "previous": PREVIOUS}
    common.log("fairness: starting two servers (batching on, --text-batch 1)")
    with EncoderServer(models, threads, queue) as batching, \
            EncoderServer(models, threads, queue + ["--text-batch", "1"]) as plain:
        urls = {"fair": batching.url, "fifo": batching.url, "fair_nobatch": plain.url}
        for url in (batching.url, plain.url):
            # Warm-up, untimed: the first forwards of a process are slower, and the batching server checks the
            # first batch of every shape (batch size, token count) against single encodes: steady state is measured.
            single(url, "fair", 4, counter)
            many(url, "fair", plan["clients"], 2, counter)
            flood(url, "fair", 32, 2, counter, threads)
        for p in range(plan["passes"]):
            order = list(arms) if p % 2 == 0 else list(arms)[::-1]
            for name in order:
                url, arm = urls[name], arms[name]
                common.log(f"fairness: pass {p + 1}/{plan['passes']}, arm {name}")
                s = single(url, name, plan["single"], counter)
                arm["single_latencies"] += s["latencies"]
                arm["single_throughput"].append(s["throughput"])
                m = many(url, name, plan["clients"], plan["per_client"], counter)
                arm["many_latencies"] += m["latencies"]
                arm["many_throughput"].append(m["throughput"])
                arm["batching_many"].append(m["batching"])
                f = flood(url, name, plan["flood"], plan["light"], counter, threads)
                arm["light_latencies"] += f["light_latencies"]
                arm["light_queue_s"] += f["light_queue_s"]
                arm["light_encode_s"] += f["light_encode_s"]
                arm["batching_flood"].append(f["batching"])
                arm["queue_depth"].append([f["queue_depth_at_start"], f["queue_depth_at_end"]])
    for name, arm in arms.items():
        summary = _ratios(arm, plan["clients"])
        for key in ("batching_many", "batching_flood"):
            totals = {k: sum(b[k] for b in arm[key]) for k in ("requests", "forwards") + WAITS}
            alone_share = [b["share_batched"] * b["requests"] for b in arm[key] if b["requests"]]
            summary[key] = {**totals, "requests_per_forward": totals["requests"] / totals["forwards"]
                            if totals["forwards"] else None,
                            "share_batched": sum(alone_share) / totals["requests"] if totals["requests"] else None}
        summary["flood_queue_depth"] = arm["queue_depth"]
        # where the light client's time goes: waiting in the queue (the running forward, mostly) or in its own one
        summary["light_queue_s"] = common.summary(arm["light_queue_s"])
        summary["light_encode_s"] = common.summary(arm["light_encode_s"])
        summary["samples"] = {k: arm[k] for k in ("single_latencies", "many_latencies", "light_latencies",
                                                  "single_throughput", "many_throughput")}
        out_results[name] = summary
    out_results["loadavg_after"] = common.loadavg()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "fairness.json").write_text(json.dumps(out_results, indent=1))
        (out / "fairness.md").write_text(markdown(out_results))
    return out_results


def _ci(value: float, ci: list[float]) -> str:
    return f"{value:.3f} ({ci[0]:.3f} .. {ci[1]:.3f})"


def markdown(results: dict) -> str:
    plan = results["plan"]
    lines = [
        "# Encoder server: fairness and text batching (`python -m bench.fairness`)", "",
        f"Real server on loopback, tiny H3, 1 torch thread; {plan['passes']} passes, arms interleaved. Single client: "
        f"{plan['single']} requests back to back per pass; {plan['clients']} clients x {plan['per_client']}; flood: "
        f"{plan['flood']} requests kept outstanding by one client while another sends {plan['light']} one at a time. "
        "All prompts distinct with equal token counts. Ratios with 95 % bootstrap intervals. Load average "
        f"{results['loadavg_before'][0]:.2f} before, {results['loadavg_after'][0]:.2f} after.", "",
        "| arm | single-client median ms | 16 clients: p99 / (16 x single) (<= 1.2) | 16 clients: throughput / "
        "single (>= 1.0; 1.5 batched) | flood: light client median / single (<= 2) | light max / single | "
        "16 clients: requests per text forward | flood: requests per text forward | queue depth around the light "
        "requests (min) | flood: light client's median queue / encode ms (server) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("fair", "fair_nobatch", "fifo"):
        r = results[name]
        lines.append(
            f"| {name} | {1000 * r['single_latency_s']['median']:.1f} | "
            f"{_ci(r['p99_over_fair_share'], r['p99_over_fair_share_ci95'])} | "
            f"{_ci(r['throughput_ratio'], r['throughput_ratio_ci95'])} | "
            f"{_ci(r['light_over_single'], r['light_over_single_ci95'])} | {r['light_max_over_single']:.2f} | "
            f"{_fmt(r['batching_many']['requests_per_forward'])} | "
            f"{_fmt(r['batching_flood']['requests_per_forward'])} | "
            f"{min(min(pair) for pair in r['flood_queue_depth']):.0f} | {_ms(r.get('light_queue_s'))} / "
            f"{_ms(r.get('light_encode_s'))} |")
    prev = results["previous"]
    lines += ["", f"Previous (bench/results/results.md, one FIFO, no batching): p99 / fair share "
              f"{prev['p99_over_fair_share']:.3f}, throughput 16 / 1 {prev['throughput_ratio']:.3f} (single-client "
              f"median {prev['single_latency_ms']} ms, 16-client p99 {prev['p99_16_ms']} ms). A light client behind a "
              "flood waited for the whole flood (FIFO): the `fifo` arm shows it.", ""]
    return "\n".join(lines) + "\n"


def _ms(stats: dict | None) -> str:
    return "-" if not stats or not stats.get("n") else f"{1000 * stats['median']:.1f}"


def _fmt(value) -> str:
    return "-" if value is None or value != value else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os
    import shutil
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", help="H3 models folder (default: build the embedded tiny H3 into a temp dir)")
    parser.add_argument("--out", help="folder for fairness.md/json (default bench/results[/quick])")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--flood-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.flood_worker:
        flood_worker(json.loads(args.flood_worker))
        return 0
    os.environ["H3_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="h3-fairness-"))
    try:
        if args.models:
            models = Path(args.models)
        else:
            from h3_core import tiny

            models = tiny.build(tmp / "tiny", seed=0)
        out = Path(args.out) if args.out else REPO / "bench" / "results" / ("quick" if args.quick else "")
        results = run(models, threads=args.threads, quick=args.quick, out=out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
