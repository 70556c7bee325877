"""Write diffusers / transformers modules out in the published layouts.

Used to produce the embedded tiny H3's ComfyUI single files, so every writer is deterministic:
keys sorted (the header is serialised by `safetensors_io`), tensors contiguous, and metadata fixed (`format`, the
component name and the full
config as sorted JSON under `h3.config`). The config metadata lets a non-release model (the tiny
one) round-trip through the Comfy layout, whose shapes alone cannot say e.g. how a fused QKV splits
into heads; ComfyUI core hard-codes the release numbers and simply ignores it.
"""

from __future__ import annotations

import json
import os

from .. import facts
from . import audio_vae_keys, config_merge, text_encoder_keys, transformer_keys, video_vae_keys
from .errors import H3WeightsError
from .safetensors_io import write_file, write_json, write_sharded
from .sources import partition_token


def _init_config(model) -> dict:
    """A diffusers model's constructor arguments (bookkeeping `_...` entries dropped)."""
    return {k: v for k, v in dict(model.config).items() if not k.startswith("_")}


def _require(model, class_name: str) -> None:
    if type(model).__name__ != class_name:
        raise H3WeightsError(f"expected a {class_name}, got {type(model).__name__}")


def save_comfy_transformer(model, path: str) -> None:
    """`MiniMaxH3Transformer3DModel` -> Comfy-Org single file (stacked QKV, `[gate; value]` fc1,
    `rope.inv_freq`), dtypes as they are in the model."""
    _require(model, "MiniMaxH3Transformer3DModel")
    config = _init_config(model)
    tensors = transformer_keys.from_diffusers(model.state_dict(), config, "comfy", inv_freq=model.rope.inv_freq)
    write_file(path, tensors, config_merge.config_metadata("transformer", config))


# Reference (sglang) names the native partitions use in transformer/config.json.
_DIFFUSERS_TO_NATIVE = {v: k for k, v in transformer_keys.NATIVE_CONFIG_NAMES.items()}
_NATIVE_PARTITIONS = {"fl2va": ("FL2VA", ["t2va", "fl2va"]), "ref2va": ("Ref2VA", ["ref2va"])}


def _native_model_index(root: str, partition: str) -> None:
    """Create (or confirm) the partition's model_index.json `_minimax_h3` block."""
    name, tasks = _NATIVE_PARTITIONS[partition]
    path = os.path.join(root, "model_index.json")
    index = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            index = json.load(handle)
        stated = str((index.get("_minimax_h3") or {}).get("partition", "")).lower()
        if stated and stated != partition:
            raise H3WeightsError(f"{path} declares partition {stated!r}, not {partition!r}")
    index.setdefault(
        "_minimax_h3",
        {
            "partition": name,
            "tasks": tasks,
            "sigma_shift_scales": {"video": facts.VIDEO_SHIFT, "audio": facts.AUDIO_SHIFT},
        },
    )
    index.setdefault("scheduler", None)
    write_json(path, index)


def save_native_transformer(
    model, directory: str, partition: str | None = None, max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    """`MiniMaxH3Transformer3DModel` -> the DiT of a native MiniMaxAI partition.

    `directory` is the partition root (`FL2VA/` or `Ref2VA/`; `partition` defaults to the token in
    its name). Writes `transformer/` (per-head interleaved QKV, `model-0000i-of-0000n.safetensors`
    shards + index, config.json in the native argument names) and the root's model_index.json
    `_minimax_h3` block. Returns the shard paths.
    """
    _require(model, "MiniMaxH3Transformer3DModel")
    partition = (partition or partition_token(os.path.basename(os.path.normpath(directory))) or "").lower()
    if partition not in _NATIVE_PARTITIONS:
        raise H3WeightsError(
            f"cannot tell the partition of {directory}: name the folder FL2VA or Ref2VA, "
            "or pass partition='fl2va'/'ref2va'"
        )
    config = _init_config(model)
    tensors = transformer_keys.from_diffusers(model.state_dict(), config, "native", inv_freq=model.rope.inv_freq)
    folder = os.path.join(directory, "transformer")
    files = write_sharded(
        folder, tensors, config_merge.config_metadata("transformer", config), "model", max_shard_bytes
    )
    write_json(os.path.join(folder, "config.json"), {_DIFFUSERS_TO_NATIVE.get(k, k): v for k, v in config.items()})
    _native_model_index(os.fspath(directory), partition)
    return files


def save_comfy_video_vae(model, path: str) -> None:
    """`AutoencoderKLMiniMaxH3` -> Comfy-Org file (fused interleaved `to_qkv`, `ff.w1/w2`,
    `decoder.x_embedder`, zero `mask_token`, `latents_mean/std` buffers from the config)."""
    _require(model, "AutoencoderKLMiniMaxH3")
    config = _init_config(model)
    tensors = video_vae_keys.from_diffusers(model.state_dict(), config, with_latent_stats=True)
    # The metadata tag is the file's own name for the component (as in native partitions' video_vae/),
    # kept so that the files this writes stay byte-identical; nothing reads it back.
    write_file(path, tensors, config_merge.config_metadata("video_vae", config))


def save_comfy_audio_vae(model, path: str) -> None:
    """`AutoencoderKLMiniMaxH3Audio` -> Comfy-Org file: weight norm folded exactly as the forward
    computes it (or taken as is if already removed), `latents_mean/std` buffers from the config."""
    _require(model, "AutoencoderKLMiniMaxH3Audio")
    config = _init_config(model)
    tensors = audio_vae_keys.from_diffusers(model.state_dict(), config)
    write_file(path, tensors, config_merge.config_metadata("audio_vae", config))


def _text_config_for_metadata(model, num_layers: int) -> dict:
    """The Qwen config restricted to the fields this package reads back, with the written depth."""
    from .. import configs

    release = configs.get("text_encoder", tiny=False)
    full = model.config.to_dict()
    text = {k: full["text_config"][k] for k in release["text_config"] if k in full["text_config"]}
    vision = {k: full["vision_config"][k] for k in release["vision_config"] if k in full["vision_config"]}
    text["num_hidden_layers"] = num_layers
    # `tie_word_embeddings` is left out: a Comfy file has no head to tie, and the flag would only
    # make the bytes depend on whether the source model had one.
    skipped = ("text_config", "vision_config", "tie_word_embeddings")
    top = {k: full[k] for k in release if k not in skipped and k in full}
    return {**top, "text_config": text, "vision_config": vision}


def save_comfy_text_encoder(model, path: str, num_layers: int = facts.TEXT_ENCODER_LAYER) -> None:
    """`Qwen3VLForConditionalGeneration` -> Comfy-Org file: `model.layers.{0..num_layers-1}`,
    `model.embed_tokens`, `visual.*`; no final norm, no lm_head."""
    from . import qwen_h3  # imports transformers' Qwen3-VL modelling; only needed here

    _require(model, "Qwen3VLForConditionalGeneration")
    available = qwen_h3.real_layer_count(model)
    if num_layers > available:
        raise H3WeightsError(f"cannot write {num_layers} decoder layers from a model that has {available}")
    state = {k: v for k, v in model.state_dict().items()}
    tensors = text_encoder_keys.from_transformers(state, num_layers)
    write_file(
        path, tensors, config_merge.config_metadata("text_encoder", _text_config_for_metadata(model, num_layers))
    )


__all__ = [
    "save_comfy_audio_vae",
    "save_comfy_text_encoder",
    "save_comfy_transformer",
    "save_comfy_video_vae",
    "save_native_transformer",
]
