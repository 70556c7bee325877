"""Media in and out of MiniMax-H3: the one place files and tensors become encoder-stage arrays.

Every entry path of the pack (CLI, ComfyUI nodes, HTTP server and client) converts media through these
functions, so a request cannot come out differently depending on how it arrived. The encoder stage consumes

* 8-bit RGB pixels: ``uint8`` numpy, ``[H, W, 3]`` for an image, ``[F, H, W, 3]`` for a video;
* float32 waveforms, ``[channels, samples]``, put on 32 kHz stereo by :func:`resample_audio` before they are
  handed on (diffusers' setup step would resample with torchaudio, which the pack does not use; at 32 kHz it
  leaves the samples alone).

Decoding and encoding go through PyAV (FFmpeg) and Pillow only; there is no torch import here (torch tensors are
accepted wherever arrays are, duck-typed). Every failure a caller can cause raises :class:`MediaError`, a
``ValueError`` whose message names the media kind and the broken constraint.

Public API::

    read_image(src, max_pixels=None)                      -> uint8 [H, W, 3]
    read_video(src, max_frames=None, max_pixels=None,
               truncate=False, target=None, fps=None)     -> VideoClip(frames, fps, audio, sample_rate, ...)
    VideoTarget(num_frames, canvas_short_edge, canvas_max_pixels)  what a reference video becomes in H3
    canvas_size(width, height, short_edge, max_pixels)    -> the canvas an aspect ratio resolves to
    read_audio(src, max_seconds=None)                     -> (float32 [C, S], sample_rate)
    resample_audio(waveform, sample_rate, target_rate)    -> float32 [2, S']
    resampled_length(num_samples, sample_rate, target_rate) -> S' (torchaudio's length rule)
    frames_to_uint8(frames) / image_to_uint8(image)       -> uint8, the reference's float->uint8 rounding
    write_mp4(path, frames, audio=None, fps=24, sample_rate=32000) -> path
    streamed_mp4(path, width, height, with_audio=True) -> Mp4Writer: write(uint8 frames) ... finish(audio)
    encode_mp4_bytes(frames, ...) / encode_wav_bytes(waveform, sample_rate) / encode_png_bytes(image) -> bytes
    probe(src)                                            -> dict read from the container headers

The implementation is split by concern (``media_base``: sources, errors; ``media_audio``; ``media_video``: the
frame-by-frame decoder; ``media_mp4``: the mp4 writer); import everything from here. Untrusted bytes (a server's
requests) should be decoded through :mod:`h3_core.media.sandbox`, which runs these same functions in a child
process.

A source (``src``) is a filesystem path (``str`` / ``os.PathLike``), the file's bytes (``bytes``, ``bytearray``,
``memoryview``) or a binary file object (read to its end). URLs are not fetched.
"""

from __future__ import annotations

import io
import os
import tempfile
import warnings
from typing import Any

import av
import numpy as np
from PIL import Image, ImageOps

from .. import facts
from .audio import (
    MAX_AUDIO_CHANNELS,
    MAX_SAMPLE_RATE,
    MIN_SAMPLE_RATE,
    encode_wav_bytes,
    read_audio,
    resample_audio,
    resampled_length,
)
from .base import (
    MediaError,
    Source,
    TooManyFrames,
    av_open,
    check_pixels,
    load_source,
    releases_on_failure,
    to_numpy,
    wrap_errors,
)
from .mp4 import Mp4Writer, encode_frames, streamed_mp4
from .video import VideoClip, VideoTarget, canvas_size, read_video

__all__ = [
    "MediaError",
    "TooManyFrames",
    "MAX_AUDIO_CHANNELS",
    "MIN_SAMPLE_RATE",
    "MAX_SAMPLE_RATE",
    "VideoClip",
    "VideoTarget",
    "canvas_size",
    "read_image",
    "read_video",
    "read_audio",
    "resample_audio",
    "resampled_length",
    "frames_to_uint8",
    "image_to_uint8",
    "write_mp4",
    "Mp4Writer",
    "streamed_mp4",
    "encode_mp4_bytes",
    "encode_wav_bytes",
    "encode_png_bytes",
    "probe",
]


# --------------------------------------------------------------------------------------------------------------
# float <-> uint8


