"""GPU check: one full-size DiT forward streamed under a 24 GB cap and resident without it, and one
streamed text-encoder forward, each measured peak next to the planner's prediction. Prints JSON.

    python bench/gpu_check.py                         # wherever torch sees CUDA (H200: a few minutes)
    python bench/gpu_check.py --small --models DIR    # the tiny H3's twins on CPU, same code path (a test runs it)
    python bench/gpu_check.py --sp 1,2,4              # the DiT sequence-parallel on 1, 2, 4 GPUs: scaling
    python bench/gpu_check.py --small --models DIR --sp 1,2   # the same on CPU with gloo ranks (a test runs it)
    python bench/gpu_check.py --cache --models DIR    # step-cache presets vs off at 1344x768x124 (bench/step_cache.py)

Weights (`--weights release`, the default): the pruned int8 + ConvRot DiT and the int8 + ConvRot text
encoder, as the synthetic release-size headers describe them (`weights.release_headers`), written as sparse
files (no disk use) and loaded by this package's own loaders (QuantLinear layers, pruned AdaLN curve), then
filled with random values in place (the file is mapped copy-on-write and never changes). With `--small` the
tiny H3's twins of the same two files are loaded instead. `--weights bf16` materialises the bf16 release
models from meta shapes (no quantised classes needed).

Streaming is `h3_core.offload` (diffusers group offloading, block level, prefetch on a side stream); host
copies stay pageable and are pinned per transfer (pinned copies of 20-66 GB beside the pageable ones would
not fit everywhere). Measured peak: `torch.cuda.max_memory_allocated` over the timed forward (the CUDA
context is outside it). Planned peak: `planner.plan_component(...)` on the same file's header (its 1 GiB
reserve covers the context and the allocator's slack). Bytes moved per step: every streamed tensor once.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h3_core import configs, facts, offload  # noqa: E402
from h3_core.planning import planner  # noqa: E402
from h3_core.safetensors_header import DTYPE_TAGS  # noqa: E402
from h3_core.weights.tensor_info import TensorInfo  # noqa: E402

GB = 1e9
CAP_BYTES = 24 * 10**9


def _meta_dit(tiny: bool):
    from accelerate import init_empty_weights
    from diffusers import MiniMaxH3Transformer3DModel

    with init_empty_weights(include_buffers=False):
        return MiniMaxH3Transformer3DModel.from_config(configs.get("transformer", tiny=tiny))


def _meta_text_encoder(tiny: bool):
    """The H3 conditioner's 50 language layers (the Comfy file's), no head."""
    from accelerate import init_empty_weights
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = configs.get("text_encoder", tiny=tiny)
    config["text_config"]["num_hidden_layers"] = facts.TEXT_ENCODER_LAYER
    with init_empty_weights(include_buffers=False):
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config))
    model.lm_head = torch.nn.Identity()  # H3 never runs the head
    return model


def materialise(model: torch.nn.Module, dtype: torch.dtype, keep_fp32=(), *, make_on, place_on) -> torch.nn.Module:
    """Random N(0, 0.02) weights (norm weights 1): drawn on `make_on` (fast on a GPU), stored on `place_on`."""
    generator = torch.Generator(device=make_on).manual_seed(0)
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            wanted = torch.float32 if module_name.split(".")[0] in keep_fp32 else dtype
            data = torch.empty(param.shape, dtype=wanted, device=make_on)
            if "norm" in name or "norm" in module_name.rsplit(".", 1)[-1]:
                data.fill_(1.0)
            else:
                data.normal_(0.0, 0.02, generator=generator)
            module._parameters[name] = torch.nn.Parameter(data.to(place_on), requires_grad=False)
            del data
    return model.eval()


RELEASE_FILES = {
    "transformer": "diffusion_models/minimax_h3_fl2va_pruned_int8_convrot.safetensors",
    "text_encoder": "text_encoders/qwen3vl_32b_minimax_h3_int8_convrot.safetensors",
}
TINY_TWINS = {
    "transformer": "comfyui/diffusion_models/minimax_h3_tiny_fl2va_pruned_int8_convrot.safetensors",
    "text_encoder": "comfyui/text_encoders/qwen3vl_minimax_h3_tiny_int8_convrot.safetensors",
}


def release_path(component: str, workdir: str, models: str | None) -> str:
    """The file to load: a tiny twin from `models`, or a sparse release-size file written to `workdir`."""
    if models:
        return os.path.join(models, TINY_TWINS[component])
    from h3_core.weights.release_headers import release_header, write_sparse

    name = RELEASE_FILES[component]
    path = os.path.join(workdir, os.path.basename(name))
    if not os.path.exists(path):
        tensors, data = release_header(name)
        write_sparse(path, tensors, data)
    return path


@torch.no_grad()
def randomise(model: torch.nn.Module, draw_on: torch.device) -> None:
    """Random values in place (integer codes over their range, floats N(0, 0.02), norm weights 1), drawn on
    `draw_on`: torch's CPU generator is single-threaded (~0.1 GB/s), a GPU draws 40 GB in seconds."""
    generator = torch.Generator(device=draw_on).manual_seed(0)
    for name, param in model.named_parameters():
        if param.dtype.is_floating_point and param.dtype.itemsize >= 2:
            fresh = torch.empty(param.shape, dtype=param.dtype, device=draw_on)
            if "norm" in name:
                fresh.fill_(1.0)
            else:
                fresh.normal_(0.0, 0.02, generator=generator)
        elif param.dtype in (torch.int8, torch.uint8):
            low, high = (-127, 128) if param.dtype == torch.int8 else (0, 256)
            fresh = torch.randint(low, high, param.shape, dtype=param.dtype, device=draw_on, generator=generator)
        else:
            continue
        param.copy_(fresh)
        del fresh


