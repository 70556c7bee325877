"""Low VRAM inside ComfyUI: the DiT and the text encoder stream their weights under ComfyUI's model management.

ComfyUI's ModelPatcher fits a model into the memory `load_models_gpu` finds free by leaving the layers that do not
fit on the offload device and marking them `comfy_cast_weights = True`; such a layer then fetches its weight and
bias for each call through `comfy.ops.cast_bias_weight` (async on an offload stream where the device has one) and
lets them go after it. Only layers that speak this cast-weights protocol (`comfy.ops.CastWeightBiasOp`) stream: a
plain `torch.nn.Linear` is loaded whole or not at all. The dynamic-VRAM patcher of newer ComfyUI (CoreModelPatcher)
pages exactly the same layers in on demand and force-loads every other one.

`make_streamable` gives every layer of a loaded module tree that holds parameters (the DiT's and Qwen3-VL's Linears,
the quantised QuantLinear, norms, embeddings, the vision patch Conv3d) the protocol by swapping its class for a subclass
with a protocol-aware `forward`: no weight is copied, and while ComfyUI keeps the layer resident the original
`forward` runs unchanged, so results are bitwise those of the unconverted model wherever the weights live.

Two more things a partially loaded model needs, both done here:
- buffers (rotary tables) and parameters of non-leaf modules are never placed by the patcher's partial load: an
  ON_LOAD callback moves them (they are a few KB) to the compute device;
- diffusers' modular pipelines and transformers take a model's compute device from its first parameter unless the
  model says otherwise through `_hf_hook.execution_device` (accelerate's offload convention); under streaming the
  first parameter may sit on the offload device, so the model says where it computes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import comfy.model_management as mm
import comfy.model_patcher
import comfy.ops
import torch

log = logging.getLogger(__name__)

try:  # ComfyUI's patcher callbacks (ON_LOAD runs after every load, full or partial)
    from comfy.patcher_extension import CallbacksMP
except ImportError:  # pragma: no cover - every core with V3 nodes has it
    CallbacksMP = None


class ExecutionDevice:
    """What `module._hf_hook` holds for diffusers and transformers: the device a model whose weights are spread
    over devices computes on (they read only `execution_device`; accelerate's real hooks carry the same field)."""

    def __init__(self, device: torch.device):
        self.execution_device = torch.device(device)

    def __repr__(self) -> str:
        return f"ExecutionDevice({self.execution_device})"


class Streamable(comfy.ops.CastWeightBiasOp):
    """Mixin placed before a layer's own class: the cast-weights protocol around that class's `forward`.

    When ComfyUI set `comfy_cast_weights` (the layer stays on the offload device) or attached weight/bias functions
    (lowvram LoRA patches), the layer's own parameters are fetched to the input's device for this call only -- the
    weight and bias through `comfy.ops.cast_bias_weight`, in their stored dtype so the maths is the layer's own --
    and the layer's own `forward` runs on them. Otherwise the layer's own `forward` runs as if never converted."""

    def forward(self, *args, **kwargs):
        if self.comfy_cast_weights or self.weight_function or self.bias_function:
            return self.forward_comfy_cast_weights(*args, **kwargs)
        return super().forward(*args, **kwargs)

    def forward_comfy_cast_weights(self, *args, **kwargs):
        device = _input_device(args, kwargs)
        own = dict(self._parameters)
        fetched, stream = {}, None
        weight = own.get("weight")
        if weight is not None:
            bias = own.get("bias")
            fetched["weight"], cast_bias, stream = comfy.ops.cast_bias_weight(
                self, device=device, dtype=weight.dtype,
                bias_dtype=bias.dtype if bias is not None else None, offloadable=True,
            )
            if bias is not None:
                fetched["bias"] = cast_bias
        for name, tensor in own.items():  # side tensors (quantisation scales): small, moved as they are
            if tensor is not None and name not in fetched:
                fetched[name] = mm.cast_to(tensor, None, device, non_blocking=mm.device_supports_non_blocking(device))
        try:
            # Plain tensors in place of the parameters for this call only: the layer's own forward reads them.
            self._parameters.update(fetched)
            return super().forward(*args, **kwargs)
        finally:
            self._parameters.update(own)
            comfy.ops.uncast_bias_weight(self, fetched.get("weight"), fetched.get("bias"), stream)


def _input_device(args, kwargs) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    raise TypeError("a streamed layer was called without a tensor input")


_SUBCLASSES: dict[type, type] = {}


def _streamable_class(cls: type) -> type:
    if issubclass(cls, Streamable):
        return cls
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Streamable{cls.__name__}", (Streamable, cls), {"__module__": __name__})
    return _SUBCLASSES[cls]


def _holds_parameters(module: torch.nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def _is_leaf_holder(module: torch.nn.Module) -> bool:
    """A module whose parameters the patcher places one by one (it skips modules whose children hold some too)."""
    own = {id(p) for p in module._parameters.values() if p is not None}
    return bool(own) and all(id(p) in own for p in module.parameters())


@dataclass
class Conversion:
    layers: int  # layers given the protocol
    layer_bytes: int  # their parameter bytes (what can stream)
    other_bytes: int  # parameters of non-leaf modules + buffers (moved whole by the ON_LOAD callback)
    classes: dict  # original class name -> count


def make_streamable(model: torch.nn.Module, execution_device: torch.device) -> Conversion:
    """Give every parameter-holding leaf layer of `model` the cast-weights protocol, in place (class swap, no
    weight copied), and mark `model` as computing on `execution_device`. Idempotent."""
    layers = layer_bytes = other_bytes = 0
    classes: dict[str, int] = {}
    for module in model.modules():
        if not _holds_parameters(module):
            continue
        size = sum(p.numel() * p.element_size() for p in module._parameters.values() if p is not None)
        if not _is_leaf_holder(module):
            other_bytes += size
            continue
        original = next(c for c in type(module).__mro__ if not issubclass(c, comfy.ops.CastWeightBiasOp))
        classes[original.__name__] = classes.get(original.__name__, 0) + 1
        module.__class__ = _streamable_class(type(module))
        if "comfy_cast_weights" not in module.__dict__:
            module.comfy_cast_weights = False
            module.weight_function, module.bias_function = [], []
        if not hasattr(module, "bias"):  # cast_bias_weight reads `bias` (RMSNorms have none)
            module.bias = None
        layers += 1
        layer_bytes += size
    other_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    model._hf_hook = ExecutionDevice(execution_device)
    return Conversion(layers, layer_bytes, other_bytes, classes)


def _place_the_rest(patcher, device_to, *_args) -> None:
    """ON_LOAD: buffers and non-leaf parameters go where the model computes (a partial load leaves them behind)."""
    if device_to is None:
        return
    model = patcher.model
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != torch.device(device_to):
                    module._buffers[name] = buffer.to(device_to)
            if _holds_parameters(module) and not _is_leaf_holder(module):
                for param in module._parameters.values():
                    if param is not None and param.device != torch.device(device_to):
                        param.data = param.data.to(device_to)


def patcher_class():
    """The patcher ComfyUI itself would use: the dynamic-VRAM one where this core has it, else ModelPatcher."""
    return getattr(comfy.model_patcher, "CoreModelPatcher", None) or comfy.model_patcher.ModelPatcher


def streamed_patcher(holder: torch.nn.Module, model: torch.nn.Module, load_device, offload_device):
    """A ComfyUI patcher around `holder` (which holds `model`) whose layers stream when VRAM is short."""
    conversion = make_streamable(model, load_device)
    cls = patcher_class()
    try:
        patcher = cls(holder, load_device=load_device, offload_device=offload_device)
    except Exception as error:  # a newer core's patcher asking for more than a plain module: the legacy one streams
        log.warning("[MiniMax H3] %s refused the model (%s); using ModelPatcher", cls.__name__, error)
        cls = comfy.model_patcher.ModelPatcher
        patcher = cls(holder, load_device=load_device, offload_device=offload_device)
    if CallbacksMP is not None:
        patcher.add_callback(CallbacksMP.ON_LOAD, _place_the_rest)
    log.info(
        "[MiniMax H3] %s: %d layers stream under %s (%.1f MB; %.2f MB of buffers/other parameters load whole)",
        type(model).__name__, conversion.layers, cls.__name__, conversion.layer_bytes / 2**20,
        conversion.other_bytes / 2**20,
    )
    return patcher
