"""Shared helpers: robust statistics, interleaved A/B timing, process memory, environment, subprocess workers."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MB = 1e6  # decimal megabytes throughout the report
MiB = 1 << 20

# The per-section sizes of `bench/run.py`'s full and --quick runs (a section run alone, e.g. `python bench/wire.py
# --quick`, uses the same plan as in the full report).
RUN_FULL = {
    "split": dict(pairs=20, steps=50, width=64, height=64, frames=124, load_rounds=3),
    "wire": dict(reps={"0.2MB": 30, "10MB": 30, "70MB": 60}),  # the target's size: the most rounds (interval)
    "remote": dict(reps={"text": 30, "refs": 10}, plan={1: 50, 4: 12, 16: 4}, passes=4,
                   hits={"sequential": 400, "concurrent": 20, "under_load": 100, "busy_per_client": 15}),
    "components": dict(rounds=4, restarts=2),
    "cache": dict(steps=20, pairs=3),
    "vae": dict(canvas=[256, 384, 512, 768, 1024], canvas_frames=22, frames=[22, 56, 124, 209], frames_canvas=384,
                encode_canvas=[256, 384, 512, 768, 1024], encode_frames=[22, 39, 56, 73], encode_frames_canvas=128,
                audio_seconds=[2.5, 5.0, 10.0, 15.0], reps=2, per_process=True),
}
RUN_QUICK = {
    "split": dict(pairs=10, steps=50, width=64, height=64, frames=124, load_rounds=1),
    "wire": dict(reps={"0.2MB": 10, "10MB": 6, "70MB": 4}),
    "remote": dict(reps={"text": 8, "refs": 3}, plan={1: 16, 4: 4, 16: 2}, passes=2,
                   hits={"sequential": 150, "concurrent": 5, "under_load": 30, "busy_per_client": 5}),
    "components": dict(rounds=2, restarts=1),
    "cache": dict(steps=20, pairs=1, presets=["every:2", "fast"]),
    "vae": dict(canvas=[256, 384, 512, 768], canvas_frames=22, frames=[22, 56, 124], frames_canvas=256,
                encode_canvas=[256, 512], encode_frames=[22, 39], encode_frames_canvas=64,
                audio_seconds=[2.5, 10.0], reps=1, per_process=False, compare_canvas=[192, 384], compare_rounds=2),
}


# --- statistics ------------------------------------------------------------------------------------


def summary(samples: Sequence[float]) -> dict[str, float]:
    """n, median, p99 (linear interpolation), quartiles, min, max, mean of `samples`."""
    a = np.asarray(list(samples), dtype=float)
    if a.size == 0:
        return {"n": 0}
    q = np.percentile(a, [25, 50, 75, 99])
    return {
        "n": int(a.size),
        "median": float(q[1]),
        "p99": float(q[3]),
        "q1": float(q[0]),
        "q3": float(q[2]),
        "min": float(a.min()),
        "max": float(a.max()),
        "mean": float(a.mean()),
    }


def bootstrap_median_ci(samples: Sequence[float], iters: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the median."""
    a = np.asarray(list(samples), dtype=float)
    if a.size < 2:
        return (float(a[0]), float(a[0])) if a.size else (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    medians = np.median(a[rng.integers(0, a.size, (iters, a.size))], axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return float(lo), float(hi)


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Per-pair ratios b_i / a_i (a = baseline arm): median, 95 % CI of the median, IQR, ratio of medians."""
    ratios = [y / x for x, y in zip(a, b)]
    lo, hi = bootstrap_median_ci(ratios)
    s = summary(ratios)
    return {
        "ratios": ratios,
        "median_ratio": s["median"],
        "ci95": [lo, hi],
        "iqr": [s["q1"], s["q3"]],
        "ratio_of_medians": float(np.median(b) / np.median(a)),
    }


def interleaved(
    arms: dict[str, Callable[[int], Any]],
    pairs: int,
    warmup: int = 1,
    on_sample: Callable[[str, int, float, float, Any], None] | None = None,
) -> dict[str, dict[str, list]]:
    """Run the arms alternately, ABBA-ordered (A B, B A, A B, ...), so drift and machine noise hit every arm alike.

    Each arm is `fn(i) -> anything`; returns per arm the wall seconds, process CPU seconds and return values.
    `warmup` untimed rounds run first.
    """
    names = list(arms)
    for i in range(warmup):
        for name in names:
            arms[name](-1 - i)
    out = {name: {"wall": [], "cpu": [], "value": []} for name in names}
    for i in range(pairs):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            value = arms[name](i)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            out[name]["wall"].append(wall)
            out[name]["cpu"].append(cpu)
            out[name]["value"].append(value)
            if on_sample is not None:
                on_sample(name, i, wall, cpu, value)
    return out


# --- memory ----------------------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmRSS / VmHWM of this process in bytes (Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        import resource

        out["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc), so RSS afterwards is what is really in use."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs). False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def param_bytes(module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


# --- environment -----------------------------------------------------------------------------------


def environment(threads: int) -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("diffusers", "transformers", "aiohttp", "safetensors", "numpy"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            versions[name] = None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {
        "cpu": cpu,
        "usable_cores": cores,
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "loadavg_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "versions": versions,
        "peak_reset_supported": reset_peak(),
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- subprocess workers ----------------------------------------------------------------------------


def worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["H3_THREADS"] = str(threads)
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("TQDM_DISABLE", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


# glibc's mmap threshold pinned at 1 MiB (which also turns off its adaptive raising): every buffer of 1 MiB or more
# is mapped on its own and unmapped when freed, so a peak (VmHWM) counts what the measured op holds, not freed heap
# that earlier ops left resident. With the adaptive default the same streamed decode peaked at 85-116 MB at 384x384
# depending on which arm ran before it in the process.
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def run_worker(module: str, args: dict[str, Any], threads: int, timeout: float = 600,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `python -m bench.<module> --worker JSON` in a fresh process (`env` added to its environment); its last
    stdout line is the JSON answer."""
    cmd = [sys.executable, "-m", f"bench.{module}", "--worker", json.dumps(args)]
    proc = subprocess.run(cmd, cwd=REPO, env={**worker_env(threads), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"bench worker {module} {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(
            f"bench worker {module} {args} printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    return json.loads(lines[-1])


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


@contextlib.contextmanager
def tiny_models(models: str | None):
    """The models folder to measure: `models`, else $H3_TINY_DIR, else the embedded tiny H3 built into a temporary
    folder for the duration of the block."""
    import tempfile

    models = models or os.environ.get("H3_TINY_DIR")
    if models:
        yield str(models)
        return
    from h3_core import tiny

    with tempfile.TemporaryDirectory() as tmp:
        yield str(tiny.build(Path(tmp) / "tiny", seed=0))


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
