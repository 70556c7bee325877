"""Live previews: the video latent the sampler holds at a step, as a small RGB picture.

Pure math, no ComfyUI: the nodes turn the picture into ComfyUI's own preview event.

What is previewed. Each DiT forward predicts a velocity for every row of the packed sequence; the
flow-matching estimate of the clean latent at that step is `x0 = x_t + sigma * v` (H3's velocity points
towards the data, see diffusers' `MiniMaxH3Scheduler`). The generated video rows are the last rows of the
video part of the sequence (condition rows come first); they unpatchify to `[1, 24, T, H/16, W/16]`.

How a latent becomes RGB. A linear map per latent pixel, `rgb = latent · factors + bias` (24 × 3 and 3),
the same kind of approximation as ComfyUI's "latent2rgb" previews. Which table:

- ComfyUI cores that know H3 publish its table (`latent_formats.MiniMaxH3Video.latent_rgb_factors`);
  the nodes use it when the running core has it (`nodes/comfy_bridge.py`).
- Otherwise `TINY_RGB_FACTORS` / `TINY_RGB_BIAS` below: a least-squares fit of *the embedded tiny H3's*
  video VAE (random weights), made by `fit_from_vae` (`python -m h3_core.previews <tiny dir>` prints it).
  It is honest only for that model: the released VAE's latent space is different and no published table
  was available offline, so with the released weights on an older core the colours are arbitrary (the
  motion and layout still show). `tests/test_previews.py` re-fits the tiny VAE and checks the table.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from . import facts, rules
from .contract.layout import unpatchify_video_rows


def generated_video_geometry(num_frames: int, height: int, width: int) -> tuple[int, int, int]:
    """(latent_t, latent_h, latent_w) of the video a request generates (frames snapped up like stage 1)."""
    frames = rules.snap_frames_up(int(num_frames))
    factor = facts.VAE_SPATIAL_FACTOR
    return facts.video_latent_frames(frames), int(height) // factor, int(width) // factor


def denoised_video(
    x_rows: torch.Tensor, velocity_rows: torch.Tensor, sigma: float, geometry: tuple[int, int, int]
) -> torch.Tensor | None:
    """The step's clean-latent estimate of the generated video, `[1, 24, T, h, w]` float32 on the CPU.

    `x_rows` / `velocity_rows`: the video rows `[N, 96]` the DiT read and predicted (condition rows first).
    None when the rows do not hold the expected geometry (a preview is never worth an error)."""
    latent_t, latent_h, latent_w = geometry
    pt, ph, pw = facts.PATCH_SIZE
    count = (latent_t // pt) * (latent_h // ph) * (latent_w // pw)
    if x_rows.ndim != 2 or x_rows.shape != velocity_rows.shape or x_rows.shape[0] < count or count == 0:
        return None
    if x_rows.shape[1] != facts.VIDEO_LATENT_CHANNELS * pt * ph * pw:
        return None
    x0 = x_rows[-count:].detach().float().cpu() + float(sigma) * velocity_rows[-count:].detach().float().cpu()
    return unpatchify_video_rows(x0, latent_t, latent_h, latent_w, facts.VIDEO_LATENT_CHANNELS)


def latent_frame_to_rgb(latent: torch.Tensor, factors: torch.Tensor, bias: torch.Tensor | None) -> np.ndarray:
    """One latent frame `[24, h, w]` -> uint8 RGB `[h, w, 3]` (values mapped from [-1, 1], clamped)."""
    frame = latent.float().permute(1, 2, 0) @ factors.float()  # [h, w, 3]
    if bias is not None:
        frame = frame + bias.float()
    return ((frame.clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8).numpy()


def preview_rgb(video: torch.Tensor, factors=None, bias=None, frame: int | None = None) -> np.ndarray:
    """The preview picture of a video latent `[1, 24, T, h, w]`: one latent frame (the middle one by default:
    the first is often a keyframe anchor, which says nothing about the sampling), uint8 `[h, w, 3]`."""
    if factors is None:  # the pack's own table, with its own bias
        factors, bias = TINY_RGB_FACTORS, TINY_RGB_BIAS
    factors = torch.as_tensor(factors, dtype=torch.float32)
    bias = None if bias is None else torch.as_tensor(bias, dtype=torch.float32)
    if tuple(factors.shape) != (video.shape[1], 3):
        raise ValueError(f"RGB factors must be [{video.shape[1]}, 3], got {tuple(factors.shape)}")
    index = video.shape[2] // 2 if frame is None else frame
    return latent_frame_to_rgb(video[0, :, index], factors, bias)


# --- the fallback table: a least-squares fit of the embedded tiny H3's video VAE -----------------


def fit_linear_rgb(latents: torch.Tensor, rgb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least squares `rgb ≈ latents · F + b` over paired samples: latents `[N, C]`, rgb `[N, 3]` in [-1, 1]."""
    design = torch.cat([latents.double(), torch.ones(latents.shape[0], 1, dtype=torch.float64)], dim=1)
    solution = torch.linalg.lstsq(design, rgb.double()).solution  # [C + 1, 3]
    return solution[:-1].float(), solution[-1].float()


