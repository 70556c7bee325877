"""GPU check: one full-size DiT forward streamed under a 24 GB cap and resident without it, and one
streamed text-encoder forward, each measured peak next to the planner's prediction. Prints JSON.

    python bench/gpu_check.py                         # wherever torch sees CUDA (H200: a few minutes)
    python bench/gpu_check.py --small --models DIR    # the tiny H3's twins on CPU, same code path (a test runs it)
    python bench/gpu_check.py --sp 1,2,4              # the DiT sequence-parallel on 1, 2, 4 GPUs: scaling
    python bench/gpu_check.py --small --models DIR --sp 1,2   # the same on CPU with gloo ranks (a test runs it)
    python bench/gpu_check.py --cache --models DIR    # step-cache presets vs off at 1344x768x124 (bench/step_cache.py)
    python bench/gpu_check.py --dynamic-vram          # the streamed int8 DiT under core 0.33's dynamic VRAM (aimdo)
    python bench/gpu_check.py --dynamic-vram --small --models DIR   # as far as CPU reaches (a test runs it)

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

Dynamic VRAM (`--dynamic-vram`, issue 39.7): the same quantised DiT, made streamable by the pack's own ComfyUI bridge
(`nodes/comfy_bridge.managed(..., stream=True)`: `nodes/low_vram.py`), under ComfyUI core 0.33's model patcher with
comfy-aimdo's dynamic VRAM switched on as core's main.py does it (`comfy_aimdo.control.init` / `init_devices`, then
`CoreModelPatcher = ModelPatcherDynamic`, `aimdo_enabled`), loaded through `load_models_gpu` as the Sampler node
does, then a few DiT forwards (steps) timed; it reports the patcher class core gave, the time per step and the peak
VRAM: torch's allocator peak and the device's used memory (`cudaMemGetInfo`, which also sees aimdo's own
allocations). It runs in a child Python with core first on its path and core's pinned packages (the overlay
scripts/setup_comfyui.sh installs) before the venv's. Feature-detected: a core without `ModelPatcherDynamic` or
without comfy-aimdo (0.3.75) is reported as unavailable (exit 2); without CUDA the mode refuses (exit 2), and
`--small` runs what CPU reaches: core's class construction, which reroutes a CPU load device to the plain
ModelPatcher, the pack's streamed layers under it, `load_models_gpu` and the forwards.
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
    parser.add_argument("--dynamic-vram", action="store_true",
                        help="instead: the streamed int8 DiT under ComfyUI core 0.33's model patcher with "
                        "comfy-aimdo's dynamic VRAM (CUDA; --small: the tiny twin on CPU, as far as CPU reaches)")
    parser.add_argument("--comfyui", help="with --dynamic-vram: the ComfyUI tree (default: $H3_COMFY033_DIR, else "
                        ".comfyui-0.33 beside this script's repository)")
    parser.add_argument("--dit-steps", type=int, default=4, help="with --dynamic-vram: DiT forwards timed (default 4)")
    parser.add_argument("--dynamic-vram-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dynamic_vram_worker:
        print(json.dumps(_dynamic_worker(json.loads(args.dynamic_vram_worker)), default=str))
        return 0
    if args.dynamic_vram:
        return _dynamic_main(args, parser)
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


# --- dynamic VRAM under ComfyUI core 0.33 (--dynamic-vram) ----------------------------------------------------------

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE033_DIR = os.environ.get("H3_COMFY033_DIR", os.path.join(REPO_DIR, ".comfyui-0.33"))
CORE033_SITE = os.path.join(sys.prefix, "h3-comfyui-0.33-site")  # core 0.33's pins (scripts/setup_comfyui.sh)
UNAVAILABLE_EXIT = 2


def _dynamic_main(args, parser) -> int:
    import subprocess

    cuda = torch.cuda.is_available() and not args.small and args.device != "cpu"
    if not cuda and not args.small:
        parser.error("--dynamic-vram needs CUDA: comfy-aimdo's dynamic VRAM pages a model's weights into GPU memory, "
                     "and on a CPU core 0.33 uses its plain ModelPatcher; --small --models DIR runs that CPU path on "
                     "the tiny twin")
    if args.small and not args.models:
        parser.error("--dynamic-vram --small needs --models (a tiny build with the quantised twins)")
    core = os.path.abspath(args.comfyui or CORE033_DIR)
    if not os.path.isfile(os.path.join(core, "main.py")):
        parser.error(f"--dynamic-vram: no ComfyUI at {core} (scripts/setup_comfyui.sh sets up core 0.33)")
    site = [CORE033_SITE] if args.comfyui is None and os.path.isdir(CORE033_SITE) else []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*site, REPO_DIR, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    spec = {"core": core, "cuda": cuda, "small": bool(args.small), "models": args.models, "steps": args.dit_steps,
            "workdir": args.workdir}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--dynamic-vram-worker", json.dumps(spec)],
                          cwd=REPO_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"--dynamic-vram: the worker failed (exit {proc.returncode})")
    result = json.loads(lines[-1])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0 if result.get("available") else UNAVAILABLE_EXIT


def _init_aimdo_control() -> None:
    """comfy-aimdo's process-wide init, as core 0.33's main.py runs it: before comfy.model_management is imported
    (its three protocol versions)."""
    import comfy_aimdo.control as control

    try:
        control.init(simple_vram_headroom=None, nvml_pressure=True)
    except TypeError:
        try:
            control.init(simple_vram_headroom=None)
        except TypeError:
            control.init()


def _init_aimdo(devices) -> bool:
    """comfy-aimdo's devices, as main.py after importing model management; True if it took."""
    import comfy_aimdo.control as control
    from comfy.cli_args import args

    headroom = int(float(getattr(args, "vram_headroom", 0) or 0) * 1024**3)  # main.py's --vram-headroom (GB)
    try:
        return bool(control.init_devices((d.index, headroom) for d in devices))
    except TypeError:
        return bool(control.init_devices(d.index for d in devices))


