"""Test-only ComfyUI extension (copied into a test server's custom_nodes/ by tests/test_low_vram_comfyui.py).

On CPU, ComfyUI always loads a model whole: `load_models_gpu` passes `lowvram_model_memory=0` for a CPU load device.
This probe makes a test server behave like a GPU short of VRAM for the models it names: it replaces that one
argument of `LoadedModel.model_load` with a budget read from $H3_PROBE_BUDGETS (JSON: model class -> bytes) at each
load, so ComfyUI's own partially_load / load(lowvram_model_memory=...) code decides what stays resident and marks the
rest `comfy_cast_weights`, exactly as on a GPU. Everything below that line is ComfyUI's and the pack's real code.

It also records, without changing them: every `load_models_gpu` memory request, every weight fetched through
`comfy.ops.cast_bias_weight` while a model runs, and the layers' residency at each forward. Arm nodes pass a model
through (resetting its records and unloading every model, so the next load applies the current budget); report
nodes return the records and a hash of their input's tensors in the prompt's history.
"""

from __future__ import annotations

import hashlib
import json
import os

import comfy.model_management as mm
import comfy.ops
import torch

STATE = {"loads": [], "casts": {}, "forwards": {}}


def _budgets() -> dict:
    path = os.environ.get("H3_PROBE_BUDGETS")
    if not path or not os.path.isfile(path):
        return {}
    return json.loads(open(path).read() or "{}")


def _inner(patcher):
    holder = getattr(patcher, "model", None)
    return getattr(holder, "model", holder)


_model_load = mm.LoadedModel.model_load


def _forced_model_load(self, lowvram_model_memory=0, force_patch_weights=False):
    budget = _budgets().get(type(_inner(self.model)).__name__)
    if budget is not None:
        lowvram_model_memory = max(float(budget), 0.1)  # ComfyUI's own floor (--novram passes 0.1)
    return _model_load(self, lowvram_model_memory, force_patch_weights)


mm.LoadedModel.model_load = _forced_model_load

_load_models_gpu = mm.load_models_gpu


def _recorded_load_models_gpu(models, memory_required=0, *args, **kwargs):
    STATE["loads"].append({"models": [type(_inner(m)).__name__ for m in models], "memory_required": memory_required})
    return _load_models_gpu(models, memory_required, *args, **kwargs)


mm.load_models_gpu = _recorded_load_models_gpu

_cast_bias_weight = comfy.ops.cast_bias_weight


def _recorded_cast(s, *args, **kwargs):
    STATE["casts"][id(s)] = sum(p.numel() * p.element_size() for p in s._parameters.values() if p is not None)
    return _cast_bias_weight(s, *args, **kwargs)


comfy.ops.cast_bias_weight = _recorded_cast


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module._parameters.values() if p is not None)


def _residency(model) -> dict:
    castable = [m for m in model.modules() if hasattr(m, "comfy_cast_weights") and _param_bytes(m)]
    streamed = [m for m in castable if m.comfy_cast_weights]
    total = sum(map(_param_bytes, castable))
    streamed_bytes = sum(map(_param_bytes, streamed))
    return {
        "layers": len(castable),
        "layers_streamed": len(streamed),
        "bytes": total,
        "streamed_bytes": streamed_bytes,
        "resident_fraction": (total - streamed_bytes) / total if total else 1.0,
        "all_layers": sum(1 for m in model.modules() if _param_bytes(m)),
    }


def _arm(loaded):
    model = _inner(loaded.patcher)
    name = type(model).__name__
    mm.unload_all_models()  # the next load_models_gpu loads afresh under the current budget
    STATE["forwards"][name] = []
    for handle in getattr(model, "_h3_probe_handles", []):
        handle.remove()

    def before(module, args, kwargs):
        STATE["casts"].clear()
        STATE["forwards"][name].append({"at_start": _residency(model)})

    def after(module, args, kwargs, output):
        record = STATE["forwards"][name][-1]
        record["cast_layers"] = len(STATE["casts"])
        record["cast_bytes"] = sum(STATE["casts"].values())
        record["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})

    # diffusers runs the text encoder's `.model` (its layer-50 states), never the top-level forward
    target = model.model if isinstance(getattr(model, "model", None), torch.nn.Module) else model
    model._h3_probe_handles = [
        target.register_forward_pre_hook(before, with_kwargs=True),
        target.register_forward_hook(after, with_kwargs=True),
    ]
    return loaded


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _report(name: str, tensors, extra: dict) -> dict:
    body = {"digest": _digest(tensors), "loads": list(STATE["loads"]), "forwards": STATE["forwards"].get(name, []),
            **extra}  # fmt: skip
    return {"ui": {"h3_probe": [json.dumps(body)]}, "result": ()}


class _Node:
    CATEGORY = "h3 test probe"
    FUNCTION = "run"

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # always run (and make everything downstream run)


class ArmDiT(_Node):
    RETURN_TYPES = ("MINIMAX_H3_DIT",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"dit": ("MINIMAX_H3_DIT",)}}

    def run(self, dit):
        return (_arm(dit),)


class ArmTextEncoder(_Node):
    RETURN_TYPES = ("MINIMAX_H3_TEXT_ENCODER",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text_encoder": ("MINIMAX_H3_TEXT_ENCODER",)}}

    def run(self, text_encoder):
        return (_arm(text_encoder),)


class ReportLatent(_Node):
    RETURN_TYPES = ()
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT",)}}

    def run(self, latent):
        tensors = latent["samples"].tensors
        return _report("MiniMaxH3Transformer3DModel", tensors, {"shapes": [list(t.shape) for t in tensors]})


class ReportConditioning(_Node):
    RETURN_TYPES = ()
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",)}}

    def run(self, conditioning):
        embeds = conditioning[0][0]
        extra = {"shape": list(embeds.shape), "dtype": str(embeds.dtype)}
        return _report("Qwen3VLForConditionalGeneration", [embeds], extra)


NODE_CLASS_MAPPINGS = {
    "H3ProbeArmDiT": ArmDiT,
    "H3ProbeArmTextEncoder": ArmTextEncoder,
    "H3ProbeReportLatent": ReportLatent,
    "H3ProbeReportConditioning": ReportConditioning,
}
