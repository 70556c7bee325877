"""Text encoder keys: transformers `Qwen3VLForConditionalGeneration` <-> Comfy-Org file.

transformers 5 names the language model `model.language_model.*` and the tower `model.visual.*`,
with a final `model.language_model.norm` and an `lm_head`. The Comfy file (and the older Hugging
Face Qwen-VL layout it descends from) uses `model.layers.N.*`, `model.embed_tokens`, `visual.*`
with the same sub-names under `visual.` (ComfyUI's Qwen3-VL tower mirrors the HF module tree,
`deepstack_merger_list` included). The Comfy file keeps only the first 50 decoder layers and has
neither the final norm nor an lm_head: H3 reads the residual stream after layer 50, before any norm.
The legacy spelling of norm/lm_head (`model.norm`, `lm_head`) is accepted on input so that a full
legacy-layout Qwen checkpoint converts too.
"""

from __future__ import annotations

import re

from .. import configs, facts
from . import config_merge
from .errors import H3WeightsError
from .keymap import ComponentHandler, KeyFamily, count_indices, rename

_TO_TRANSFORMERS = [
    (re.compile(r"model\.embed_tokens\.(.+)"), r"model.language_model.embed_tokens.\1"),
    (re.compile(r"model\.layers\.(\d+)\.(.+)"), r"model.language_model.layers.\1.\2"),
    (re.compile(r"model\.norm\.(.+)"), r"model.language_model.norm.\1"),
    (re.compile(r"visual\.(.+)"), r"model.visual.\1"),
    (re.compile(r"lm_head\.(.+)"), r"lm_head.\1"),
]
_LAYER = re.compile(r"model\.language_model\.layers\.(\d+)\.(.+)")
_FROM_TRANSFORMERS = [
    (re.compile(r"model\.language_model\.embed_tokens\.(.+)"), r"model.embed_tokens.\1"),
    (re.compile(r"model\.visual\.(.+)"), r"visual.\1"),
]


def to_transformers(state: dict) -> tuple[dict, list[str]]:
    """Comfy/legacy names -> transformers 5 names. Returns (converted, unexpected keys)."""
    out, unexpected = {}, []
    for key, tensor in state.items():
        new_key = rename(key, _TO_TRANSFORMERS)
        if new_key is None:
            unexpected.append(key)
        else:
            out[new_key] = tensor
    return out, unexpected


def from_transformers(state: dict, num_layers: int) -> dict:
    """transformers names -> Comfy file: first `num_layers` decoder layers, no final norm, no lm_head."""
    out, layers_seen = {}, set()
    for key, tensor in state.items():
        match = _LAYER.fullmatch(key)
        if match:
            index, rest = int(match.group(1)), match.group(2)
            if index < num_layers:
                out[f"model.layers.{index}.{rest}"] = tensor
                layers_seen.add(index)
            continue
        if key.startswith("model.language_model.norm.") or key.startswith("lm_head."):
            continue
        new_key = rename(key, _FROM_TRANSFORMERS)
        if new_key is None:
            raise H3WeightsError(f"not a Qwen3VLForConditionalGeneration weight: {key}")
        out[new_key] = tensor
    if layers_seen != set(range(num_layers)):
        raise H3WeightsError(
            f"the text encoder has decoder layers {sorted(layers_seen)[:3]}...{sorted(layers_seen)[-3:]}, "
            f"fewer than the {num_layers} a Comfy file keeps"
        )
    return out


