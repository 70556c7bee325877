"""Release-size tensor tables of the published files, built on the meta device, and the planner's
machines x files table (`python -m h3_core plan --table`, docs/REAL_WEIGHTS.md).

The bf16 tables are the release models' own parameters at the files' dtypes (the DiT's float32 islands
are the modules diffusers keeps in float32; the text-encoder file holds 50 layers, no final norm, no
head). The quantised and pruned variants are derived from them by the on-disk rules of each format:
int8 / fp8 weights one byte per weight plus a float32 scale per row (int8) or per tensor (fp8); W6A8
six bits per weight plus a float8 scale per 16 weights and a float32 scale per row; NVFP4 four bits plus
a float8 scale per 16; the pruned DiT replaces the 2688-wide AdaLN projections by 8-wide float16 ones
and the time embedder by a [1025, 8] float32 table. Sizes agree with the published files within 1 %.
"""

from __future__ import annotations

import re

import torch

from . import configs, planner
from .weights.headers import TensorInfo

_BLOCK_LINEAR = re.compile(
    r"^transformer_blocks\.\d+\.(attn\.to_[qkv]|attn\.to_out\.0|ff\.net\.0\.proj|ff\.net\.2)\.weight$")
_ADALN = re.compile(r"^(transformer_blocks\.\d+\.adaln_proj|norm_out)\.linear\.(weight|bias)$")
_TEXT_LINEAR = re.compile(
    r"^model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def _meta_state(component: str) -> dict[str, torch.Tensor]:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        if component == "text_encoder":
            from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

            model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**configs.get("text_encoder", tiny=False)))
        else:
            from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

            cls = {"transformer": MiniMaxH3Transformer3DModel, "vae": AutoencoderKLMiniMaxH3,
                   "audio_vae": AutoencoderKLMiniMaxH3Audio}[component]
            model = cls.from_config(configs.get(component, tiny=False))
    return {name: param for name, param in model.named_parameters()}


def _info(tag: str, *shape: int) -> TensorInfo:
    return TensorInfo(dtype=tag, shape=tuple(int(s) for s in shape), file="")