def _pack_bridge():
    """The pack's nodes/comfy_bridge.py as ComfyUI imports it (a package above nodes/ and h3_core/), without running
    the pack's or nodes/' __init__ (every node)."""
    import importlib
    import types

    for name, path in (("h3_pack", REPO_DIR), ("h3_pack.nodes", os.path.join(REPO_DIR, "nodes"))):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [path]
            sys.modules[name] = package
    return importlib.import_module("h3_pack.nodes.comfy_bridge"), importlib.import_module("h3_pack.nodes.low_vram")


def _dynamic_worker(spec: dict) -> dict:
    """In a child Python: core first on the path, its args parsed as main.py would (`--cpu` off CUDA)."""
    import importlib.metadata
    import importlib.util

    sys.path.insert(0, spec["core"])
    sys.argv = ["main.py", *([] if spec["cuda"] else ["--cpu"])]
    import comfy.options

    comfy.options.enable_args_parsing()
    aimdo_control = spec["cuda"] and importlib.util.find_spec("comfy_aimdo") is not None
    if aimdo_control:
        _init_aimdo_control()
    import comfy.model_management as mm
    import comfy.model_patcher

    version = {}
    exec(open(os.path.join(spec["core"], "comfyui_version.py")).read(), version)  # noqa: S102 - core's own file
    result = {"mode": "dynamic_vram", "core": version.get("__version__"), "device": "cpu", "torch": torch.__version__}
    dynamic = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
    has_aimdo = importlib.util.find_spec("comfy_aimdo") is not None
    result["aimdo"] = importlib.metadata.version("comfy-aimdo") if has_aimdo else None
    result["core_has_dynamic_patcher"] = dynamic is not None
    if dynamic is None or not has_aimdo or importlib.util.find_spec("comfy.memory_management") is None:
        missing = "ModelPatcherDynamic" if dynamic is None else "comfy-aimdo"
        result.update(available=False, reason=f"ComfyUI {result['core']} has no {missing}: no dynamic VRAM here "
                                              "(core 0.33 with comfy-aimdo has it)")
        return result
    import comfy.memory_management
    if spec["cuda"]:
        result["device"] = torch.cuda.get_device_name(mm.get_torch_device())
        if not _init_aimdo(mm.get_all_torch_devices()):
            result.update(available=False, reason="comfy-aimdo did not initialise on this device (init_devices)")
            return result
        comfy.memory_management.aimdo_enabled = True
    comfy.model_patcher.CoreModelPatcher = dynamic  # what main.py does once aimdo took (on CPU: the class asked for)
    result["patcher_requested"] = dynamic.__name__
    result["aimdo_enabled"] = bool(comfy.memory_management.aimdo_enabled)

    bridge, low_vram = _pack_bridge()
    load_device, offload_device = mm.get_torch_device(), mm.unet_offload_device()
    device = torch.device(load_device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tiny = spec["small"]
    job = {"width": 64, "height": 64, "frames": 124, "text_tokens": 16} if tiny else \
        {"width": 1344, "height": 768, "frames": 124, "text_tokens": 512}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="h3-gpu-check-", dir=spec.get("workdir")) as workdir:
        path = release_path("transformer", workdir, spec["models"] if tiny else None)
        started = time.perf_counter()
        model = load_release("transformer", path, dtype, device if device.type == "cuda" else torch.device("cpu"))
        result["host_load_s"] = round(time.perf_counter() - started, 2)
        plan = _dit_plan(model, path, device, dtype, job)
        patcher = bridge.managed(model, load_device, offload_device, stream=True)
        result.update(weights=os.path.basename(path), job=job, weights_bytes=offload.module_bytes(model),
                      patcher=type(patcher).__name__,
                      patcher_is_dynamic=bool(getattr(patcher, "is_dynamic", lambda: False)()),
                      streamable_layers=sum(isinstance(m, low_vram.Streamable) for m in model.modules()),
                      planned_activation_bytes=plan.activation)
        inputs, _ = dit_inputs(model.config, device=device, dtype=dtype, **job)
        _free(device)
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            used_before = total - torch.cuda.mem_get_info(device)[0]
        started = time.perf_counter()
        bridge.use(patcher, memory_required=plan.activation)  # as the Sampler node: core decides what is resident
        _sync(device)
        result["load_models_gpu_s"] = round(time.perf_counter() - started, 3)
        steps, peak_used = [], 0
        with torch.no_grad():
            for step in range(spec["steps"]):
                t = 1.0 - step / max(spec["steps"], 1)
                inputs["timestep"] = torch.tensor([t, min(1.0, t + 0.1)], device=device)
                started = time.perf_counter()
                out = model(**inputs)
                _sync(device)
                steps.append(round(time.perf_counter() - started, 4))
                if device.type == "cuda":
                    peak_used = max(peak_used, total - torch.cuda.mem_get_info(device)[0] - used_before)
        first = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
        first = first[0] if isinstance(first, (tuple, list)) else first
        result.update(
            available=True, steps_s=steps, seconds_per_step=round(sorted(steps)[len(steps) // 2], 4),
            output_finite=bool(torch.isfinite(first.float()).all()),
            loaded_size_bytes=int(patcher.loaded_size()), model_size_bytes=int(patcher.model_size()),
            peak_torch_allocated_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            peak_device_used_bytes=peak_used if device.type == "cuda" else None,
            note=("CUDA: peaks over load + steps; the device's used memory also counts aimdo's own allocations"
                  if device.type == "cuda" else
                  "CPU: core reroutes ModelPatcherDynamic to ModelPatcher for a CPU load device; no VRAM figures"))
    return result


if __name__ == "__main__":
    raise SystemExit(main())
