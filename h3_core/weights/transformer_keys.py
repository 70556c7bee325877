"""DiT keys: diffusers `MiniMaxH3Transformer3DModel` <-> Comfy-Org single file / native partition.

Comfy-Org and native files use the reference names (`video_patch_proj`,
`blocks.N.attn.qkv_proj`, `mlp.fc1`, `final_layer.*`, `rope.inv_freq`...) and differ only in the
fused QKV row order: Comfy files are stacked `[q; k; v]`, native shards interleave per head
(diffusers' single-file converter documents both). `fc1` is `[gate; value]` in both, diffusers'
SwiGLU wants `[value; gate]`. `rope.inv_freq` is not a diffusers weight: the model recomputes it
from `rope_theta`, so it is dropped on the way in (the loader checks it matches) and recomputed
with diffusers' own module on the way out.
"""

from __future__ import annotations

import os
import re
import tempfile

import torch

from .. import configs
from . import config_merge
from .errors import H3WeightsError
from .fused import fuse_qkv, split_qkv, swap_halves
from .keymap import ComponentHandler, KeyFamily, count_indices
from .quant.plan import split_side
from .quant.route import follow_rows
from .safetensors_io import load_tensors, write_json

QKV_LAYOUT_BY_NAMING = {"comfy": "stacked", "native": "interleaved"}

# Reference name -> diffusers name, for everything outside the repeated blocks.
_TOP_LEVEL = {
    "video_patch_proj.weight": "proj_in.weight",
    "video_patch_proj.bias": "proj_in.bias",
    "audio_patch_proj.weight": "audio_proj_in.weight",
    "audio_patch_proj.bias": "audio_proj_in.bias",
    "condition_proj.weight": "context_embedder.weight",
    "condition_proj.bias": "context_embedder.bias",
    "time_embedder.proj_in.weight": "time_embedder.linear_1.weight",
    "time_embedder.proj_in.bias": "time_embedder.linear_1.bias",
    "time_embedder.proj_out.weight": "time_embedder.linear_2.weight",
    "time_embedder.proj_out.bias": "time_embedder.linear_2.bias",
    "token_refiner.final_norm.weight": "token_refiner.final_norm.weight",
    "final_layer.norm.weight": "norm_out.norm.weight",
    "final_layer.adaln_proj.linear.weight": "norm_out.linear.weight",
    "final_layer.adaln_proj.linear.bias": "norm_out.linear.bias",
    "final_layer.video_out.weight": "proj_out.weight",
    "final_layer.video_out.bias": "proj_out.bias",
    "final_layer.audio_out.weight": "audio_proj_out.weight",
    "final_layer.audio_out.bias": "audio_proj_out.bias",
}
_TOP_LEVEL_INV = {v: k for k, v in _TOP_LEVEL.items()}

# Inside one block: reference suffix -> diffusers suffix (qkv and fc1 need tensor work too).
_BLOCK = {
    "norm1.weight": "norm1.weight",
    "norm2.weight": "norm2.weight",
    "attn.q_norm.weight": "attn.norm_q.weight",
    "attn.k_norm.weight": "attn.norm_k.weight",
    "attn.out_proj.weight": "attn.to_out.0.weight",
    "mlp.fc1.weight": "ff.net.0.proj.weight",
    "mlp.fc2.weight": "ff.net.2.weight",
    "adaln_proj.linear.weight": "adaln_proj.linear.weight",
    "adaln_proj.linear.bias": "adaln_proj.linear.bias",
}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()}
_QKV = "attn.qkv_proj.weight"
_SPLIT = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight")

_REF_BLOCK = re.compile(r"(blocks|token_refiner\.blocks)\.(\d+)\.(.+)")
_DIFF_BLOCK = re.compile(r"(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)")
_PREFIX_TO_DIFFUSERS = {"blocks": "transformer_blocks", "token_refiner.blocks": "token_refiner.refiner_blocks"}
_PREFIX_TO_REFERENCE = {v: k for k, v in _PREFIX_TO_DIFFUSERS.items()}

