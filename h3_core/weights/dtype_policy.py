"""Which dtype each loaded tensor gets.

One rule for every loading path, copied from what diffusers' `from_pretrained(torch_dtype=...)`
does, so a module loaded from a Comfy file, a native partition or a diffusers folder ends up with
the same dtypes: floating tensors take the requested dtype, except those inside a module named in
the class's `_keep_in_fp32_modules` (matched against the dotted name's components, as diffusers
matches them), which stay float32. Integer tensors are never cast.
"""

from __future__ import annotations

import torch


def keeps_fp32(name: str, keep_in_fp32_modules) -> bool:
    parts = name.split(".")
    return any(module in parts for module in (keep_in_fp32_modules or ()))


def target_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype, keep_in_fp32_modules) -> torch.dtype:
    if not tensor.is_floating_point():
        return tensor.dtype
    if keeps_fp32(name, keep_in_fp32_modules):
        return torch.float32
    return dtype


def cast_state_dict(state_dict: dict[str, torch.Tensor], dtype: torch.dtype, keep_in_fp32_modules) -> dict:
    """Cast a state dict before assigning it into a model (no copy when the dtype already matches)."""
    return {
        name: tensor.to(target_dtype(name, tensor, dtype, keep_in_fp32_modules))
        for name, tensor in state_dict.items()
    }


def apply_to_module(module: torch.nn.Module, dtype: torch.dtype, keep_in_fp32_modules) -> None:
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