def _float_to_uint8(x: np.ndarray, kind: str) -> np.ndarray:
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if x.dtype.kind != "f":
        raise MediaError(f"{kind} must be uint8 or floating point over [0, 1], got dtype {x.dtype}")
    if not np.isfinite(x).all():
        raise MediaError(f"{kind} contains NaN or infinite values")
    # diffusers' MiniMaxH3Ref2VASetupStep._normalize_video_condition: (x * 255.0).round().clip(0, 255).astype(uint8),
    # evaluated in the input's own dtype (round half to even). Done in place on one temporary; same values.
    y = np.multiply(x, 255.0)
    np.round(y, out=y)
    np.clip(y, 0, 255, out=y)
    return y.astype(np.uint8)


def frames_to_uint8(frames: Any) -> np.ndarray:
    """Video frames ``[F, H, W, 3]`` (numpy or torch; float over [0, 1] or uint8) -> contiguous uint8 ``[F, H, W, 3]``.

    Floats are rounded exactly as the reference does, ``(x * 255).round().clip(0, 255)`` in the input's dtype
    (ComfyUI ``IMAGE`` batches go through here). uint8 input is returned as is (made contiguous). Non-finite
    values raise :class:`MediaError`.
    """
    x = to_numpy(frames)
    if x.ndim != 4 or x.shape[-1] != 3:
        raise MediaError(f"video frames must be [frames, height, width, 3] RGB, got shape {tuple(x.shape)}")
    return _float_to_uint8(x, "video frames")


def image_to_uint8(image: Any) -> np.ndarray:
    """One image ``[H, W, 3]`` (or a batch of one, ``[1, H, W, 3]``) -> uint8 ``[H, W, 3]``, same rounding as
    :func:`frames_to_uint8`."""
    x = to_numpy(image)
    if x.ndim == 4 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 3 or x.shape[-1] != 3:
        raise MediaError(f"an image must be [height, width, 3] RGB (or a batch of one), got shape {tuple(x.shape)}")
    return _float_to_uint8(x, "image")


# --------------------------------------------------------------------------------------------------------------
# images


@releases_on_failure
def read_image(src: Source, max_pixels: int | None = None) -> np.ndarray:
    """Decode an image file (PNG, JPEG, WEBP, ... whatever Pillow reads) to uint8 RGB ``[H, W, 3]``.

    Like diffusers' ``load_image``: EXIF orientation is applied, and every mode goes to RGB through Pillow's
    ``convert("RGB")`` (alpha is dropped, not composited; palette and greyscale expanded), except 16-bit greyscale,
    which Pillow would clip to white and which is scaled ``v / 257`` instead. An animated file gives its first
    frame. ``max_pixels`` is checked against the header's size before any pixel data is decoded (decompression-bomb
    guard); Pillow's own guard (``Image.MAX_IMAGE_PIXELS``, twice that is an error) applies on top.
    """
    data, label = load_source(src, "image")
    with wrap_errors("image", label), warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(data if isinstance(data, str) else io.BytesIO(data))
        except Image.DecompressionBombError as error:
            raise MediaError(f"image {label} is over Pillow's decompression-bomb limit: {error}") from error
        with image:
            check_pixels("image", label, image.width, image.height, max_pixels)
            image.load()
            image = ImageOps.exif_transpose(image)
            if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
                grey = np.asarray(image).astype(np.float64)
                grey = np.clip(np.round(grey / 257.0), 0, 255).astype(np.uint8)
                return np.ascontiguousarray(np.repeat(grey[:, :, None], 3, axis=2))
            rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return np.ascontiguousarray(rgb)


def encode_png_bytes(image: Any, compress_level: int = 6) -> bytes:
    """PNG bytes of one RGB image (uint8 or float over [0, 1], ``[H, W, 3]`` or ``[1, H, W, 3]``); lossless, so
    ``read_image(encode_png_bytes(x)) == image_to_uint8(x)``."""
    pixels = image_to_uint8(image)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=compress_level)
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------------------------
# video