ROPE_KEY = "rope.inv_freq"


def _weight_targets(key: str, heads: int, head_dim: int, layout: str):
    """Where reference tensor `key` goes: (diffusers names, row operation or None), or None if unknown."""
    if key in _TOP_LEVEL:
        return [_TOP_LEVEL[key]], None
    match = _REF_BLOCK.fullmatch(key)
    if not match:
        return None
    prefix, index, suffix = match.groups()
    target = f"{_PREFIX_TO_DIFFUSERS[prefix]}.{index}."
    if suffix == _QKV:
        return [target + name for name in _SPLIT], lambda t: split_qkv(t, heads, head_dim, layout, key)
    if suffix == "mlp.fc1.weight":
        return [target + _BLOCK[suffix]], lambda t: (swap_halves(t, key),)
    if suffix in _BLOCK and (prefix == "blocks" or not suffix.startswith("adaln_proj")):
        return [target + _BLOCK[suffix]], None
    return None


def to_diffusers(state: dict, config: dict, naming: str) -> tuple[dict, list[str]]:
    """Reference-named DiT state dict -> diffusers names. Returns (converted, unexpected keys).

    A quantised layer's side tensors (`P.weight_scale`, `P.comfy_quant`, ...) go where `P.weight` goes:
    row-aligned ones are split / half-swapped with the weight's rows, per-tensor ones and the marker
    are copied to every part (`quant.route.follow_rows`)."""
    layout = QKV_LAYOUT_BY_NAMING[naming]
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    out, unexpected = {}, []
    for key, tensor in state.items():
        if key == ROPE_KEY:
            continue
        side = split_side(key)
        found = _weight_targets(f"{side[0]}.weight" if side else key, heads, head_dim, layout)
        if found is None:
            unexpected.append(key)
            continue
        targets, op = found
        if side is None:
            parts = op(tensor) if op is not None else (tensor,)
        else:
            parts = follow_rows(state, side[0], side[1], tensor, op, len(targets))
            targets = [name[: -len("weight")] + side[1] for name in targets]
        out.update(zip(targets, parts, strict=True))
    return out, unexpected


def rope_inv_freq(config: dict) -> torch.Tensor:
    """The `rope.inv_freq` diffusers computes, taken from diffusers' own module (bit-identical)."""
    from ..diffusers_adapter import rope_inv_freq as diffusers_rope_inv_freq

    return diffusers_rope_inv_freq(config["rope_freq_dim"], config["rope_theta"])


def from_diffusers(state: dict, config: dict, naming: str, inv_freq: torch.Tensor | None = None) -> dict:
    """Diffusers DiT state dict -> reference names in `naming` ('comfy' stacked or 'native' interleaved)."""
    layout = QKV_LAYOUT_BY_NAMING[naming]
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    out, pending_qkv, unexpected = {}, {}, []
    for key, tensor in state.items():
        if key in _TOP_LEVEL_INV:
            out[_TOP_LEVEL_INV[key]] = tensor
            continue
        match = _DIFF_BLOCK.fullmatch(key)
        if not match:
            unexpected.append(key)
            continue
        prefix, index, suffix = match.groups()
        target = f"{_PREFIX_TO_REFERENCE[prefix]}.{index}."
        if suffix in _SPLIT:
            pending_qkv.setdefault(target, {})[suffix] = tensor
        elif suffix == "ff.net.0.proj.weight":
            out[target + _BLOCK_INV[suffix]] = swap_halves(tensor, key)
        elif suffix in _BLOCK_INV:
            out[target + _BLOCK_INV[suffix]] = tensor
        else:
            unexpected.append(key)
    for target, parts in pending_qkv.items():
        if set(parts) != set(_SPLIT):
            raise H3WeightsError(f"{target}attn: to_q/to_k/to_v incomplete ({sorted(parts)}), cannot fuse qkv_proj")
        out[target + _QKV] = fuse_qkv(*(parts[name] for name in _SPLIT), heads, head_dim, layout)
    if unexpected:
        raise H3WeightsError(f"not MiniMaxH3Transformer3DModel weights: {sorted(unexpected)[:5]}")
    out[ROPE_KEY] = rope_inv_freq(config) if inv_freq is None else inv_freq
    return out