def fit_from_vae(vae, size: int = 256, images: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit the table for a video VAE: encode blocky random-colour images (one latent pixel per 16×16 colour
    block, so each latent pixel has one colour to explain) and regress the block colours on the latents."""
    from .diffusers_adapter import encode_vae_condition

    factor = facts.VAE_SPATIAL_FACTOR
    generator = torch.Generator("cpu").manual_seed(seed)
    xs, ys = [], []
    for _ in range(images):
        blocks = torch.randint(0, 256, (3, size // factor, size // factor), generator=generator, dtype=torch.uint8)
        pixels = blocks.repeat_interleave(factor, 1).repeat_interleave(factor, 2)[None, :, None]  # [1, 3, 1, H, W]
        with torch.no_grad():
            latent = encode_vae_condition(vae, pixels, facts.PIXEL_MEAN, facts.PIXEL_STD,
                                          encode_seed=facts.KEYFRAME_ENCODE_SEED)  # [1, 24, 1, h, w]
        xs.append(latent[0, :, 0].float().reshape(latent.shape[1], -1).T)
        ys.append((blocks.float() / 127.5 - 1.0).reshape(3, -1).T)
    return fit_linear_rgb(torch.cat(xs), torch.cat(ys))


# Fitted on the embedded tiny H3 (h3_core.tiny, seed 0) by `fit_from_vae(vae)`; rows are latent channels.
TINY_RGB_FACTORS = [
    [ 0.0059, -0.0028,  0.0285],
    [ 0.0072, -0.0074, -0.0231],
    [ 0.0244, -0.0159,  0.0044],
    [ 0.0086,  0.0016,  0.0088],
    [-0.0036,  0.0005, -0.0118],
    [-0.0202, -0.0053,  0.0152],
    [ 0.0230, -0.0163,  0.0058],
    [-0.0002,  0.0129,  0.0034],
    [-0.0011,  0.0012, -0.0140],
    [-0.0141,  0.0022,  0.0022],
    [ 0.0079, -0.0017,  0.0287],
    [-0.0194, -0.0118,  0.0023],
    [-0.0022,  0.0075, -0.0177],
    [-0.0136, -0.0194, -0.0007],
    [ 0.0114,  0.0017,  0.0130],
    [-0.0007, -0.0008,  0.0043],
    [ 0.0067,  0.0032,  0.0049],
    [-0.0054, -0.0055, -0.0258],
    [ 0.0059, -0.0014,  0.0045],
    [-0.0035,  0.0054,  0.0053],
    [ 0.0081, -0.0163, -0.0048],
    [-0.0038,  0.0089,  0.0031],
    [-0.0008, -0.0046, -0.0078],
    [-0.0080,  0.0256, -0.0002],
]
TINY_RGB_BIAS = [-0.0500, -0.0010,  0.0354]


def main(argv: list[str]) -> int:
    """`python -m h3_core.previews <model dir>`: print the fitted table of that model's video VAE."""
    from .models import ModelSource

    vae = ModelSource.from_path(argv[0]).load("vae")
    factors, bias = fit_from_vae(vae)
    print("TINY_RGB_FACTORS = [")
    for row in factors.tolist():
        print("    [" + ", ".join(f"{v: .4f}" for v in row) + "],")
    print("]")
    print("TINY_RGB_BIAS = [" + ", ".join(f"{v: .4f}" for v in bias.tolist()) + "]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
