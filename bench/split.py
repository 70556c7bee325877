"""Section 1: stage-split overhead and load times.

Overhead: with every model already loaded in one process, the split path
    EncoderStage.encode -> H3Conditioning.to_bytes -> from_bytes -> DiffusionStage.generate
against one call of diffusers' monolithic `MiniMaxH3ModularPipeline` on the same job and seed, interleaved
(ABBA) so machine noise hits both arms. Overhead = median over pairs of split/mono - 1.

Load times: each arm in a fresh process (page cache warm): the monolithic pipeline's full load, the encoder stage,
and the diffusion stage from a stage-1-only folder (no text encoder, tokenizer or processor on disk) and from the
full folder. `cold` = importing the arm's own code + loading (a server start); `warm` = loading again in the same
process (weights only).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench import common

STAGE1_ENTRIES = ("transformer", "transformer_ref", "vae", "audio_vae", "scheduler", "audio_scheduler",
                  "model_index.json", "modular_model_index.json")
LOAD_ARMS = ("monolithic", "encoder_stage", "diffusion_stage1_only", "diffusion_full_source")


def diffusers_root(models: Path) -> Path:
    models = Path(models)
    return models / "diffusers" if (models / "tiny.json").is_file() else models


def stage1_only_folder(models: Path, where: Path) -> Path:
    """A diffusers root holding only what stage 1 needs (symlinks): the DiT partitions, the VAEs, schedulers."""
    root = diffusers_root(models)
    out = Path(where) / "stage1_only"
    out.mkdir(parents=True, exist_ok=True)
    for name in STAGE1_ENTRIES:
        if (root / name).exists() and not (out / name).exists():
            os.symlink((root / name).resolve(), out / name)
    return out


# --- load-time worker (fresh process per arm) ------------------------------------------------------

def _load_worker(args: dict) -> dict:
    """Fresh process: `cold` = import the arm's own code + load its weights (what starting a server costs);
    `warm` = the same load again in the same process (weights only, code already imported)."""
    import sys

    import torch

    models, arm = Path(args["models"]), args["arm"]

    def load() -> dict:
        if arm == "monolithic":
            from diffusers import ModularPipeline

            pipe = ModularPipeline.from_pretrained(str(diffusers_root(models)), workflow="t2va")
            pipe.load_components(dtype=torch.float32)
            return {name: getattr(pipe, name) for name in ("text_encoder", "transformer", "vae", "audio_vae")}
        from h3_core.models import ModelSource

        if arm == "encoder_stage":
            from h3_core.encoder import EncoderStage

            stage = EncoderStage(ModelSource.from_path(models))
            return {"text_encoder": stage.text_encoder, "vae": stage.vae, "audio_vae": stage.audio_vae}
        from h3_core.diffusion import DiffusionStage

        folder = args["stage1_folder"] if arm == "diffusion_stage1_only" else models
        stage = DiffusionStage(ModelSource.from_path(folder))
        return {"transformer": stage.transformer("t2va"), "vae": stage.vae, "audio_vae": stage.audio_vae}

    common.trim_heap()
    rss0 = common.proc_status()["VmRSS"]
    t0 = time.perf_counter()
    modules = load()
    cold_s = time.perf_counter() - t0
    rss1 = common.proc_status()["VmRSS"]
    param = {name: common.param_bytes(m) for name, m in modules.items()}
    del modules
    common.trim_heap()
    t0 = time.perf_counter()
    load()
    warm_s = time.perf_counter() - t0
    out = {"arm": arm, "cold_s": cold_s, "warm_s": warm_s, "rss_delta_bytes": rss1 - rss0, "param_bytes": param,
           "imported_qwen3vl_modeling": "transformers.models.qwen3_vl.modeling_qwen3_vl" in sys.modules}
    if arm.startswith("diffusion"):
        from h3_core.models import ModelSource

        folder = args["stage1_folder"] if arm == "diffusion_stage1_only" else models
        out["source_components"] = sorted(ModelSource.from_path(folder).paths)
    return out


def load_times(models: Path, rounds: int, threads: int, tmp: Path) -> dict:
    folder = stage1_only_folder(models, tmp)
    runs = {arm: [] for arm in LOAD_ARMS}
    for r in range(rounds):
        order = LOAD_ARMS if r % 2 == 0 else LOAD_ARMS[::-1]
        for arm in order:
            common.log(f"split: load time, {arm} (round {r + 1}/{rounds})")
            runs[arm].append(common.run_worker("split", {"mode": "load", "arm": arm, "models": str(models),
                                                         "stage1_folder": str(folder)}, threads, timeout=600))
    out = {}
    for arm, items in runs.items():
        out[arm] = {
            "cold_s": common.summary([x["cold_s"] for x in items]),
            "warm_s": common.summary([x["warm_s"] for x in items]),
            "imported_qwen3vl_modeling": items[0]["imported_qwen3vl_modeling"],
            "rss_delta_bytes": int(sorted(x["rss_delta_bytes"] for x in items)[len(items) // 2]),
            "param_bytes": items[0]["param_bytes"],
            "param_bytes_total": sum(items[0]["param_bytes"].values()),
        }
        if "source_components" in items[0]:
            out[arm]["source_components"] = items[0]["source_components"]
    return out


# --- overhead (in one process, everything loaded) --------------------------------------------------

def overhead(models: Path, pairs: int, steps: int, width: int, height: int, frames: int, seed: int = 0) -> dict:
    import torch
    from diffusers import ModularPipeline

    from h3_core.contract import H3Conditioning
    from h3_core.diffusion import DiffusionStage, SamplingOptions
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource
    from h3_core.request import EncodeRequest

    common.log("split: loading the monolithic pipeline and both stages")
    pipe = ModularPipeline.from_pretrained(str(diffusers_root(models)), workflow="t2va")
    pipe.load_components(dtype=torch.float32)
    try:
        pipe.set_progress_bar_config(disable=True)
    except Exception:  # noqa: BLE001
        pass
    source = ModelSource.from_path(models)
    encoder, diffusion = EncoderStage(source), DiffusionStage(source)
    diffusion.transformer("t2va"), diffusion.vae, diffusion.audio_vae  # loaded before timing
    prompt = "A red fox trots through fresh snow at dawn; wind hisses over the drifts."
    request = EncodeRequest(prompt=prompt, width=width, height=height, num_frames=frames)
    parts: dict[str, list[float]] = {k: [] for k in ("encode", "to_bytes", "from_bytes", "sample", "decode")}
    contract_bytes = []

    def split(i: int):
        t = [time.perf_counter()]
        cond = encoder.encode(request)
        t.append(time.perf_counter())
        data = cond.to_bytes()
        t.append(time.perf_counter())
        received = H3Conditioning.from_bytes(data)
        t.append(time.perf_counter())
        latents = diffusion.sample(received, SamplingOptions(steps=steps, seed=seed))
        t.append(time.perf_counter())
        decoded = diffusion.decode(latents)
        t.append(time.perf_counter())
        if i >= 0:
            for key, a, b in zip(parts, t, t[1:]):
                parts[key].append(b - a)
            contract_bytes.append(len(data))
        return decoded.video if i in (-1, 0) else None

    def mono(i: int):
        state = pipe(prompt=prompt, num_frames=frames, width=width, height=height, num_inference_steps=steps,
                     generator=torch.Generator("cpu").manual_seed(seed), output_type="pt")
        return state.get("videos")[0].permute(0, 2, 3, 1).float() if i in (-1, 0) else None

    def show(name, i, wall, cpu, _):
        common.log(f"split: pair {i + 1}/{pairs} {name:5s} {wall:6.2f} s wall, {cpu:6.2f} s cpu")

    common.log(f"split: {pairs} interleaved pairs of a t2va {width}x{height}x{frames} job, {steps} steps")
    runs = common.interleaved({"mono": mono, "split": split}, pairs, warmup=1, on_sample=show)
    video_split, video_mono = runs["split"]["value"][0], runs["mono"]["value"][0]
    bit_exact = bool(video_split.shape == video_mono.shape and torch.equal(video_split, video_mono))
    wall = common.paired(runs["mono"]["wall"], runs["split"]["wall"])
    cpu = common.paired(runs["mono"]["cpu"], runs["split"]["cpu"])
    return {
        "job": {"task": "t2va", "width": width, "height": height, "num_frames": frames, "steps": steps,
                "seed": seed, "pairs": pairs, "order": "ABBA, 1 warm-up round per arm"},
        "mono_wall_s": common.summary(runs["mono"]["wall"]), "split_wall_s": common.summary(runs["split"]["wall"]),
        "mono_cpu_s": common.summary(runs["mono"]["cpu"]), "split_cpu_s": common.summary(runs["split"]["cpu"]),
        "mono_wall_samples": runs["mono"]["wall"], "split_wall_samples": runs["split"]["wall"],
        "wall": wall, "cpu": cpu,
        "overhead": wall["median_ratio"] - 1, "overhead_ci95": [wall["ci95"][0] - 1, wall["ci95"][1] - 1],
        "overhead_cpu": cpu["median_ratio"] - 1,
        "split_parts_s": {k: common.summary(v) for k, v in parts.items()},
        "contract_bytes": contract_bytes[0] if contract_bytes else None,
        "bit_exact_video": bit_exact,
    }


def run(models: Path, *, pairs: int, steps: int, width: int, height: int, frames: int, load_rounds: int,
        threads: int, tmp: Path) -> dict:
    out = {"loadavg_before": common.loadavg()}
    out["load"] = load_times(models, load_rounds, threads, tmp)
    out.update(overhead(models, pairs, steps, width, height, frames))
    out["loadavg_after"] = common.loadavg()
    return out


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    args = json.loads(parser.parse_args().worker)
    common.set_threads(int(os.environ.get("H3_THREADS", "2")))
    print(json.dumps(_load_worker(args)), flush=True)


if __name__ == "__main__":
    _main()