# Native partitions' config.json uses the reference (sglang) argument names for some fields.
NATIVE_CONFIG_NAMES = {
    "token_refiner_num_layers": "num_refiner_layers",
    "ffn_hidden_size": "ffn_dim",
    "latents_dim": "in_channels",
    "audio_latents_dim": "audio_in_channels",
    "timestep_input_dim": "freq_dim",
    "time_embed_hidden_size": "time_embed_hidden_dim",
    "rope_inv_freq_len": "rope_freq_dim",
}


def stated_config(raw: dict) -> dict:
    """A checkpoint's own config in diffusers argument names (native names translated)."""
    return {NATIVE_CONFIG_NAMES.get(key, key): value for key, value in raw.items()}


def derive_config(shapes: dict, naming: str, stated: dict | None, source: str) -> dict:
    """Config from tensor shapes (+ what the checkpoint states for the rest), diffusers names."""
    ref = naming != "diffusers"
    n = {  # the few names derivation reads, in either naming
        "video_in": "video_patch_proj.weight" if ref else "proj_in.weight",
        "audio_in": "audio_patch_proj.weight" if ref else "audio_proj_in.weight",
        "text_in": "condition_proj.weight" if ref else "context_embedder.weight",
        "t_in": "time_embedder.proj_in.weight" if ref else "time_embedder.linear_1.weight",
        "t_out": "time_embedder.proj_out.weight" if ref else "time_embedder.linear_2.weight",
        "q_norm": "blocks.0.attn.q_norm.weight" if ref else "transformer_blocks.0.attn.norm_q.weight",
        "fc1": "blocks.0.mlp.fc1.weight" if ref else "transformer_blocks.0.ff.net.0.proj.weight",
        "blocks": r"blocks\.(\d+)\." if ref else r"transformer_blocks\.(\d+)\.",
        "refiner": r"token_refiner\.blocks\.(\d+)\." if ref else r"token_refiner\.refiner_blocks\.(\d+)\.",
    }
    missing = [
        n[k] for k in ("video_in", "audio_in", "text_in", "t_in", "t_out", "q_norm", "fc1") if n[k] not in shapes
    ]
    if missing:
        raise H3WeightsError(f"{source}: not a complete MiniMax-H3 DiT, missing {missing}")
    stated = stated or {}
    patch = stated.get("patch_size", configs.RELEASE_TRANSFORMER["patch_size"])
    patch_volume = patch[0] * patch[1] * patch[2]
    hidden, video_dim = shapes[n["video_in"]]
    if video_dim % patch_volume:
        raise H3WeightsError(f"{source}: video patch width {video_dim} is not channels x patch {patch}")
    head_dim = shapes[n["q_norm"]][0]
    if ref:
        qkv_rows = shapes["blocks.0.attn.qkv_proj.weight"][0]
    else:
        qkv_rows = 3 * shapes["transformer_blocks.0.attn.to_q.weight"][0]
    if qkv_rows % (3 * head_dim):
        raise H3WeightsError(f"{source}: qkv rows {qkv_rows} are not 3 x heads x head_dim {head_dim}")
    derived = {
        "hidden_size": hidden,
        "in_channels": video_dim // patch_volume,
        "audio_in_channels": shapes[n["audio_in"]][1],
        "text_dim": shapes[n["text_in"]][1],
        "freq_dim": shapes[n["t_in"]][1],
        "time_embed_hidden_dim": shapes[n["t_in"]][0],
        "time_embed_dim": shapes[n["t_out"]][0],
        "attention_head_dim": head_dim,
        "num_attention_heads": qkv_rows // (3 * head_dim),
        "num_layers": count_indices(shapes, n["blocks"]),
        "num_refiner_layers": count_indices(shapes, n["refiner"]),
        "ffn_dim": shapes[n["fc1"]][0] // 2,
    }
    if ROPE_KEY in shapes:
        derived["rope_freq_dim"] = shapes[ROPE_KEY][0]
    return config_merge.merge(configs.get("transformer", tiny=False), stated, derived, source)


