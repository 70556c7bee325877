"""H3's request rules as pure functions: frame grid, canvas, durations, reference counts.

Every entry point (CLI, ComfyUI nodes, encoder server) validates through these functions before
any heavy work, so a bad request fails the same way, with the same message, wherever it enters.
The rules are vLLM-Omni's serving rules and diffusers' modular pipeline's checks; diffusers wins where
the two disagree. The output length is ComfyUI core's (5..3592 frames on the 17k+5 grid): diffusers' 5-15 s, checked
after snapping, is H3's trained range, a warning (`trained_range_warning`), not a refusal. The numbers live in
`facts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import facts

TASKS = ("t2va", "fl2va", "ref2va")


class H3InputError(ValueError):
    """A request breaks one of H3's rules; the message names the rule and the offending value."""


# --- frame grid ----------------------------------------------------------------------------------


def snap_frames_up(num_frames: int) -> int:
    """The next frame count of the form 17k+5 at or above `num_frames`."""
    if num_frames < 1:
        raise H3InputError(f"frame count must be positive, got {num_frames}")
    k = max(0, math.ceil((num_frames - facts.LATENTS_PER_CLIP) / facts.FRAMES_PER_CLIP))
    return facts.FRAMES_PER_CLIP * k + facts.LATENTS_PER_CLIP


