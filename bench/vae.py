"""Section 5: peak memory and time of the VAEs as the canvas, the frame count and the audio duration grow.

Every point runs in a fresh process (`--quick`: one process per sweep, heap trimmed between points): load the VAE,
warm it up on a small input, build the input, trim the heap,
reset the kernel's RSS high-water mark (/proc/self/clear_refs = 5), run the op once, read VmHWM. Peak = VmHWM -
RSS just before the op (what the op added on top of the loaded model and its input); "working" = peak - the
returned tensor's bytes. Time = median of `reps` runs (the first is the measured-peak run).

diffusers' AutoencoderKLMiniMaxH3 tiles spatially (on by default; 256 px tiles, >= 64 px overlap, widened to
cover the frame) and chunks time (17-frame clips); tiles of a clip are all kept, then blended and concatenated;
decoded clips are concatenated at the end. The audio VAE runs in one pass.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench import common


def latent_frames(frames: int) -> int:
    return 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2


def tile_grid(pixels: int, tile: int = 256, overlap: int = 64, ratio: int = 16) -> int:
    """Tiles along one edge, as diffusers' _split_tiles lays them."""
    if tile >= pixels:
        return 1
    n = -(-pixels // tile)
    while tile * n - overlap * (n - 1) - pixels < 0:
        n += 1
    return n


def _worker(spec: dict) -> list[dict]:
    """Measure `spec["points"]` in this process, in order (one point per process in the full run)."""
    import torch

    from h3_core.models import ModelSource

    torch.set_num_threads(int(os.environ.get("H3_THREADS", "1")))
    source = ModelSource.from_path(spec["models"])
    loaded: dict = {}
    results = []
    for args in spec["points"]:
        op = args["op"]
        kind = "vae" if op.startswith("video") else "audio_vae"
        if kind not in loaded:
            loaded[kind] = source.load(kind)
        vae = loaded[kind]
        results.append(_measure(vae, op, args, torch))
    return results


def _measure(vae, op: str, args: dict, torch) -> dict:
    generator = torch.Generator().manual_seed(0)
    h = w = frames = seconds = None
    if op.startswith("video"):
        h, w, frames = args["height"], args["width"], args["frames"]
        if op == "video_decode":
            make = lambda hh, ww, ff: torch.randn(1, 24, latent_frames(ff), hh // 16, ww // 16, generator=generator)
            fn = lambda x: vae.decode(x).sample
        elif op.startswith("video_decode_stream"):
            from bench.vae_stream import streaming_decode

            dtype = torch.uint8 if op.endswith("u8") else torch.float32
            make = lambda hh, ww, ff: torch.randn(1, 24, latent_frames(ff), hh // 16, ww // 16, generator=generator)
            fn = lambda x: streaming_decode(vae, x, dtype)
        else:
            make = lambda hh, ww, ff: torch.rand(1, 3, ff, hh, ww, generator=generator) * 2 - 1
            fn = lambda x: vae.encode(x).latent_dist.mode()
        warm = make(64, 64, frames if op == "video_encode" and frames == 1 else 22)
        info = {
            "tiles": tile_grid(h) * tile_grid(w),
            "tiling": bool(vae.use_tiling),
            "tile_px": vae.tile_sample_min_height,
            "tile_overlap_px": vae.tile_sample_min_overlap_height,
        }
    else:
        seconds = args["seconds"]
        if op == "audio_decode":
            make = lambda s: torch.randn(2, vae.config.latent_channels, round(s * 40), generator=generator)
            fn = lambda x: vae.decode(x).sample
        else:
            make = lambda s: torch.rand(2, 1, round(s * 32000), generator=generator) * 0.6 - 0.3
            fn = lambda x: vae.encode(x).latent_dist.mode()
        warm = make(1.0)
        info = {}
    with torch.no_grad():
        fn(warm)
        del warm
        x = make(h, w, frames) if op.startswith("video") else make(seconds)
        common.trim_heap()
        reset_ok = common.reset_peak()
        before = common.proc_status()
        t0 = time.perf_counter()
        out = fn(x)
        first = time.perf_counter() - t0
        after = common.proc_status()
        out_bytes = out.numel() * out.element_size()
        out_shape = list(out.shape)
        times = [first]
        for _ in range(int(args.get("reps", 1)) - 1):
            del out
            t0 = time.perf_counter()
            out = fn(x)
            times.append(time.perf_counter() - t0)
        del out
    peak = after["VmHWM"] - before["VmRSS"]
    result = {
        **args,
        **info,
        "time_s": sorted(times)[len(times) // 2],
        "times_s": times,
        "peak_bytes": peak,
        "working_bytes": peak - out_bytes,
        "output_bytes": out_bytes,
        "input_bytes": x.numel() * x.element_size(),
        "output_shape": out_shape,
        "rss_before": before["VmRSS"],
        "hwm_after": after["VmHWM"],
        "peak_reset": reset_ok,
    }
    del x
    common.trim_heap()
    return result


def _show(r: dict) -> None:
    common.log(
        f"vae:   {r['time_s']:.2f} s, peak +{r['peak_bytes'] / common.MB:.0f} MB "
        f"(output {r['output_bytes'] / common.MB:.0f} MB)"
    )


def point(models, threads: int, **args) -> dict:
    """One point in its own fresh process."""
    label = " ".join(f"{k}={v}" for k, v in args.items() if k != "reps")
    common.log(f"vae: {label}")
    r = common.run_worker("vae", {"models": str(models), "points": [args]}, threads, timeout=900)["points"][0]
    _show(r)
    return r


def sweep(models, threads: int, points: list[dict], per_process: bool) -> list[dict]:
    """A sweep: a fresh process per point (clean peaks), or one process for the whole sweep (faster)."""
    if per_process:
        return [point(models, threads, **p) for p in points]
    common.log(f"vae: {points[0]['op']} sweep of {len(points)} points in one process")
    rs = common.run_worker("vae", {"models": str(models), "points": points}, threads, timeout=1800)["points"]
    for r in rs:
        _show(r)
    return rs


def run(
    models,
    *,
    canvas: list[int],
    canvas_frames: int,
    frames: list[int],
    frames_canvas: int,
    encode_canvas: list[int],
    encode_frames: list[int],
    encode_frames_canvas: int,
    audio_seconds: list[float],
    reps: int,
    threads: int,
    per_process: bool = True,
) -> dict:
    out = {"loadavg_before": common.loadavg(), "process_per_point": per_process}
    measure = lambda points: sweep(models, threads, points, per_process)
    out["decode_canvas"] = measure(
        [dict(op="video_decode", height=s, width=s, frames=canvas_frames, reps=reps) for s in canvas]
    )
    out["decode_frames"] = measure(
        [dict(op="video_decode", height=frames_canvas, width=frames_canvas, frames=f, reps=reps) for f in frames]
    )
    # What would reach the target: the same decode, streamed into a preallocated output (bench/vae_stream.py).
    out["decode_canvas_stream"] = measure(
        [dict(op="video_decode_stream", height=s, width=s, frames=canvas_frames, reps=1) for s in canvas]
    )
    out["decode_canvas_stream_u8"] = measure(
        [dict(op="video_decode_stream_u8", height=s, width=s, frames=canvas_frames, reps=1) for s in canvas]
    )
    out["encode_canvas"] = measure(
        [dict(op="video_encode", height=s, width=s, frames=1, reps=1) for s in encode_canvas]
    )
    out["encode_frames"] = measure(
        [
            dict(op="video_encode", height=encode_frames_canvas, width=encode_frames_canvas, frames=f, reps=1)
            for f in encode_frames
        ]
    )
    out["audio_decode"] = measure([dict(op="audio_decode", seconds=s, reps=reps) for s in audio_seconds])
    out["audio_encode"] = measure([dict(op="audio_encode", seconds=s, reps=reps) for s in audio_seconds])
    out["stream_bit_exact"] = stream_check(models, threads)
    out["pixel_ratios"] = pixel_ratios(out["decode_canvas"])
    out["pixel_ratios_stream"] = pixel_ratios(out["decode_canvas_stream"])
    out["pixel_ratios_stream_u8"] = pixel_ratios(out["decode_canvas_stream_u8"])
    out["loadavg_after"] = common.loadavg()
    return out


def _stream_check_worker(models: str) -> dict:
    import torch

    from bench.vae_stream import streaming_decode
    from h3_core.models import ModelSource

    vae = ModelSource.from_path(models).load("vae")
    generator = torch.Generator().manual_seed(1)
    same = True
    with torch.no_grad():
        for h, w, f in ((384, 320, 56), (512, 512, 22)):  # several tiles; two clips with a temporal cross-fade
            z = torch.randn(1, 24, latent_frames(f), h // 16, w // 16, generator=generator)
            same &= bool(torch.equal(vae.decode(z).sample, streaming_decode(vae, z)))
    return {"bit_exact": same}


def stream_check(models, threads: int) -> bool:
    """The streamed prototype equals diffusers' decode bit for bit (float32), checked in a worker."""
    return bool(common.run_worker("vae", {"models": str(models), "check_stream": True}, threads)["bit_exact"])


def pixel_ratios(points: list[dict]) -> list[dict]:
    """Every pair of canvas points whose pixel counts differ by 4x: peak and working-memory ratios."""
    by_px = {p["height"] * p["width"]: p for p in points}
    pairs = []
    for px, small in sorted(by_px.items()):
        big = by_px.get(4 * px)
        if big is None:
            continue
        pairs.append(
            {
                "from": f"{small['width']}x{small['height']}",
                "to": f"{big['width']}x{big['height']}",
                "tiles_from": small["tiles"],
                "tiles_to": big["tiles"],
                "peak_ratio": big["peak_bytes"] / small["peak_bytes"],
                "working_ratio": big["working_bytes"] / small["working_bytes"],
                "time_ratio": big["time_s"] / small["time_s"],
            }
        )
    return pairs


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    spec = json.loads(parser.parse_args().worker)
    if spec.get("check_stream"):
        print(json.dumps(_stream_check_worker(spec["models"])), flush=True)
    else:
        print(json.dumps({"points": _worker(spec)}), flush=True)