# --- the handler ---------------------------------------------------------------------------------

# Detection markers (the reference names' refiner QKV, and diffusers' single-file detector key).
REFERENCE_MARKERS = ("token_refiner.blocks.0.attn.qkv_proj.weight", "video_patch_proj.weight")
DIFFUSERS_MARKERS = ("token_refiner.refiner_blocks.0.attn.to_q.weight", "proj_in.weight", "audio_proj_in.weight")


def _naming(layout: str) -> str:
    """Comfy files stack q/k/v, native shards interleave them per head: the layout decides."""
    return "comfy" if layout == "comfyui" else "native"


def _to_model(tensors: dict, config: dict, family: str, layout: str):
    if family == "diffusers":
        return dict(tensors), []
    return to_diffusers(tensors, config, _naming(layout))


def _from_model(state: dict, config: dict, family: str, layout: str) -> dict:
    return dict(state) if family == "diffusers" else from_diffusers(state, config, _naming(layout))


def _derive(shapes: dict, family: str, stated: dict, where: str) -> dict:
    return derive_config(shapes, "diffusers" if family == "diffusers" else "reference", stated, where)


def _notes(keys, family: str) -> tuple[str, ...]:
    return ("stores rope.inv_freq (checked against rope_theta at load)",) if ROPE_KEY in keys else ()


def _load_single_file(det, config: dict):
    """Through diffusers' own single-file loader, with a local config folder (never the hub)."""
    from diffusers import MiniMaxH3Transformer3DModel

    with tempfile.TemporaryDirectory(prefix="h3-dit-config-") as config_dir:
        write_json(os.path.join(config_dir, "config.json"), {"_class_name": "MiniMaxH3Transformer3DModel", **config})
        model = MiniMaxH3Transformer3DModel.from_single_file(
            det.path, config=config_dir, local_files_only=True, torch_dtype=None
        )
    # from_single_file's low-memory path leaves absent weights on `meta` instead of failing.
    leftover = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise H3WeightsError(f"{det.path}: diffusers' single-file loader left weights unloaded: {leftover[:5]}")
    return model


def _check_rope(det, model, dtype) -> None:
    """The stored `rope.inv_freq` must equal what diffusers recomputes from `rope_theta`:
    diffusers drops the stored table, so a different table would be silently ignored."""
    if ROPE_KEY not in det.header.tensors:
        return
    stored = load_tensors(det.header, {ROPE_KEY})[ROPE_KEY]
    computed = model.rope.inv_freq
    if stored.shape != computed.shape or not torch.equal(stored.to(torch.float32), computed.to(torch.float32)):
        raise H3WeightsError(
            f"{det.path}: rope.inv_freq does not equal 1/rope_theta^(2i/{2 * computed.numel()}) for "
            f"rope_theta={model.config.rope_theta}; MiniMaxH3Transformer3DModel recomputes that table and "
            "cannot carry a different one"
        )


HANDLER = ComponentHandler(
    name="transformer",
    label="DiT",
    model_class="MiniMaxH3Transformer3DModel",
    library="diffusers",
    folders=("transformer", "transformer_ref"),
    families=(
        KeyFamily("reference", REFERENCE_MARKERS, comfy=True, native=True),
        KeyFamily("diffusers", DIFFUSERS_MARKERS),
    ),
    derive_config=_derive,
    to_model=_to_model,
    from_model=_from_model,
    stated_config=lambda stated, source: stated_config(stated),
    notes=_notes,
    load_single_file=_load_single_file,
    after_load=_check_rope,
    partitioned=True,
)
