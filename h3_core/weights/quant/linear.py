"""Modules that keep a quantised layer in its stored form and compute with it.

`QuantLinear` replaces an `nn.Linear` whose file stores it quantised. Every stored tensor (the
quantised `weight`, its scales, an AWQ `pre_quant_scale`) is an `nn.Parameter(requires_grad=False)`
so module sizes, `.to()`, ComfyUI's model patcher and diffusers' group offloading all see and move
them at their stored size. By default `forward` dequantises the weight per call (weight-only: the
dense weight lives only for the matmul) with comfy-kitchen and runs `F.linear` in the activation's
dtype - the same numbers a dense model holding kitchen's dequantised weights computes.

Optional fast path (`kitchen_matmul = True`, set by `use_kitchen_matmul`): kitchen's own int8 GEMM
(int8 and w6a8 layers: the activation is rotated and row-quantised, W8A8) or fp8 `_scaled_mm` (fp8
layers with a static `input_scale`), as ComfyUI core runs these files on a GPU. It differs from the
weight-only result by the activation quantisation (~1 % relative); kitchen picks its CUDA kernels
where the device has them and its eager reference otherwise.

`Int8Embedding` is the int8 row-wise token table of the nvfp4 text encoder: rows are gathered first
and only those are dequantised (the [V, D] table is never materialised).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from . import ggml, kitchen
from .layouts import FP8, GGUF, INT8, NVFP4, W6A8, LayerSpec

# Order in which stored tensors are registered (bias first, see `QuantLinear.__init__`).
_STORED_ORDER = ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "weight_s_rel",
                 "weight_s_channel", "weight_codebook")


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
        # `bias` is registered first on purpose: diffusers reads a projection's compute dtype as its first
        # floating parameter (`get_parameter_dtype`), which must be the dense bias, not an fp32 scale or fp8 codes.
        self.bias = _frozen(bias) if bias is not None else None
        for name in _STORED_ORDER:
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
                for name in _STORED_ORDER if hasattr(self, name)}

    def dense_weight(self, dtype: torch.dtype, device=None) -> torch.Tensor:
        """The dequantised [out, in] weight in `dtype` (kitchen's dequantisation), storage moved to `device`
        first so only the quantised bytes travel. The AWQ `pre_quant_scale` is not folded in."""
        spec = self.spec
        if self.fmt == GGUF:  # diffusers' GGUF dequantisers, not kitchen's
            weight = self.weight if device is None else self.weight.to(device)
            return ggml.dequantise(weight, spec.marker["ggml_type"], spec.shape, dtype)
        return kitchen.dequantise(self.fmt, self.stored(device), spec.shape, dtype, convrot=spec.convrot,
                                  convrot_groupsize=spec.convrot_groupsize, group_size=spec.group_size)

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
        """Kitchen's quantised GEMM for this layer, or None where the format has none (weight-only path)."""
        import comfy_kitchen as ck
        from comfy_kitchen import tensor as layouts

        spec, stored = self.spec, self.stored(x.device)
        if self.fmt == INT8:
            scale = stored["weight_scale"].reshape(-1)
            return ck.int8_linear(x, stored["weight"], scale, bias, x.dtype, convrot=spec.convrot,
                                  convrot_groupsize=spec.convrot_groupsize or 256)
        if self.fmt == W6A8:
            s_rel = stored["weight_s_rel"]
            if s_rel.dtype == torch.uint8:
                s_rel = s_rel.view(torch.float8_e4m3fn)
            codebook = stored.get("weight_codebook")
            return layouts.w4a8_int8_linear(x, stored["weight"], s_rel, stored["weight_s_channel"], bias=bias,
                                            codebook=None if codebook is None else codebook.to(torch.float32),
                                            group_size=spec.group_size, convrot_groupsize=spec.convrot_groupsize,
                                            out_dtype=x.dtype)
        if self.fmt == FP8 and "input_scale" in stored and not spec.marker.get("full_precision_matrix_mult"):
            fp8 = layouts.TensorCoreFP8Layout
            x_params = fp8.Params(scale=stored["input_scale"], orig_dtype=x.dtype, orig_shape=tuple(x.shape))
            x_q = layouts.QuantizedTensor(ck.quantize_per_tensor_fp8(x, stored["input_scale"]), fp8.__name__, x_params)
            w_params = fp8.Params(scale=stored["weight_scale"], orig_dtype=x.dtype, orig_shape=spec.shape)
            w_q = layouts.QuantizedTensor(stored["weight"], fp8.__name__, w_params)
            # Kitchen's fp8 linear runs torch._scaled_mm and falls back to dequantising where the device has no fp8.
            out = F.linear(x_q, w_q, bias)
            return out.dequantize() if isinstance(out, layouts.QuantizedTensor) else out
        return None  # nvfp4 files ask for full-precision matmul; fp8 without a static input scale likewise

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
        return kitchen.dequantise_rows(stored, ids.to(self.weight.device), self.compute_dtype,
                                       convrot=self.spec.convrot, convrot_groupsize=self.spec.convrot_groupsize)

    def dense_weight(self, dtype: torch.dtype, device=None) -> torch.Tensor:
        stored = {"weight": self.weight.to(device) if device else self.weight, "weight_scale": self.weight_scale}
        return kitchen.dequantise(INT8, stored, self.spec.shape, dtype, convrot=self.spec.convrot,
                                  convrot_groupsize=self.spec.convrot_groupsize)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 row-wise, computes in {self.compute_dtype}"


def kitchen_matmul_available(device: torch.device, fmt: str) -> bool:
    """Whether kitchen has a native (CUDA) GEMM for layer format `fmt` on `device`."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    from comfy_kitchen import tensor as layouts

    capability = torch.cuda.get_device_capability(torch.device(device))
    needed = {INT8: layouts.TensorWiseINT8Layout.MIN_SM_VERSION, W6A8: layouts.AsymW4A8Int8Layout.MIN_SM_VERSION,
              FP8: layouts.TensorCoreFP8Layout.MIN_SM_VERSION}.get(fmt)
    return needed is not None and capability >= needed


def use_kitchen_matmul(model: nn.Module, enabled: bool = True, *, device=None, force: bool = False) -> int:
    """Turn kitchen's quantised GEMM on (or off) for every QuantLinear of `model` whose format has one
    on `device` (default: where the layer's weight is). `force` skips the device check: kitchen then
    runs its eager reference (how CPU tests exercise this dispatch). Returns how many layers changed."""
    changed = 0
    for module in model.modules():
        if not isinstance(module, QuantLinear):
            continue
        where = device if device is not None else module.weight.device
        has_gemm = module.fmt not in (NVFP4, GGUF)  # nvfp4 files ask for full precision; GGUF has no kitchen GEMM
        wanted = bool(enabled) and has_gemm and (force or kitchen_matmul_available(where, module.fmt))
        if module.kitchen_matmul != wanted:
            module.kitchen_matmul = wanted
            changed += 1
    return changed
