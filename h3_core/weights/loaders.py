"""Load ready-to-run diffusers / transformers modules from any published H3 layout.

Every loader: detect (refuses pruned / quantised), resolve the config, run the header-only check
(so a wrong file fails in seconds with a precise key list, before any weight is read), then load.
The Comfy-Org DiT goes through diffusers' own `from_single_file` with a local config derived from
its shapes (no hub access); everything else is converted here and assigned into a model built on
the meta device. dtype follows diffusers' rule (see dtype_policy): the default float32 gives
exact weights; lower dtypes keep each class's `_keep_in_fp32_modules` in float32.
"""

from __future__ import annotations

import os
import tempfile

import torch

from . import audio_vae_keys, components, dtype_policy, transformer_keys, video_vae_keys
from .check import check_detection
from .detect import Detection, detect, scan
from .errors import H3WeightsError
from .safetensors_io import load_tensors, write_json
from .sources import component_paths


def _resolve(path, component: str, partition: str | None = None) -> Detection:
    """The one `component` at `path` (a file, a component folder, or any root `scan` understands:
    diffusers root, native partition(s), ComfyUI models folder)."""
    path = os.fspath(path)
    wanted_partition = {"t2va": "fl2va"}.get(partition, partition)
    targets = component_paths(path)
    if len(targets) == 1 and targets[0] == path:
        det = detect(path)
        if det.component != component:
            raise H3WeightsError(f"{det.path} holds a {det.component}, not a {component}")
    else:
        found, problems = [], []
        for item in scan(path):
            if isinstance(item, Detection):
                if item.component == component:
                    found.append(item)
            else:
                problems.append(f"{os.path.basename(item.path)}: {item}")
        if wanted_partition is not None and len(found) > 1:
            found = [d for d in found if d.partition in (wanted_partition, None)]
        if not found:
            detail = f"; problems: {' | '.join(problems)}" if problems else ""
            raise H3WeightsError(f"{path}: no usable {component} found{detail}")
        if len(found) > 1:
            choices = sorted(f"{os.path.basename(d.path)} ({d.partition or d.layout})" for d in found)
            hint = " pass partition='fl2va' or 'ref2va'," if component == "transformer" else ""
            raise H3WeightsError(f"{path} holds several {component}s {choices};{hint} or point at one of them")
        det = found[0]
    if wanted_partition is not None and det.partition is not None and det.partition != wanted_partition:
        raise H3WeightsError(f"{det.path} is the {det.partition} DiT partition, not {partition}")
    return det


def _checked(det: Detection):
    """Header-only check first: a wrong file fails in seconds, before any weight is read.
    Returns the check result (its config, and the meta model to assign into)."""
    result = check_detection(det)
    result.raise_if_failed()
    return result


def _assign(model: torch.nn.Module, det: Detection, converted: dict, dtype: torch.dtype) -> torch.nn.Module:
    """Assign converted tensors into a meta-built model: strict, no copies beyond the dtype cast."""
    keep = getattr(type(model), "_keep_in_fp32_modules", None)
    state = dtype_policy.cast_state_dict(converted, dtype, keep)
    expected = components.expected_keys(model)
    for alias, owner in expected.aliases.items():
        state.setdefault(alias, state[owner])  # tied weights saved once
    model.load_state_dict(state, strict=True, assign=True)
    leftover = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise H3WeightsError(f"{det.path}: parameters left unloaded: {leftover[:5]}")
    if expected.aliases and hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()


def _load_generic(det: Detection, checked, dtype: torch.dtype) -> torch.nn.Module:
    """Read every tensor, convert the names, assign into the check's meta model."""
    tensors = load_tensors(det.header)
    converted, unexpected = components.to_model_names(det, tensors, checked.config)
    if unexpected:  # already excluded by the check; kept as a guard for future converters
        raise H3WeightsError(f"{det.path}: unexpected tensors {unexpected[:5]}")
    return _assign(checked.model, det, converted, dtype)


def _latent_stats(det: Detection, keys, read) -> dict:
    """`latents_mean` / `latents_std` buffers of a Comfy VAE file, as config values. A config.json
    that states other values is a contradiction, not a preference."""
    present = set(keys) & set(det.header.tensors)
    if not present:
        return {}
    stats = read(load_tensors(det.header, present))
    for key, values in stats.items():
        stated = det.source.config.get(key)
        if stated is not None and [float(v) for v in stated] != values:
            raise H3WeightsError(f"{det.path}: {key} in config.json differs from the file's {key} buffer")
    return stats