def load_release(component: str, path: str, dtype: torch.dtype, draw_on: torch.device) -> torch.nn.Module:
    from h3_core import weights

    model = weights.load(path, component, dtype=dtype)
    randomise(model, draw_on)
    return model


def tensor_table(model: torch.nn.Module) -> dict[str, TensorInfo]:
    return {name: TensorInfo(DTYPE_TAGS[t.dtype], tuple(t.shape), "") for name, t in model.state_dict().items()}


def dit_inputs(config, *, width: int, height: int, frames: int, text_tokens: int, device, dtype):
    from h3_core import facts

    grid = (height // 32) * (width // 32)
    video = facts.video_latent_frames(frames) * grid
    audio = facts.audio_latent_frames(frames) * facts.AUDIO_CHANNELS
    length = text_tokens + video + audio
    video_dim = config.in_channels * 4
    g = torch.Generator(device="cpu").manual_seed(1)
    positions = torch.stack([torch.arange(length, dtype=torch.float64) % 64,
                             torch.arange(length, dtype=torch.float64) % 24,
                             torch.arange(length, dtype=torch.float64) % 42], dim=-1)
    inputs = {
        "hidden_states": torch.randn(1, video, video_dim, generator=g),
        "audio_hidden_states": torch.randn(1, audio, config.audio_in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, text_tokens, config.text_dim, generator=g).to(dtype),
        "timestep": torch.tensor([0.3, 0.8]),
        "timestep_indices": torch.tensor([0] * (text_tokens + video) + [1] * audio),
        "token_tags": torch.tensor([1] * text_tokens + [0] * video + [2] * audio),
        "position_ids": positions,
        "video_indices": torch.arange(text_tokens, text_tokens + video),
        "audio_indices": torch.arange(text_tokens + video, length),
        "text_indices": torch.arange(text_tokens),
    }
    return {k: v.to(device) for k, v in inputs.items()}, length


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_forward(run, device, repeats: int = 1) -> tuple[float, int | None]:
    """Warm-up (the streamed first forward also records the prefetch order), then timed forwards."""
    with torch.no_grad():
        run()
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        _sync(device)
    seconds = (time.perf_counter() - start) / repeats
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return seconds, peak


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _cap(device, limit: int | None) -> None:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if limit is None else min(1.0, limit / total), device)


def _record(name, plan, offload_mode, seconds, peak, moved, cap):
    predicted = plan.peak(offload_mode)
    return {
        "check": name,
        "offload": offload_mode,
        "cap_bytes": cap,
        "seconds_per_forward": round(seconds, 3),
        "measured_peak_bytes": peak,
        "planned_peak_bytes": predicted,
        "planned_activation_bytes": plan.activation,
        "planned_over_measured": None if not peak else round(predicted / peak, 3),
        "bytes_moved_per_step": moved,
        "weights_bytes": plan.device_bytes,
    }


def _dit_plan(model, path, device, dtype, job):
    if path is not None:
        return planner.plan_file(path, device=device.type, dtype=dtype, **job)
    return planner.plan_component("transformer", tensor_table(model), device=device.type, dtype=dtype,
                                  config=dict(model.config), **job)