def derive_config(shapes: dict, naming: str, stated: dict | None, source: str) -> dict:
    """Qwen3-VL config (nested text/vision dicts) from shapes plus stated/release values.

    Not visible in shapes: rope (theta, mrope sections), norm eps, the vision tower's head count
    and its DeepStack layer indexes (only their number is) - these come from the stated config or
    the release values.
    """
    lm = "model.layers." if naming == "comfy" else "model.language_model.layers."
    embed = "model.embed_tokens.weight" if naming == "comfy" else "model.language_model.embed_tokens.weight"
    vis = "visual." if naming == "comfy" else "model.visual."
    needed = [
        embed,
        f"{lm}0.self_attn.q_proj.weight",
        f"{lm}0.self_attn.q_norm.weight",
        f"{vis}patch_embed.proj.weight",
    ]
    missing = [key for key in needed if key not in shapes]
    if missing:
        raise H3WeightsError(f"{source}: not a complete Qwen3-VL text encoder, missing {missing}")
    stated = stated or {}
    release = configs.get("text_encoder", tiny=False)
    vocab, hidden = shapes[embed]
    head_dim = shapes[f"{lm}0.self_attn.q_norm.weight"][0]
    text_derived = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": count_indices(shapes, re.escape(lm) + r"(\d+)\."),
        "head_dim": head_dim,
        "num_attention_heads": shapes[f"{lm}0.self_attn.q_proj.weight"][0] // head_dim,
        "num_key_value_heads": shapes[f"{lm}0.self_attn.k_proj.weight"][0] // head_dim,
        "intermediate_size": shapes[f"{lm}0.mlp.gate_proj.weight"][0],
        "attention_bias": f"{lm}0.self_attn.q_proj.bias" in shapes,
    }
    v_hidden, in_ch, t_patch, patch, _ = shapes[f"{vis}patch_embed.proj.weight"]
    merge_dim = shapes[f"{vis}merger.linear_fc1.weight"][1]
    n_deepstack = count_indices(shapes, re.escape(vis) + r"deepstack_merger_list\.(\d+)\.")
    vision_derived = {
        "depth": count_indices(shapes, re.escape(vis) + r"blocks\.(\d+)\."),
        "hidden_size": v_hidden,
        "in_channels": in_ch,
        "temporal_patch_size": t_patch,
        "patch_size": patch,
        "intermediate_size": shapes[f"{vis}blocks.0.mlp.linear_fc1.weight"][0],
        "spatial_merge_size": round((merge_dim // v_hidden) ** 0.5),
        "out_hidden_size": shapes[f"{vis}merger.linear_fc2.weight"][0],
        "num_position_embeddings": shapes[f"{vis}pos_embed.weight"][0],
    }
    text = config_merge.merge(release["text_config"], stated.get("text_config", {}), text_derived, source)
    vision = config_merge.merge(release["vision_config"], stated.get("vision_config", {}), vision_derived, source)
    if len(vision["deepstack_visual_indexes"]) != n_deepstack:
        raise H3WeightsError(
            f"{source}: {n_deepstack} DeepStack mergers but deepstack_visual_indexes "
            f"{vision['deepstack_visual_indexes']}; the checkpoint must state the indexes"
        )
    top = {k: v for k, v in release.items() if k not in ("text_config", "vision_config")}
    top = config_merge.merge(
        top, {k: v for k, v in stated.items() if k not in ("text_config", "vision_config")}, {}, source
    )
    return {**top, "text_config": text, "vision_config": vision}


# --- the handler ---------------------------------------------------------------------------------

COMFY_MARKERS = ("model.layers.0.self_attn.q_proj.weight", "visual.patch_embed.proj.weight")
TRANSFORMERS_MARKERS = ("model.language_model.layers.0.self_attn.q_proj.weight", "model.visual.patch_embed.proj.weight")
_LAYER_PREFIX = {"legacy": "model.layers.", "transformers": "model.language_model.layers."}


def layer_count(keys, family: str) -> int:
    return count_indices(keys, re.escape(_LAYER_PREFIX[family]) + r"(\d+)\.")


def has_final_norm(keys) -> bool:
    return any(key.startswith(("model.norm.", "model.language_model.norm.")) for key in keys)


def _notes(keys, family: str) -> tuple[str, ...]:
    norm = "with" if has_final_norm(keys) else "without"
    return (f"{layer_count(keys, family)} decoder layers, {norm} final norm",)


def _build(cls, det, config: dict):
    """A file without its final norm is the truncated H3 conditioner (the Comfy file): it becomes
    the H3 arrangement of `qwen_h3`; a complete stack is built as it is, ties included."""
    from accelerate import init_empty_weights
    from transformers import Qwen3VLConfig

    from . import qwen_h3  # imports transformers' Qwen3-VL modelling; only needed for models

    own = det.source.config if det.source is not None else {}
    # The folder's own config.json when it has one (every field kept), else the derived dict.
    qconfig = Qwen3VLConfig.from_dict(own) if own.get("model_type") == "qwen3_vl" else Qwen3VLConfig(**config)
    if has_final_norm(det.header.tensors):
        with init_empty_weights(include_buffers=False):
            model = cls(qconfig)
        # accelerate's meta-init re-creates every registered parameter, which unties shared ones;
        # tying again outside the context restores the aliases (e.g. lm_head = embed_tokens).
        model.tie_weights()
        return model
    layers = layer_count(det.header.tensors, det.key_format)
    if layers < facts.TEXT_ENCODER_LAYER:
        raise H3WeightsError(
            f"{det.path}: H3 reads the residual stream after decoder layer {facts.TEXT_ENCODER_LAYER}, "
            f"but this truncated text encoder has only {layers} layers"
        )
    with init_empty_weights(include_buffers=False):
        model = cls(qwen_h3.arrangement_config(qconfig, layers))
        qwen_h3.apply_arrangement(model, layers)
    return model


def _to_model(tensors: dict, config: dict, family: str, layout: str):
    return to_transformers(tensors) if family == "legacy" else (dict(tensors), [])


def _from_model(state: dict, config: dict, family: str, layout: str) -> dict:
    if family != "legacy":
        return dict(state)
    return from_transformers(state, layer_count(state, "transformers"))


def _set_dtype(det, model, dtype) -> None:
    model.config.dtype = dtype


HANDLER = ComponentHandler(
    name="text_encoder",
    label="text encoder",
    model_class="Qwen3VLForConditionalGeneration",
    library="transformers",
    folders=("text_encoder",),
    families=(
        KeyFamily("legacy", COMFY_MARKERS, comfy=True, native=True),
        KeyFamily("transformers", TRANSFORMERS_MARKERS),
    ),
    derive_config=lambda shapes, family, stated, where: derive_config(
        shapes, "comfy" if family == "legacy" else "transformers", stated, where
    ),
    to_model=_to_model,
    from_model=_from_model,
    notes=_notes,
    build=_build,
    after_load=_set_dtype,
)