def write_mp4(
    path: str | os.PathLike,
    frames: Any,
    audio: Any = None,
    fps: float = facts.FPS,
    sample_rate: int = facts.AUDIO_SAMPLE_RATE,
    crf: int = 18,
    audio_bitrate: int = 192_000,
) -> str:
    """Write an MP4: H.264 (libx264, yuv420p, BT.601 limited range, ``crf``) and, when ``audio`` is given, AAC
    stereo at ``sample_rate`` (the rate ``audio`` carries: 32 kHz for H3 output; it is not resampled).

    ``frames``: uint8 or float over [0, 1], ``[F, H, W, 3]``, numpy or torch (floats rounded by
    :func:`frames_to_uint8`); width and height must be even. ``audio``: ``[C, S]`` float, mono duplicated, channels
    beyond two dropped, trimmed or zero-padded to exactly ``round(F / fps * sample_rate)`` samples. Written to a
    temporary file next to ``path`` and moved into place (no partial file on failure), with the index at the front
    (``+faststart``). Returns ``path`` as a string.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    handle, partial = tempfile.mkstemp(prefix=".partial-", suffix=".mp4", dir=directory)
    os.close(handle)
    try:
        encode_frames(partial, frames_to_uint8(frames), audio, fps, sample_rate, crf, audio_bitrate)
        os.chmod(partial, 0o644)  # mkstemp made it 0600; an output file is meant to be shared
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def encode_mp4_bytes(frames: Any, audio: Any = None, **options: Any) -> bytes:
    """The bytes :func:`write_mp4` would write for the same arguments (`options`: its ``fps``, ``sample_rate``,
    ``crf``, ``audio_bitrate``); it goes through a temporary file."""
    with tempfile.TemporaryDirectory(prefix="h3-mp4-") as directory:
        path = write_mp4(os.path.join(directory, "clip.mp4"), frames, audio, **options)
        with open(path, "rb") as file:
            return file.read()


# --------------------------------------------------------------------------------------------------------------
# probe


def _seconds(value, time_base) -> float | None:
    if value is None or time_base is None:
        return None
    return float(value * time_base)


@releases_on_failure
def probe(src: Source) -> dict[str, Any]:
    """Container facts from the headers only (no frame is decoded), for cheap validation.

    Returns ``{"format", "duration", "streams", "width", "height", "fps", "frames", "sample_rate", "channels"}``:
    ``streams`` lists every stream (``type``, ``codec``, ``duration`` in seconds, and ``width``/``height``/``fps``/
    ``frames`` for video, ``sample_rate``/``channels``/``layout`` for audio); the top-level video and audio keys
    describe the first stream of each kind, ``None`` where absent or undeclared. ``width``/``height`` are the coded
    size: a display-matrix rotation (applied by :func:`read_video`) is not visible in the headers PyAV exposes.
    Images open too (one video stream).
    """
    data, label = load_source(src, "media")
    with wrap_errors("media", label), av_open(data) as container:
        streams = []
        for stream in container.streams:
            entry: dict[str, Any] = {
                "index": stream.index,
                "type": stream.type,
                "codec": getattr(getattr(stream, "codec_context", None), "name", None),
                "duration": _seconds(stream.duration, stream.time_base),
            }
            if stream.type == "video":
                rate = stream.average_rate or stream.guessed_rate
                entry.update(
                    width=stream.codec_context.width,
                    height=stream.codec_context.height,
                    fps=float(rate) if rate else None,
                    frames=stream.frames or None,
                )
            elif stream.type == "audio":
                entry.update(
                    sample_rate=stream.codec_context.sample_rate or None,
                    channels=stream.codec_context.channels or None,
                    layout=stream.layout.name if stream.layout else None,
                )
            streams.append(entry)
        if container.format.name.endswith("_pipe") or container.format.name == "image2":
            for entry in streams:  # a still image: the demuxer's default rate (25) means nothing
                if entry["type"] == "video":
                    entry["fps"] = None
        duration = container.duration / av.time_base if container.duration is not None else None
        if duration is None:
            known = [entry["duration"] for entry in streams if entry["duration"] is not None]
            duration = max(known) if known else None
        result: dict[str, Any] = {
            "format": container.format.name,
            "duration": duration,
            "streams": streams,
        }
    video = next((entry for entry in streams if entry["type"] == "video"), {})
    sound = next((entry for entry in streams if entry["type"] == "audio"), {})
    for key in ("width", "height", "fps", "frames"):
        result[key] = video.get(key)
    for key in ("sample_rate", "channels"):
        result[key] = sound.get(key)
    return result
