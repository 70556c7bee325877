"""GPU check: one full-size DiT forward streamed under a 24 GB cap and resident without it, and one
streamed text-encoder forward, each measured peak next to the planner's prediction. Prints JSON.

    python bench/gpu_check.py            # wherever torch sees CUDA (H200: a few minutes)
    python bench/gpu_check.py --small    # the tiny H3 on CPU, same code path (tests/test_gpu_check.py)

Weights are random, materialised from the release models' shapes and dtypes (bf16 with the DiT's float32
islands: the bf16 release files). The quantised / pruned release models (int8 text encoder, pruned int8 DiT)
need the quantised and pruned model classes; until they are importable (h3_core.weights.quant,
h3_core.weights.pruned) the check runs the bf16 files, the largest the planner plans, and says so in
`"weights"`. Streaming is `h3_core.offload` (diffusers group offloading, block level, prefetch on a side
stream). Host copies are left pageable and pinned per transfer (a 66 GB pinned copy does not fit beside the
pageable one in 128 GB of RAM).

Measured peak: `torch.cuda.max_memory_allocated` over the timed forward (the allocator's own view; the
CUDA context is outside it). Planned peak: `planner.plan_component(...)` on the same model's tensors (its
1 GiB reserve covers context and allocator slack).
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

from h3_core import configs, offload, planner  # noqa: E402
from h3_core.safetensors_header import DTYPE_TAGS  # noqa: E402
from h3_core.weights.headers import TensorInfo  # noqa: E402

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
    config["text_config"]["num_hidden_layers"] = configs.TEXT_ENCODER_LAYER
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


def check_dit(device, dtype, job, *, tiny: bool, streamed: bool) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel

    keep = MiniMaxH3Transformer3DModel._keep_in_fp32_modules
    make_on = device if device.type == "cuda" else torch.device("cpu")
    place_on = torch.device("cpu") if streamed else device
    model = materialise(_meta_dit(tiny), dtype, keep, make_on=make_on, place_on=place_on)
    if not streamed:
        model.to(device)  # the buffers (rope) built with the meta model
    plan = planner.plan_component("transformer", tensor_table(model), device=device.type, dtype=dtype,
                                  config=dict(model.config), **job)
    cap = CAP_BYTES if streamed and device.type == "cuda" else None
    _cap(device, cap)
    if streamed:
        info = offload.stream_blocks(model, "transformer", device, pin=False)
        moved = info.moved_per_forward
    else:
        moved = 0
    inputs, _ = dit_inputs(model.config, device=device, dtype=dtype, **job)
    seconds, peak = timed_forward(lambda: model(**inputs), device)
    record = _record("dit_" + ("streamed" if streamed else "resident"), plan, "block" if streamed else "none",
                     seconds, peak, moved, cap)
    record["tokens"] = planner.dit_tokens(**job)
    model = inputs = None  # free before the next check (the closure holds the cells)
    _cap(device, None)
    _free(device)
    return record


def check_text_encoder(device, dtype, job, *, tiny: bool) -> dict:
    make_on = device if device.type == "cuda" else torch.device("cpu")
    model = materialise(_meta_text_encoder(tiny), dtype, make_on=make_on, place_on=torch.device("cpu"))
    config = model.config.to_dict()
    plan = planner.plan_component("text_encoder", tensor_table(model), device=device.type, dtype=dtype,
                                  config=config, **job)
    cap = CAP_BYTES if device.type == "cuda" else None
    _cap(device, cap)
    info = offload.stream_blocks(model, "text_encoder", device, pin=False)
    ids = torch.randint(0, 1000, (1, job["text_tokens"]), device=device)

    def run():
        return model.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                           output_hidden_states=True).hidden_states[-1]

    seconds, peak = timed_forward(run, device)
    record = _record("text_encoder_streamed", plan, "block", seconds, peak, info.moved_per_forward, cap)
    model = None
    _cap(device, None)
    _free(device)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the tiny H3 on CPU (what the test runs)")
    parser.add_argument("--device", default=None, help="default: cuda if torch sees it, else cpu")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.small else "cpu"))
    tiny = args.small
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    job = {"width": 64, "height": 64, "frames": 124, "text_tokens": 16} if tiny else \
        {"width": 1344, "height": 768, "frames": 124, "text_tokens": 512}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "weights": "random, release bf16 shapes (quantised / pruned classes not importable here)" if not tiny
        else "random, tiny H3 shapes",
        "job": job,
        "checks": [],
    }
    started = time.perf_counter()
    result["checks"].append(check_text_encoder(device, dtype, job, tiny=tiny))
    result["checks"].append(check_dit(device, dtype, job, tiny=tiny, streamed=True))
    result["checks"].append(check_dit(device, dtype, job, tiny=tiny, streamed=False))
    result["seconds_total"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