def _run_dit(model, plan, device, dtype, job, *, streamed: bool) -> dict:
    cap = CAP_BYTES if streamed and device.type == "cuda" else None
    _cap(device, cap)
    if streamed:
        moved = offload.stream_blocks(model, "transformer", device, pin=False).moved_per_forward
    else:
        offload.place(model, "transformer", device, "none")
        moved = 0
    inputs, _ = dit_inputs(model.config, device=device, dtype=dtype, **job)
    seconds, peak = timed_forward(lambda: model(**inputs), device)
    record = _record("dit_" + ("streamed" if streamed else "resident"), plan, "block" if streamed else "none",
                     seconds, peak, moved, cap)
    record["tokens"] = planner.dit_tokens(**job)
    record["loaded_bytes"] = offload.module_bytes(model)
    inputs = None
    _cap(device, None)
    _free(device)
    return record


def check_dits(device, dtype, job, *, tiny: bool, path: str | None) -> list[dict]:
    """Resident (no cap) then streamed (24 GB cap): the same weights, moved back to the host in between."""
    from diffusers import MiniMaxH3Transformer3DModel

    if path is not None:
        model = load_release("transformer", path, dtype, device)
    else:
        make_on = device if device.type == "cuda" else torch.device("cpu")
        model = materialise(_meta_dit(tiny), dtype, MiniMaxH3Transformer3DModel._keep_in_fp32_modules,
                            make_on=make_on, place_on=torch.device("cpu"))
    plan = _dit_plan(model, path, device, dtype, job)
    records = [_run_dit(model, plan, device, dtype, job, streamed=False)]
    model.to("cpu")
    _free(device)
    records.append(_run_dit(model, plan, device, dtype, job, streamed=True))
    model = None
    _free(device)
    return records


def check_text_encoder(device, dtype, job, *, tiny: bool, path: str | None) -> dict:
    if path is not None:
        model = load_release("text_encoder", path, dtype, device)
        plan = planner.plan_file(path, device=device.type, dtype=dtype, **job)
    else:
        make_on = device if device.type == "cuda" else torch.device("cpu")
        model = materialise(_meta_text_encoder(tiny), dtype, make_on=make_on, place_on=torch.device("cpu"))
        plan = planner.plan_component("text_encoder", tensor_table(model), device=device.type, dtype=dtype,
                                      config=model.config.to_dict(), **job)
    cap = CAP_BYTES if device.type == "cuda" else None
    _cap(device, cap)
    info = offload.stream_blocks(model, "text_encoder", device, pin=False)
    ids = torch.randint(0, 1000, (1, job["text_tokens"]), device=device)

    def run():
        return model.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                           output_hidden_states=True).hidden_states[-1]

    seconds, peak = timed_forward(run, device)
    record = _record("text_encoder_streamed", plan, "block", seconds, peak, info.moved_per_forward, cap)
    record["loaded_bytes"] = offload.module_bytes(model)
    model = None
    _cap(device, None)
    _free(device)
    return record


# --- sequence-parallel scaling (--sp) -------------------------------------------------------------------------------


def _sp_rank(rank: int, layout, port: int, path: str | None, job: dict, tiny: bool, out: str) -> None:
    """One rank of the scaling check: the DiT (the same random weights on every rank), resident on this rank's
    device, sequence-parallel over the layout, timed over one forward after a warm-up. Only the DiT: the text
    encoder is never on the sequence-parallel GPUs. Rank 0 writes its record to `out` (JSON)."""
    from diffusers import MiniMaxH3Transformer3DModel

    from h3_core import sequence_parallel

    if layout.base_device.type == "cpu":
        torch.set_num_threads(sequence_parallel.worker_threads(layout))
    device = sequence_parallel.init_rank(layout, rank, port)
    try:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        if path is not None:
            model = load_release("transformer", path, dtype, device)
        else:
            model = materialise(_meta_dit(tiny), dtype, MiniMaxH3Transformer3DModel._keep_in_fp32_modules,
                                make_on=device, place_on=torch.device("cpu"))
        plan = _dit_plan(model, path, device, dtype, job).per_rank(layout.degree)
        offload.place(model, "transformer", device, "none")
        if layout.degree > 1:
            sequence_parallel.parallelize(model, layout)
        inputs, _ = dit_inputs(model.config, device=device, dtype=dtype, **job)
        seconds, peak = timed_forward(lambda: model(**inputs), device)
        if rank == 0:
            record = _record(f"dit_sp{layout.degree}", plan, "none", seconds, peak, 0, None)
            record.update(ranks=layout.degree, tokens=planner.dit_tokens(**job))
            with open(out, "w", encoding="utf-8") as handle:
                json.dump(record, handle)
    finally:
        sequence_parallel.shutdown()


