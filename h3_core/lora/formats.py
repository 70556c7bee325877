"""Key maps: every trainer's H3 DiT LoRA naming onto diffusers' module names, with nothing dropped silently.

What each producer writes (one file = one naming; `A`/`B` = down/up factor; module names are the reference
checkpoint's unless said otherwise):

- `native` (Comfy-Org Turbo files, the reference `generate.py`, ai-toolkit): `[diffusion_model.]blocks.{i}.attn.
  qkv_proj.lora_{A,B}.weight` or `.lora_{down,up}.weight` + `.alpha`; fused qkv, `mlp.fc1` = [gate; value].
- `musubi` (musubi-tuner, kohya): `lora_unet_blocks_{i}_attn_qkv_proj.lora_{down,up}.weight` + `.alpha`: the native
  name with every `.` as `_`, recovered by matching the whole name against the native vocabulary.
- `diffsynth` (DiffSynth-Studio): native names, no prefix, peft's `.lora_{A,B}.default.weight`; the fused qkv rows
  interleaved per head [h0: q k v, h1: q k v, ...] (split with the DiT's own head_dim when bound).
- `diffusers` (diffusers' save_lora_weights, peft dumps, the PDD trunk): `[transformer.]transformer_blocks.{i}.attn.
  to_q.lora_{A,B}[.default].weight` or `.lora_{down,up}.weight`, on diffusers' own module names.

PDD "Acc" files (alibaba-pai MiniMax-H3-Acc-LoRAs) add a head bank beside a `diffusers` trunk: full tensors
`proj_out.weight` [N, out, in] / `proj_out.bias` [N, out] and the same for `audio_proj_out`, one output head per
interval of an N-point time grid (Comfy's converted copies store it as `final_layer.{video,audio}_out.set_weight`
[N*out, in] / `.set_bias` [N*out]). Those are parsed into `heads`; any other tensor that is not a LoRA factor or
alpha (`.diff`, `.diff_b`, `.dora_scale`, a full weight of another module, a bias delta) is an error naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch


class LoraError(ValueError):
    """A LoRA file that cannot apply to this DiT (unknown key or module, wrong shape, not safetensors)."""


#: The DiT's audio branch in diffusers' names: the audio patch projection in and the audio head out. Inside the
#: blocks attention and FFN are shared by all modalities of the packed sequence; only each block's AdaLN projection
#: has per-modality rows (`adaln_proj.linear` out = [video | text | audio] x 6 x hidden, modality 2 = audio).
AUDIO_MODULES = ("audio_proj_in", "audio_proj_out")
ADALN_MODALITIES, AUDIO_MODALITY = 3, 2
HEAD_MODULES = {"proj_out": "video", "audio_proj_out": "audio"}

_PREFIXES = ("diffusion_model.", "transformer.", "transformer_ref.")
_SUFFIXES = (  # (suffix, kind)
    (".lora_A.default.weight", "down"), (".lora_B.default.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"),
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".alpha", "alpha"), (".set_weight", "set_weight"), (".set_bias", "set_bias"),
    (".weight", "weight"), (".bias", "bias"),
)
# The reference checkpoint's Linear names -> diffusers'. `qkv` is split in three, `fc1` has its halves swapped.
_NATIVE_BLOCK = {
    "attn.qkv_proj": "attn.qkv", "attn.out_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2", "adaln_proj.linear": "adaln_proj.linear",
}
_NATIVE_STANDALONE = {
    "video_patch_proj": "proj_in", "audio_patch_proj": "audio_proj_in", "condition_proj": "context_embedder",
    "time_embedder.proj_in": "time_embedder.linear_1", "time_embedder.proj_out": "time_embedder.linear_2",
    "final_layer.adaln_proj.linear": "norm_out.linear", "final_layer.video_out": "proj_out",
    "final_layer.audio_out": "audio_proj_out",
}
# musubi-tuner's flattened names (native name, `.` -> `_`), matched whole against the native vocabulary.
_FLAT = [(re.compile(pattern), dotted) for pattern, dotted in (
    (r"blocks_(\d+)_attn_(qkv|out)_proj", r"blocks.\1.attn.\2_proj"),
    (r"blocks_(\d+)_mlp_fc([12])", r"blocks.\1.mlp.fc\2"),
    (r"blocks_(\d+)_adaln_proj_linear", r"blocks.\1.adaln_proj.linear"),
    (r"token_refiner_blocks_(\d+)_attn_(qkv|out)_proj", r"token_refiner.blocks.\1.attn.\2_proj"),
    (r"token_refiner_blocks_(\d+)_mlp_fc([12])", r"token_refiner.blocks.\1.mlp.fc\2"),
    (r"(video|audio)_patch_proj", r"\1_patch_proj"),
    (r"condition_proj", "condition_proj"),
    (r"time_embedder_proj_(in|out)", r"time_embedder.proj_\1"),
    (r"final_layer_adaln_proj_linear", "final_layer.adaln_proj.linear"),
    (r"final_layer_(video|audio)_out", r"final_layer.\1_out"),
)]
_NATIVE_ROOTS = ("blocks.", "token_refiner.blocks.", "final_layer.", "video_patch_proj", "audio_patch_proj",
                 "condition_proj", "time_embedder.proj_")


@dataclass
class Parsed:
    format: str
    factors: dict = field(default_factory=dict)  # diffusers module -> (A [r, in], B [out, r], scale)
    interleaved_qkv: dict = field(default_factory=dict)  # "<block>.attn" -> (A, B per-head [q k v], scale)
    heads: dict = field(default_factory=dict)  # "proj_out" / "audio_proj_out" -> (W [N, out, in], b [N, out] | None)
    keys: int = 0


def _split(key: str) -> tuple[str, str]:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    for suffix, kind in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], kind
    return key, "?"


def _unflatten(module: str, key: str) -> str:
    flat = module[len("lora_unet_"):]
    for pattern, dotted in _FLAT:
        if pattern.fullmatch(flat):
            return pattern.sub(dotted, flat)
    raise LoraError(f"{key}: not an H3 DiT module in musubi-tuner's flattened `lora_unet_` naming")


def _native_to_diffusers(module: str) -> str | None:
    if module in _NATIVE_STANDALONE:
        return _NATIVE_STANDALONE[module]
    match = re.fullmatch(r"(token_refiner\.)?blocks\.(\d+)\.(.+)", module)
    if match and match.group(3) in _NATIVE_BLOCK:
        stack = "token_refiner.refiner_blocks" if match.group(1) else "transformer_blocks"
        return f"{stack}.{match.group(2)}.{_NATIVE_BLOCK[match.group(3)]}"
    return None


def metadata_alpha(metadata: dict) -> float | None:
    """The network alpha a file states in its `__metadata__` (lightx2v Turbo files: `alpha`), for files without
    per-module `.alpha` tensors; None when it states none (then alpha = rank, scale 1, diffusers' convention)."""
    for key in ("alpha", "lora_alpha", "ss_network_alpha"):
        if key in metadata:
            try:
                value = json.loads(metadata[key])
            except ValueError:
                value = metadata[key]
            if value is None or value in ("None", "none", ""):
                return None
            try:
                return float(value)
            except (TypeError, ValueError):
                raise LoraError(f"the file's metadata `{key}` = {metadata[key]!r} is not a number") from None
    return None


def parse(raw: dict, metadata: dict, name: str) -> Parsed:
    """`raw` (one safetensors file) -> factors on diffusers' module names, scale = alpha / rank folded per module."""
    if not raw:
        raise LoraError(f"{name}: the file holds no tensors")
    musubi = any(k.startswith("lora_unet_") for k in raw)
    diffsynth = any(".default.weight" in k for k in raw)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in raw.items():
        module, kind = _split(key)
        if musubi and kind in ("down", "up", "alpha"):
            if not module.startswith("lora_unet_"):
                unknown.append(key)
                continue
            module = _unflatten(module, key)
        if kind == "?" or (kind in ("weight", "bias", "set_weight", "set_bias")
                           and (_native_to_diffusers(module) or module) not in HEAD_MODULES):
            unknown.append(key)
            continue
        slot = groups.setdefault(module, {})
        if kind in slot:
            raise LoraError(f"{name}: {module} has two `{kind}` tensors (two prefixes for one module?)")
        slot[kind] = tensor
    if unknown:
        shown = ", ".join(sorted(unknown)[:6]) + (f" (+{len(unknown) - 6} more)" if len(unknown) > 6 else "")
        raise LoraError(
            f"{name}: {len(unknown)} tensor(s) are neither LoRA factors, alphas nor an H3 PDD head bank, and are not "
            f"applied: {shown}"
        )
    native_names = {m for m in groups if m.startswith(_NATIVE_ROOTS)}
    fmt = ("musubi" if musubi else "diffsynth" if diffsynth and native_names
           else "diffusers" if not native_names else "native" if len(native_names) == len(groups)
           else "native+diffusers")
    has_alpha = any("alpha" in slot for slot in groups.values())
    try:
        file_alpha = None if has_alpha else metadata_alpha(metadata)
    except LoraError as error:
        raise LoraError(f"{name}: {error}") from None
    parsed = Parsed(fmt, keys=len(raw))
    for module, slot in groups.items():
        native = module in native_names
        target = _native_to_diffusers(module) if native else module
        if target is None:
            raise LoraError(f"{name}: {module} is not a LoRA-able module of the H3 DiT's reference checkpoint")
        if target in HEAD_MODULES and not {"down", "up"} & slot.keys():
            parsed.heads[target] = _head_bank(slot, target, name)
            continue
        if set(slot) - {"down", "up", "alpha"}:
            extra = sorted(set(slot) - {"down", "up", "alpha"})
            raise LoraError(f"{name}: {module} mixes LoRA factors with full tensors {extra}")
        if "down" not in slot or "up" not in slot:
            raise LoraError(f"{name}: {module} has {sorted(slot)} but not both LoRA factors (down/A and up/B)")
        down, up = slot["down"].float(), slot["up"].float()
        if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
            raise LoraError(f"{name}: {module} factors A {tuple(down.shape)} / B {tuple(up.shape)} are not a LoRA pair")
        alpha = float(slot["alpha"]) if "alpha" in slot else file_alpha
        scale = 1.0 if alpha is None else alpha / down.shape[0]
        if target.endswith(".attn.qkv"):
            if up.shape[0] % 3:
                raise LoraError(f"{name}: {module} has {up.shape[0]} output rows, not a fused q/k/v projection")
            if fmt == "diffsynth":
                parsed.interleaved_qkv[target[: -len(".qkv")]] = (down, up, scale)
                continue
            for proj, part in zip(("to_q", "to_k", "to_v"), up.chunk(3, dim=0)):
                parsed.factors[f"{target[: -len('qkv')]}{proj}"] = (down, part.contiguous(), scale)
        elif native and target.endswith(".ff.net.0.proj"):
            if up.shape[0] % 2:
                raise LoraError(f"{name}: {module} has {up.shape[0]} output rows, not a fused SwiGLU projection")
            gate, value = up.chunk(2, dim=0)
            # the reference's [gate; value] -> diffusers' SwiGLU [value; gate]: a permutation of B's rows only
            parsed.factors[target] = (down, torch.cat([value, gate]), scale)
        else:
            parsed.factors[target] = (down, up, scale)
    return parsed


def _head_bank(slot: dict, target: str, name: str):
    weight = slot.get("weight", slot.get("set_weight"))
    bias = slot.get("bias", slot.get("set_bias"))
    if weight is None:
        raise LoraError(f"{name}: {target} has a bias bank but no weight bank")
    if "set_weight" in slot:  # Comfy's converted bank: [N*out, in] / [N*out]; N is read off the model at bind time
        return ("flat", weight.float(), None if bias is None else bias.float())
    if weight.ndim != 3 or (bias is not None and (bias.ndim != 2 or bias.shape[0] != weight.shape[0])):
        raise LoraError(
            f"{name}: {target} weight {tuple(weight.shape)} is not a PDD head bank [N, out, in] (a full replacement "
            "weight is not a LoRA and is not applied)"
        )
    return ("bank", weight.float(), None if bias is None else bias.float())


def deinterleave_qkv(up: torch.Tensor, head_dim: int, name: str, module: str) -> torch.Tensor:
    """DiffSynth's per-head [h0: q k v, h1: q k v, ...] rows -> [q_all; k_all; v_all] (the model's own head_dim)."""
    if up.shape[0] % (3 * head_dim):
        raise LoraError(f"{name}: {module} has {up.shape[0]} qkv rows, not a multiple of 3 x head_dim {head_dim}")
    heads = up.shape[0] // (3 * head_dim)
    return up.reshape(heads, 3, head_dim, up.shape[1]).transpose(0, 1).reshape(up.shape[0], up.shape[1]).contiguous()
