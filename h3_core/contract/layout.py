"""The contract's tensor layouts: video latents <-> DiT patch rows, audio latents <-> channel-major rows.

These are exactly what the DiT sees, and all three implementations (ComfyUI core, diffusers, vLLM-Omni)
agree on them:

* Patchify: a video latent `[1, C, T, H, W]` becomes rows `[T*(H/2)*(W/2), C*1*2*2]`, ordered t, then h,
  then w, each 1x2x2 patch flattened channel-major (`einsum("nctrhpwq->nthwcrpq")`).
* Audio rows are channel-major stereo: `[2*T, A]` = channel 0 frames 0..T-1, then channel 1. ComfyUI core
  keeps the latent as `[1, A, 2, T]` and packs it with `latent[0].permute(1, 2, 0).reshape(2*T, A)`.

Every function is a pure reshuffle (bit exact) that validates its input and returns a contiguous tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import facts
from .errors import ContractError

__all__ = [
    "audio_latent_to_rows",
    "audio_rows_to_latent",
    "patchify_video_latent",
    "unpatchify_video_rows",
]


def _got(value: object) -> object:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def patchify_video_latent(latent: torch.Tensor, patch_size: Sequence[int] = facts.PATCH_SIZE) -> torch.Tensor:
    """`[1, C, T, H, W]` -> `[(T/pt)*(H/ph)*(W/pw), C*pt*ph*pw]` rows, t-major then h then w, each patch
    flattened channel-major (`einsum("nctrhpwq->nthwcrpq")`). Contiguous; a pure reshuffle (bit exact)."""
    if not isinstance(latent, torch.Tensor) or latent.ndim != 5 or latent.shape[0] != 1:
        raise ContractError("latent: must be a [1, C, T, H, W] tensor", field="latent")
    pt, ph, pw = (int(p) for p in patch_size)
    _, c, t, h, w = latent.shape
    if t % pt or h % ph or w % pw:
        raise ContractError(f"latent: shape {tuple(latent.shape)} is not divisible by the patch {tuple(patch_size)}",
                            field="latent")
    x = latent.reshape(1, c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # n t h w c r p q
    return x.reshape(-1, c * pt * ph * pw).contiguous()


def unpatchify_video_rows(
    rows: torch.Tensor,
    latent_t: int,
    latent_h: int,
    latent_w: int,
    channels: int,
    patch_size: Sequence[int] = facts.PATCH_SIZE,
) -> torch.Tensor:
    """Inverse of `patchify_video_latent`: rows -> `[1, channels, latent_t, latent_h, latent_w]`, contiguous."""
    pt, ph, pw = (int(p) for p in patch_size)
    if latent_t % pt or latent_h % ph or latent_w % pw:
        raise ContractError(f"rows: latent shape {(latent_t, latent_h, latent_w)} is not divisible by the patch "
                            f"{tuple(patch_size)}", field="rows")
    n = (latent_t // pt) * (latent_h // ph) * (latent_w // pw)
    width = channels * pt * ph * pw
    if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or tuple(rows.shape) != (n, width):
        raise ContractError(f"rows: expected shape ({n}, {width}), got {_got(rows)}", field="rows")
    x = rows.reshape(1, latent_t // pt, latent_h // ph, latent_w // pw, channels, pt, ph, pw)
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)  # n c t r h p w q
    return x.reshape(1, channels, latent_t, latent_h, latent_w).contiguous()


def audio_latent_to_rows(latent: torch.Tensor) -> torch.Tensor:
    """ComfyUI-layout audio latent `[1, A, 2, T]` -> channel-major rows `[2*T, A]` (ch0 t0..T-1, then ch1)."""
    if not isinstance(latent, torch.Tensor) or latent.ndim != 4 or latent.shape[0] != 1 \
            or latent.shape[2] != facts.AUDIO_CHANNELS:
        raise ContractError(f"audio_latent: must be a [1, A, 2, T] tensor, got {_got(latent)}", field="audio_latent")
    a, _, t = latent.shape[1:]
    return latent[0].permute(1, 2, 0).reshape(facts.AUDIO_CHANNELS * t, a).contiguous()


def audio_rows_to_latent(rows: torch.Tensor) -> torch.Tensor:
    """Channel-major rows `[2*T, A]` -> ComfyUI-layout audio latent `[1, A, 2, T]`, contiguous."""
    if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or rows.shape[0] % facts.AUDIO_CHANNELS:
        raise ContractError(f"audio rows: must be [2*T, A], got {_got(rows)}", field="audio_rows")
    t = rows.shape[0] // facts.AUDIO_CHANNELS
    return rows.reshape(facts.AUDIO_CHANNELS, t, rows.shape[1]).permute(2, 0, 1).unsqueeze(0).contiguous()
