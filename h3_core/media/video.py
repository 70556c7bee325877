"""Video in: decoding frame by frame into what the clip will become (H3's clock, length and canvas).

Part of :mod:`h3_core.media` (import from there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .. import facts
from .audio import decode_audio_stream
from .base import (
    MediaError,
    Source,
    TooManyFrames,
    av_open,
    check_pixels,
    load_source,
    releases_on_failure,
    wrap_errors,
)


@dataclass
class VideoClip:
    """A decoded video: ``frames`` uint8 ``[F, H, W, 3]`` upright at ``fps``, and its soundtrack (float32 ``[C, S]``
    at ``sample_rate``, the stream's own) or ``None``/``None``.

    ``source_frames`` / ``source_fps`` describe the stream as decoded (before any :class:`VideoTarget`
    normalisation): the rules' reference-duration check reads :attr:`source_seconds`, which a normalised clip,
    truncated to the generated length, no longer shows in ``frames``.
    """

    frames: np.ndarray
    fps: float
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    source_frames: int | None = None
    source_fps: float | None = None

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])

    @property
    def duration(self) -> float:
        """Seconds of video in ``frames``, ``num_frames / fps``."""
        return self.num_frames / self.fps

    @property
    def source_seconds(self) -> float:
        """Seconds of video the container held, ``source_frames / source_fps`` (``duration`` when unset)."""
        if self.source_frames is None or not self.source_fps:
            return self.duration
        return self.source_frames / self.source_fps


@dataclass(frozen=True)
class VideoTarget:
    """What a reference video becomes inside H3, so :func:`read_video` can produce it while decoding.

    diffusers' setup step normalises a reference video in three passes over the whole clip (onto ``fps`` by
    holding/dropping whole frames, truncation to ``num_frames``, a LANCZOS resize onto the canvas the clip's own
    aspect ratio resolves to). Done here frame by frame, the decoder never holds more than one full-resolution
    frame, and the clip comes out exactly as that step would leave it (which then passes it through untouched).
    ``num_frames`` is the generated frame count after snapping to the 17k+5 grid; the canvas rule is the pipeline
    config's (``canvas_short_edge``, ``canvas_max_pixels``) with axes rounded to ``canvas_multiple``.
    """

    num_frames: int
    canvas_short_edge: int
    canvas_max_pixels: int
    canvas_multiple: int = 32
    fps: float = float(facts.FPS)


MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
"""Aspect ratios (width / height) a video reference may have; the canvas rule refuses others."""


def canvas_size(width: float, height: float, short_edge: int, max_pixels: int, multiple: int = 32) -> tuple[int, int]:
    """``(width, height)`` of the canvas an aspect ratio resolves to: the short edge at ``short_edge``, the area
    capped at ``max_pixels``, both axes rounded to ``multiple`` (diffusers' ``resolve_canvas_size``, the same float
    arithmetic, so the numbers agree)."""
    if width <= 0 or height <= 0:
        raise MediaError(f"the aspect ratio must be positive, got {width}:{height}")
    ratio = width / height
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise MediaError(f"a video reference must be within 1:4 and 4:1, got {width}x{height} ({ratio:.3g})")
    if ratio >= 1.0:
        w, h = short_edge * ratio, float(short_edge)
    else:
        w, h = float(short_edge), short_edge / ratio
    area = w * h
    if area > max_pixels:
        scale = (max_pixels / area) ** 0.5
        w, h = w * scale, h * scale
    return max(multiple, round(w / multiple) * multiple), max(multiple, round(h / multiple) * multiple)


class _FrameStore:
    """Frames written by index into preallocated blocks, joined once at the end.

    With a known frame count it is one block (no copy when the count is met). Otherwise blocks are added as frames
    arrive and the join releases each block as soon as it is copied, so the peak is the clip plus one block, not
    twice the clip as a list of frames followed by ``np.stack`` is.
    """

    def __init__(self, shape: tuple[int, int, int], expected: int | None, limit: int | None):
        self.shape = shape
        self.block = max(1, expected) if expected else 16
        if limit is not None:
            self.block = min(self.block, limit)
        self.blocks: list[np.ndarray] = []
        self.count = 0

    def put(self, start: int, stop: int, pixels: np.ndarray) -> None:
        for index in range(start, stop):
            while index >= len(self.blocks) * self.block:
                self.blocks.append(np.empty((self.block, *self.shape), dtype=np.uint8))
            self.blocks[index // self.block][index % self.block] = pixels
        self.count = max(self.count, stop)

    def finish(self) -> np.ndarray:
        if len(self.blocks) == 1:  # a leading slice: contiguous, and the untouched tail was never resident
            return self.blocks.pop()[: self.count]
        out = np.empty((self.count, *self.shape), dtype=np.uint8)
        for start in range(0, self.count, self.block):
            block = self.blocks.pop(0)
            stop = min(self.count, start + self.block)
            out[start:stop] = block[: stop - start]
            del block
        return out


def _slots(index: int, scale: float) -> tuple[int, int]:
    """Output frames ``[start, stop)`` that source frame ``index`` fills on the target clock: diffusers' rule
    (every frame is held until the slot of the next one, ``floor(i * scale + 0.5)``; the last one until the slot
    the stream's end rounds to, the same formula at ``i = N``)."""
    return math.floor(index * scale + 0.5), math.floor((index + 1) * scale + 0.5)


def _decode_video_frames(
    container, label: str, max_frames: int | None, max_pixels: int | None, truncate: bool,
    target: VideoTarget | None, fps: float | None,
) -> tuple[np.ndarray, int, float]:
    """``(frames, source frames decoded, source fps)``; see :func:`read_video`. Frame by frame: convert one decoded
    frame to RGB, turn it upright, resize it if it is kept, write it into the output, drop it."""
    if not container.streams.video:
        raise MediaError(f"video {label} has no video stream")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    check_pixels("video", label, width, height, max_pixels)
    declared = int(stream.frames or 0)
    if max_frames is not None and not truncate and declared > max_frames:
        raise TooManyFrames(f"video {label} has {declared} frames, over the limit of max_frames={max_frames}")
    if fps is None:
        rate = stream.average_rate or stream.guessed_rate
        if not rate or rate <= 0:
            raise MediaError(f"video {label} declares no frame rate")
        fps = float(rate)
    elif not fps > 0:
        raise MediaError(f"video {label}: fps must be positive, got {fps!r}")
    if target is not None:  # refuse a clip the canvas rule refuses before decoding anything
        canvas_size(width, height, target.canvas_short_edge, target.canvas_max_pixels, target.canvas_multiple)
    scale = 1.0 if target is None or fps == target.fps else target.fps / fps
    stream.thread_type = "AUTO"  # decoders are bit-exact whatever the threading

    store, turns, out_size, count, size = None, 0, None, 0, None
    for frame in container.decode(stream):
        if size is None:
            size = (frame.width, frame.height)
            check_pixels("video", label, frame.width, frame.height, max_pixels)
        elif (frame.width, frame.height) != size:
            raise MediaError(
                f"video {label} changes size mid-stream ({size[0]}x{size[1]} -> {frame.width}x{frame.height})"
            )
        if max_frames is not None and count == max_frames:
            if truncate:
                break
            raise TooManyFrames(f"video {label} has more than max_frames={max_frames} frames")
        if store is None:
            # The display matrix (surfaced on each frame) is the stream's: the first frame's applies to all.
            # PyAV's ``rotation`` is the counter-clockwise angle the display transform turns the coded picture
            # by (an iPhone portrait clip reads -90 and needs a clockwise quarter turn); snapped to quarter
            # turns, flips not applied, as FFmpeg's autorotate does. NOTE: diffusers 0.42.1's own decoder turns
            # the other way (``np.rot90(k=-turns)``), which agrees with this for 180 degrees only.
            turns = round(frame.rotation / 90.0) % 4
            upright = (frame.height, frame.width) if turns % 2 == 0 else (frame.width, frame.height)
            out_size, expected, limit = upright, declared or None, max_frames
            if target is not None:
                out_size = _target_size(upright, target)
                limit = target.num_frames
                expected = min(limit, _slots(declared - 1, scale)[1]) if declared else None
            store = _FrameStore((*out_size, 3), expected, limit)
        start, stop = _slots(count, scale) if scale != 1.0 else (count, count + 1)
        if target is not None:
            stop = min(stop, target.num_frames)
        count += 1
        if start >= stop:
            continue  # dropped by the frame-rate change or past the truncation: never converted
        pixels = frame.to_ndarray(format="rgb24")
        del frame
        if turns:
            pixels = np.rot90(pixels, k=turns)
        if pixels.shape[:2] != out_size:
            # diffusers' per-frame resize, verbatim: PIL LANCZOS on the upright uint8 frame.
            resized = Image.fromarray(np.ascontiguousarray(pixels)).resize(out_size[::-1], Image.Resampling.LANCZOS)
            pixels = np.asarray(resized)
        store.put(start, stop, pixels)
        del pixels
    if store is None or store.count == 0:
        raise MediaError(f"video {label} is zero-length (no video frames decoded)")
    return store.finish(), count, fps


def _target_size(upright: tuple[int, int], target: VideoTarget) -> tuple[int, int]:
    """``(height, width)`` the frames are stored at: the canvas of the clip's own aspect ratio, or the decoded size
    when the canvas rule applied to the canvas itself would pick another canvas (diffusers would then resize the
    stored frames a second time; keeping the decoded size leaves it the single resize it always did)."""
    rule = (target.canvas_short_edge, target.canvas_max_pixels, target.canvas_multiple)
    width, height = canvas_size(upright[1], upright[0], *rule)
    try:
        stable = canvas_size(width, height, *rule) == (width, height)
    except MediaError:  # rounding pushed the canvas's own aspect past the rule's limits (e.g. 4:1 -> 5:1)
        stable = False
    return (height, width) if stable else upright


@releases_on_failure
def read_video(
    src: Source,
    max_frames: int | None = None,
    max_pixels: int | None = None,
    truncate: bool = False,
    target: VideoTarget | None = None,
    fps: float | None = None,
) -> VideoClip:
    """Decode a video file (MP4/MOV/WEBM/..., H.264/H.265/VP9/...) to a :class:`VideoClip`.

    Frames are the first video stream converted to ``rgb24`` by FFmpeg (the conversion diffusers uses), at the
    frame rate the container reports (``average_rate``, else ``guessed_rate``; ``fps`` overrides it), turned upright
    per the container's display matrix. The first audio stream, if any, is decoded exactly as :func:`read_audio`
    does (its own rate and channels; :func:`resample_audio` puts it on 32 kHz stereo).

    ``max_pixels`` is checked against the stream header before decoding (and again on every decoded frame).
    ``max_frames`` counts decoded frames: with ``truncate=False`` a clip with more is refused (:class:`MediaError`,
    also before decoding when the header declares a count); with ``truncate=True`` decoding stops after
    ``max_frames`` and the soundtrack is cut to the same duration, ``int(max_frames / fps * sample_rate)`` samples.

    ``target`` (a :class:`VideoTarget`) returns the clip as H3 will use it: on ``target.fps``, at most
    ``target.num_frames`` frames, on its canvas, produced frame by frame (see :class:`VideoTarget`); the whole
    stream is still decoded (up to ``max_frames``) so ``source_frames`` counts it. Memory: the output plus a few
    decoded frames. On failure the decoder and every decoded frame are released before :class:`MediaError` is
    raised, and the error carries no traceback into the decoding frames.
    """
    if max_frames is not None and max_frames < 1:
        raise MediaError(f"max_frames must be at least 1, got {max_frames}")
    if target is not None and target.num_frames < 1:
        raise MediaError(f"target.num_frames must be at least 1, got {target.num_frames}")
    data, label = load_source(src, "video")
    return _read_video_streams(data, label, max_frames, max_pixels, truncate, target, fps)


def _read_video_streams(
    data: str | bytes, label: str, max_frames: int | None, max_pixels: int | None, truncate: bool,
    target: VideoTarget | None, fps: float | None,
) -> VideoClip:
    with wrap_errors("video", label), av_open(data) as container:
        frames, count, fps = _decode_video_frames(container, label, max_frames, max_pixels, truncate, target, fps)
        has_audio = bool(container.streams.audio)
    audio, sample_rate = None, None
    if has_audio:
        # A fresh open rather than a seek: the soundtrack is then exactly what read_audio(src) decodes.
        with wrap_errors("video soundtrack", label), av_open(data) as container:
            astream = container.streams.audio[0]
            sample_rate = int(astream.codec_context.sample_rate or 0)
            if sample_rate > 0:
                cut = None
                if truncate and max_frames is not None and count == max_frames:
                    cut = int(max_frames / fps * sample_rate)
                audio = decode_audio_stream(container, astream, "video soundtrack", label, cut)
        if audio is None or audio.shape[1] == 0:
            audio, sample_rate = None, None
    out_fps = fps if target is None else float(target.fps)
    return VideoClip(frames=frames, fps=out_fps, audio=audio, sample_rate=sample_rate, source_frames=count,
                     source_fps=fps)
