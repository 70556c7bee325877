"""Load ready-to-run diffusers / transformers modules from any published H3 layout.

One path for every component, driven by its handler (`components.HANDLERS`): detect (refuses
unsupported weight formats), resolve the config, run the header-only check (so a wrong file fails in
seconds with a precise key list, before any weight is read), then load. Comfy-Org files of a handler
with `load_single_file` (the DiT: diffusers' own `from_single_file` with a local config derived from
its shapes, no hub access) go through it; everything else is converted and assigned into the
check's meta model.

dtype follows diffusers' `from_pretrained(torch_dtype=...)` rule, so a module loaded from a Comfy
file, a native partition or a diffusers folder ends up with the same dtypes: floating tensors take the
requested dtype, except those inside a module named in the class's `_keep_in_fp32_modules` (plus the
handler's `fp32_modules`; matched against the dotted name's components, as diffusers matches them),
which stay float32; integer tensors are never cast. The default float32 gives exact weights.

Quantised Comfy-Org files take the convert-and-assign path (never diffusers' single-file loader, which
would cast int8 codes to floats): each quantised layer becomes a `QuantLinear` holding the file's codes
and scales unchanged (their dtypes are the format's, not the requested one; only biases follow the
rule above), or, for a component that dequantises at load (the video VAE), a dense weight. See
`weights.quant.route`.
"""

from __future__ import annotations

import os

import torch

from .. import progress
from . import components, file_identity
from .check import check_detection
from .detect import Detection, detect, scan
from .errors import H3WeightsError
from .quant import route as quant_route
from .safetensors_io import load_tensors
from .sources import component_paths

# --- dtype policy --------------------------------------------------------------------------------


def target_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype, keep_in_fp32_modules) -> torch.dtype:
    if not tensor.is_floating_point():
        return tensor.dtype
    if any(module in name.split(".") for module in (keep_in_fp32_modules or ())):
        return torch.float32
    return dtype


def cast_state_dict(state_dict: dict, dtype: torch.dtype, keep_in_fp32_modules, keep_as_stored=()) -> dict:
    """Cast a state dict before assigning it into a model (no copy when the dtype already matches).
    Names in `keep_as_stored` (quantised layers' codes and scales) keep the file's dtype."""
    return {name: t if name in keep_as_stored else t.to(target_dtype(name, t, dtype, keep_in_fp32_modules))
            for name, t in state_dict.items()}


def cast_module(module: torch.nn.Module, dtype: torch.dtype, keep_in_fp32_modules) -> None:
    """Cast a loaded module's parameters and persistent buffers in place by the same rule.

    Non-persistent buffers (rotary `inv_freq`, ...) are computed by the module itself in float32
    and are left alone, as `from_pretrained` leaves them.
    """
    for name, param in module.named_parameters():
        wanted = target_dtype(name, param, dtype, keep_in_fp32_modules)
        if param.dtype != wanted:
            param.data = param.data.to(wanted)
    persistent = set(module.state_dict(keep_vars=True))
    for name, buffer in module.named_buffers():
        if name not in persistent or buffer is None:
            continue
        wanted = target_dtype(name, buffer, dtype, keep_in_fp32_modules)
        if buffer.dtype != wanted:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            setattr(owner, attr, buffer.to(wanted))


# --- finding the one component -------------------------------------------------------------------


def resolve(path, component: str, partition: str | None = None) -> Detection:
    """The one `component` (a handler name) at `path`: a file, a component folder, or any root
    `scan` understands (diffusers root, native partition(s), ComfyUI models folder)."""
    path = os.fspath(path)
    label = components.require_handler(component).label
    wanted_partition = {"t2va": "fl2va"}.get(partition, partition)
    targets = component_paths(path)
    if len(targets) == 1 and targets[0] == path:
        det = detect(path)
        if det.component != component:
            raise H3WeightsError(f"{det.path} holds the H3 {det.handler.label}, not the {label}")
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
            raise H3WeightsError(f"{path}: no usable {label} found{detail}")
        if len(found) > 1:
            choices = sorted(f"{os.path.basename(d.path)} ({d.partition or d.layout})" for d in found)
            hint = " pass partition='fl2va' or 'ref2va'," if found[0].handler.partitioned else ""
            raise H3WeightsError(f"{path} holds several {label}s {choices};{hint} or point at one of them")
        det = found[0]
    if wanted_partition is not None and det.partition is not None and det.partition != wanted_partition:
        raise H3WeightsError(f"{det.path} is the {det.partition} DiT partition, not {partition}")
    return det


# --- loading -------------------------------------------------------------------------------------