def check_sequence_parallel(degrees: list[int], device, job, *, tiny: bool, path: str | None, workdir: str) -> list:
    """Seconds per DiT forward on 1, 2, 4... ranks side by side, each degree's speed-up over the first."""
    from h3_core import sequence_parallel

    records = []
    for degree in degrees:
        layout = sequence_parallel.check(degree, "ulysses", device)
        out = os.path.join(workdir, f"sp{degree}.json")
        sequence_parallel.launch(_sp_rank, layout, path, job, tiny, out)
        with open(out, encoding="utf-8") as handle:
            records.append(json.load(handle))
    for record in records:  # > 1: faster than the first degree listed (1 rank); < 1 on shared CPU cores
        record["speedup"] = round(records[0]["seconds_per_forward"] / record["seconds_per_forward"], 3)
    return records


def main(argv=None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the tiny H3 on CPU (what the test runs)")
    parser.add_argument("--models", help="with --small: a tiny build with the quantised twins (python -m h3_core tiny)")
    parser.add_argument("--weights", choices=("release", "bf16"), default="release",
                        help="release: pruned int8 DiT + int8 text encoder (default); bf16: the bf16 release models")
    parser.add_argument("--device", default=None, help="default: cuda if torch sees it, else cpu")
    parser.add_argument("--workdir", help="where the sparse release-size files go (default: a temporary folder)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--sp", help="comma-separated sequence-parallel degrees, e.g. 1,2,4: the DiT's scaling only "
                        "(one process per GPU; gloo processes with --small)")
    parser.add_argument("--cache", action="store_true",
                        help="instead: step-cache presets vs off on --models (a ComfyUI models folder with real "
                        "weights, or a tiny build, which the JSON then says) at 1344x768x124; wall ratio, PSNR / SSIM")
    parser.add_argument("--cond", help="with --cache: a conditioning file (`python -m h3_core encode`); default: "
                        "encode a fixed prompt with the folder's text encoder")
    parser.add_argument("--steps", type=int, default=50, help="with --cache: sigma points (default 50)")
    parser.add_argument("--presets", default="quality,balanced,fast,every:2,every:3",
                        help="with --cache: comma-separated presets (h3_core/step_cache.py)")
    args = parser.parse_args(argv)
    if args.cache:
        return _cache_main(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.small else "cpu"))
    tiny = args.small
    release = args.weights == "release"
    if release and tiny and not args.models:
        parser.error("--small with --weights release needs --models (a tiny build with the quantised twins)")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    job = {"width": 64, "height": 64, "frames": 124, "text_tokens": 16} if tiny else \
        {"width": 1344, "height": 768, "frames": 124, "text_tokens": 512}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "job": job,
        "checks": [],
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="h3-gpu-check-", dir=args.workdir) as workdir:
        paths = {c: release_path(c, workdir, args.models if tiny else None) for c in RELEASE_FILES} if release \
            else {c: None for c in RELEASE_FILES}
        result["weights"] = {c: os.path.basename(p) if p else f"random, {'tiny' if tiny else 'release'} bf16 shapes"
                             for c, p in paths.items()}
        if args.sp:
            degrees = [int(part) for part in args.sp.split(",") if part]
            result["checks"] = check_sequence_parallel(degrees, device, job, tiny=tiny, path=paths["transformer"],
                                                       workdir=workdir)
        for name, check in () if args.sp else (("text_encoder", check_text_encoder), ("transformer", check_dits)):
            try:
                records = check(device, dtype, job, tiny=tiny, path=paths[name])
            except torch.OutOfMemoryError as error:  # a plan that was wrong is a result too: report, go on
                records = {"check": name, "error": f"out of memory: {str(error).splitlines()[0]}"}
                _cap(device, None)
                _free(device)
            result["checks"] += records if isinstance(records, list) else [records]
    result["seconds_total"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0


def _cache_main(args) -> int:
    from bench import step_cache

    if not args.models:
        raise SystemExit("--cache needs --models: a ComfyUI models folder (or a tiny build: python -m h3_core tiny)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.small else "cpu"))
    job = {"width": 64, "height": 64, "frames": 124} if args.small else {"width": 1344, "height": 768, "frames": 124}
    result = step_cache.full_size(args.models, device=device, job=job, steps=args.steps,
                                  presets=[p for p in args.presets.split(",") if p], cond_path=args.cond)
    result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    text = json.dumps(result, indent=2, default=float)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
