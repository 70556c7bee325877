"""comfy-kitchen, the library whose layouts every Comfy quantised format computes with (its eager backend on CPU).

Nothing in this package re-implements kitchen's maths: every code, scale and rotation the format classes
(`formats/`) produce or read comes from `comfy_kitchen.tensor.*Layout.quantize/dequantize` or
`dequantize_w4a8_int8_weight`, so a file written here has kitchen's (and so ComfyUI core's) bits, and a weight
read here is kitchen's dequantisation of it. This module holds what the formats share: the import, and the
ConvRot group rule.
"""

from __future__ import annotations

import torch

from ..errors import H3WeightsError


def tensor_module():
    """`comfy_kitchen.tensor` (its layouts), or an error naming the missing dependency."""
    try:
        from comfy_kitchen import tensor as kitchen_tensor
    except ImportError as exc:  # a runtime dependency (requirements.txt); say which when it is missing
        raise H3WeightsError(f"quantised weights need comfy-kitchen (pip install comfy-kitchen): {exc}") from None
    return kitchen_tensor


#: The first comfy-kitchen with the 6-bit asym_w4a8 layout (Comfy-Org's w6a8 files). ComfyUI core 0.33 pins 0.2.31,
#: which has only the 4-bit one: it writes 4-bit codes for a 6-bit request and fails on 6-bit rows with a
#: divisibility error, so a w6a8 layer is refused by name below that version instead.
SIX_BIT_KITCHEN = (0, 2, 40)


def installed_version() -> tuple[int, ...] | None:
    """comfy-kitchen's version as installed (from its metadata: no import), or None when it is missing."""
    from importlib import metadata

    try:
        text = metadata.version("comfy-kitchen")
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def require_six_bit(where: str) -> None:
    """Refuse a 6-bit (w6a8) layer where the installed comfy-kitchen cannot compute it."""
    found = installed_version()
    if found is not None and found < SIX_BIT_KITCHEN:
        raise H3WeightsError(
            f"{where}: a w6a8 (6-bit) layer needs comfy-kitchen >= {'.'.join(map(str, SIX_BIT_KITCHEN))}, and "
            f"{'.'.join(map(str, found))} is installed (ComfyUI 0.33 pins 0.2.31): `pip install "
            "'comfy-kitchen>=0.2.40,<0.3'` in ComfyUI's Python, or use the int8 / fp8 files")


def default_rotation(k: int) -> int:
    """The ConvRot group for in_features `k`: 256 (every H3 release layer) when it divides `k`, else the
    largest power of 4 that does (tiny widths: 64 for K = 64 or 128, 16 for K = 32)."""
    group = 256
    while group >= 4:
        if k % group == 0:
            return group
        group //= 4
    raise H3WeightsError(f"in_features {k} is not divisible by 4: no ConvRot group fits")


def row_scale(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """Kitchen broadcasts the scale against [N, K]: a 1-D per-row scale must stand as [N, 1]."""
    return scale.reshape(rows, 1) if scale.dim() == 1 and scale.numel() == rows and rows > 1 else scale


def e4m3(s_rel: torch.Tensor) -> torch.Tensor:
    """Group scales stored as U8 are e4m3 bytes (core reads them so)."""
    return s_rel.view(torch.float8_e4m3fn) if s_rel.dtype == torch.uint8 else s_rel
