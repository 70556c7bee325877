"""Per-component dispatch: config resolution, key conversion and empty (meta) model building.

Everything that differs between the four components and their layouts is routed from here, so
`check` (meta tensors from headers) and the loaders (real tensors) share one conversion path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import audio_vae_keys, config_merge, text_encoder_keys, transformer_keys, video_vae_keys
from .detect import Detection
from .errors import H3WeightsError


def _public(config: dict) -> dict:
    """Drop bookkeeping entries (`_class_name`, `_diffusers_version`, ...)."""
    return {k: v for k, v in (config or {}).items() if not k.startswith("_")}


def _native_audio_config(kwargs: dict, config: dict) -> dict:
    """Native `audio_vae/metadata.json` kwargs + `config.json` -> diffusers argument names
    (the translation diffusers' conversion script applies)."""
    stated = {}
    renames = {
        "encoder_dim": "encoder_dim",
        "encoder_rates": "encoder_rates",
        "latent_dim": "latent_dim",
        "decoder_dim": "decoder_dim",
        "decoder_rates": "decoder_rates",
        "vae_latent_channels": "latent_channels",
        "sample_rate": "sampling_rate",
    }
    for native, name in renames.items():
        if native in kwargs:
            stated[name] = kwargs[native]
    if "sample_rate" in config:
        stated["sampling_rate"] = config["sample_rate"]
    for key in ("latent_channels", "latents_mean", "latents_std"):
        if key in config:
            stated[key] = config[key]
    return stated


def resolve_config(det: Detection) -> dict:
    """The component's config (diffusers / transformers argument names) for this checkpoint."""
    shapes = det.header.shapes
    source = det.source
    stated = {**_public(source.config), **config_merge.metadata_config(det.header.metadata)}
    where = det.path
    if det.component == "transformer":
        naming = "diffusers" if det.key_format == "diffusers" else "reference"
        return transformer_keys.derive_config(shapes, naming, transformer_keys.stated_config(stated), where)
    if det.component == "video_vae":
        naming = "diffusers" if det.key_format == "diffusers" else "reference"
        return video_vae_keys.derive_config(shapes, naming, stated, where)
    if det.component == "audio_vae":
        if source.extra_config:
            stated = {**_native_audio_config(source.extra_config, source.config), **stated}
        return audio_vae_keys.derive_config(shapes, stated, where)
    naming = "comfy" if det.key_format == "legacy" else "transformers"
    return text_encoder_keys.derive_config(shapes, naming, stated, where)


def to_model_names(det: Detection, tensors: dict, config: dict) -> tuple[dict, list[str]]:
    """File tensors -> the model's own state-dict names. Returns (converted, unexpected keys)."""
    if det.component == "transformer":
        if det.key_format == "diffusers":
            return dict(tensors), []
        naming = "comfy" if det.layout == "comfy" else "native"
        return transformer_keys.to_diffusers(tensors, config, naming)
    if det.component == "video_vae":
        if det.key_format == "diffusers":
            return dict(tensors), []
        return video_vae_keys.to_diffusers(tensors, config)
    if det.component == "audio_vae":
        return audio_vae_keys.to_diffusers(tensors)
    if det.key_format == "legacy":
        return text_encoder_keys.to_transformers(tensors)
    return dict(tensors), []


def text_layer_count(det: Detection) -> int:
    prefix = "model.layers." if det.key_format == "legacy" else "model.language_model.layers."
    return len({k[len(prefix):].split(".", 1)[0] for k in det.header.tensors if k.startswith(prefix)})


def text_has_final_norm(det: Detection) -> bool:
    return any(k.startswith(("model.norm.", "model.language_model.norm.")) for k in det.header.tensors)


def needs_h3_arrangement(det: Detection) -> bool:
    """A text encoder without its final norm is the truncated H3 conditioner (the Comfy file)."""
    return det.component == "text_encoder" and not text_has_final_norm(det)


def qwen_config(det: Detection, config: dict):
    """A transformers `Qwen3VLConfig`: the folder's own config.json when it has one (every field
    kept), else the derived dict."""
    from transformers import Qwen3VLConfig

    own = det.source.config if det.source is not None else {}
    if own.get("model_type") == "qwen3_vl":
        return Qwen3VLConfig.from_dict(own)
    return Qwen3VLConfig(**config)


MODEL_CLASSES = {
    "transformer": "MiniMaxH3Transformer3DModel",
    "video_vae": "AutoencoderKLMiniMaxH3",
    "audio_vae": "AutoencoderKLMiniMaxH3Audio",
    "text_encoder": "Qwen3VLForConditionalGeneration",
}


def model_class(component: str):
    if component == "text_encoder":
        import transformers

        return getattr(transformers, MODEL_CLASSES[component])
    import diffusers

    return getattr(diffusers, MODEL_CLASSES[component])


def remove_weight_norm(module: torch.nn.Module) -> None:
    """Turn every weight-normed conv of a module into a plain one (in place)."""
    # `torch.nn.utils.weight_norm` is also the name of a function; import from the module itself.
    from torch.nn.utils.weight_norm import WeightNorm, remove_weight_norm as remove

    for sub in module.modules():
        for hook in list(sub._forward_pre_hooks.values()):
            if isinstance(hook, WeightNorm):
                remove(sub, hook.name)


def empty_model(det: Detection, config: dict) -> torch.nn.Module:
    """The target model with meta parameters (real non-persistent buffers), ready to be assigned."""
    from accelerate import init_empty_weights

    from . import qwen_h3  # imports transformers' Qwen3-VL modelling; only needed for models

    cls = model_class(det.component)
    tie_after = False
    with init_empty_weights(include_buffers=False):
        if det.component == "text_encoder":
            qconfig = qwen_config(det, config)
            if needs_h3_arrangement(det):
                layers = text_layer_count(det)
                if layers < qwen_h3.H3_TEXT_ENCODER_LAYER:
                    raise H3WeightsError(
                        f"{det.path}: H3 reads the residual stream after decoder layer "
                        f"{qwen_h3.H3_TEXT_ENCODER_LAYER}, but this truncated text encoder has only {layers} layers"
                    )
                model = cls(qwen_h3.arrangement_config(qconfig, layers))
                qwen_h3.apply_arrangement(model, layers)
            else:
                model = cls(qconfig)
                tie_after = True
        else:
            model = cls.from_config(config)
            if det.component == "audio_vae" and det.key_format == "folded":
                remove_weight_norm(model)
    if tie_after:
        # accelerate's meta-init re-creates every registered parameter, which unties shared ones;
        # tying again outside the context restores the aliases (e.g. lm_head = embed_tokens).
        model.tie_weights()
    return model


@dataclass(frozen=True)
class ExpectedKeys:
    """What a model's state dict needs: required names with shapes, plus tolerated aliases."""

    shapes: dict
    aliases: dict  # alias name -> the required name it shares storage with (tied weights)


def expected_keys(model: torch.nn.Module) -> ExpectedKeys:
    shapes, aliases, first_name = {}, {}, {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        owner = first_name.setdefault(id(tensor), name)
        if owner != name:
            aliases[name] = owner
        else:
            shapes[name] = tuple(tensor.shape)
    return ExpectedKeys(shapes=shapes, aliases=aliases)
