"""Step caching on the tiny H3, every preset against `off` in one interleaved run: `python bench/step_cache.py`.

    python bench/step_cache.py [--models DIR] [--steps 20] [--pairs 3] [--presets every:2,fast] [--threads 1]

Per preset (h3_core/step_cache.py): wall time / `off` (median of per-round ratios, all arms interleaved ABBA after a
warm-up round, with its spread: min / median / max of the per-round ratios), block passes computed / total, latent
relative error (video and audio, L2) and decoded-video PSNR against `off` (same seed; the decode is deterministic).
Prints JSON; `bench/run.py --sections cache` runs the same and adds the targets: `every:2` <= 0.6x the wall time
of `off` with <= 0.55 of the block passes.

Which figure is which: the wall ratio here is the tiny H3's (2 DiT blocks, random weights, 64x64 on CPU), where the
fixed per-step costs outside the blocks dominate (`TINY_NOTE`); what the cache saves on the real 33B DiT follows the
block passes ratio, and `bench/gpu_check.py --cache` measures it at full size on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CASE = "t2va-64x64-seed0"  # 64 x 64 x 124 frames: the split section's job
TINY_NOTE = ("The wall ratio is the tiny H3's: its 2 DiT blocks are a small part of a step, and the per-step costs "
             "outside the blocks (embedders, token refiner, output heads, scheduler, cache bookkeeping), which every "
             "preset still pays, dominate; on the real 33B DiT its blocks (50 in the pruned release) are nearly all "
             "of a step, so the wall ratio there approaches the block passes ratio (bench/gpu_check.py --cache "
             "measures it on a GPU).")


def spread(ratios) -> dict:
    """min / median / max of the per-round wall ratios (the median is the one the target reads)."""
    ordered = sorted(ratios)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {"min": ordered[0], "median": median, "max": ordered[-1], "n": len(ordered)}


def psnr(a, b) -> float:
    """dB between two float videos in 0..1 (inf when identical)."""
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


def run(models, *, steps: int = 20, pairs: int = 3, presets=None, threads: int = 1) -> dict:
    import torch

    from bench import common
    from h3_core import step_cache
    from h3_core.diffusion import DiffusionStage, SamplingOptions
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource
    from h3_core.testing import CASES

    common.set_threads(threads)
    presets = [p for p in (presets or step_cache.CHOICES) if p != step_cache.OFF]
    source = ModelSource.from_path(models)
    request, _, seed = CASES[CASE]
    cond = EncoderStage(source, components=("text",)).encode(request)
    stage = DiffusionStage(source)
    stage.transformer(cond.task), stage.vae, stage.audio_vae  # loaded outside every timed region
    last = {}

    def arm(preset):
        def sample(_round):
            last[preset] = stage.sample(cond, SamplingOptions(steps=steps, seed=seed, cache=preset))

        return sample

    names = [step_cache.OFF, *presets]
    common.log(f"step cache: {', '.join(names)} at {steps} steps, {pairs} interleaved rounds")
    timed = common.interleaved({name: arm(name) for name in names}, pairs)
    off = last[step_cache.OFF]
    with torch.no_grad():
        off_video = stage.decode(off).video
    rows = {}
    for name in names:
        latents = last[name]
        video = off_video if name == step_cache.OFF else stage.decode(latents).video
        rows[name] = {
            "wall_s": common.summary(timed[name]["wall"]),
            "wall_ratio": common.paired(timed[step_cache.OFF]["wall"], timed[name]["wall"]),
            "wall_ratio_spread": spread([w / o for o, w in zip(timed[step_cache.OFF]["wall"], timed[name]["wall"])]),
            "passes_computed": latents.passes.computed,
            "passes_total": latents.passes.total,
            "passes_ratio": latents.passes.computed / latents.passes.total,
            "latent_rel_err": rel_err(latents.video, off.video),
            "audio_latent_rel_err": rel_err(latents.audio, off.audio),
            "video_psnr_db": psnr(video, off_video),
        }
        sp = rows[name]["wall_ratio_spread"]
        common.log(f"  {name}: wall x{sp['median']:.3f} (min {sp['min']:.3f}, max {sp['max']:.3f} over {sp['n']} "
                   f"rounds), {latents.passes}, "
                   f"latent rel err {rows[name]['latent_rel_err']:.2e}, PSNR {rows[name]['video_psnr_db']:.1f} dB")
    return {"case": CASE, "steps": steps, "pairs": pairs, "threads": threads, "presets": rows, "note": TINY_NOTE}


def table(results: dict) -> list[str]:
    """Markdown rows: preset | wall / off (median, min-max over the rounds) | block passes | latent rel err |
    decoded-video PSNR vs off; then the sentence saying whose wall ratio it is (`TINY_NOTE`)."""
    lines = ["| preset | wall / off, tiny H3 (median; min-max over rounds) | block passes computed | latent rel. err "
             "(video / audio) | video PSNR vs off |", "|---|---|---|---|---|"]
    for name, row in results["presets"].items():
        sp = row.get("wall_ratio_spread") or spread(row["wall_ratio"]["ratios"])
        db = "identical" if math.isinf(row["video_psnr_db"]) else f"{row['video_psnr_db']:.1f} dB"
        lines.append(f"| {name} | {sp['median']:.3f} ({sp['min']:.3f}-{sp['max']:.3f}, {sp['n']} rounds) | "
                     f"{row['passes_computed']}/"
                     f"{row['passes_total']} ({row['passes_ratio']:.2f}) | {row['latent_rel_err']:.2e} / "
                     f"{row['audio_latent_rel_err']:.2e} | {db} |")
    lines += ["", results.get("note", TINY_NOTE)]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="H3 models folder (default: $H3_TINY_DIR or a freshly built tiny H3)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=3, help="timed rounds per arm after one warm-up round")
    parser.add_argument("--presets", help="comma-separated presets (default: every choice of the Sampler)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    from bench import common

    with common.tiny_models(args.models) as models:
        results = run(models, steps=args.steps, pairs=args.pairs, threads=args.threads,
                      presets=args.presets.split(",") if args.presets else None)
    print("\n".join(table(results)), file=sys.stderr)
    print(json.dumps(results, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# --- bench/gpu_check.py --cache: the presets at full size against the lossless run ----------------------------------

PROMPT = "A red fox trots across fresh snow at dawn, its breath steaming; wind hisses through the pines."


def ssim(a, b) -> float:
    """Mean SSIM (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03) of two float videos
    [F, H, W, 3] in 0..1, per frame and channel."""
    import torch
    import torch.nn.functional as F

    x, y = (t.permute(0, 3, 1, 2).reshape(-1, 1, t.shape[1], t.shape[2]).double() for t in (a, b))
    g = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5) ** 2) / (2 * 1.5**2))
    window = (g[:, None] * g[None, :] / g.sum() ** 2)[None, None].to(x.device)
    mean = lambda t: F.conv2d(t, window)
    mx, my = mean(x), mean(y)
    vx, vy, cov = mean(x * x) - mx**2, mean(y * y) - my**2, mean(x * y) - mx * my
    c1, c2 = 0.01**2, 0.03**2
    return float((((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))).mean())


def full_size(models, *, device, job: dict, steps: int, presets, cond_path=None, offload: str = "auto") -> dict:
    """Each preset against `off` (the lossless run) on `models` at `job`'s size: wall ratio (synchronised), block
    passes, latent rel. error, decoded-video PSNR and SSIM. Says when the folder holds only the tiny H3."""
    import gc
    import time

    import torch

    from h3_core import configs, dtypes, step_cache
    from h3_core.contract import H3Conditioning
    from h3_core.diffusion import DiffusionStage, SamplingOptions
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource
    from h3_core.request import EncodeRequest

    device = torch.device(device)
    source = ModelSource.from_path(models)
    if cond_path:
        cond = H3Conditioning.load(cond_path)
    else:
        request = EncodeRequest.from_sources(PROMPT, task="t2va", width=job["width"], height=job["height"],
                                             num_frames=job["frames"])
        encoder = EncoderStage(source, components=("text",), device=device, offload=offload,
                               dtype=dtypes.compute_dtype("text_encoder", device))
        cond = encoder.encode(request)
        del encoder
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    stage = DiffusionStage(source, dtype=dtypes.compute_dtype("transformer", device), device=device, offload=offload)
    dit = stage.transformer(cond.task)
    release_blocks = configs.get("transformer", tiny=False)["num_layers"]
    tiny = len(dit.transformer_blocks) < release_blocks
    note = (f"only the tiny H3 ({len(dit.transformer_blocks)} blocks, random weights) in this models folder: the wall "
            f"ratios show the machinery, the quality figures say nothing about real weights; give --models a "
            f"folder with the released DiT ({release_blocks} blocks) for those") if tiny else \
        "real weights: quality against the lossless (off) run of the same seed"

    def sample(preset):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        latents = stage.sample(cond, SamplingOptions(steps=steps, seed=0, cache=preset))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return latents, time.perf_counter() - start

    sample(step_cache.OFF if steps <= 3 else "every:2")  # warm-up: kernels, allocator, the streamed prefetch order
    off, off_s = sample(step_cache.OFF)
    off_video = stage.decode(off).video
    rows = {step_cache.OFF: {"seconds": off_s, "wall_ratio": 1.0, "passes": str(off.passes)}}
    for preset in presets:
        if preset == step_cache.OFF:
            continue
        latents, seconds = sample(preset)
        video = stage.decode(latents).video
        rows[preset] = {"seconds": seconds, "wall_ratio": seconds / off_s, "speedup": off_s / seconds,
                        "passes": str(latents.passes), "latent_rel_err": rel_err(latents.video, off.video),
                        "video_psnr_db": psnr(video, off_video), "video_ssim": ssim(video, off_video)}
    return {"mode": "cache", "tiny_model": tiny, "note": note, "job": job, "steps": steps,
            "cond": cond_path or f"encoded here: {PROMPT!r}", "presets": rows}