def _assign(model: torch.nn.Module, det: Detection, converted: dict, dtype: torch.dtype) -> torch.nn.Module:
    """Assign converted tensors into a meta-built model: strict, no copies beyond the dtype cast."""
    keep_in_fp32 = det.handler.keep_in_fp32(type(model))
    state = cast_state_dict(converted, dtype, keep_in_fp32, quant_route.stored_names(model))
    quant_route.set_compute_dtype(model, dtype, keep_in_fp32)
    expected = components.expected_keys(model)
    for alias, owner in expected.aliases.items():
        state.setdefault(alias, state[owner])  # tied weights saved once
    model.load_state_dict(state, strict=True, assign=True)
    leftover = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise H3WeightsError(f"{det.path}: parameters left unloaded: {leftover[:5]}")
    if expected.aliases and hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def _latent_stats(det: Detection) -> dict:
    """A file's `latents_mean` / `latents_std` buffers, as config lists (float32 values, exactly
    representable). A config.json that states other values is a contradiction, not a preference."""
    present = set(det.handler.latent_stat_keys) & set(det.header.tensors)
    if not present:
        return {}
    tensors = load_tensors(det.header, present)
    stats = {key: [float(v) for v in tensors[key].to(torch.float32).tolist()] for key in sorted(present)}
    for key, values in stats.items():
        stated = det.source.config.get(key)
        if stated is not None and [float(v) for v in stated] != values:
            raise H3WeightsError(f"{det.path}: {key} in config.json differs from the file's {key} buffer")
    return stats


def _single_file_reader(det: Detection):
    """The handler's own single-file loader for a Comfy file its key family allows it to read, else None."""
    if det.layout != "comfyui" or det.quant is not None or det.format == "gguf":
        return None  # GGUF and quantised files take the assign path (diffusers' reader would cast int8 codes to floats)
    if not det.handler.family_named(det.key_format).diffusers_single_file:
        return None
    return det.handler.load_single_file


def _reusable(detection: Detection | None, path, component: str, partition: str | None) -> bool:
    """Whether a caller's earlier detection of `path` (`ModelSource.for_file` / `from_path` detect before they load)
    answers this load: the same single-file component, its files unchanged since (`Detection.current`). A folder is
    detected again: its config files are not stamped."""
    if detection is None or detection.component != component or detection.source is None:
        return False
    if detection.source.container != "file" or os.path.abspath(detection.path) != os.path.abspath(os.fspath(path)):
        return False
    wanted = {"t2va": "fl2va"}.get(partition, partition)
    if wanted is not None and detection.partition not in (wanted, None):
        return False
    return detection.current()


def load(path, component: str, dtype: torch.dtype = torch.float32, partition: str | None = None, *,
         detection: Detection | None = None) -> torch.nn.Module:
    """The `component` (a key of `components.HANDLERS`) at `path` as a ready, eval-mode module.

    `partition` ('fl2va' / 't2va' / 'ref2va') picks the DiT where a root holds both. `detection`: what the caller
    already detected at `path`; taken as it is when it still describes the file (`_reusable`), so one load reads
    each header once, else the path is detected again."""
    det = detection if _reusable(detection, path, component, partition) else resolve(path, component, partition)
    handler = det.handler
    checked = check_detection(det)  # header only: a wrong file fails here, before any weight is read
    checked.raise_if_failed()
    stats = _latent_stats(det)
    if _single_file_reader(det) is not None:
        # diffusers' single-file loader reads the file itself: the bar shows its start and its end only.
        counter = progress.Counter("load", det.header.total_bytes) if progress.active() else None
        model = handler.load_single_file(det, checked.config)
        cast_module(model, dtype, handler.keep_in_fp32(type(model)))
        if counter is not None:
            counter.finish()
    else:
        tensors = quant_route.before_conversion(det, load_tensors(det.header, report=True))
        converted, unexpected = components.to_model_names(det, tensors, checked.config)
        if unexpected:  # already excluded by the check; kept as a guard for future converters
            raise H3WeightsError(f"{det.path}: unexpected tensors {unexpected[:5]}")
        # The check installed the QuantLinears on this model: this pass drops the markers and dequantises only a
        # GGUF layer of a module that is not a Linear (it was a meta tensor during the check).
        converted, _ = quant_route.install(checked.model, converted)
        model = _assign(checked.model, det, converted, dtype)
    if stats:
        model.register_to_config(**stats)
    if handler.after_load is not None:
        handler.after_load(det, model, dtype)
    file_identity.remember(model, det.header.files)
    return model.eval()


def load_transformer(path, dtype: torch.dtype = torch.float32, partition: str | None = None):
    """`MiniMaxH3Transformer3DModel` from a Comfy-Org file, a native partition (root or
    `transformer/`), or a diffusers folder / root (`partition` picks `transformer` or `transformer_ref`)."""
    return load(path, "transformer", dtype, partition)


def load_video_vae(path, dtype: torch.dtype = torch.float32):
    """`AutoencoderKLMiniMaxH3`; the Comfy file's `latents_mean/std` buffers become its config."""
    return load(path, "vae", dtype)


def load_audio_vae(path, dtype: torch.dtype = torch.float32):
    """`AutoencoderKLMiniMaxH3Audio`. A folded (Comfy) file loads into a model whose weight norm
    is removed, which is bit-exact with the weight-normed model it was folded from."""
    return load(path, "audio_vae", dtype)


def load_text_encoder(path, dtype: torch.dtype = torch.float32):
    """`Qwen3VLForConditionalGeneration`. A Comfy file (50 layers, no final norm, no head) becomes
    the H3 arrangement of `qwen_h3`, which diffusers' `get_qwen3vl_prompt_embeds` accepts and whose
    `hidden_states[50]` is the un-normalised stream after decoder layer 50."""
    return load(path, "text_encoder", dtype)
