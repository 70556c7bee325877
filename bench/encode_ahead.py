"""Encode-ahead in a real ComfyUI: a queue of two ref2va prompts with and without it (nodes/encode_ahead.py).

A real ComfyUI (tests/support/comfy_harness.py: `.comfyui/`, CPU, loopback) with the pack, and a real H3 encoder server
(`python -m h3_core serve`) listed in H3_ENCODER_URLS, both on the embedded tiny H3. One round posts two ref2va
prompts (the shipped ref2va_remote workflow, each with its own prompt text so neither ComfyUI's cache nor the
server's serves them) at once and times from the first POST to the second prompt's end. The arms differ only in
the prompts' `extra_data` (`h3_encode_ahead: false` turns encode-ahead off per prompt), so they share one server
pair and alternate ABBA after a warm-up round of each. Ratio = with / without, median of per-round ratios with a
95 % bootstrap interval.

    python -m bench.encode_ahead [--models TINY_DIR] [--rounds 4] [--steps 8] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from bench import common

GRAPH = common.REPO / "workflows" / "api" / "ref2va_remote.json"
ENCODE_S = {"t2va": 0.25, "ref2va (one image)": 9.66}  # vLLM-Omni's stage 0 on a GB10 with FP8
REST_S = {"50-step DiT, fastest": 2088.0, "50-step DiT, slowest": 4040.0, "5-step whole job": 15.6}


def expected_ratio(encode_s: float, rest_s: float, prompts: int = 2) -> float:
    """A queue of `prompts` equal jobs, each `encode_s` of stage 0 and `rest_s` after it: every encode but the
    first runs while the previous job's DiT runs."""
    return 1 - (prompts - 1) * encode_s / (prompts * (encode_s + rest_s))


def _graph(endpoint: str, text: str, steps: int, seed: int) -> dict:
    graph = json.loads(GRAPH.read_text())
    for node in graph.values():
        if node["class_type"] == "H3SplitRemoteEncode":
            node["inputs"].update(endpoint=endpoint, prompt=f"<Picture 1> {text} like <Video 1>, to <Audio 2>.")
        if node["class_type"] == "H3SplitSampler":
            node["inputs"].update(steps=steps, seed=seed)
    return graph


def _wait(comfy, prompt_id: str, timeout: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = comfy.history(prompt_id).get("status", {}).get("status_str")
        if status == "success":
            return
        if status == "error":
            raise RuntimeError(f"prompt {prompt_id} failed\n{comfy.log_tail()}")
        time.sleep(0.05)
    raise TimeoutError(f"prompt {prompt_id} did not finish\n{comfy.log_tail()}")


def _pair(comfy, endpoint: str, ahead: bool, tag: str, steps: int) -> float:
    started = time.perf_counter()
    ids = []
    for k in range(2):
        body = {"prompt": _graph(endpoint, f"{tag} object {k} moves", steps, seed=len(ids)),
                "client_id": uuid.uuid4().hex, "extra_data": {"h3_encode_ahead": ahead}}
        status, answer = comfy.request("POST", "/prompt", body)
        if status != 200:
            raise RuntimeError(f"POST /prompt -> {status}: {answer}")
        ids.append(answer["prompt_id"])
    for prompt_id in ids:
        _wait(comfy, prompt_id)
    return time.perf_counter() - started


def run(models: Path, *, rounds: int = 4, steps: int = 8, threads: int = 1) -> dict:
    sys.path.insert(0, str(common.REPO / "tests"))
    from support import comfy_harness

    env = common.worker_env(threads)
    port = comfy_harness.free_port()
    folder = Path(tempfile.mkdtemp(prefix="h3-encode-ahead-"))
    log = open(folder / "encoder.log", "w")
    encoder = subprocess.Popen([sys.executable, "-m", "h3_core", "serve", "--models", str(models), "--port",
                                str(port)], cwd=common.REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    comfy = None
    try:
        for _ in range(1200):
            try:
                urllib.request.urlopen(f"{url}/v1/health", timeout=2).read()
                break
            except OSError:
                if encoder.poll() is not None:
                    raise RuntimeError("the encoder server died") from None
                time.sleep(0.5)
        comfy_env = {"H3_TINY_DIR": str(models), "H3_ENCODER_URLS": url, "H3_ENCODE_AHEAD_DELAY": "0",
                     "OMP_NUM_THREADS": str(threads), "H3_THREADS": str(threads)}
        comfy = comfy_harness.start_comfy(folder / "comfy", models_src=Path(models) / "comfyui", env=comfy_env,
                                          start_timeout=600)
        comfy.add_model("minimax_h3", models, "tiny")
        common.log("encode-ahead: warm-up")
        for arm in (False, True):
            _pair(comfy, url, arm, f"warm {arm}", steps)
        times = {"without": [], "with": []}
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for ahead in order:
                seconds = _pair(comfy, url, ahead, f"round {r} {ahead}", steps)
                times["with" if ahead else "without"].append(seconds)
                common.log(f"encode-ahead: round {r} {'with' if ahead else 'without'}: {seconds:.2f} s")
        encodes = [line for line in (folder / "encoder.log").read_text().splitlines() if "POST /v1/encode" in line]
        ahead_log = comfy.log_text().count("encoded ahead")
    finally:
        if comfy is not None:
            comfy.stop()
        encoder.send_signal(signal.SIGTERM)
        encoder.wait(timeout=60)
        log.close()
    pair = common.paired(times["without"], times["with"])
    return {
        "rounds": rounds, "steps": steps, "threads": threads, "times_s": times, "ratio": pair["median_ratio"],
        "ci95": pair["ci95"], "ratio_of_medians": pair["ratio_of_medians"], "encodes_served": len(encodes),
        "cache_hits": sum("cache=hit" in line for line in encodes), "encoded_ahead": ahead_log,
        "expected_full_size": {f"{e} / {r}": expected_ratio(ENCODE_S[e], REST_S[r]) for e in ENCODE_S
                               for r in REST_S},
        "loadavg": common.loadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="the embedded tiny H3 (default: $H3_TINY_DIR)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    models = Path(args.models or os.environ["H3_TINY_DIR"])
    result = run(models, rounds=args.rounds, steps=args.steps, threads=args.threads)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
