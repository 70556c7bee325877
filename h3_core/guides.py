"""Guides: an image, a clip, an audio, or a clip with its soundtrack anchored at any frame of the output.

ComfyUI core's `MiniMaxH3AddGuide` semantics, which the pack follows everywhere (graph, CLI, encoder server):

* `frame_index` counts output pixel frames from 0; a negative one counts from the end (-1 is the last frame).
* Frames: one image, or a clip. A clip of 5 frames or more is cut *down* to the video VAE's grid (17k+5: 5, 22, 39,
  ...); a batch shorter than 5 frames anchors its first image only. The guide must fit: `index + frames <= num_frames`.
* Audio: anchored at the same index and cut to the output's remaining soundtrack, `floor(audio_t - 5/3 * index)`
  latents (the two streams share one rotary clock: 5/3 per pixel frame, 1 per audio latent); at least one latent
  must remain.
* Guides chain: several may be given, each its own rows. They ride in the conditioning as core's `minimax_keyframes`
  entries (`resolved_frame_index`, `latent`, `audio_latent`), so core's sampler reads the pack's guides and the
  pack's Sampler reads core's.

This module holds the request side (`GuideMedia`, checked and put on the canvas by `prepare`) and the rules both
sides share (`clip_frames`, `fit_error`, `audio_latent_cap`). The packed layout that samples them is
`guide_layout.py`; the contract's field is `H3Conditioning.guides`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import facts, rules

# Rotary time per output pixel frame, in audio latents (24 fps video, 40 latents/s): the clock both streams share.
FRAME_RESCALE = facts.AUDIO_LATENTS_PER_SECOND / facts.FPS  # 5/3

# A guide clip or audio is held to a reference's 15 s (the contract's size bounds for a condition latent and its
# audio rows; core has no cap of its own): 345 frames, 600 audio latents.
MAX_GUIDE_FRAMES = rules.snap_frames_down(int(facts.MAX_AUDIO_CLIP_S * facts.FPS))  # 345
MAX_GUIDE_AUDIO_LATENTS = facts.audio_latents(facts.MAX_AUDIO_CLIP_S)  # 600
SAMPLES_PER_AUDIO_LATENT = facts.AUDIO_SAMPLE_RATE // facts.AUDIO_LATENTS_PER_SECOND  # 800


@dataclass
class GuideMedia:
    """One guide of a request, as decoded: frames uint8 [N, H, W, 3] and/or audio float32 [C, S] at its rate."""

    frame_index: int
    frames: np.ndarray | None = None
    audio: np.ndarray | None = None
    sample_rate: int | None = None

    @property
    def frame_count(self) -> int:
        """How many frames the guide anchors (core's rule): 0 without frames, 1 below 5, else 17k+5 cut down."""
        return 0 if self.frames is None else clip_frames(int(self.frames.shape[0]))


@dataclass
class PreparedGuide:
    """A guide on the output's canvas: resolved frame, pixels uint8 [1, 3, n, H, W], audio float32 [2, S] at 32 kHz."""

    frame: int
    pixels: object | None  # torch uint8 [1, 3, n, H, W] (torch imported lazily)
    audio: np.ndarray | None
    audio_cap: int  # the most audio latents the output leaves after `frame`


def clip_frames(batch: int) -> int:
    """Frames a batch anchors: 1 below 5 frames (its first image), else cut down to 17k+5 (core's rule)."""
    if batch < facts.LATENTS_PER_CLIP:
        return 1 if batch >= 1 else 0
    return rules.snap_frames_down(batch)


def frames_of_latent_t(latent_t: int) -> int | None:
    """Pixel frames a guide latent of `latent_t` frames stands for (1 -> 1, 5k+2 -> 17k+5), None for other T."""
    if latent_t == 1:
        return 1
    if latent_t >= 2 and (latent_t - 2) % facts.LATENTS_PER_CLIP == 0:
        return (latent_t - 2) // facts.LATENTS_PER_CLIP * facts.FRAMES_PER_CLIP + facts.LATENTS_PER_CLIP
    return None


def resolve_index(frame_index: int, num_frames: int) -> int:
    """Core's `resolved_frame_index`: a negative index counts from the end."""
    return frame_index if frame_index >= 0 else num_frames + frame_index


def audio_latent_cap(frame: int, num_frames: int) -> int:
    """The audio latents a guide at `frame` keeps: what the output leaves from there on, floor(audio_t - 5/3 *
    frame) (core's rule), and at most 15 s."""
    return min(math.floor(facts.audio_latent_frames(num_frames) - FRAME_RESCALE * frame), MAX_GUIDE_AUDIO_LATENTS)


def fit_error(frame_index: int, frames: int, num_frames: int, *, audio: bool = False) -> str | None:
    """Why a guide of `frames` frames (0: audio only) at `frame_index` does not fit a `num_frames` output, or None."""
    frame = resolve_index(frame_index, num_frames)
    if frames > MAX_GUIDE_FRAMES:
        return (f"a guide clip anchors at most {MAX_GUIDE_FRAMES} frames ({MAX_GUIDE_FRAMES / facts.FPS:.1f} s), "
                f"got {frames}: cut the clip")
    if frames <= 1 and not 0 <= frame < num_frames:
        return f"frame_idx {frame_index} is outside the video's {num_frames} frames"
    if frames > 1 and (frame < 0 or frame + frames > num_frames):
        return (f"a {frames}-frame guide clip at frame_idx {frame_index} does not fit in the video's "
                f"{num_frames} frames (it would end at frame {frame + frames - 1})")
    if audio and audio_latent_cap(frame, num_frames) < 1:
        return f"frame_idx {frame_index} is past the end of the video's audio track"
    return None


def check(guides, num_frames: int) -> None:
    """Every guide of a request against the output length, before anything is resized or encoded."""
    if len(guides) > facts.MAX_GUIDES:
        raise rules.H3InputError(f"at most {facts.MAX_GUIDES} guides per request, got {len(guides)}")
    for number, guide in enumerate(guides, start=1):
        index = guide.frame_index
        if not isinstance(index, int) or isinstance(index, bool) or abs(index) > facts.MAX_FRAMES:
            raise rules.H3InputError(f"guide {number}: frame_idx must be an integer within ±{facts.MAX_FRAMES}, "
                                     f"got {index!r}")
        if guide.frames is None and guide.audio is None:
            raise rules.H3InputError(f"guide {number} needs an image, a clip or an audio to anchor")
        if guide.frames is not None:
            frames = guide.frames
            if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 \
                    or frames.shape[-1] != 3 or min(frames.shape[:3]) < 1:
                raise rules.H3InputError(f"guide {number}: frames must be uint8 RGB [N, H, W, 3], got "
                                         f"{getattr(frames, 'dtype', type(frames))} {getattr(frames, 'shape', '')}")
        if guide.audio is not None:
            if guide.sample_rate is None or guide.sample_rate <= 0:
                raise rules.H3InputError(f"guide {number}: its audio needs a positive sample rate")
            if guide.audio.ndim != 2 or guide.audio.shape[-1] < 1:
                raise rules.H3InputError(f"guide {number}: audio must be [channels, samples], got "
                                         f"{tuple(guide.audio.shape)}")
        problem = fit_error(index, guide.frame_count, num_frames, audio=guide.audio is not None)
        if problem:
            raise rules.H3InputError(f"guide {number}: {problem}")


def _cover(image: np.ndarray, width: int, height: int):
    """One frame scaled to cover the canvas and centre-cropped (core's "center" crop), Lanczos."""
    from PIL import Image

    h, w = image.shape[:2]
    scale = max(width / w, height / h)
    size = (max(width, round(w * scale)), max(height, round(h * scale)))
    resized = Image.fromarray(image).resize(size, Image.LANCZOS)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    return np.asarray(resized.crop((left, top, left + width, top + height)))


def prepare(guides, width: int, height: int, num_frames: int) -> list[PreparedGuide]:
    """Each guide resolved and on the canvas: frames cut to what the guide anchors and cover-cropped, audio resampled
    to 32 kHz stereo and cut a second past what the output leaves (the latents are cut exactly after encoding)."""
    import torch

    from . import media

    check(guides, num_frames)
    out = []
    for guide in guides:
        frame = resolve_index(guide.frame_index, num_frames)
        pixels = None
        if guide.frames is not None:
            kept = guide.frames[:guide.frame_count]
            canvas = np.stack([_cover(f, width, height) for f in kept])
            pixels = torch.from_numpy(np.ascontiguousarray(canvas)).permute(3, 0, 1, 2)[None]
        audio, cap = None, audio_latent_cap(frame, num_frames)
        if guide.audio is not None:
            keep = int(math.ceil((cap + facts.AUDIO_LATENTS_PER_SECOND) / facts.AUDIO_LATENTS_PER_SECOND
                                 * guide.sample_rate))
            audio = media.resample_audio(guide.audio[:, :keep], guide.sample_rate, facts.AUDIO_SAMPLE_RATE)
        out.append(PreparedGuide(frame=frame, pixels=pixels, audio=audio, audio_cap=cap))
    return out


def continuation(frames: np.ndarray, fps: float, audio: np.ndarray | None, rate: int | None,
                 overlap: int) -> GuideMedia:
    """The guide that continues a clip: its last `overlap` frames (cut down to 17k+5; at 24 fps, frames picked by
    time from a clip at another rate) and the soundtrack under them, anchored at frame 0 of the new video."""
    overlap = min(clip_frames(overlap), MAX_GUIDE_FRAMES)
    if fps is None or fps <= 0 or frames.shape[0] < 1:
        raise rules.H3InputError(f"the clip to continue needs frames and a positive frame rate, got "
                                 f"{frames.shape[0]} frames at {fps!r} fps")
    duration = frames.shape[0] / fps
    if duration * facts.FPS + 1e-6 < overlap:
        raise rules.H3InputError(f"the clip is {duration:.2f} s ({frames.shape[0]} frames at {fps:g} fps), shorter "
                                 f"than the {overlap} frames ({overlap / facts.FPS:.2f} s) to continue from: lower "
                                 "the overlap")
    times = duration - (np.arange(overlap)[::-1] + 0.5) / facts.FPS  # centres of the last `overlap` 24 fps frames
    picked = np.clip(np.floor(times * fps).astype(int), 0, frames.shape[0] - 1)
    tail = None
    if audio is not None:
        samples = int(round(overlap / facts.FPS * rate))
        tail = np.ascontiguousarray(audio[:, -samples:]) if samples < audio.shape[-1] else audio
    return GuideMedia(0, np.ascontiguousarray(frames[picked]), tail, rate if tail is not None else None)


def crop_audio_rows(rows, cap: int):
    """Channel-major audio rows [2T, A] cut to `cap` latents per channel (no copy when already short enough)."""
    t = rows.shape[0] // facts.AUDIO_CHANNELS
    if t <= cap:
        return rows
    return rows.reshape(facts.AUDIO_CHANNELS, t, rows.shape[1])[:, :cap].reshape(-1, rows.shape[1]).contiguous()