def dit_table(variant: str = "bf16") -> dict[str, TensorInfo]:
    """variant: bf16, pruned_bf16, int8_convrot, pruned_int8_convrot, pruned_fp8_scaled, pruned_w6a8."""
    from diffusers import MiniMaxH3Transformer3DModel

    keep = MiniMaxH3Transformer3DModel._keep_in_fp32_modules
    pruned, fmt = variant.startswith("pruned_"), variant.removeprefix("pruned_").split("_")[0]
    table: dict[str, TensorInfo] = {}
    for name, param in _meta_state("transformer").items():
        shape = tuple(param.shape)
        if pruned and name.startswith("time_embedder."):
            continue
        if pruned and _ADALN.match(name):
            table[name] = _info("F16", shape[0], 8) if name.endswith("weight") else _info("F16", *shape)
            continue
        quantised = _BLOCK_LINEAR.match(name) or (fmt == "int8" and not pruned and _ADALN.match(name)
                                                  and name.endswith("weight"))
        if quantised and fmt in ("int8", "fp8"):
            table[name] = _info("I8" if fmt == "int8" else "F8_E4M3", *shape)
            table[name + "_scale"] = _info("F32", shape[0], 1) if fmt == "int8" else _info("F32")
            continue
        if quantised and fmt == "w6a8":
            table[name] = _info("I8", shape[0], shape[1] * 3 // 4)
            table[name + "_s_rel"] = _info("F8_E4M3", shape[0], shape[1] // 16)
            table[name + "_s_channel"] = _info("F32", shape[0])
            continue
        table[name] = _info("F32" if name.split(".")[0] in keep else "BF16", *shape)
    if pruned:
        table["adaln_t_table"] = _info("F32", 1025, 8)
    return table


def text_encoder_table(variant: str = "bf16") -> dict[str, TensorInfo]:
    """The Comfy text-encoder file: 50 language layers, no final norm, no head. variant: bf16,
    int8_convrot, nvfp4_awq."""
    layers = configs.TEXT_ENCODER_LAYER
    table: dict[str, TensorInfo] = {}
    for name, param in _meta_state("text_encoder").items():
        match = re.match(r"^model\.language_model\.layers\.(\d+)\.", name)
        if (match and int(match.group(1)) >= layers) or name.startswith("lm_head.") or name.endswith(
                "language_model.norm.weight"):
            continue
        shape = tuple(param.shape)
        if variant != "bf16" and _TEXT_LINEAR.match(name):
            if variant.startswith("int8"):
                table[name] = _info("I8", *shape)
                table[name + "_scale"] = _info("F32", shape[0], 1)
            else:
                table[name] = _info("U8", shape[0], shape[1] // 2)
                table[name + "_scale"] = _info("F8_E4M3", shape[0], shape[1] // 16)
            continue
        if variant.startswith("nvfp4") and name.endswith("embed_tokens.weight"):
            table[name] = _info("I8", *shape)
            table[name + "_scale"] = _info("F32", shape[0], 1)
            continue
        table[name] = _info("BF16", *shape)
    return table


def vae_table(component: str) -> dict[str, TensorInfo]:
    tag = "F16" if component == "vae" else "F32"
    return {name: _info(tag, *param.shape) for name, param in _meta_state(component).items()}


DIT_VARIANTS = ("bf16", "pruned_bf16", "int8_convrot", "pruned_int8_convrot", "pruned_fp8_scaled", "pruned_w6a8")
TEXT_VARIANTS = ("bf16", "int8_convrot", "nvfp4_awq")
GPUS = (24, 48, 80, 141)
RAMS = (32, 64, 128)


def release_plans(*, width: int, height: int, frames: int, text_tokens: int) -> list[planner.ComponentPlan]:
    job = {"width": width, "height": height, "frames": frames, "text_tokens": text_tokens}
    plans = [planner.plan_component("transformer", dit_table(v), name=f"minimax_h3_fl2va_{v}", **job)
             for v in DIT_VARIANTS]
    plans += [planner.plan_component("text_encoder", text_encoder_table(v), name=f"qwen3vl_32b_minimax_h3_{v}", **job)
              for v in TEXT_VARIANTS]
    plans.append(planner.plan_component("vae", vae_table("vae"), name="minimax_h3_video_vae_fp16", **job))
    plans.append(planner.plan_component("audio_vae", vae_table("audio_vae"), name="minimax_h3_audio_vae_fp32", **job))
    return plans


def _cell(plan, decoders, gpu: int) -> str:
    from .plan_report import GB, _decide

    for ram in RAMS:
        def extra(offload, plan=plan):
            if plan.component == "text_encoder":
                return plan.peak(offload) + decoders[0]
            return (plan.device_bytes if offload == "none" else 0) + decoders[0] + decoders[1] + planner.RESERVE_BYTES

        verdict = _decide("", plan, extra, int(gpu * GB), int(ram * GB))
        if verdict.offload is not None:
            how = "resident" if verdict.offload == "none" else "streamed"
            return f"{how} {verdict.peak / GB:.0f} GB" + ("" if ram == RAMS[0] else f" (RAM ≥ {ram})")
    return "no" if plan.component != "text_encoder" else "remote"


def machine_table(*, width: int = 1344, height: int = 768, frames: int = 124, text_tokens: int = 512) -> str:
    from .plan_report import GB

    plans = release_plans(width=width, height=height, frames=frames, text_tokens=text_tokens)
    vae, audio = plans[-2], plans[-1]
    decoders = (vae.device_bytes + audio.device_bytes, max(vae.activation, audio.activation))
    tokens = planner.dit_tokens(width=width, height=height, frames=frames, text_tokens=text_tokens)
    lines = [
        f"Job {width}x{height}x{frames} ({tokens} DiT tokens), bf16 compute; GB = 1e9 bytes; "
        f"RAM tiers {', '.join(map(str, RAMS))} GB. "
        "A cell: the first of resident / streamed that fits, its planned device peak, and the least RAM it needs "
        "(none stated: 32 GB is enough). The text encoder's cell includes both VAEs beside it (a local encoder); "
        "\"remote\": run it on an encoder server (`serve`) and `encode --server URL`.",
        "",
        "| file | stored GB | resident peak | streamed peak | host RAM to stream | "
        + " | ".join(f"{gpu} GB GPU" for gpu in GPUS) + " |",
        "|---|---:|---:|---:|---:|" + "---|" * len(GPUS),
    ]
    for plan in plans[:-2]:
        cells = [_cell(plan, decoders, gpu) for gpu in GPUS]
        lines.append(
            f"| {plan.name} | {plan.stored_bytes / GB:.2f} | {plan.resident_peak / GB:.1f} | "
            f"{plan.streamed_peak / GB:.1f} | {plan.host_bytes('block') / GB:.0f} | " + " | ".join(cells) + " |"
        )
    for plan in plans[-2:]:
        lines.append(f"| {plan.name} | {plan.stored_bytes / GB:.2f} | {plan.resident_peak / GB:.1f} | - | - | "
                     + " | ".join("resident" for _ in GPUS) + " |")
    return "\n".join(lines)


def _best(plans, decoders, vram: int, ram: int):
    """The first plan (in the caller's quality order) that fits the machine, with its verdict."""
    from .plan_report import GB, _decide

    for plan in plans:
        def extra(offload, plan=plan):
            if plan.component == "text_encoder":
                return plan.peak(offload) + decoders[0]
            return (plan.device_bytes if offload == "none" else 0) + decoders[0] + decoders[1] + planner.RESERVE_BYTES

        verdict = _decide("", plan, extra, int(vram * GB), int(ram * GB))
        if verdict.offload is not None:
            return plan, verdict
    return None, None


def machine_choices(*, width: int = 1344, height: int = 768, frames: int = 124, text_tokens: int = 512) -> str:
    """Per machine (GPU x RAM): the highest-precision DiT and text encoder that run there, how, and at what
    planned peak; a text encoder that fits nowhere locally is run remotely."""
    from .plan_report import GB

    plans = release_plans(width=width, height=height, frames=frames, text_tokens=text_tokens)
    vae, audio = plans[-2], plans[-1]
    decoders = (vae.device_bytes + audio.device_bytes, max(vae.activation, audio.activation))
    dits = [p for p in plans if p.component == "transformer"]
    texts = [p for p in plans if p.component == "text_encoder"]
    lines = [
        f"| GPU | RAM | DiT (job {width}x{height}x{frames}) | text encoder (local, beside both VAEs) |",
        "|---:|---:|---|---|",
    ]
    for gpu in GPUS:
        for ram in RAMS:
            cells = []
            for group, missing in ((dits, "none fits"), (texts, "remote: `serve` elsewhere + `encode --server URL`")):
                plan, verdict = _best(group, decoders, gpu, ram)
                if plan is None:
                    cells.append(missing)
                    continue
                how = "resident" if verdict.offload == "none" else "--offload block"
                cells.append(f"{plan.name.split('minimax_h3_')[-1]}, {how}, {verdict.peak / GB:.0f} GB")
            lines.append(f"| {gpu} GB | {ram} GB | " + " | ".join(cells) + " |")
    return "\n".join(lines)
