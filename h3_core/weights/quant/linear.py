"""Modules that keep a quantised layer in its stored form and compute with it.

`QuantLinear` replaces an `nn.Linear` whose file stores it quantised. Every stored tensor (the
quantised `weight`, its scales, an AWQ `pre_quant_scale`) is an `nn.Parameter(requires_grad=False)`
so module sizes, `.to()`, ComfyUI's model patcher and diffusers' group offloading all see and move
them at their stored size. By default `forward` dequantises the weight per call (weight-only: the
dense weight lives only for the matmul) with comfy-kitchen and runs `F.linear` in the activation's
dtype - the same numbers a dense model holding kitchen's dequantised weights computes.

Every format-specific step (which tensors are stored, in which order, how they dequantise, which GEMM runs) is
asked of the layer's registered format (`spec.layer_format`, see `layer_format`); nothing here names a format.

Optional fast path (`kitchen_matmul = True`, set by `use_kitchen_matmul`): the format's `kitchen_forward`, e.g.
kitchen's own int8 GEMM (int8 and w6a8 layers: the activation is rotated and row-quantised, W8A8) or fp8
`_scaled_mm` (fp8 layers with a static `input_scale`), as ComfyUI core runs these files on a GPU. It differs from the
weight-only result by the activation quantisation (~1 % relative); kitchen picks its CUDA kernels
where the device has them and its eager reference otherwise.

`Int8Embedding` is the int8 row-wise token table of the nvfp4 text encoder: rows are gathered first
and only those are dequantised (the [V, D] table is never materialised).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .layer_format import LayerSpec


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class _LoraHandle:
    """Removes one LoRA branch from a QuantLinear (the `RemovableHandle` role of a forward hook)."""

    def __init__(self, module: "QuantLinear", branch: tuple):
        self.module, self.branch = module, branch

    def remove(self) -> None:
        branches = self.module.lora_branches
        for index, item in enumerate(branches):
            if item is self.branch:
                del branches[index]
                return


class QuantLinear(nn.Module):
    """A linear layer holding its weight as a published file stores it (see the module docstring)."""

    def __init__(self, spec: LayerSpec, stored: dict, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = spec.shape
        self.fmt = spec.format
        self.spec = spec
        self.layer_format = spec.layer_format
        # `bias` is registered first on purpose: diffusers reads a projection's compute dtype as its first
        # floating parameter (`get_parameter_dtype`), which must be the dense bias, not an fp32 scale or fp8 codes.
        self.bias = _frozen(bias) if bias is not None else None
        for name in self.layer_format.stored_order():
            if name in stored:
                setattr(self, name, _frozen(stored[name]))
        self.kitchen_matmul = False
        self.lora_branches: list = []

    @classmethod
    def empty(cls, spec: LayerSpec, bias_dtype: torch.dtype | None, device="meta") -> "QuantLinear":
        """Stand-in parameters of the stored dtypes and shapes (to be assigned by `load_state_dict`)."""
        from ...safetensors_header import DTYPES

        stored = {suffix: torch.empty(shape, dtype=DTYPES[tag], device=device)
                  for suffix, (tag, shape) in spec.tensors.items()}
        bias = torch.empty(spec.shape[0], dtype=bias_dtype, device=device) if bias_dtype is not None else None
        return cls(spec, stored, bias)

    def stored(self, device=None) -> dict:
        return {name: (getattr(self, name) if device is None else getattr(self, name).to(device))
                for name in self.layer_format.stored_order() if hasattr(self, name)}

    def dense_weight(self, dtype: torch.dtype, device=None) -> torch.Tensor:
        """The dequantised [out, in] weight in `dtype` (kitchen's dequantisation), storage moved to `device`
        first so only the quantised bytes travel. The AWQ `pre_quant_scale` is not folded in."""
        return self.layer_format.dequantise(self.spec, self.stored(device), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(device=x.device, dtype=x.dtype)
        out = None
        if self.kitchen_matmul:
            out = self._kitchen_forward(x, bias)
        if out is None:
            prescale = getattr(self, "pre_quant_scale", None)
            scaled = x if prescale is None else x * prescale.to(device=x.device, dtype=x.dtype)
            out = F.linear(scaled, self.dense_weight(x.dtype, x.device), bias)
        for down, up, factor in self.lora_branches:
            # The low-rank update sees the unscaled input: it belongs to the original W, not to W / s.
            down_x, up_x = down.to(device=x.device, dtype=x.dtype), up.to(device=x.device, dtype=x.dtype)
            out = out + factor * F.linear(F.linear(x, down_x), up_x).to(out.dtype)
        return out

    def _kitchen_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The format's quantised GEMM for this layer, or None where it has none (weight-only path)."""
        return self.layer_format.kitchen_forward(self.spec, self.stored(x.device), x, bias)

    def add_lora(self, down: torch.Tensor, up: torch.Tensor, factor: float) -> _LoraHandle:
        """Add y += factor * up(down(x)) beside the quantised weight (never re-quantised); returns a handle."""
        branch = (down, up, float(factor))
        self.lora_branches.append(branch)
        return _LoraHandle(self, branch)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.label}"


class Int8Embedding(nn.Module):
    """An int8 row-wise embedding table (`weight` I8 [V, D], `weight_scale` F32 [V, 1]), gathered then dequantised."""

    def __init__(self, spec: LayerSpec, stored: dict, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = spec.shape
        self.fmt = spec.format
        self.spec = spec
        self.weight = _frozen(stored["weight"])
        self.weight_scale = _frozen(stored["weight_scale"])
        self.compute_dtype = compute_dtype

    @classmethod
    def empty(cls, spec: LayerSpec, device="meta") -> "Int8Embedding":
        from ...safetensors_header import DTYPES

        stored = {suffix: torch.empty(shape, dtype=DTYPES[tag], device=device)
                  for suffix, (tag, shape) in spec.tensors.items()}
        return cls(spec, stored)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        stored = {"weight": self.weight, "weight_scale": self.weight_scale}
        return self.spec.layer_format.dequantise_rows(self.spec, stored, ids.to(self.weight.device),
                                                      self.compute_dtype)

    def dense_weight(self, dtype: torch.dtype, device=None) -> torch.Tensor:
        stored = {"weight": self.weight.to(device) if device else self.weight, "weight_scale": self.weight_scale}
        return self.spec.layer_format.dequantise(self.spec, stored, dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 row-wise, computes in {self.compute_dtype}"


def kitchen_matmul_available(device: torch.device, fmt: str) -> bool:
    """Whether kitchen has a native (CUDA) GEMM for layer format `fmt` on `device`."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    from .layouts import layer_format

    needed = layer_format(fmt).gemm_min_sm()
    return needed is not None and torch.cuda.get_device_capability(torch.device(device)) >= needed


def use_kitchen_matmul(model: nn.Module, enabled: bool = True, *, device=None, force: bool = False) -> int:
    """Turn kitchen's quantised GEMM on (or off) for every QuantLinear of `model` whose format has one
    on `device` (default: where the layer's weight is). `force` skips the device check: kitchen then
    runs its eager reference (how CPU tests exercise this dispatch). Returns how many layers changed."""
    changed = 0
    for module in model.modules():
        if not isinstance(module, QuantLinear):
            continue
        where = device if device is not None else module.weight.device
        has_gemm = module.layer_format.gemm_min_sm() is not None  # nvfp4 files ask for full precision; GGUF has none
        wanted = bool(enabled) and has_gemm and (force or kitchen_matmul_available(where, module.fmt))
        if module.kitchen_matmul != wanted:
            module.kitchen_matmul = wanted
            changed += 1
    return changed
