"""The packed sequence of a guided fl2va request: `[text | each guide's video and audio rows | target audio | target
video]`, and the diffusers blocks that sample it.

diffusers' fl2va layout (`MiniMaxH3PrepareLayoutStep`) anchors single-frame keyframes at the first and last frame
only. Guides (`h3_core/guides.py`) go anywhere, as clips and as audio, so a conditioning with guides is laid out here,
after ComfyUI core's `PackedLayout` (comfy/ldm/minimax/model.py), the reference for guides:

* every guide's rows start at rotary time `text_len + 5/3 * frame` (5/3 per output pixel frame: 24 fps video and
  40 latents/s audio on one clock); its video rows take the target's spatial grid and the latent-frame spacing
  `5/3 * (1, 4, 4, 4, 4)` from there, its audio rows one unit per latent, channel-major, pinned to the width grid's
  two extremes (as the target's audio is);
* the keyframe anchors are guides at frame 0 and `num_frames - 1` (an image each);
* video guide rows are conditioning rows at the keyframes' noise level (diffusers' `keyframe_noise_aug`, 0.999),
  audio guide rows are clean (timestep 1.0), as core and as diffusers' reference audio rows.

A conditioning without guides never comes here: its layout stays diffusers' own, bit-exact with diffusers. Everything
else a step does (condition noise, timestep plan, denoise loop, scheduler steps) is diffusers' own blocks, fed the
rows through their `num_condition_video_rows` / `num_condition_audio_rows` (the ref2va latents step concatenates the
audio condition rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import facts
from .guides import FRAME_RESCALE

# Output pixel frames per latent frame, in the order a clip's latent frames come (the first latent is one frame).
FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
ROPE_SPATIAL_SCALE = 32.0


@dataclass(frozen=True)
class GuideRows:
    """One guide as the layout sees it: its frame, and how many video latent frames / audio latents it brings."""

    frame: int
    video_t: int  # 0: no video rows
    audio_t: int  # 0: no audio rows


def entries_of(cond) -> list[GuideRows]:
    """The conditioning's keyframe anchors and guides, in condition-latent order (anchors first)."""
    out = [GuideRows(0 if anchor == "first" else cond.num_frames - 1, 1, 0) for anchor in cond.keyframe_anchors]
    video = iter(cond.condition_latents[len(cond.keyframe_anchors):])
    audio = iter(cond.audio_condition_latents)
    for guide in cond.guides:
        video_t = int(next(video).shape[2]) if guide.video else 0
        audio_t = int(next(audio).shape[0]) // facts.AUDIO_CHANNELS if guide.audio else 0
        out.append(GuideRows(guide.frame, video_t, audio_t))
    return out


def _axis(dim: int, patch: int, sqrt_area: float) -> torch.Tensor:
    ratio = dim / sqrt_area
    n = dim // patch
    return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1.0 - ratio) / 2.0) * ROPE_SPATIAL_SCALE


