"""Fused-projection row layouts shared by the DiT and the video-VAE converters.

Two layouts of a fused `[3 * heads * head_dim, ...]` QKV weight (or bias) appear in the
published files (docs/ARCHITECTURE.md §6 / diffusers' `convert_minimax_h3_transformer_checkpoint_to_diffusers`):
- "stacked":     [q_all; k_all; v_all]                 Comfy-Org DiT single files
- "interleaved": [h0: q k v, h1: q k v, ...]           native MiniMaxAI DiT shards, and the video
                                                       VAE decoder's `to_qkv` in every published file
Both cannot be told apart from the tensor, so the caller always names the layout.

Gated MLPs fuse two halves too: the reference (and every published file) stores `[gate; value]`,
diffusers' `SwiGLU` reads `[value; gate]`; swapping halves is its own inverse.
"""

from __future__ import annotations

import torch

from .errors import H3WeightsError

QKV_LAYOUTS = ("stacked", "interleaved")


def _check_rows(tensor: torch.Tensor, heads: int, head_dim: int, what: str) -> None:
    if tensor.shape[0] != 3 * heads * head_dim:
        raise H3WeightsError(
            f"{what}: fused qkv has {tensor.shape[0]} rows, expected 3 * {heads} heads * {head_dim} = "
            f"{3 * heads * head_dim}"
        )


def split_qkv(fused: torch.Tensor, heads: int, head_dim: int, layout: str, what: str = "qkv"):
    """Fused QKV rows -> (q, k, v), each `[heads * head_dim, ...]`."""
    _check_rows(fused, heads, head_dim, what)
    if layout == "stacked":
        return tuple(part.contiguous() for part in fused.chunk(3, dim=0))
    if layout == "interleaved":
        grouped = fused.reshape(heads, 3, head_dim, *fused.shape[1:])
        return tuple(part.reshape(heads * head_dim, *fused.shape[1:]).contiguous() for part in grouped.unbind(1))
    raise H3WeightsError(f"qkv layout must be one of {QKV_LAYOUTS}, got {layout!r}")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, head_dim: int, layout: str):
    """(q, k, v) -> one fused tensor in `layout` (exact inverse of `split_qkv`)."""
    if not (q.shape == k.shape == v.shape) or q.shape[0] != heads * head_dim:
        raise H3WeightsError(
            f"cannot fuse q/k/v of shapes {list(q.shape)}/{list(k.shape)}/{list(v.shape)} "
            f"into {heads} heads of {head_dim}"
        )
    if layout == "stacked":
        return torch.cat([q, k, v], dim=0)
    if layout == "interleaved":
        rest = q.shape[1:]
        grouped = torch.stack([t.reshape(heads, head_dim, *rest) for t in (q, k, v)], dim=1)
        return grouped.reshape(3 * heads * head_dim, *rest)
    raise H3WeightsError(f"qkv layout must be one of {QKV_LAYOUTS}, got {layout!r}")


def swap_halves(tensor: torch.Tensor, what: str = "gated projection") -> torch.Tensor:
    """`[a; b]` -> `[b; a]` along rows: converts `[gate; value]` <-> `[value; gate]`."""
    if tensor.shape[0] % 2:
        raise H3WeightsError(f"{what}: {tensor.shape[0]} rows cannot be split into gate and value halves")
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)
