"""The encoder endpoint's component cache: a prompt edit against a cold request, before and after a restart.

One real encoder server (`python -m h3_core serve --cache-dir DIR`) on the embedded tiny H3, and a ref2va request
with a reference image, a 5 s reference video with a soundtrack and a 5 s reference audio. Each round:

  cold     new media (new pixels and samples: every part is encoded) with a new prompt;
  prompt   the same media with another new prompt (the references' parts come from the cache, the text is encoded);
  restart  (restart rounds only) the server is stopped and started again on the same DIR, then the same media with
           a third new prompt: the references' parts come from the disk tier.

Times are client wall seconds of the POST on loopback (body built beforehand), answer read whole. Ratios are
per-round (prompt / cold, restart / cold), medians with a 95 % bootstrap interval. Also measured in process: the
share of the text encoder's time its vision tower takes on this request (what caching vision features could save,
were the text step able to take them: docs/ARCHITECTURE.md §4.3).

    python -m bench.component_cache [--models TINY_DIR] [--rounds 4] [--restarts 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import common

TARGET = 0.35  # prompt-only change <= 0.35 x the cold request (and the same after a restart)


def request(seed: int, prompt: str):
    """ref2va: one image, a 5 s video with a 44.1 kHz soundtrack, a 5 s audio; pixels and samples from `seed`."""
    from h3_core.request import AudioInput, EncodeRequest, VideoInput

    rng = np.random.default_rng(seed)
    seconds = 5.0
    t = np.arange(int(seconds * 44100)) / 44100
    tone = lambda freq: np.stack([0.3 * np.sin(2 * np.pi * freq * t),  # noqa: E731
                                  0.3 * np.sin(2 * np.pi * 1.5 * freq * t)]).astype(np.float32)
    frames = rng.integers(0, 256, (int(seconds * 24), 96, 128, 3), dtype=np.uint8)
    image = rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)
    freq = 200.0 + seed % 400
    return EncodeRequest(prompt=f"<Picture 1> walks in like <Video 1>, to <Audio 2>. {prompt}", ref_images=[image],
                         ref_videos=[VideoInput(frames=frames, fps=24.0, audio=tone(freq), sample_rate=44100)],
                         ref_audios=[AudioInput(tone(freq * 1.25)[:, : int(seconds * 32000)], 32000)],
                         num_frames=124)


class Server:
    """`python -m h3_core serve` on a free loopback port, `args` added; stopped with SIGTERM (drained)."""

    def __init__(self, models: str, threads: int, args: tuple = ()):
        self.proc = subprocess.Popen([sys.executable, "-m", "h3_core", "serve", "--models", models, "--port", "0",
                                      *args], cwd=common.REPO, env=common.worker_env(threads),
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the encoder server exited with {self.proc.returncode}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline().decode()
                if "listening on " in line:
                    self.port = int(line.strip().rsplit(":", 1)[1])
                    return
        raise RuntimeError("the encoder server did not start")

    def post(self, body: tuple[str, bytes]) -> tuple[float, dict]:
        content_type, data = body
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        started = time.perf_counter()
        conn.request("POST", "/v1/encode", body=data, headers={"Content-Type": content_type})
        response = conn.getresponse()
        payload = response.read()
        seconds = time.perf_counter() - started
        conn.close()
        if response.status != 200:
            raise RuntimeError(f"encode answered {response.status}: {payload[:300]!r}")
        return seconds, {key: value for key, value in response.getheaders() if key.startswith("X-H3-")}

    def stop(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        self.proc.stdout.close()


def _wire(req) -> tuple[str, bytes]:
    from h3_core.remote.client import packing

    body, parts = packing.request_to_wire(req)
    content_type, buffers = packing.encode_multipart(body, parts)
    return content_type, b"".join(buffers)


def vision_share(models: str, threads: int) -> dict:
    """Seconds of the text encoder and of its vision tower inside it, on the bench's request (in process)."""
    import torch

    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource

    common.set_threads(threads)
    stage = EncoderStage(ModelSource.from_path(models), components=("text",))
    prepared = stage.prepare(request(0, "vision share"))
    visual = stage.text_encoder.model.visual
    spent = []

    def before(*_):
        spent.append(-time.perf_counter())

    def after(*_):
        spent[-1] += time.perf_counter()

    handles = [visual.register_forward_pre_hook(before), visual.register_forward_hook(after)]
    texts, visions = [], []
    try:
        with torch.no_grad():
            for _ in range(4):
                spent.clear()
                started = time.perf_counter()
                stage.encode_text(prepared)
                texts.append(time.perf_counter() - started)
                visions.append(sum(spent))
    finally:
        for handle in handles:
            handle.remove()
    return {"text_s": float(np.median(texts[1:])), "vision_s": float(np.median(visions[1:])),
            "vision_share": float(np.median([v / t for v, t in zip(visions[1:], texts[1:])]))}


def run(models: str, threads: int = 1, rounds: int = 4, restarts: int = 2) -> dict:
    cache_dir = Path(tempfile.mkdtemp(prefix="h3-bench-components-"))
    args = ("--cache-dir", str(cache_dir), "--cache-disk-bytes", str(1 << 30))
    cold, prompt_only, after_restart, parts = [], [], [], {}
    try:
        server = Server(models, threads, args)
        try:
            server.post(_wire(request(10_000, "warm-up")))  # untimed: first-call costs (sandbox, allocator)
            for i in range(rounds):
                seconds, headers = server.post(_wire(request(i, f"cold {i}")))
                cold.append(seconds)
                parts["cold"] = headers.get("X-H3-Cache-Components")
                seconds, headers = server.post(_wire(request(i, f"edited {i}")))
                prompt_only.append(seconds)
                parts["prompt"] = headers.get("X-H3-Cache-Components")
                common.log(f"components round {i}: cold {cold[-1]:.2f} s, prompt-only {prompt_only[-1]:.2f} s")
            for i in range(restarts):  # restart on the same DIR, then a prompt edit of the last round's media
                server.stop()
                server = Server(models, threads, args)
                body = _wire(request(rounds - 1 - i % rounds, f"after restart {i}"))
                seconds, headers = server.post(body)
                after_restart.append(seconds)
                parts["restart"] = headers.get("X-H3-Cache-Components")
                common.log(f"components restart {i}: {after_restart[-1]:.2f} s")
        finally:
            server.stop()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    cold_median = float(np.median(cold))
    restart_ratios = [seconds / cold_median for seconds in after_restart]
    return {
        "request": "ref2va: image 128x96, 5 s video 128x96 with a 44.1 kHz stereo soundtrack, 5 s stereo audio; "
                   "124 frames",
        "rounds": rounds, "restarts": restarts,
        "cold_s": common.summary(cold), "prompt_s": common.summary(prompt_only),
        "restart_s": common.summary(after_restart),
        "prompt_ratio": common.paired(cold, prompt_only),
        "restart_ratio": {"ratios": restart_ratios, "median_ratio": float(np.median(restart_ratios))
                          if restart_ratios else None, "ci95": list(common.bootstrap_median_ci(restart_ratios))
                          if restart_ratios else None},
        "parts": parts,
        "vision": vision_share(models, threads),
        "target": TARGET,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="models folder (default: the embedded tiny H3, built now)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    with common.tiny_models(args.models) as models:
        results = run(models, args.threads, args.rounds, args.restarts)
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    prompt, restart = results["prompt_ratio"]["median_ratio"], results["restart_ratio"]["median_ratio"]
    print(f"prompt-only / cold: {prompt:.3f}; after restart / cold: {restart if restart is None else round(restart, 3)}"
          f" (target <= {TARGET})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(main())