def frame_grid(latent_h: int, latent_w: int, patch_h: int, patch_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `(h, w)` rotary coordinates of one latent frame's patch rows (area-normalised), and its width axis."""
    sqrt_area = math.sqrt(latent_h * latent_w)
    hh, ww = torch.meshgrid(_axis(latent_h, patch_h, sqrt_area), _axis(latent_w, patch_w, sqrt_area), indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), _axis(latent_w, patch_w, sqrt_area)


def time_grid(latent_t: int, origin: float) -> torch.Tensor:
    """Rotary time of each latent frame from `origin`: exclusive cumsum of 5/3 * (1, 4, 4, 4, 4, 1, 4, ...)."""
    spans = torch.tensor([FRAME_RESCALE * FRAMES_PER_LATENT[k % len(FRAMES_PER_LATENT)] for k in range(latent_t)],
                         dtype=torch.float64)
    return float(origin) + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def _video_positions(latent_t: int, grid: torch.Tensor, origin: float) -> torch.Tensor:
    out = torch.empty(latent_t, grid.shape[0], 3, dtype=torch.float64)
    out[:, :, 0] = time_grid(latent_t, origin)[:, None]
    out[:, :, 1:] = grid[None]
    return out.reshape(-1, 3)


def _audio_positions(t: int, origin: float, w_low: float, w_high: float, channels: int) -> torch.Tensor:
    out = torch.zeros(t * channels, 3, dtype=torch.float64)
    out[:, 0] = (origin + torch.arange(t, dtype=torch.float64)).repeat(channels)
    out[:t, 2] = w_low
    out[t:, 2] = w_high
    return out


def build(text_token_tags: torch.Tensor, num_latent_frames: int, latent_h: int, latent_w: int,
          num_audio_latents: int, entries: list[GuideRows], *, patch_size=facts.PATCH_SIZE,
          audio_channels: int = facts.AUDIO_CHANNELS, audio_tag: int = 2, video_tag: int = 0) -> dict:
    """The layout outputs diffusers' layout step makes (same names), for `entries` anchored as core anchors them."""
    _, patch_h, patch_w = patch_size
    grid, width_axis = frame_grid(latent_h, latent_w, patch_h, patch_w)
    w_low, w_high = float(width_axis[0]), float(width_axis[-1])
    rows_per_frame = grid.shape[0]
    text_len = int(text_token_tags.shape[0])
    text_pos = torch.zeros(text_len, 3, dtype=torch.float64)
    text_pos[:, 0] = torch.arange(text_len, dtype=torch.float64)
    positions, video_index, audio_index = [text_pos], [], []
    row = text_len
    for entry in entries:
        origin = text_len + FRAME_RESCALE * entry.frame
        if entry.video_t:
            n = entry.video_t * rows_per_frame
            positions.append(_video_positions(entry.video_t, grid, origin))
            video_index.append(torch.arange(row, row + n))
            row += n
        if entry.audio_t:
            n = entry.audio_t * audio_channels
            positions.append(_audio_positions(entry.audio_t, origin, w_low, w_high, audio_channels))
            audio_index.append(torch.arange(row, row + n))
            row += n
    n_cond_video = sum(int(i.numel()) for i in video_index)
    n_cond_audio = sum(int(i.numel()) for i in audio_index)
    n_audio = num_audio_latents * audio_channels
    positions.append(_audio_positions(num_audio_latents, float(text_len), w_low, w_high, audio_channels))
    audio_index.append(torch.arange(row, row + n_audio))
    row += n_audio
    n_video = num_latent_frames * rows_per_frame
    positions.append(_video_positions(num_latent_frames, grid, float(text_len)))
    video_index.append(torch.arange(row, row + n_video))
    row += n_video

    video_indices, audio_indices = torch.cat(video_index), torch.cat(audio_index)
    token_tags = torch.empty(row, dtype=torch.long)
    token_tags[:text_len] = text_token_tags.to(torch.long)
    token_tags[audio_indices] = audio_tag
    token_tags[video_indices] = video_tag
    return {"position_ids": torch.cat(positions), "token_tags": token_tags, "video_indices": video_indices,
            "audio_indices": audio_indices, "text_indices": torch.arange(text_len),
            "num_condition_video_rows": n_cond_video, "num_condition_audio_rows": n_cond_audio}


def guided_blocks(blocks: dict) -> dict:
    """diffusers' resolved fl2va denoise blocks with the layout step replaced by the guided one and the latents step
    by the one that also puts the audio condition rows ahead of the generated audio (ref2va's)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3Ref2VAPrepareLatentsStep

    out = {}
    for name, block in blocks.items():
        if name == "denoise.prepare_layout":
            block = _guided_layout_step()
        elif name == "denoise.prepare_latents_fl2va":
            block = MiniMaxH3Ref2VAPrepareLatentsStep()
        out[name] = block
    return out


def _guided_layout_step():
    """diffusers' layout step (its canvas and 17k+5 resolution, its output names) with the guided layout built from
    the `guide_rows` input instead of first/last anchors."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep
    from diffusers.modular_pipelines.modular_pipeline_utils import InputParam

    class GuidedLayoutStep(MiniMaxH3PrepareLayoutStep):
        @property
        def description(self) -> str:
            return "The pack's layout for guides at any frame (h3_core/guide_layout.py), after core's PackedLayout."

        @property
        def inputs(self):
            # keyframe_anchors stays declared (the caller passes none): the anchors are among `guide_rows`
            return super().inputs + [
                InputParam(name="guide_rows", type_hint=list, required=True,
                           description="GuideRows per keyframe anchor and guide, in condition-latent order."),
            ]

        @torch.no_grad()
        def __call__(self, components, state):
            guide_rows = self.get_block_state(state).guide_rows
            components, state = super().__call__(components, state)  # the geometry; the layout is rebuilt below
            layout = build(state.get("text_token_tags").cpu(), state.get("num_latent_frames"),
                           state.get("latent_height"), state.get("latent_width"), state.get("num_audio_latents"),
                           guide_rows, patch_size=components.patch_size, audio_channels=components.audio_channels,
                           audio_tag=components.audio_tag, video_tag=components.video_tag)
            old_positions = state.get("position_ids")
            layout["position_ids"] = layout["position_ids"].to(old_positions.device, old_positions.dtype)
            for name, value in layout.items():  # the names diffusers' step just set (their kwargs types kept)
                state.values[name] = value.to(old_positions.device) if isinstance(value, torch.Tensor) else value
            return components, state

    return GuidedLayoutStep()
