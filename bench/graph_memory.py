"""ComfyUI's memory after a ref2va graph with a large reference video: the pack at a base ref vs this tree.

Two real ComfyUI servers (tests/support/comfy_harness.py: `.comfyui/`, CPU, loopback), one after the other, run the same
graph on the embedded tiny H3: LoadVideo (a synthetic reference video with a soundtrack) -> H3 References -> H3
Text Encode (an explicit canvas, so the normalised reference is canvas-sized as at release) -> H3 Video VAE Encode
-> H3 Audio VAE Encode -> H3 Save Conditioning. One server loads the pack as committed at `--base` (default
`main`, exported with `git archive`), the other this working tree. After the prompt, ComfyUI's cache holds every
node's output. RSS (VmRSS of the ComfyUI process) is read idle after the run, and again after POST /free (outputs
dropped, models unloaded); held = the difference: what the cached outputs keep alive. Both servers hold the same
decoded input video (the References node's output); what differs is whether a CONDITIONING keeps the request's
normalised media (reference frames resized to the canvas, 32 kHz audio) alive once its parts are complete.

    python -m bench.graph_memory [--models TINY_DIR] [--base main] [--small] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import common

FULL = {"video": (960, 540, 8.0), "canvas": (768, 448)}  # 8 s 960x540 reference; 768x448 canvas
SMALL = {"video": (320, 192, 3.0), "canvas": (256, 128)}
TINY = "[embedded] tiny H3 (random weights, outputs are noise)"


def reference_video(path: Path, width: int, height: int, seconds: float) -> None:
    """A moving gradient with a 220 Hz stereo tone: large once decoded (W·H·3 bytes a frame, 24 fps)."""
    from h3_core import media

    frames = int(seconds * 24)
    x = np.linspace(0, 255, width, dtype=np.float32)[None, None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[None, :, None, None]
    t = np.arange(frames, dtype=np.float32)[:, None, None, None] * 4
    video = ((x + y + t) % 256).astype(np.uint8).repeat(3, axis=3)
    tone = np.sin(np.arange(int(seconds * 32000)) / 32000 * 2 * np.pi * 220).astype(np.float32) * 0.2
    media.encode_frames(str(path), video, np.stack([tone, tone]), 24, 32000, 18, 192_000)


def graph(video_name: str, canvas: tuple[int, int]) -> dict:
    return {
        "1": {"class_type": "H3SplitTextEncoderLoader", "inputs": {"text_encoder": TINY}},
        "2": {"class_type": "H3SplitVideoVAELoader", "inputs": {"vae": TINY}},
        "3": {"class_type": "H3SplitAudioVAELoader", "inputs": {"audio_vae": TINY}},
        "6": {"class_type": "LoadVideo", "inputs": {"file": video_name}},
        "8": {"class_type": "H3SplitReferences", "inputs": {"ref_video_1": ["6", 0]}},
        "9": {"class_type": "H3SplitTextEncode", "inputs": {
            "text_encoder": ["1", 0], "prompt": "<Video 1> in the rain, with the sound of <Audio 1>.",
            "width": canvas[0], "height": canvas[1], "length": 124, "media": ["8", 0], "task": "ref2va"}},
        "10": {"class_type": "H3SplitVideoVAEEncode", "inputs": {"conditioning": ["9", 0], "vae": ["2", 0]}},
        "11": {"class_type": "H3SplitAudioVAEEncode", "inputs": {"conditioning": ["10", 0], "audio_vae": ["3", 0]}},
        "12": {"class_type": "H3SplitSaveConditioning",
               "inputs": {"conditioning": ["11", 0], "filename_prefix": "h3/bench_memory"}},
    }


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def settled_rss(pid: int, seconds: float = 3.0) -> int:
    """RSS once it stopped moving (freed pages are returned a moment after the prompt ends)."""
    last, stable_since = rss(pid), time.monotonic()
    while time.monotonic() - stable_since < seconds:
        time.sleep(0.5)
        now = rss(pid)
        if abs(now - last) > 1 << 20:
            stable_since = time.monotonic()
        last = now
    return last


def measure(pack: Path, models: Path, folder: Path, video: Path, canvas: tuple[int, int], threads: int) -> dict:
    sys.path.insert(0, str(common.REPO / "tests"))
    from support import comfy_harness

    base = folder / "comfy"
    (base / "custom_nodes").mkdir(parents=True)
    (base / "custom_nodes" / comfy_harness.PACK_NAME).symlink_to(pack, target_is_directory=True)
    env = {"H3_TINY_DIR": str(models), "OMP_NUM_THREADS": str(threads), "H3_THREADS": str(threads)}
    comfy = comfy_harness.start_comfy(base, models_src=models / "comfyui", env=env, start_timeout=600)
    try:
        comfy.add_model("minimax_h3", models, "tiny")
        # a copy, not a link: core 0.33's Load Video refuses a file that resolves outside input/
        shutil.copyfile(video, comfy.input_dir / video.name)
        started = settled_rss(comfy.proc.pid)
        t0 = time.monotonic()
        comfy.run_prompt(graph(video.name, canvas), timeout=3600)
        seconds = time.monotonic() - t0
        after_run = settled_rss(comfy.proc.pid)
        comfy.free(unload_models=True, free_memory=True)
        time.sleep(2)
        after_free = settled_rss(comfy.proc.pid)
    finally:
        comfy.stop()
    return {"rss_started": started, "rss_after_run": after_run, "rss_after_free": after_free,
            "held_by_cache": after_run - after_free, "run_s": round(seconds, 1)}


def release_normalisation(width: int, height: int, seconds: float) -> dict:
    """What one chain's normalised media cost at the release pipeline config (768 px canvas), in this process.

    The tiny H3 normalises references onto its 64 px canvas, so in the ComfyUI run above the normalised copy is a
    few MB beside the decoded input. At release size it is canvas-sized: `prepare` (no model needed) is run on the
    same kind of request, and RSS is read with the result held (what the base ref's cached CONDITIONINGs kept:
    their encode parts held this object) and after the chain released it (this tree, once the parts complete)."""
    import gc

    from h3_core import configs
    from h3_core.encoder import prepare
    from h3_core.request import EncodeRequest, VideoInput

    frames = int(seconds * 24)
    video = np.random.default_rng(0).integers(0, 255, (frames, height, width, 3), dtype=np.uint8)
    tone = np.sin(np.arange(int(seconds * 32000)) / 32000 * 2 * np.pi * 220).astype(np.float32) * 0.2
    request = EncodeRequest(prompt="<Video 1> in the rain.", task="ref2va", num_frames=124, ref_videos=[
        VideoInput(frames=video, fps=24.0, audio=np.stack([tone, tone]), sample_rate=32000)])
    warm = EncodeRequest(prompt="<Video 1>.", task="ref2va", num_frames=124, ref_videos=[VideoInput(
        frames=video[:60, :64, :64].copy(), fps=24.0, audio=np.stack([tone, tone]), sample_rate=32000)])
    prepare(warm, configs.RELEASE_PIPELINE_CONFIG)  # imports and first-call caches are not the request's cost
    gc.collect()
    common.trim_heap()
    before = common.proc_status()["VmRSS"]
    prepared = prepare(request, configs.RELEASE_PIPELINE_CONFIG)
    gc.collect()
    held = common.proc_status()["VmRSS"] - before
    ref = prepared.references[0]
    normalised = int(ref.frames.nbytes + ref.audio.numel() * ref.audio.element_size())
    canvas = (prepared.width, prepared.height)
    del prepared, ref
    gc.collect()
    common.trim_heap()
    released = common.proc_status()["VmRSS"] - before
    return {"canvas": canvas, "normalised_bytes": normalised, "rss_held_bytes": held,
            "rss_after_release_bytes": released}


def run(models: Path, *, base_ref: str | None = "main", small: bool = False, threads: int = 1) -> dict:
    """Both servers, or with `base_ref=None` this tree's alone (no comparison: what a smoke needs, at half the cost:
    a ComfyUI start and a run)."""
    sizes = SMALL if small else FULL
    width, height, seconds = sizes["video"]
    canvas = sizes["canvas"]
    folder = Path(tempfile.mkdtemp(prefix="h3-graph-memory-"))
    arms = [("this tree", common.REPO)]
    if base_ref is not None:
        base_pack = folder / "base_pack"
        base_pack.mkdir()
        archive = subprocess.run(["git", "-C", str(common.REPO), "archive", base_ref], check=True,
                                 capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(base_pack)], input=archive.stdout, check=True)
        arms.insert(0, (base_ref, base_pack))
    video = folder / "h3_bench_reference.mp4"
    reference_video(video, width, height, seconds)
    results = {}
    for name, pack in arms:
        common.log(f"graph-memory: {name}")
        results[name] = measure(pack, models, folder / name.replace(" ", "_"), video, canvas, threads)
    frames = 124
    normalised = frames * canvas[0] * canvas[1] * 3 + 2 * int(min(seconds, frames / 24) * 32000) * 4
    after = results["this tree"]["held_by_cache"]
    before = results[base_ref]["held_by_cache"] if base_ref is not None else None
    return {
        "reference_video": {"width": width, "height": height, "seconds": seconds,
                            "decoded_bytes": int(seconds * 24) * width * height * 3},
        "canvas": canvas, "normalised_media_bytes": normalised, "results": results,
        "held_saved_bytes": None if before is None else before - after,
        "held_ratio": after / before if before else None,
        "release_size": release_normalisation(width, height, seconds),
        "loadavg": common.loadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="the embedded tiny H3 (default: $H3_TINY_DIR, else built)")
    parser.add_argument("--base", default="main", help="the git ref whose pack is measured beside this tree")
    parser.add_argument("--small", action="store_true", help="a small reference video (the tests' size)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    with common.tiny_models(args.models) as models:
        result = run(Path(models), base_ref=args.base, small=args.small, threads=args.threads)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
