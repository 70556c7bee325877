"""The planner's machines x files tables (`python -m h3_core plan --table`, docs/REAL_WEIGHTS.md), planned
from the release-size headers of every published file (`weights.release_headers`: names, dtypes, shapes
and markers as the published files have them; no data, no file written).
"""

from __future__ import annotations

from ..weights.tensor_info import TensorInfo
from . import planner
from .planner import GB


def published_table(name: str) -> dict[str, TensorInfo]:
    """`{tensor: TensorInfo}` of a published file (a key of `release_headers.PUBLISHED`), headers only."""
    from ..weights.release_headers import release_header

    tensors, _ = release_header(name)
    return {tensor: TensorInfo(dtype=tag, shape=tuple(shape), file="") for tensor, (tag, shape) in tensors.items()}


def dit_table(variant: str = "bf16", partition: str = "fl2va") -> dict[str, TensorInfo]:
    return published_table(f"diffusion_models/minimax_h3_{partition}_{variant}.safetensors")


def text_encoder_table(variant: str = "bf16") -> dict[str, TensorInfo]:
    return published_table(f"text_encoders/qwen3vl_32b_minimax_h3_{variant}.safetensors")


def vae_table(component: str, variant: str | None = None) -> dict[str, TensorInfo]:
    if component == "vae":
        return published_table(f"vae/minimax_h3_video_vae_{variant or 'fp16'}.safetensors")
    return published_table("vae/minimax_h3_audio_vae_fp32.safetensors")


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


def _extra(plan, decoders):
    """What shares the device with `plan`, per offload mode: a text encoder sits beside both VAEs' weights (a local
    encoder); a DiT stays loaded (resident) or not (streamed) while the VAEs decode."""

    def extra(offload):
        if plan.component == "text_encoder":
            return plan.peak(offload) + decoders[0]
        return (plan.device_bytes if offload == "none" else 0) + decoders[0] + decoders[1] + planner.RESERVE_BYTES

    return extra


def _cell(plan, decoders, gpu: int) -> str:
    for ram in RAMS:
        verdict = planner.decide("", plan, _extra(plan, decoders), int(gpu * GB), int(ram * GB))
        if verdict.offload is not None:
            how = "resident" if verdict.offload == "none" else "streamed"
            return f"{how} {verdict.peak / GB:.0f} GB" + ("" if ram == RAMS[0] else f" (RAM ≥ {ram})")
    return "no" if plan.component != "text_encoder" else "remote"


def machine_table(*, width: int = 1344, height: int = 768, frames: int = 124, text_tokens: int = 512) -> str:
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
    for plan in plans:
        verdict = planner.decide("", plan, _extra(plan, decoders), int(vram * GB), int(ram * GB))
        if verdict.offload is not None:
            return plan, verdict
    return None, None


def machine_choices(*, width: int = 1344, height: int = 768, frames: int = 124, text_tokens: int = 512) -> str:
    """Per machine (GPU x RAM): the highest-precision DiT and text encoder that run there, how, and at what
    planned peak; a text encoder that fits nowhere locally is run remotely."""
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
