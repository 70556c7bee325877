"""Disaggregated H3, measured side by side: `python bench/run.py [--quick] [--models DIR]`.

Runs these sections on CPU with the embedded tiny H3 (built into a temporary folder unless --models is given);
bench/README.md describes each:
  split       stage-split overhead vs diffusers' monolithic pipeline, and load times per side (split.py)
  wire        the conditioning contract over the real server vs a raw loopback socket (wire.py)
  remote      remote vs local encode on loopback; the server under 1 / 4 / 16 clients, and cache hits (remote.py)
  vae         VAE peak memory and time vs canvas, frames and audio duration; streamed vs diffusers' decode (vae.py)
  ray         the Ray Serve engine: replicas and per-request overhead (ray_bench.py)
  fairness    fair turns and text batching vs one FIFO (fairness.py)
  components  the encoder's component cache: prompt edits and restarts (component_cache.py)
  cache       step-cache presets vs off at 20 steps (step_cache.py)
writes results.md, results.json and PNG plots (bench/results/, or bench/results/quick/ for --quick, not committed),
and ends with one line per target (its measured ratio) and `targets met: N/M`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SECTIONS = ("split", "wire", "remote", "vae", "ray", "fairness", "components", "cache")

NOTES = [
    "Threads: every process (bench, encoder server, workers) runs torch with the same thread count (`--threads`, "
    "default 1). On this shared 2-core machine 2 threads made the same job 2.5-17x slower and wildly noisy "
    "(OpenMP threads spin at barriers while the other workers hold a core), e.g. a 64x64x124 8-step job took "
    "3.8-27 s with 2 threads and 1.5 s with 1.",
    "Interleaving: each A/B comparison alternates the arms ABBA after one untimed warm-up round per arm; ratios are "
    "medians of per-pair ratios with a 95 % bootstrap interval, so drift and other jobs' load hit both arms.",
    "Model loading is outside every timed region except the load-time table, which runs each arm in a fresh "
    "process (page cache warm).",
    "Peak memory on CPU: RSS high-water mark (VmHWM) after resetting it with /proc/self/clear_refs, minus RSS just "
    "before the op, after trimming the heap (malloc_trim). Full runs use a fresh process per point; --quick runs "
    "a sweep per process (checked against per-point processes: peaks within ~4 %). The streamed-decode comparison "
    "and bench/vae_wide.py measure peaks with glibc's mmap threshold pinned at 1 MiB (MALLOC_MMAP_THRESHOLD_): "
    "buffers of 1 MiB or more are unmapped when freed, so a peak is what the op holds rather than freed heap an "
    "earlier arm left resident (with the adaptive default, the same decode peaked 85-116 MB at 384x384 depending "
    "on the arm before it); its times come from a second process with the default allocator.",
    "Wire: the same subprocess serves the real aiohttp app (around a synthetic stage that returns prebuilt "
    "contracts; cache off, so each request pays to_wire: header + one xxh3-128 pass) and a raw blocking TCP server "
    "that sendall()s the very same bytes; the client side is EncoderClient.encode vs socket.recv_into a fresh buffer. "
    "Exact bytes per direction come from a counting TCP proxy.",
    "p99 uses linear interpolation between samples; with n < 100 it is close to the maximum.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="reduced counts and sizes (a few minutes)")
    parser.add_argument("--models", help="H3 models folder (default: build the embedded tiny H3 into a temp dir)")
    parser.add_argument("--out", help="output folder (default bench/results, or bench/results/quick with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every process (default 1)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default all)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--update", action="store_true",
                        help="keep the other sections of the output folder's results.json: measure only --sections "
                             "and re-render the report (each section records when it ran)")
    parser.add_argument("--render", metavar="RESULTS_JSON",
                        help="measure nothing: re-render results.md and the plots from a results.json")
    args = parser.parse_args(argv)
    if args.render:
        from bench import report

        results = json.loads(Path(args.render).read_text())
        results.pop("targets", None)
        out = Path(args.out) if args.out else Path(args.render).parent
        report.write(results, out, with_plots=not args.no_plots)
        for line in report.status_lines(results):
            print(line)
        return 0
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")

    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ["H3_THREADS"] = str(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from bench import common, report

    common.set_threads(args.threads)
    plan = common.RUN_QUICK if args.quick else common.RUN_FULL
    out = Path(args.out) if args.out else REPO / "bench" / "results" / ("quick" if args.quick else "")
    started = time.perf_counter()
    results: dict = {"meta": {"mode": "quick" if args.quick else "full",
                              "started": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                              "threads": args.threads, "sections": sections, "plan": _jsonable(plan),
                              "environment": common.environment(args.threads), "notes": NOTES}}
    if args.update and (out / "results.json").exists():
        kept = json.loads((out / "results.json").read_text())
        kept.pop("targets", None)
        for key, value in kept.items():
            if key != "meta" and key not in sections:
                results[key] = value
        earlier = kept.get("meta", {})
        results["meta"]["section_started"] = {s: earlier.get("section_started", {}).get(s, earlier.get("started"))
                                              for s in earlier.get("sections", []) if s not in sections}
        results["meta"]["sections"] = [s for s in SECTIONS if s in sections or s in results]
        results["meta"]["section_s"] = {s: v for s, v in earlier.get("section_s", {}).items() if s not in sections}
        results["meta"]["updated"] = sections
    tmp = Path(tempfile.mkdtemp(prefix="h3-bench-"))
    try:
        if args.models:
            models = Path(args.models)
        else:
            from h3_core import tiny

            common.log("building the embedded tiny H3")
            t0 = time.perf_counter()
            models = tiny.build(tmp / "tiny", seed=0)
            results["meta"]["built_tiny"] = True
            results["meta"]["build_tiny_s"] = time.perf_counter() - t0
        # the folder's name only: a results file is committed and shared, a machine's absolute path means nothing
        results["meta"]["models"] = (f"given folder '{Path(models).name}'" if args.models
                                     else "embedded tiny H3 (built by this run)")
        for section in sections:
            t0 = time.perf_counter()
            common.log(f"=== section {section} ===")
            results["meta"].setdefault("section_started", {})[section] = \
                datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
            if section == "split":
                from bench import split

                results["split"] = split.run(models, threads=args.threads, tmp=tmp, **plan["split"])
            elif section == "wire":
                from bench import wire

                results["wire"] = wire.run(threads=args.threads, **plan["wire"])
            elif section == "remote":
                from bench import remote

                results["remote"] = remote.run(models, threads=args.threads, **plan["remote"])
            elif section == "vae":
                from bench import vae

                results["vae"] = vae.run(models, threads=args.threads, **plan["vae"])
                if not args.quick:  # the streamed decode on a decoder of the released width (a few minutes)
                    from bench import vae_wide

                    results["vae"]["wide"] = vae_wide.run(str(models), threads=args.threads)
            elif section == "ray":  # Ray Serve engine (bench/ray_bench.py), its plan there
                results["ray"] = __import__("bench.ray_bench").ray_bench.run(models, args.threads, args.quick)
            elif section == "cache":  # step caching presets vs off (bench/step_cache.py)
                from bench import step_cache

                results["cache"] = step_cache.run(models, threads=args.threads, **plan["cache"])
            elif section == "fairness":  # writes fairness.md / fairness.json next to results.md
                # In a fresh process: run after the wire section in this one, its 16 client threads measured a p99
                # 2.4x higher (1.22 vs 0.50 of the fair share). The cause is Python's cyclic GC: the earlier
                # sections leave ~160k more objects here (torch, h3_core), and each full collection stops every
                # client thread while it walks them; gc.freeze() after the wire section gave 0.32-0.34 (alone 0.31-
                # 0.33, without it 0.52-0.68, quick plan). The server's own process is not affected.
                out.mkdir(parents=True, exist_ok=True)
                cmd = [sys.executable, "-m", "bench.fairness", "--models", str(models), "--out", str(out),
                       "--threads", str(args.threads), *(["--quick"] if args.quick else [])]
                subprocess.run(cmd, cwd=REPO, env=common.worker_env(args.threads), check=True)
                results["fairness"] = json.loads((out / "fairness.json").read_text())
            elif section == "components":  # the encoder's component cache: prompt edits, restarts (its own server)
                from bench import component_cache

                results["components"] = component_cache.run(str(models), threads=args.threads,
                                                            **plan["components"])
            results["meta"].setdefault("section_s", {})[section] = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["meta"]["wall_s"] = time.perf_counter() - started
    results["meta"]["loadavg_end"] = common.loadavg()
    written = report.write(results, out, with_plots=not args.no_plots)
    common.log(f"wrote {written['markdown']}, {written['json']}, {len(written['plots'])} plot(s); "
               f"{results['meta']['wall_s'] / 60:.1f} min")
    for line in report.status_lines(results):
        print(line, flush=True)
    return 0


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
