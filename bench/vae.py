"""Section 5: peak memory and time of the VAEs as the canvas, the frame count and the audio duration grow.

Every point runs in a fresh process (`--quick`: one process per sweep, heap trimmed between points): load the VAE,
warm it up on a small input, build the input, trim the heap,
reset the kernel's RSS high-water mark (/proc/self/clear_refs = 5), run the op once, read VmHWM. Peak = VmHWM -
RSS just before the op (what the op added on top of the loaded model and its input); "working" = peak - the
returned tensor's bytes. Time = median of `reps` runs (the first is the measured-peak run).

diffusers' AutoencoderKLMiniMaxH3 tiles spatially (on by default; 256 px tiles, >= 64 px overlap, widened to
cover the frame) and chunks time (17-frame clips); tiles of a clip are all kept, then blended and concatenated;
decoded clips are concatenated at the end. The audio VAE runs in one pass.

`compare`: diffusers' decode step against h3_core's streamed decode (h3_core/vae_stream.py) side by side, the arms
interleaved round by round (rotated order), heap trimmed and the high-water mark reset before every op: peak and time
of each arm at 1x, 4x and 16x the pixels, with 95 % bootstrap intervals of the ratios (peak: ratio of medians, the
two canvases resampled independently; time: paired per round). Two processes per canvas: the peaks come from one with
glibc's mmap threshold pinned at 1 MiB (`common.LIVE_MEMORY_ENV`: each op's live memory, not the freed heap earlier
arms left resident), the times from one with the default allocator (its peaks are kept too).
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


# --- diffusers' decode step vs the streamed decode, side by side -----------------------------------------------

ARMS = ("diffusers", "stream_f32", "stream_u8", "mp4_whole", "mp4_stream")
WRITER_ARMS = ("stream_u8", "mp4_stream")  # hand uint8 clips to a writer: their product is one clip, not the video
ARM_LABELS = {
    "diffusers": "diffusers' decode step (vae.decode, de-normalise, clamp; float32 video out)",
    "stream_f32": "streamed, float32 video out (Decode node IMAGE, Decoded.video)",
    "stream_u8": "streamed, uint8 frames handed to a frame writer (the mp4 writer's input)",
    "mp4_whole": "end to end: diffusers' decode step, then write_mp4 of the whole video (before)",
    "mp4_stream": "end to end: streamed decode straight into the mp4 encoder (CLI generate now)",
}


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
    compare_canvas: tuple[int, ...] = (384, 768, 1536),
    compare_rounds: int = 5,
    compare_arms: tuple[str, ...] = ARMS,
) -> dict:
    out = {"loadavg_before": common.loadavg(), "process_per_point": per_process}
    measure = lambda points: sweep(models, threads, points, per_process)
    out["compare"] = compare(models, threads, sizes=tuple(compare_canvas), frames=canvas_frames,
                             rounds=compare_rounds, arms=tuple(compare_arms))
    out["decode_canvas"] = measure(
        [dict(op="video_decode", height=s, width=s, frames=canvas_frames, reps=reps) for s in canvas]
    )
    out["decode_frames"] = measure(
        [dict(op="video_decode", height=frames_canvas, width=frames_canvas, frames=f, reps=reps) for f in frames]
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
    out["pixel_ratios"] = pixel_ratios(out["decode_canvas"])
    out["loadavg_after"] = common.loadavg()
    return out


def _compare_worker(spec: dict) -> dict:
    """One canvas: the arms round by round in this process (rotated order), peak and time of every op."""
    import tempfile

    import torch

    from h3_core import media, vae_stream
    from h3_core.blocks import pipeline_for, workflow_blocks
    from h3_core.models import ModelSource

    torch.set_num_threads(int(os.environ.get("H3_THREADS", "1")))
    source = ModelSource.from_path(spec["models"])
    vae = source.load("vae")
    blocks = {name: b for name, b in workflow_blocks("t2va", ("decode",)).items() if name == "decode.video"}
    pipe = pipeline_for(blocks, {"vae": vae}, source.pipeline_config)
    folder = tempfile.mkdtemp(prefix="h3-vae-bench-")

    def diffusers_video(z):  # exactly what DiffusionStage.decode ran before the streamed decode
        return pipe(latents=z, output_type="pt").get("videos")[0].permute(0, 2, 3, 1).float().cpu().contiguous()

    def arm(name, z):
        if name == "diffusers":
            return diffusers_video(z)
        if name == "stream_f32":
            sink = vae_stream.TensorSink()
            vae_stream.decode_video(vae, z, sink)
            return sink.video
        if name == "stream_u8":
            vae_stream.decode_video(vae, z, vae_stream.WriterSink(lambda frames: None))
            return None
        path = os.path.join(folder, f"{name}.mp4")
        if name == "mp4_whole":
            media.write_mp4(path, diffusers_video(z))
        else:
            plan = vae_stream.plan(vae, z.shape)
            with media.streamed_mp4(path, plan.width, plan.height) as writer:
                vae_stream.decode_video(vae, z, vae_stream.WriterSink(writer.write))
                writer.finish()
        os.remove(path)
        return None

    size, frames, arms = spec["size"], spec["frames"], list(spec["arms"])
    generator = torch.Generator().manual_seed(0)
    make = lambda px: torch.randn(1, 24, latent_frames(frames), px // 16, px // 16, generator=generator)
    out = {name: {"peak_bytes": [], "time_s": [], "output_bytes": 0} for name in arms}
    with torch.no_grad():
        warm = make(64)
        for name in arms:
            arm(name, warm)
        same = torch.equal(arm("diffusers", warm), arm("stream_f32", warm))
        del warm
        z = make(size)
        for r in range(spec["rounds"]):
            order = arms[r % len(arms):] + arms[: r % len(arms)]
            for name in order if r % 2 == 0 else order[::-1]:
                common.trim_heap()
                common.reset_peak()
                before = common.proc_status()
                t0 = time.perf_counter()
                result = arm(name, z)
                elapsed = time.perf_counter() - t0
                after = common.proc_status()
                out[name]["peak_bytes"].append(after["VmHWM"] - before["VmRSS"])
                out[name]["time_s"].append(elapsed)
                out[name]["output_bytes"] = 0 if result is None else result.numel() * result.element_size()
                del result
    plan = vae_stream.plan(vae, z.shape)
    # What each arm hands on, which grows with the pixels by definition: the float32 video it returns, or for the
    # writer arms the one reusable uint8 buffer of the largest clip (the frames the mp4 writer takes at once).
    handover = max(plan.clip_frames(c) for c in range(plan.chunks))
    handover_bytes = handover * plan.height * plan.width * 3
    for name in arms:
        out[name]["product_bytes"] = handover_bytes if name in WRITER_ARMS else out[name]["output_bytes"]
    return {"size": size, "frames": plan.frames, "tiles": plan.tiles_per_clip, "clips": plan.chunks,
            "handover_frames": handover, "arms": out, "bit_exact_warmup": same}


def ratio_ci(small: list[float], big: list[float], iters: int = 2000, seed: int = 0) -> dict:
    """median(big) / median(small), with a 95 % percentile-bootstrap interval (the two resampled independently)."""
    import numpy as np

    a, b = np.asarray(small, float), np.asarray(big, float)
    rng = np.random.default_rng(seed)
    ma = np.median(a[rng.integers(0, a.size, (iters, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, (iters, b.size))], axis=1)
    lo, hi = np.percentile(mb / ma, [2.5, 97.5])
    return {"ratio": float(np.median(b) / np.median(a)), "ci95": [float(lo), float(hi)]}


def working_bytes(arm: dict) -> list[float]:
    """Each round's peak less what the arm hands on (`product_bytes`): the decode's own memory."""
    return [peak - arm["product_bytes"] for peak in arm["peak_bytes"]]


def compare(models, threads: int, *, sizes=(384, 768, 1536), frames: int = 22, rounds: int = 5,
            arms: tuple[str, ...] = ARMS, timing_process: bool = True) -> dict:
    """Every arm at every canvas (a process per canvas); peak ratios against the first canvas, time ratios of the
    streamed arms against diffusers' at each canvas. `timing_process=False` (bench/smoke.py) takes the times from the
    peak process too (pinned allocator), one process per canvas instead of two."""
    points = []
    for size in sizes:
        common.log(f"vae compare: {size}x{size}, {frames} frames, {rounds} rounds of {', '.join(arms)}")
        spec = {"models": str(models), "compare": True, "size": size, "frames": frames, "rounds": rounds,
                "arms": list(arms)}
        # Two processes per canvas: peaks with glibc's mmap threshold pinned (live memory, whatever ran before),
        # times with the default allocator (what users run; pinned, every large buffer is faulted in afresh)
        point = common.run_worker("vae", spec, threads, timeout=3600, env=common.LIVE_MEMORY_ENV)
        timed = common.run_worker("vae", spec, threads, timeout=3600) if timing_process else point
        point["bit_exact_warmup"] = point["bit_exact_warmup"] and timed["bit_exact_warmup"]
        for name in arms:
            m, t = point["arms"][name], timed["arms"][name]
            m["time_s_pinned_allocator"], m["time_s"] = m["time_s"], t["time_s"]
            if timing_process:
                m["peak_bytes_default_allocator"] = t["peak_bytes"]
            common.log(f"vae compare:   {name}: peak {common.summary(m['peak_bytes'])['median'] / common.MB:.0f} MB "
                       f"(default allocator {common.summary(t['peak_bytes'])['median'] / common.MB:.0f} MB), "
                       f"{common.summary(m['time_s'])['median']:.2f} s")
        points.append(point)
    base = points[0]
    peaks = {}
    for point in points[1:]:
        factor = round(point["size"] ** 2 / base["size"] ** 2)
        peaks[f"{factor}x"] = {
            "from": base["size"], "to": point["size"],
            **{name: ratio_ci(base["arms"][name]["peak_bytes"], point["arms"][name]["peak_bytes"]) for name in arms},
        }
    working = {}  # peak - what the arm hands on (the video it returns, or its clip buffer): the decode's own memory
    for point in points[1:]:
        factor = round(point["size"] ** 2 / base["size"] ** 2)
        working[f"{factor}x"] = {
            "from": base["size"], "to": point["size"],
            # not mp4_whole: the video it decodes lives and dies inside the arm, nothing is handed on
            **{name: ratio_ci(working_bytes(base["arms"][name]), working_bytes(point["arms"][name]))
               for name in arms if name != "mp4_whole"},
        }
    times = {}
    for point in points:
        if "diffusers" not in point["arms"]:
            continue
        ref = point["arms"]["diffusers"]["time_s"]
        times[str(point["size"])] = {
            name: {k: v for k, v in common.paired(ref, point["arms"][name]["time_s"]).items() if k != "ratios"}
            for name in arms if name.startswith("stream")
        }
        if "mp4_whole" in point["arms"] and "mp4_stream" in point["arms"]:
            pair = common.paired(point["arms"]["mp4_whole"]["time_s"], point["arms"]["mp4_stream"]["time_s"])
            times[str(point["size"])]["mp4_stream_vs_whole"] = {k: v for k, v in pair.items() if k != "ratios"}
    return {"points": points, "peak_ratios": peaks, "working_ratios": working, "time_ratios": times, "arms": list(arms),
            "bit_exact": all(p["bit_exact_warmup"] for p in points)}


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
    if spec.get("compare"):
        print(json.dumps(_compare_worker(spec)), flush=True)
    else:
        print(json.dumps({"points": _worker(spec)}), flush=True)