def _check_rope(det: Detection, model) -> None:
    """The stored `rope.inv_freq` must equal what diffusers recomputes from `rope_theta`:
    diffusers drops the stored table, so a different table would be silently ignored."""
    if transformer_keys.ROPE_KEY not in det.header.tensors:
        return
    stored = load_tensors(det.header, {transformer_keys.ROPE_KEY})[transformer_keys.ROPE_KEY]
    computed = model.rope.inv_freq
    if stored.shape != computed.shape or not torch.equal(stored.to(torch.float32), computed.to(torch.float32)):
        raise H3WeightsError(
            f"{det.path}: rope.inv_freq does not equal 1/rope_theta^(2i/{2 * computed.numel()}) for "
            f"rope_theta={model.config.rope_theta}; MiniMaxH3Transformer3DModel recomputes that table and "
            "cannot carry a different one"
        )


def _load_comfy_transformer(det: Detection, config: dict, dtype: torch.dtype):
    """Through diffusers' single-file loader, with a local config folder (never the hub)."""
    from diffusers import MiniMaxH3Transformer3DModel

    with tempfile.TemporaryDirectory(prefix="h3-dit-config-") as config_dir:
        write_json(
            os.path.join(config_dir, "config.json"),
            {"_class_name": "MiniMaxH3Transformer3DModel", **config},
        )
        model = MiniMaxH3Transformer3DModel.from_single_file(
            det.path, config=config_dir, local_files_only=True, torch_dtype=None
        )
    # from_single_file's low-memory path leaves absent weights on `meta` instead of failing.
    leftover = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise H3WeightsError(f"{det.path}: diffusers' single-file loader left weights unloaded: {leftover[:5]}")
    dtype_policy.apply_to_module(model, dtype, MiniMaxH3Transformer3DModel._keep_in_fp32_modules)
    return model.eval()


def load_transformer(path, dtype: torch.dtype = torch.float32, partition: str | None = None):
    """`MiniMaxH3Transformer3DModel` from a Comfy-Org file, a native partition (root or
    `transformer/`), or a diffusers folder / root (`partition` picks `transformer` or `transformer_ref`)."""
    det = _resolve(path, "transformer", partition)
    checked = _checked(det)
    if det.layout == "comfy":
        model = _load_comfy_transformer(det, checked.config, dtype)
    else:
        model = _load_generic(det, checked, dtype)
    _check_rope(det, model)
    return model


def load_video_vae(path, dtype: torch.dtype = torch.float32):
    """`AutoencoderKLMiniMaxH3`; the Comfy file's `latents_mean/std` buffers become its config."""
    det = _resolve(path, "video_vae")
    checked = _checked(det)
    stats = _latent_stats(det, video_vae_keys.LATENT_STAT_KEYS, video_vae_keys.latent_stats)
    model = _load_generic(det, checked, dtype)
    if stats:
        model.register_to_config(**stats)
    return model


def load_audio_vae(path, dtype: torch.dtype = torch.float32):
    """`AutoencoderKLMiniMaxH3Audio`. A folded (Comfy) file loads into a model whose weight norm
    is removed, which is bit-exact with the weight-normed model it was folded from."""
    det = _resolve(path, "audio_vae")
    checked = _checked(det)
    stats = _latent_stats(det, audio_vae_keys.LATENT_STAT_KEYS, audio_vae_keys.latent_stats)
    model = _load_generic(det, checked, dtype)
    if stats:
        model.register_to_config(**stats)
    return model


def load_text_encoder(path, dtype: torch.dtype = torch.float32):
    """`Qwen3VLForConditionalGeneration`. A Comfy file (50 layers, no final norm, no head) becomes
    the H3 arrangement of `qwen_h3`, which diffusers' `get_qwen3vl_prompt_embeds` accepts and whose
    `hidden_states[50]` is the un-normalised stream after decoder layer 50."""
    det = _resolve(path, "text_encoder")
    model = _load_generic(det, _checked(det), dtype)
    model.config.dtype = dtype
    return model
