"""How quantised layers travel from a file into a model: the steps `check` and the loaders share.

1. `before_conversion`: components whose handler dequantises at load (`quantised_layers =
   "dequantise"`: the video VAE) get dense `P.weight` tensors here (the layer format's dequantisation,
   float32; data-free meta tensors during a header-only check), so their key converters see a dense file.
2. The component's key converter renames / splits / swaps the stored tensors; side tensors follow their
   weight as their format says (`follow_rows`), markers are copied to every part of a split.
3. `install`: every converted marker `M.comfy_quant` turns module `M` of the (meta) model into a
   `QuantLinear` (an `nn.Embedding` into an `Int8Embedding` where the format allows it; another module's
   layer is dequantised at load where the format asks for it: GGUF) whose parameters are the stored tensors,
   and the marker is consumed. The model's state dict then names exactly the converted tensors, so the
   usual zero-missing / zero-unexpected / equal-shapes check covers quantised files too. The check installs on
   its meta model and the load assigns into that model: the load's pass skips installed modules before reading
   their markers, and each distinct marker is parsed once (`plan.marker_options`; a GGUF plan's, never), however
   many layers and passes carry it.
"""

from __future__ import annotations

import torch
from torch import nn

from ...safetensors_header import DTYPE_TAGS
from ..errors import H3WeightsError
from . import layouts, markers
from .linear import Int8Embedding, QuantLinear
from .plan import QuantPlan, marker_options, split_side

_MARKER_TAIL = "." + markers.MARKER_SUFFIX


def follow_rows(state: dict, layer: str, suffix: str, tensor: torch.Tensor, op, count: int) -> tuple:
    """Side tensor `layer.suffix` transformed as its weight's rows are by `op` (which returns `count` parts):
    row-aligned tensors go through `op`, per-tensor / per-input ones are copied to every part."""
    if op is None:
        return (tensor,)
    marker = state.get(f"{layer}{_MARKER_TAIL}")
    if marker is None or marker.device.type == "meta":
        raise H3WeightsError(f"{layer}.{suffix}: side tensor of a layer without a readable .comfy_quant marker")
    fmt = layouts.layer_format(marker_options(marker, layer)["format"])
    aligned = fmt.row_aligned(suffix, tuple(tensor.shape))
    if aligned is None:  # a blocked layout: the format re-tiles it, or refuses
        return fmt.follow_rows(layer, suffix, state[f"{layer}.weight"], tensor, op, count)
    return tuple(op(tensor)) if aligned else (tensor,) * count


def _densify(plan: QuantPlan, tensors: dict) -> dict:
    out = {k: v for k, v in tensors.items() if k not in plan.stored_keys()}
    for layer, spec in plan.layers.items():
        stored = {suffix: tensors[f"{layer}.{suffix}"] for suffix in spec.tensors}
        if stored["weight"].device.type == "meta":
            dense = torch.empty(spec.shape, dtype=torch.float32, device="meta")
        else:
            dense = spec.layer_format.dequantise(spec, stored, torch.float32)
            if "pre_quant_scale" in stored:  # x W^T = (x * s) W'^T: folded once, at load
                dense = dense * stored["pre_quant_scale"].to(torch.float32)
        out[f"{layer}.weight"] = dense
    return out


def before_conversion(det, tensors: dict) -> dict:
    """The file tensors a component's converter receives (see the module docstring, step 1)."""
    plan = getattr(det, "quant", None)
    if plan is None:
        return tensors
    # GGUF layers' markers are the plan's (the file has none); a Comfy file's read ones are the same tensors.
    tensors = {**plan.markers, **tensors}
    return _densify(plan, tensors) if det.handler.quantised_layers == "dequantise" else tensors


def _families(converted: dict) -> dict:
    """{module name: {suffix: tensor}}: every tensor grouped under the module that holds it."""
    families: dict = {}
    for key, tensor in converted.items():
        module, _, suffix = key.rpartition(".")
        families.setdefault(module, {})[suffix] = tensor
    return families


def install(model: nn.Module, converted: dict) -> tuple[dict, list]:
    """Turn the modules named by converted markers into quantised modules (step 3). Returns the converted
    tensors without their markers, and shape mismatches `(name, file shape, model shape)` found on the way."""
    marker_keys = sorted(k for k in converted if k.endswith(_MARKER_TAIL))
    if not marker_keys:
        return converted, []
    out = {k: v for k, v in converted.items() if k not in marker_keys}
    families = _families(out)
    mismatched = []
    for key in marker_keys:
        name = key[: -len(_MARKER_TAIL)]
        parent_name, _, attr = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
            current = getattr(parent, attr)
        except AttributeError:
            continue  # no such module: `compare` reports its tensors as unexpected
        if isinstance(current, (QuantLinear, Int8Embedding)):
            # Installed, and its family judged, by the check on this model: the load's pass only drops the marker
            # (a module the check left dense, a GGUF conv or table, still gets its weight dequantised below).
            continue
        family = {suffix: (DTYPE_TAGS[t.dtype], tuple(t.shape)) for suffix, t in families.get(name, {}).items()}
        spec = layouts.describe(name, marker_options(converted[key], key), family)
        fmt = spec.layer_format
        if fmt.non_linear == "dequantise" and not isinstance(current, nn.Linear):
            out[f"{name}.weight"] = _dense_at_load(spec, out[f"{name}.weight"])  # a conv / embedding (GGUF)
            continue
        if isinstance(current, nn.Linear):
            dense = (current.out_features, current.in_features)
            replacement = QuantLinear.empty(spec, current.bias.dtype if current.bias is not None else None)
        elif isinstance(current, nn.Embedding) and fmt.embeddable(spec):
            dense = (current.num_embeddings, current.embedding_dim)
            replacement = Int8Embedding.empty(spec)
        else:
            raise H3WeightsError(f"{name}: a {spec.format} layer in the file, but the model's {name} is a "
                                 f"{type(current).__name__}; only Linear layers (and int8 row-wise embeddings) "
                                 "are read quantised")
        if tuple(spec.shape) != dense:
            mismatched.append((f"{name}.weight", tuple(spec.shape), dense))
            continue
        setattr(parent, attr, replacement)
    return out, mismatched


def _dense_at_load(spec, stored: torch.Tensor) -> torch.Tensor:
    """The weight of a non-Linear module its format dequantises at load (float32; meta during a header-only
    check)."""
    if stored.device.type == "meta":
        return torch.empty(spec.shape, dtype=torch.float32, device="meta")
    return spec.layer_format.dequantise(spec, {"weight": stored}, torch.float32)


def stored_names(model: nn.Module) -> set[str]:
    """State-dict names of quantised modules' stored tensors: never dtype-cast at load (bias excepted)."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, (QuantLinear, Int8Embedding)):
            for param_name, _ in module.named_parameters(recurse=False):
                if param_name != "bias":
                    names.add(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def set_compute_dtype(model: nn.Module, dtype: torch.dtype, keep_in_fp32_modules=()) -> None:
    """Quantised embeddings return rows in the model's compute dtype (float32 inside fp32-kept modules)."""
    for name, module in model.named_modules():
        if isinstance(module, Int8Embedding):
            keep = any(part in name.split(".") for part in (keep_in_fp32_modules or ()))
            module.compute_dtype = torch.float32 if keep else dtype


__all__ = ["before_conversion", "follow_rows", "install", "set_compute_dtype", "split_side", "stored_names"]
