"""Streamed video-VAE encode of one visual condition (keyframe, image or video reference): clip by clip from uint8.

diffusers' `encode_vae_condition` turns the whole uint8 video into float32 and normalises it (`to`, `div`, `-`,
`/`: whole-video float temporaries of 4 bytes a pixel each), pads it to whole clips with a whole-video `cat`, and
only then calls `vae.encode`, which encodes it one `clip_length`-frame clip at a time anyway. For a long reference
that is several float copies of the video next to the model (a 10 s 1344x768 reference at 24 fps: ~3 GB each).

`encode_condition` converts and normalises each clip on its own, right before diffusers' own `_encode_clip` encodes
it, and pads the last clip by repeating its last uint8 frame. Every operation is element-wise on the same values in
the same order, the moments are concatenated, cut by `token_drop`, sampled and rounded exactly as diffusers does,
so the latents are bit-identical (tests/test_vae_encode.py). The peak holds the uint8 video (which the request holds
anyway) plus one clip's work: it no longer grows by float copies of the whole video. A single frame (keyframe, image
reference) has no clips and goes through diffusers' helper unchanged.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import diffusers_adapter


def clip_count(vae, frames: int) -> int:
    """Temporal clips `vae` encodes a video of `frames` frames in (0 for a single frame: no temporal path)."""
    return 0 if frames == 1 else -(-frames // int(vae.config.clip_length))


def units(vae, frames: int) -> int:
    """Progress units of one condition: its clips, or 1 for a single frame."""
    return max(1, clip_count(vae, frames))


@torch.no_grad()
def encode_condition(vae, pixels: torch.Tensor, pixel_mean, pixel_std, encode_seed: int,
                     on_clip: Callable[[], None] | None = None) -> torch.Tensor:
    """Normalised latents `[1, 24, T, h, w]` (float32, CPU) of uint8 `pixels` `[1, 3, F, H, W]` on the VAE's device,
    bit-identical to diffusers' `encode_vae_condition`. `on_clip()` is called after each clip (once for a single
    frame): `units(vae, frames)` calls in all."""
    frames = int(pixels.shape[2])
    clips = clip_count(vae, frames)
    if clips == 0 or pixels.dtype != torch.uint8:
        latents = diffusers_adapter.encode_vae_condition(vae, pixels, pixel_mean, pixel_std, encode_seed=encode_seed)
        if on_clip is not None:
            on_clip()
        return latents
    diffusers_adapter.run_offload_hook(vae)  # what diffusers' `apply_forward_hook` on `vae.encode` does first
    length = int(vae.config.clip_length)
    mean = torch.tensor(pixel_mean, device=pixels.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(pixel_std, device=pixels.device).view(1, -1, 1, 1, 1)
    dtype = diffusers_adapter.parameter_dtype(vae.encoder)  # `vae.encode` casts its input to the encoder's dtype
    moments = []
    for i in range(clips):
        clip = pixels[:, :, i * length: (i + 1) * length]
        if clip.shape[2] < length:  # diffusers repeats the last (normalised) frame: the same values
            clip = torch.cat([clip, clip[:, :, -1:].repeat(1, 1, length - clip.shape[2], 1, 1)], dim=2)
        x = ((clip.to(torch.float32).div(255.0) - mean) / std).to(dtype)
        moments.append(diffusers_adapter.vae_encode_clip(vae, x))
        del x, clip
        if on_clip is not None:
            on_clip()
    moments = torch.cat(moments, dim=2)
    drop = int(vae.config.token_drop)
    if drop > 0:
        moments = moments[:, :, :-drop]
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    latents = DiagonalGaussianDistribution(moments).sample(generator=torch.Generator().manual_seed(encode_seed))
    latents = latents.to(torch.float16).float().cpu()
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    latents_std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (latents - latents_mean) / latents_std
