"""What the encoder stage is asked to encode: decoded media plus the request's numbers.

Every entry point (CLI, ComfyUI nodes, encoder server) builds an `EncodeRequest` from 8-bit RGB
frames and float waveforms (`h3_core.media` does the decoding and the float->uint8 quantisation),
so the encoder stage sees the same arrays whichever path the media came in by.

Reference order is fixed, as ComfyUI core and vLLM-Omni present it: all images,
then each video (its soundtrack labelled right before it), then standalone audios. The prompt's
`<Picture i>` / `<Video k>` / `<Audio j>` tags refer to that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from . import facts, guides, rules
from .guides import GuideMedia


def needed_encoders(*, keyframes: int = 0, images: int = 0, videos: int = 0, audios: int = 0,
                    soundtracks: int = 0, guide_frames: int = 0, guide_audios: int = 0) -> tuple[str, ...]:
    """The encoders a request with these media needs: the one rule every caller reads.

    Every request needs the text encoder; keyframes, reference images and reference videos go through the video
    VAE; reference audios and video soundtracks through the audio VAE. `soundtracks` counts the reference videos
    that carry one (or may: the encoder server counts a soundtrack it can only learn by decoding). Guides
    (`guides.py`) need the video VAE for their frames and the audio VAE for their audio.
    """
    needs = ["text"]
    if keyframes or images or videos or guide_frames:
        needs.append("video")
    if audios or soundtracks or guide_audios:
        needs.append("audio")
    return tuple(needs)


class NeedsEncoders:
    """What a prepared or resolved request says about its encoders: `encoders` holds `needed_encoders()`."""

    encoders: tuple[str, ...]

    @property
    def needs_video_vae(self) -> bool:
        return "video" in self.encoders

    @property
    def needs_audio_vae(self) -> bool:
        return "audio" in self.encoders


@dataclass
class VideoInput:
    """A reference video: uint8 RGB frames [F, H, W, 3] at `fps`, with an optional soundtrack.

    `source_seconds`: the length of the clip as decoded, when `frames` no longer shows it (the encoder server
    decodes a reference straight onto the output length, so a longer clip arrives truncated); H3's 2-15 s rule
    reads it. None: `frames` is the whole clip.
    """

    frames: np.ndarray
    fps: float
    audio: np.ndarray | None = None  # float32 [channels, samples]
    sample_rate: int | None = None
    source_seconds: float | None = None

    @property
    def seconds(self) -> float:
        if self.source_seconds is not None:
            return float(self.source_seconds)
        return self.frames.shape[0] / float(self.fps)

    @property
    def soundtrack_seconds(self) -> float | None:
        if self.audio is None:
            return None
        return self.audio.shape[-1] / float(self.sample_rate)


@dataclass
class AudioInput:
    """A standalone reference audio: float32 waveform [channels, samples] at `sample_rate`."""

    waveform: np.ndarray
    sample_rate: int

    @property
    def seconds(self) -> float:
        return self.waveform.shape[-1] / float(self.sample_rate)


@dataclass
class EncodeRequest:
    prompt: str
    task: str | None = None  # None: inferred from the media (h3_core.rules.infer_task)
    width: int | None = None  # None: H3's canvas rule picks it (16:9, or the first keyframe's aspect)
    height: int | None = None
    num_frames: int = facts.DEFAULT_FRAMES
    first_frame: np.ndarray | None = None  # uint8 [H, W, 3]
    last_frame: np.ndarray | None = None
    ref_images: list[np.ndarray] = field(default_factory=list)
    ref_videos: list[VideoInput] = field(default_factory=list)
    ref_audios: list[AudioInput] = field(default_factory=list)
    guides: list[GuideMedia] = field(default_factory=list)  # at any frame (guides.py): fl2va

    @classmethod
    def from_sources(
        cls,
        prompt: str,
        *,
        task: str | None = None,
        width: int | None = None,
        height: int | None = None,
        num_frames: int = facts.DEFAULT_FRAMES,
        first_frame: Any = None,
        last_frame: Any = None,
        ref_images: Iterable[Any] = (),
        ref_videos: Iterable[Any] = (),
        ref_audios: Iterable[Any] = (),
        read_image: Callable[[Any], np.ndarray] | None = None,
        read_video: Callable[[Any], VideoInput] | None = None,
        read_audio: Callable[[Any], AudioInput] | None = None,
    ) -> "EncodeRequest":
        """The request for media sources (paths or bytes by default), decoded in slot order.

        The CLI passes file paths and the default readers (`h3_core.media.read_*`); the encoder server passes
        its received parts and readers that check size caps from the headers first. Both build the same arrays
        from the same bytes, so a remote encode equals a local one.
        """
        read_image = read_image or _read_image
        read_video = read_video or _read_video
        read_audio = read_audio or _read_audio
        return cls(
            prompt=prompt,
            task=task,
            width=width,
            height=height,
            num_frames=num_frames,
            first_frame=None if first_frame is None else read_image(first_frame),
            last_frame=None if last_frame is None else read_image(last_frame),
            ref_images=[read_image(source) for source in ref_images],
            ref_videos=[read_video(source) for source in ref_videos],
            ref_audios=[read_audio(source) for source in ref_audios],
        )

    def summary(self) -> rules.MediaSummary:
        return rules.MediaSummary(
            keyframes=int(self.first_frame is not None) + int(self.last_frame is not None),
            image_refs=len(self.ref_images),
            video_ref_seconds=tuple(video.seconds for video in self.ref_videos),
            soundtrack_seconds=tuple(video.soundtrack_seconds for video in self.ref_videos),
            audio_ref_seconds=tuple(audio.seconds for audio in self.ref_audios),
            guides=len(self.guides),
        )

    def needed_encoders(self) -> tuple[str, ...]:
        """The encoders this request needs (`needed_encoders`), from its decoded media."""
        return needed_encoders(
            keyframes=int(self.first_frame is not None) + int(self.last_frame is not None),
            images=len(self.ref_images),
            videos=len(self.ref_videos),
            audios=len(self.ref_audios),
            soundtracks=sum(video.audio is not None for video in self.ref_videos),
            guide_frames=sum(guide.frames is not None for guide in self.guides),
            guide_audios=sum(guide.audio is not None for guide in self.guides),
        )

    def resolved_task(self) -> str:
        return self.task or rules.infer_task(self.summary())

    def validate(self) -> str:
        """Check every rule that needs no model; returns the resolved task."""
        task = self.resolved_task()
        rules.check_request(task, self.prompt, self.summary(), self.num_frames)
        guides.check(self.guides, self.num_frames)
        if (self.width is None) != (self.height is None):
            raise rules.H3InputError("width and height must be given together, or neither")
        if self.width is not None:
            rules.check_canvas(self.width, self.height)
        for label, image in (("first frame", self.first_frame), ("last frame", self.last_frame)):
            if image is not None:
                _check_rgb(image, label)
        for index, image in enumerate(self.ref_images, start=1):
            _check_rgb(image, f"reference image {index}")
        for index, video in enumerate(self.ref_videos, start=1):
            if video.frames.ndim != 4 or video.frames.shape[-1] != 3 or video.frames.dtype != np.uint8:
                raise rules.H3InputError(
                    f"reference video {index} must be uint8 RGB frames [F, H, W, 3], "
                    f"got {video.frames.dtype} {tuple(video.frames.shape)}"
                )
            if not video.fps or video.fps <= 0:
                raise rules.H3InputError(f"reference video {index} needs a positive frame rate, got {video.fps}")
        return task


def _read_image(source: Any) -> np.ndarray:
    from . import media

    return media.read_image(source)


def _read_video(source: Any) -> VideoInput:
    from . import media

    clip = media.read_video(source)
    return VideoInput(frames=clip.frames, fps=clip.fps, audio=clip.audio, sample_rate=clip.sample_rate)


def _read_audio(source: Any) -> AudioInput:
    from . import media

    waveform, sample_rate = media.read_audio(source)
    return AudioInput(waveform=waveform, sample_rate=sample_rate)


def _check_rgb(image: np.ndarray, label: str) -> None:
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        shape, dtype = getattr(image, "shape", None), getattr(image, "dtype", type(image))
        raise rules.H3InputError(f"{label} must be uint8 RGB pixels [H, W, 3], got {dtype} {shape}")
    height, width = image.shape[:2]
    if min(height, width) < 1 or max(width / height, height / width) > facts.MAX_ASPECT:
        raise rules.H3InputError(f"{label} must have an aspect ratio within 1:4 and 4:1, got {width}x{height}")