def snap_frames_down(num_frames: int) -> int:
    """The largest frame count of the form 17k+5 not above `num_frames` (at least 5)."""
    k = max(0, (num_frames - facts.LATENTS_PER_CLIP) // facts.FRAMES_PER_CLIP)
    return facts.FRAMES_PER_CLIP * k + facts.LATENTS_PER_CLIP


def check_output_frames(num_frames: int) -> int:
    """Validate an output length: on the 17k+5 grid and within the lengths ComfyUI core allows (5..3592 frames).
    Returns it unchanged. Outside H3's trained 124-345 frames it is valid: `trained_range_warning` says so."""
    if not isinstance(num_frames, int) or isinstance(num_frames, bool):
        raise H3InputError(f"frame count must be an integer, got {num_frames!r}")
    if not facts.is_on_frame_grid(num_frames):
        raise H3InputError(
            f"frame count must be of the form 17k+5 (the video VAE's clip grid), got {num_frames}; "
            f"nearest valid: {snap_frames_down(num_frames)} or {snap_frames_up(num_frames)}"
        )
    if not facts.MIN_FRAMES <= num_frames <= facts.MAX_FRAMES:
        raise H3InputError(
            f"frame count must be within {facts.MIN_FRAMES}-{facts.MAX_FRAMES} frames on the 17k+5 grid "
            f"({facts.MAX_FRAMES / facts.FPS:.1f} s at {facts.FPS} fps, ComfyUI core's longest), "
            f"got {num_frames} frames ({num_frames / facts.FPS:.2f} s)"
        )
    return num_frames


def trained_range_warning(num_frames: int) -> str | None:
    """Why a valid length is outside what H3 was trained on (5-15 s: 124-345 frames), or None. A warning, not a
    refusal: the job runs, its quality is untested (ComfyUI core says the same of its longer lengths)."""
    if facts.TRAINED_MIN_FRAMES <= num_frames <= facts.TRAINED_MAX_FRAMES:
        return None
    return (f"{num_frames} frames ({num_frames / facts.FPS:.2f} s) is outside H3's trained range of "
            f"{facts.MIN_DURATION_S:g}-{facts.MAX_DURATION_S:g} s ({facts.TRAINED_MIN_FRAMES}-"
            f"{facts.TRAINED_MAX_FRAMES} frames): it runs, but its quality is untested")


# --- canvas --------------------------------------------------------------------------------------


def check_canvas(width: int, height: int, multiple: int = facts.CANVAS_MULTIPLE) -> tuple[int, int]:
    """Validate an output canvas: positive multiples of 32 px with an aspect within 1:4..4:1, within H3's trained
    size."""
    for name, value in (("width", width), ("height", height)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise H3InputError(f"{name} must be a positive integer number of pixels, got {value!r}")
        if value % multiple:
            raise H3InputError(
                f"{name} must be a multiple of {multiple} px (VAE /16 x DiT patch 2), got {value}; "
                f"nearest valid: {max(multiple, value // multiple * multiple)} or {-(-value // multiple) * multiple}"
            )
    ratio = width / height
    if not facts.MIN_ASPECT <= ratio <= facts.MAX_ASPECT:
        raise H3InputError(f"canvas aspect ratio must be within 1:4 and 4:1, got {width}x{height} ({ratio:.3g})")
    check_canvas_size(width, height)
    return width, height


def canvas_size_error(width: int, height: int) -> str | None:
    """Why a canvas is larger than any the pack runs (`facts.MAX_CANVAS_EDGE`, `MAX_CANVAS_PIXELS`: the absolute bound,
    8.8x H3's trained area), or None."""
    if max(width, height) > facts.MAX_CANVAS_EDGE or width * height > facts.MAX_CANVAS_PIXELS:
        return (f"canvas {width}x{height} is larger than the pack runs (at most {facts.MAX_CANVAS_EDGE} px a side and "
                f"{facts.MAX_CANVAS_PIXELS} pixels, e.g. 4096x2304; H3 was trained up to {facts.TRAINED_CANVAS_EDGE} "
                f"px a side and {facts.TRAINED_CANVAS_PIXELS} pixels, e.g. 1344x768)")
    return None


def canvas_trained_warning(width: int, height: int) -> str | None:
    """A canvas beyond H3's trained size (`facts.TRAINED_CANVAS_EDGE`, `TRAINED_CANVAS_PIXELS`): it runs (ComfyUI core
    allows it too), with this warning; None within it."""
    if max(width, height) > facts.TRAINED_CANVAS_EDGE or width * height > facts.TRAINED_CANVAS_PIXELS:
        return (f"canvas {width}x{height} is beyond H3's trained size (at most {facts.TRAINED_CANVAS_EDGE} px a side "
                f"and {facts.TRAINED_CANVAS_PIXELS} pixels, e.g. 1344x768, 1856x576 or 2016x512): it runs, but its "
                "quality is untested and it needs more memory (`plan` says whether it fits)")
    return None


def check_canvas_size(width: int, height: int) -> None:
    error = canvas_size_error(width, height)
    if error:
        raise H3InputError(error)


def resolve_canvas(aspect_w: float, aspect_h: float, short_edge: int, max_pixels: int) -> tuple[int, int]:
    """The (width, height) H3 generates at for an aspect ratio (diffusers' rule: short edge, area cap, /32)."""
    from .diffusers_adapter import resolve_canvas_size

    try:
        height, width = resolve_canvas_size(aspect_w, aspect_h, facts.CANVAS_MULTIPLE, short_edge, max_pixels)
    except ValueError as error:
        raise H3InputError(str(error)) from None
    return width, height


# --- references ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaSummary:
    """What the rules need to know about a request's media, independent of how it was decoded."""

    keyframes: int = 0
    image_refs: int = 0
    video_ref_seconds: tuple[float, ...] = ()  # duration of each reference video
    soundtrack_seconds: tuple[float | None, ...] = ()  # per reference video: its soundtrack, or None
    audio_ref_seconds: tuple[float, ...] = ()  # duration of each standalone reference audio
    guides: int = 0  # guides at any frame (h3_core/guides.py)


def infer_task(summary: MediaSummary) -> str:
    """The implicit task: video or audio references -> ref2va, keyframes or guides -> fl2va, else t2va."""
    if summary.video_ref_seconds or summary.audio_ref_seconds or summary.image_refs:
        return "ref2va"
    if summary.keyframes or summary.guides:
        return "fl2va"
    return "t2va"


def check_request(task: str, prompt: str, summary: MediaSummary, num_frames: int) -> None:
    """Validate a whole request's shape before any media is encoded."""
    if task not in TASKS:
        raise H3InputError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise H3InputError("prompt must be a non-empty string")
    check_output_frames(num_frames)
    n_videos, n_audios = len(summary.video_ref_seconds), len(summary.audio_ref_seconds)
    n_refs = summary.image_refs + n_videos + n_audios
    if task == "t2va" and (summary.keyframes or n_refs or summary.guides):
        raise H3InputError("t2va takes a prompt only: no keyframes, guides or references (use fl2va or ref2va, or "
                           "task auto)")
    if task == "fl2va":
        if n_refs:
            raise H3InputError("fl2va takes first/last keyframes and guides only; references need task ref2va")
        if summary.keyframes > facts.MAX_KEYFRAMES or not (summary.keyframes or summary.guides):
            raise H3InputError(f"fl2va needs 1 or 2 keyframes (first and/or last frame) or a guide, got "
                               f"{summary.keyframes} keyframes")
    if task == "ref2va":
        if summary.keyframes:
            raise H3InputError("ref2va takes references, not keyframes; keyframes need task fl2va")
        if summary.guides:
            raise H3InputError("ref2va takes references, not guides; guides at any frame need task fl2va (or auto)")
        check_reference_counts(summary.image_refs, n_videos, n_audios)
        check_reference_durations(summary, num_frames)


def check_reference_counts(images: int, videos: int, audios: int) -> None:
    if images > facts.MAX_REF_IMAGES:
        raise H3InputError(f"ref2va accepts at most {facts.MAX_REF_IMAGES} image references, got {images}")
    if videos > facts.MAX_REF_VIDEOS:
        raise H3InputError(f"ref2va accepts at most {facts.MAX_REF_VIDEOS} video references, got {videos}")
    if audios > facts.MAX_REF_AUDIOS:
        raise H3InputError(f"ref2va accepts at most {facts.MAX_REF_AUDIOS} audio references, got {audios}")
    if images + videos + audios > facts.MAX_REFS:
        total = images + videos + audios
        raise H3InputError(f"ref2va accepts at most {facts.MAX_REFS} references in total, got {total}")
    if images + videos == 0:
        raise H3InputError(
            "ref2va needs at least one image or video reference (an audio reference cannot be the only one)"
        )


def check_reference_durations(summary: MediaSummary, num_frames: int) -> None:
    """Reference clip lengths: each 2-15 s; embedded and standalone budgets 15 s each.

    Soundtracks and standalone audio are cut to the output duration before encoding (as the
    reference does), so the budgets are checked on what is actually encoded.
    """
    output_s = num_frames / facts.FPS
    for index, seconds in enumerate(summary.video_ref_seconds, start=1):
        if not facts.MIN_REFERENCE_VIDEO_S <= seconds <= facts.MAX_AUDIO_CLIP_S:
            raise H3InputError(
                f"reference video {index} must be {facts.MIN_REFERENCE_VIDEO_S:g}-{facts.MAX_AUDIO_CLIP_S:g} s long, "
                f"got {seconds:.2f} s"
            )
    embedded = []
    for index, seconds in enumerate(summary.soundtrack_seconds, start=1):
        if seconds is None:
            continue
        encoded = min(seconds, output_s)
        if facts.MIN_AUDIO_CLIP_S <= seconds <= facts.MAX_AUDIO_CLIP_S and encoded < facts.MIN_AUDIO_CLIP_S:
            raise H3InputError(
                f"the soundtrack of reference video {index} is cut to the output's {output_s:.2f} s, under the "
                f"{facts.MIN_AUDIO_CLIP_S:g} s a reference clip needs: make the output at least "
                f"{snap_frames_up(math.ceil(facts.MIN_AUDIO_CLIP_S * facts.FPS))} frames, or mute the video"
            )
        if not facts.MIN_AUDIO_CLIP_S <= seconds <= facts.MAX_AUDIO_CLIP_S:
            raise H3InputError(
                f"the soundtrack of reference video {index} must be "
                f"{facts.MIN_AUDIO_CLIP_S:g}-{facts.MAX_AUDIO_CLIP_S:g} s long, "
                f"got {seconds:.2f} s"
            )
        embedded.append(encoded)
    standalone = []
    for index, seconds in enumerate(summary.audio_ref_seconds, start=1):
        if not facts.MIN_AUDIO_CLIP_S <= seconds <= facts.MAX_AUDIO_CLIP_S:
            raise H3InputError(
                f"reference audio {index} must be {facts.MIN_AUDIO_CLIP_S:g}-{facts.MAX_AUDIO_CLIP_S:g} s long, "
                f"got {seconds:.2f} s"
            )
        standalone.append(min(seconds, output_s))
    for label, clips, budget in (("reference video soundtracks", embedded, facts.EMBEDDED_AUDIO_BUDGET_S),
                                 ("standalone reference audios", standalone, facts.STANDALONE_AUDIO_BUDGET_S)):
        if sum(clips) > budget + 1e-9:
            raise H3InputError(
                f"{label} must total at most {budget:g} s (a separate budget from the other audio kind), "
                f"got {sum(clips):.2f} s"
            )
