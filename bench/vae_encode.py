"""Video-VAE encode of a long reference video: diffusers' `encode_vae_condition` vs h3_core's clip-by-clip encode.

One fresh process per (arm, length); in each, the uint8 frames are built first (the request holds them anyway), the
heap is trimmed and the RSS high-water mark reset, then one encode runs: peak = VmHWM - RSS before the encode. The
latents of the two arms are compared bit for bit in every run (each worker returns their sha256).

    python -m bench.vae_encode [--quick]     writes bench/results/vae_encode.json and prints a table
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from bench import common

ARMS = ("diffusers", "streamed")


def worker(args: dict) -> dict:
    import torch

    from h3_core import diffusers_adapter, facts, vae_encode
    from h3_core.models import ModelSource

    common.set_threads(int(args.get("threads", 1)))
    vae = ModelSource.from_path(args["tiny"]).load("vae")
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (1, 3, args["frames"], args["size"], args["size"]), generator=generator,
                           dtype=torch.uint8)
    encode = (diffusers_adapter.encode_vae_condition if args["arm"] == "diffusers" else vae_encode.encode_condition)
    common.trim_heap()
    before = common.proc_status()
    common.reset_peak()
    started = time.perf_counter()
    with torch.no_grad():  # as the encoder stage runs it
        latents = encode(vae, pixels, facts.PIXEL_MEAN, facts.PIXEL_STD, encode_seed=facts.KEYFRAME_ENCODE_SEED)
    seconds = time.perf_counter() - started
    after = common.proc_status()
    return {"peak_bytes": after["VmHWM"] - before["VmRSS"], "seconds": seconds, "input_bytes": pixels.numel(),
            "sha256": hashlib.sha256(latents.numpy().tobytes()).hexdigest()}


def run(tiny: str, *, size: int, lengths: tuple[int, ...], threads: int = 1) -> dict:
    out = {"size": size, "lengths": {}}
    for frames in lengths:
        row = {}
        for arm in ARMS:
            row[arm] = common.run_worker("vae_encode", {"tiny": tiny, "arm": arm, "frames": frames, "size": size,
                                                        "threads": threads}, threads)
        row["bit_identical"] = row["diffusers"]["sha256"] == row["streamed"]["sha256"]
        out["lengths"][frames] = row
        peaks = {arm: row[arm]["peak_bytes"] / common.MB for arm in ARMS}
        common.log(f"vae encode {size}x{size} x {frames} frames: diffusers {peaks['diffusers']:.0f} MB, streamed "
                   f"{peaks['streamed']:.0f} MB, bit-identical {row['bit_identical']}")
    first, last = lengths[0], lengths[-1]
    for arm in ARMS:
        grow = out["lengths"][last][arm]["peak_bytes"] - out["lengths"][first][arm]["peak_bytes"]
        out[f"{arm}_bytes_per_added_frame"] = grow / (last - first)
    out["input_bytes_per_frame"] = 3 * size * size
    return out


def table(result: dict) -> str:
    size = result["size"]
    lines = [f"| frames ({size}x{size}) | uint8 input MB | diffusers peak MB / s | streamed peak MB / s | "
             "bit-identical |", "|---:|---:|---:|---:|---|"]
    for frames, row in result["lengths"].items():
        d, s = row["diffusers"], row["streamed"]
        lines.append(f"| {frames} | {d['input_bytes'] / common.MB:.1f} | {d['peak_bytes'] / common.MB:.1f} / "
                     f"{d['seconds']:.2f} | {s['peak_bytes'] / common.MB:.1f} / {s['seconds']:.2f} | "
                     f"{row['bit_identical']} |")
    per = result["input_bytes_per_frame"]
    lines.append("")
    lines.append(f"Peak added per extra frame: diffusers {result['diffusers_bytes_per_added_frame'] / per:.1f}x the "
                 f"frame's uint8 bytes, streamed {result['streamed_bytes_per_added_frame'] / per:.1f}x.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", help="the embedded tiny H3 (default: $H3_TINY_DIR, else built into a temp dir)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    size, lengths = (128, (22, 73)) if args.quick else (256, (22, 73, 124, 175))
    with common.tiny_models(args.models) as models:
        result = run(models, size=size, lengths=lengths, threads=args.threads)
    out = common.REPO / "bench" / "results"
    (out / "vae_encode.json").write_text(json.dumps(result, indent=1))
    (out / "vae_encode.md").write_text(f"# {__doc__.splitlines()[0]}\n\n{table(result)}\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
