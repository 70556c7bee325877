"""Streamed VAE decode (uint8 frames to a writer) on a video decoder of the released width: peak at 4x / 16x pixels.

The embedded tiny H3's video decoder is 32 features wide, so one tile's work is small and what grows with the canvas
(the clip waiting for its last tile, the overlap strips) dominates its peak. The released decoder is a ViT 2048
features wide (32 heads x 64, SwiGLU 4x, 36 blocks). This builds diffusers' `AutoencoderKLMiniMaxH3` with the tiny
H3's geometry but one decoder block of the released width (random weights: memory and the code path do not depend
on the values; one block, since blocks run one after another and their activations do not accumulate), and measures
the very same `vae_stream.decode_video` -> `WriterSink` path real weights take, one fresh process per canvas (glibc's
mmap threshold pinned, `common.LIVE_MEMORY_ENV`, as in bench/vae.py's comparison).

    python -m bench.vae_wide [--quick]                 writes bench/results/vae_wide.json, prints the ratios
    python -m bench.vae_wide --device cuda             the same decode on a GPU: device peaks (vae_wide_cuda.json)
"""

from __future__ import annotations

import argparse
import json
import time

from bench import common

RELEASED_DECODER = dict(decoder_num_attention_heads=32, decoder_attention_head_dim=64, decoder_ffn_mult=4,
                        decoder_num_layers=1)
LATENT_FRAMES = 7  # 22 output frames, one temporal clip: the target's geometry


def build_vae(config_path: str):
    import torch
    from diffusers import AutoencoderKLMiniMaxH3

    config = {k: v for k, v in json.loads(open(config_path).read()).items() if not k.startswith("_")}
    config.update(RELEASED_DECODER)
    torch.manual_seed(0)
    vae = AutoencoderKLMiniMaxH3(**config).eval()
    vae.enable_tiling()
    return vae


def worker(args: dict) -> dict:
    import torch

    from h3_core import vae_stream

    common.set_threads(int(args.get("threads", 1)))
    device = torch.device(args.get("device", "cpu"))
    vae = build_vae(args["config"]).to(device)
    size = int(args["size"])
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(1, 24, LATENT_FRAMES, size // 16, size // 16, generator=generator).to(device)
    cuda = device.type == "cuda"
    with torch.no_grad():
        vae_stream.decode_video(vae, z[..., :8, :8], vae_stream.WriterSink(lambda frames: None))  # warm-up
        handed = []
        sink = vae_stream.WriterSink(lambda frames: handed.append(frames.shape[0]))  # uint8 frames in host memory
        common.trim_heap()
        if cuda:  # the decode's work lives on the device: its peak is the caching allocator's, not the RSS
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        before = common.proc_status()
        common.reset_peak()
        started = time.perf_counter()
        plan = vae_stream.decode_video(vae, z, sink)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        after = common.proc_status()
    device_peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    host_peak = after["VmHWM"] - before["VmRSS"]
    return {"size": size, "device": str(device), "device_peak_bytes": device_peak, "host_peak_bytes": host_peak,
            "peak_bytes": host_peak if device_peak is None else device_peak, "seconds": seconds,
            "frames": plan.frames, "tiles": plan.tiles_per_clip, "handed_frames": sum(handed),
            "clip_bytes": max(handed) * size * size * 3,
            "decoder_width": vae.decoder.proj_out.in_features}


def run(models: str, *, sizes=(384, 768, 1536), threads: int = 1, device: str = "cpu") -> dict:
    """Peaks at each canvas and their ratios to the first. On CUDA `peak_bytes` is the decode's device peak
    (`torch.cuda.max_memory_allocated` above what was allocated before it; the clip buffer stays in host memory,
    `host_peak_bytes`); on CPU it is the RSS high-water mark."""
    from pathlib import Path

    config = str(Path(models) / "diffusers" / "vae" / "config.json")
    points = {}
    for size in sizes:
        spec = {"config": config, "size": size, "threads": threads, "device": device}
        points[size] = common.run_worker("vae_wide", spec, threads, timeout=3600, env=common.LIVE_MEMORY_ENV)
        common.log(f"vae wide decoder {size}x{size}: peak {points[size]['peak_bytes'] / common.MB:.0f} MB, "
                   f"{points[size]['seconds']:.1f} s")
    base = points[sizes[0]]["peak_bytes"]
    ratios = {f"{(s // sizes[0]) ** 2}x": points[s]["peak_bytes"] / base for s in sizes[1:]}
    # less the clip buffer handed to the writer (in host memory: on CUDA the device peak never held it)
    working = lambda p: p["peak_bytes"] - (p["clip_bytes"] if p["device_peak_bytes"] is None else 0)
    working_ratios = {f"{(s // sizes[0]) ** 2}x": working(points[s]) / working(points[sizes[0]]) for s in sizes[1:]}
    return {"decoder": RELEASED_DECODER, "device": device, "points": points, "peak_ratios": ratios,
            "working_ratios": working_ratios, "allocator": common.LIVE_MEMORY_ENV}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--quick", action="store_true", help="384 and 768 only")
    parser.add_argument("--models", help="the embedded tiny H3 (default: $H3_TINY_DIR, else built into a temp dir)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu (RSS peaks) or cuda (device peaks; needs a GPU)")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    with common.tiny_models(args.models) as models:
        result = run(models, sizes=(384, 768) if args.quick else (384, 768, 1536), threads=args.threads,
                     device=args.device)
    if not args.quick:
        name = "vae_wide.json" if args.device == "cpu" else f"vae_wide_{args.device.split(':')[0]}.json"
        (common.REPO / "bench" / "results" / name).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["peak_ratios"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
