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
    encode_mp4_bytes(frames, ...) / encode_wav_bytes(waveform, sample_rate) / encode_png_bytes(image) -> bytes
    probe(src)                                            -> dict read from the container headers

A source (``src``) is a filesystem path (``str`` / ``os.PathLike``), the file's bytes (``bytes``, ``bytearray``,
``memoryview``) or a binary file object (read to its end). URLs are not fetched.
"""

from __future__ import annotations

import functools
import io
import math
import os
import struct
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, BinaryIO, Union

import av
import numpy as np
from PIL import Image, ImageOps

__all__ = [
    "H3_FPS",
    "H3_SAMPLE_RATE",
    "MediaError",
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
    "encode_mp4_bytes",
    "encode_wav_bytes",
    "encode_png_bytes",
    "probe",
]

H3_FPS = 24
"""MiniMax-H3's video clock (frames per second)."""
H3_SAMPLE_RATE = 32000
"""The audio VAE's sample rate (Hz); H3 audio is stereo at this rate."""

Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]


class MediaError(ValueError):
    """Media that cannot be read, written or accepted; the message names the media kind and the constraint."""


# --------------------------------------------------------------------------------------------------------------
# sources and error mapping


def _load_source(src: Source, kind: str) -> tuple[str | bytes, str]:
    """``(path or bytes, label for messages)``; a file object is read to its end so it can be opened twice."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        if not data:
            raise MediaError(f"{kind} input is zero-length (0 bytes)")
        return data, f"<{len(data)} bytes>"
    if hasattr(src, "read"):
        data = src.read()
        if not isinstance(data, (bytes, bytearray)):
            raise MediaError(f"{kind} file object must be opened in binary mode")
        if not data:
            raise MediaError(f"{kind} input is zero-length (0 bytes)")
        return bytes(data), f"<{len(data)} bytes from {getattr(src, 'name', 'a file object')!r}>"
    try:
        path = os.fspath(src)
    except TypeError:
        raise MediaError(
            f"{kind} source must be a path, bytes or a binary file object, got {type(src).__name__}"
        ) from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not os.path.isfile(path):
        raise MediaError(f"{kind} file not found: {path!r}")
    if os.path.getsize(path) == 0:
        raise MediaError(f"{kind} file is zero-length (0 bytes): {path!r}")
    return path, repr(path)


def _av_open(data: str | bytes):
    return av.open(data if isinstance(data, str) else io.BytesIO(data), mode="r")


class _wrap_errors:
    """Turn PyAV/Pillow/OS failures inside the block into :class:`MediaError` naming ``kind`` and ``label``."""

    def __init__(self, kind: str, label: str, action: str = "decode"):
        self.kind, self.label, self.action = kind, label, action

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, MediaError):
            return False
        if isinstance(exc, (av.FFmpegError, OSError, EOFError, SyntaxError, ValueError, struct.error)):
            what = "unreadable container or corrupt data" if self.action == "decode" else "encoder failure"
            raise MediaError(f"could not {self.action} {self.kind} {self.label} ({what}): {exc}") from exc
        return False


def _release_traceback(error: BaseException | None) -> None:
    """Clear the locals of every frame a failure (and the failures chained to it) went through."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def _releases_on_failure(function):
    """Raise a decoder's :class:`MediaError` as a fresh one carrying the message only.

    A traceback references every frame the failure went through, and with them the decoded pixels or samples, the
    container and FFmpeg's decoder threads; a server that keeps the exception (a job's future) or a reference cycle
    through it would keep all of that alive. The frames are cleared and the error re-raised outside the ``except``
    block, so it chains to nothing. Other exceptions (``MemoryError``, ``KeyboardInterrupt``) propagate as they are,
    their frames cleared the same way.
    """

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        failure = None
        try:
            return function(*args, **kwargs)
        except MediaError as error:
            failure = str(error)
            _release_traceback(error)
        except BaseException as error:
            _release_traceback(error.__cause__)
            _release_traceback(error.__context__)
            traceback.clear_frames(error.__traceback__)
            raise
        raise MediaError(failure)

    return wrapper


def _check_pixels(kind: str, label: str, width: int, height: int, max_pixels: int | None) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(f"{kind} {label} has no pixels ({width}x{height})")
    if max_pixels is not None and width * height > max_pixels:
        raise MediaError(
            f"{kind} {label} is {width}x{height} = {width * height} pixels, over the limit of max_pixels={max_pixels}"
        )


# --------------------------------------------------------------------------------------------------------------
# float <-> uint8


def _to_numpy(x: Any) -> np.ndarray:
    """numpy view of a numpy array or a torch tensor (any device; bfloat16 widened to float32, exactly)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, duck-typed so torch is never imported here
        x = x.detach()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.cpu().numpy()
    return np.asarray(x)


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
    x = _to_numpy(frames)
    if x.ndim != 4 or x.shape[-1] != 3:
        raise MediaError(f"video frames must be [frames, height, width, 3] RGB, got shape {tuple(x.shape)}")
    return _float_to_uint8(x, "video frames")


def image_to_uint8(image: Any) -> np.ndarray:
    """One image ``[H, W, 3]`` (or a batch of one, ``[1, H, W, 3]``) -> uint8 ``[H, W, 3]``, same rounding as
    :func:`frames_to_uint8`."""
    x = _to_numpy(image)
    if x.ndim == 4 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 3 or x.shape[-1] != 3:
        raise MediaError(f"an image must be [height, width, 3] RGB (or a batch of one), got shape {tuple(x.shape)}")
    return _float_to_uint8(x, "image")


# --------------------------------------------------------------------------------------------------------------
# images


@_releases_on_failure
def read_image(src: Source, max_pixels: int | None = None) -> np.ndarray:
    """Decode an image file (PNG, JPEG, WEBP, ... whatever Pillow reads) to uint8 RGB ``[H, W, 3]``.

    Like diffusers' ``load_image``: EXIF orientation is applied, and every mode goes to RGB through Pillow's
    ``convert("RGB")`` (alpha is dropped, not composited; palette and greyscale expanded), except 16-bit greyscale,
    which Pillow would clip to white and which is scaled ``v / 257`` instead. An animated file gives its first
    frame. ``max_pixels`` is checked against the header's size before any pixel data is decoded (decompression-bomb
    guard); Pillow's own guard (``Image.MAX_IMAGE_PIXELS``, twice that is an error) applies on top.
    """
    data, label = _load_source(src, "image")
    with _wrap_errors("image", label), warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(data if isinstance(data, str) else io.BytesIO(data))
        except Image.DecompressionBombError as error:
            raise MediaError(f"image {label} is over Pillow's decompression-bomb limit: {error}") from error
        with image:
            _check_pixels("image", label, image.width, image.height, max_pixels)
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
# audio


def _waveform_to_numpy(waveform: Any, kind: str = "waveform") -> np.ndarray:
    x = _to_numpy(waveform)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2 or x.shape[0] < 1:
        raise MediaError(f"a {kind} must be [channels, samples] (or [samples] for mono), got shape {tuple(x.shape)}")
    if x.dtype.kind != "f":
        raise MediaError(f"a {kind} must be floating point (float32 over [-1, 1]), got dtype {x.dtype}")
    return x.astype(np.float32, copy=False)


def _to_stereo(x: np.ndarray) -> np.ndarray:
    """Mono duplicated to both channels; channels beyond the first two dropped (the reference rule). A new array."""
    if x.shape[0] == 1:
        return np.repeat(x, 2, axis=0)
    return np.array(x[:2], dtype=np.float32, copy=True, order="C")


def _check_rate(sample_rate: Any, what: str) -> int:
    if isinstance(sample_rate, bool) or not float(sample_rate).is_integer() or int(sample_rate) <= 0:
        raise MediaError(f"{what} must be a positive whole number of Hz, got {sample_rate!r}")
    return int(sample_rate)


MAX_AUDIO_CHANNELS = 8
"""The most channels a decoded stream may carry (7.1); more is refused before any sample is decoded."""
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 384_000
"""Sample rates accepted for decoding and resampling (Hz). Outside them the resampler's filter and the output it
produces grow without a useful bound (1 Hz -> 32 kHz is a 32000x expansion), so they are refused."""


def _check_audio_format(kind: str, label: str, sample_rate: int, channels: int) -> None:
    """Refuse a sample rate or channel count this module does not decode (from headers, before decoding)."""
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise MediaError(
            f"{kind} {label} has a sample rate of {sample_rate} Hz, outside the supported range "
            f"{MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz"
        )
    if channels > MAX_AUDIO_CHANNELS:
        raise MediaError(
            f"{kind} {label} has {channels} audio channels, over the supported maximum of {MAX_AUDIO_CHANNELS}"
        )


def resampled_length(num_samples: int, sample_rate: int, target_rate: int = H3_SAMPLE_RATE) -> int:
    """Length :func:`resample_audio` returns: ``ceil(S * target / rate)``, evaluated like ``torchaudio``'s
    ``Resample`` (rates reduced by their gcd, the quotient rounded to float32 before the ceiling), so lengths
    match what diffusers' torchaudio path would produce."""
    g = math.gcd(sample_rate, target_rate)
    quotient = np.float32((target_rate // g) * num_samples / (sample_rate // g))
    return int(np.ceil(quotient))


def resample_audio(waveform: Any, sample_rate: int, target_rate: int = H3_SAMPLE_RATE) -> np.ndarray:
    """A waveform ``[C, S]`` (numpy or torch, float) -> float32 stereo ``[2, S']`` at ``target_rate``.

    Mono is duplicated to both channels and channels beyond two are dropped (SPEC 1.3: the reference duplicates
    mono and drops extra channels; it does not down-mix). At ``sample_rate == target_rate`` the samples are
    returned untouched (a new array). Otherwise they go through FFmpeg's resampler (PyAV ``AudioResampler``,
    FFmpeg's default windowed-sinc filter, deterministic) in one pass: the input is followed by zeros so the
    filter's tail is fully flushed, and the output is cut to exactly :func:`resampled_length` =
    ``ceil(S * target / rate)`` samples, time-aligned with the input (no leading delay). The values are not
    torchaudio's (different filter), the length is.
    """
    x = _to_stereo(_waveform_to_numpy(waveform))
    sample_rate = _check_rate(sample_rate, "sample_rate")
    target_rate = _check_rate(target_rate, "target_rate")
    if x.shape[1] == 0:
        raise MediaError("cannot resample a zero-length waveform (0 samples)")
    if sample_rate == target_rate:
        return x
    for rate, what in ((sample_rate, "sample_rate"), (target_rate, "target_rate")):
        if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
            raise MediaError(
                f"{what} {rate} Hz is outside the supported range {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz"
            )
    length = resampled_length(x.shape[1], sample_rate, target_rate)
    # Zero tail so the filter is fully flushed: FFmpeg's filter spans 32 taps at the lower of the two rates, plus
    # its internal buffering (about 1024 output samples). Counted in input samples, so upsampling from a low rate
    # does not multiply it by the rate ratio.
    ratio = sample_rate / target_rate
    tail = math.ceil(1024 * ratio) + 64 * math.ceil(max(1.0, ratio))
    padded = np.zeros((2, x.shape[1] + tail), dtype=np.float32)
    padded[:, : x.shape[1]] = x
    frame = av.AudioFrame.from_ndarray(padded, format="fltp", layout="stereo")
    frame.sample_rate = sample_rate
    frame.pts = 0
    frame.time_base = Fraction(1, sample_rate)
    resampler = av.AudioResampler(format="fltp", layout="stereo", rate=target_rate)
    chunks = [out.to_ndarray() for out in resampler.resample(frame)]
    chunks += [out.to_ndarray() for out in resampler.resample(None)]  # drain what the filter still holds
    out = np.concatenate(chunks, axis=1) if chunks else np.zeros((2, 0), np.float32)
    if out.shape[1] < length:  # not expected with the tail above; keep the length contract regardless
        out = np.pad(out, ((0, 0), (0, length - out.shape[1])))
    return np.ascontiguousarray(out[:, :length], dtype=np.float32)


def _decode_audio_stream(container, stream, kind: str, label: str, max_samples: int | None) -> np.ndarray:
    """All samples of ``stream`` as float32 ``[C, S]`` at the stream's own rate and channel count, stopping once
    ``max_samples`` are in hand.

    The conversion asks FFmpeg for *packed* float and de-interleaves in numpy: the same float values as diffusers'
    planar-float conversion, but PyAV's planar path reads past its plane table for 8-channel frames and crashes
    the process (SIGSEGV), so it is never used here. Rate and channel count are checked from the header first and
    again on every decoded frame.
    """
    rate = int(stream.codec_context.sample_rate or 0)
    channels = int(stream.codec_context.channels or 0)
    _check_audio_format(kind, label, rate, channels)
    converter, chunks, total = None, [], 0
    for frame in container.decode(stream):
        frame_channels = frame.layout.nb_channels
        _check_audio_format(kind, label, rate, frame_channels)
        if converter is None:
            channels = frame_channels
            layout = stream.layout if stream.layout.nb_channels == channels else frame.layout
            converter = av.AudioResampler(format="flt", layout=layout, rate=rate)
        elif frame_channels != channels:
            raise MediaError(f"{kind} {label} changes channel count mid-stream ({channels} -> {frame_channels})")
        for converted in converter.resample(frame):
            chunk = converted.to_ndarray().reshape(-1, channels)  # interleaved [S, C]
            chunks.append(chunk)
            total += chunk.shape[0]
        if max_samples is not None and total >= max_samples:
            break
    else:
        if converter is not None:  # drain what the converter still holds
            chunks += [converted.to_ndarray().reshape(-1, channels) for converted in converter.resample(None)]
    if not chunks:
        return np.zeros((channels or 1, 0), dtype=np.float32)
    interleaved = np.concatenate(chunks, axis=0)
    del chunks
    if max_samples is not None:
        interleaved = interleaved[:max_samples]
    return np.ascontiguousarray(interleaved.T, dtype=np.float32)


@_releases_on_failure
def read_audio(src: Source, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Decode the first audio stream of a file (WAV, FLAC, MP3, AAC/M4A, or a video's soundtrack) to
    ``(float32 [C, S], sample_rate)`` at the file's own rate and channel count (pass it to :func:`resample_audio`
    for H3).

    ``max_seconds`` stops decoding after ``int(max_seconds * sample_rate)`` samples and cuts there (the cut
    diffusers applies). Lossy codecs may carry up to one codec frame of encoder padding past the declared
    duration; it is kept, as FFmpeg and diffusers keep it.
    """
    data, label = _load_source(src, "audio")
    with _wrap_errors("audio", label), _av_open(data) as container:
        if not container.streams.audio:
            raise MediaError(f"audio {label} has no audio stream")
        stream = container.streams.audio[0]
        rate = int(stream.codec_context.sample_rate or 0)
        if rate <= 0:
            raise MediaError(f"audio {label} has no sample rate in its header")
        max_samples = None if max_seconds is None else int(max_seconds * rate)
        waveform = _decode_audio_stream(container, stream, "audio", label, max_samples)
    if waveform.shape[1] == 0:
        raise MediaError(f"audio {label} is zero-length (no samples decoded)")
    return waveform, rate


def encode_wav_bytes(waveform: Any, sample_rate: int, sample_format: str = "f32") -> bytes:
    """WAV bytes of a waveform ``[C, S]`` (or ``[S]``). ``sample_format="f32"`` (IEEE float, lossless:
    ``read_audio`` gives the same float32 samples back) or ``"s16"`` (16-bit PCM, ``round(x * 32768)`` clipped to the int16 range)."""
    x = _waveform_to_numpy(waveform)
    sample_rate = _check_rate(sample_rate, "sample_rate")
    channels = x.shape[0]
    if sample_format == "f32":
        fmt_tag, width, payload = 3, 4, np.ascontiguousarray(x.T).astype("<f4").tobytes()
    elif sample_format == "s16":
        # FFmpeg's float -> s16 rule (x * 32768, rounded, clipped), so decoding (/ 32768) is its inverse.
        ints = np.clip(np.round(x.astype(np.float64) * 32768.0), -32768, 32767).astype("<i2")
        fmt_tag, width, payload = 1, 2, np.ascontiguousarray(ints.T).tobytes()
    else:
        raise MediaError(f"WAV sample_format must be 'f32' or 's16', got {sample_format!r}")
    block = channels * width
    fmt = struct.pack("<HHIIHH", fmt_tag, channels, sample_rate, sample_rate * block, block, 8 * width)
    chunks = [b"fmt ", struct.pack("<I", len(fmt)), fmt]
    if fmt_tag == 3:  # non-PCM WAV carries a fact chunk with the frame count
        chunks += [b"fact", struct.pack("<II", 4, x.shape[1])]
    chunks += [b"data", struct.pack("<I", len(payload)), payload]
    body = b"WAVE" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


# --------------------------------------------------------------------------------------------------------------
# video


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
    fps: float = float(H3_FPS)


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
        self.shape, self.limit = shape, limit
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
        if len(self.blocks) == 1 and self.count == self.block:
            return self.blocks.pop()
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
    _check_pixels("video", label, width, height, max_pixels)
    declared = int(stream.frames or 0)
    if max_frames is not None and not truncate and declared > max_frames:
        raise MediaError(f"video {label} has {declared} frames, over the limit of max_frames={max_frames}")
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
            _check_pixels("video", label, frame.width, frame.height, max_pixels)
        elif (frame.width, frame.height) != size:
            raise MediaError(
                f"video {label} changes size mid-stream ({size[0]}x{size[1]} -> {frame.width}x{frame.height})"
            )
        if max_frames is not None and count == max_frames:
            if truncate:
                break
            raise MediaError(f"video {label} has more than max_frames={max_frames} frames")
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
    if canvas_size(width, height, *rule) != (width, height):
        return upright
    return height, width


@_releases_on_failure
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
    data, label = _load_source(src, "video")
    return _read_video_streams(data, label, max_frames, max_pixels, truncate, target, fps)


def _read_video_streams(
    data: str | bytes, label: str, max_frames: int | None, max_pixels: int | None, truncate: bool,
    target: VideoTarget | None, fps: float | None,
) -> VideoClip:
    with _wrap_errors("video", label), _av_open(data) as container:
        frames, count, fps = _decode_video_frames(container, label, max_frames, max_pixels, truncate, target, fps)
        has_audio = bool(container.streams.audio)
    audio, sample_rate = None, None
    if has_audio:
        # A fresh open rather than a seek: the soundtrack is then exactly what read_audio(src) decodes.
        with _wrap_errors("video soundtrack", label), _av_open(data) as container:
            astream = container.streams.audio[0]
            sample_rate = int(astream.codec_context.sample_rate or 0)
            if sample_rate > 0:
                cut = None
                if truncate and max_frames is not None and count == max_frames:
                    cut = int(max_frames / fps * sample_rate)
                audio = _decode_audio_stream(container, astream, "video soundtrack", label, cut)
        if audio is None or audio.shape[1] == 0:
            audio, sample_rate = None, None
    out_fps = fps if target is None else float(target.fps)
    return VideoClip(frames=frames, fps=out_fps, audio=audio, sample_rate=sample_rate, source_frames=count,
                     source_fps=fps)


def _fps_fraction(fps: Any) -> Fraction:
    rate = Fraction(fps).limit_denominator(1001) if not isinstance(fps, Fraction) else fps
    if rate <= 0:
        raise MediaError(f"fps must be positive, got {fps!r}")
    return rate


def _encode_mp4(
    target: str,
    frames: Any,
    audio: Any,
    fps: Any,
    sample_rate: int,
    crf: int,
    audio_bitrate: int,
) -> None:
    pixels = frames_to_uint8(frames)
    count, height, width = pixels.shape[:3]
    if count == 0:
        raise MediaError("cannot write a zero-length video (0 frames)")
    if height % 2 or width % 2 or height == 0 or width == 0:
        raise MediaError(f"H.264 yuv420p needs an even, non-zero width and height, got {width}x{height}")
    rate = _fps_fraction(fps)
    stereo = None
    if audio is not None:
        sample_rate = _check_rate(sample_rate, "sample_rate")
        stereo = _to_stereo(_waveform_to_numpy(audio, "soundtrack"))
        # Exactly the video's duration F / fps: trimmed, or zero-padded.
        wanted = int(round(Fraction(count) * sample_rate / rate))
        if stereo.shape[1] >= wanted:
            stereo = np.ascontiguousarray(stereo[:, :wanted])
        else:
            stereo = np.pad(stereo, ((0, 0), (0, wanted - stereo.shape[1])))
    codec = "libx264" if "libx264" in av.codecs_available else "h264"
    with _wrap_errors("mp4", repr(target), "encode"), av.open(
        target, mode="w", format="mp4", options={"movflags": "+faststart"}
    ) as container:
        vstream = container.add_stream(codec, rate=rate)
        vstream.width, vstream.height, vstream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            vstream.options = {"crf": str(int(crf))}
        # Tag what the conversion below does (BT.601 matrix, limited range), so players do not assume BT.709.
        context = vstream.codec_context
        context.colorspace, context.color_range, context.color_primaries, context.color_trc = 6, 1, 6, 6
        astream = None
        if stereo is not None:
            astream = container.add_stream("aac", rate=sample_rate, layout="stereo")
            astream.bit_rate = int(audio_bitrate)
        for index in range(count):
            frame = av.VideoFrame.from_ndarray(pixels[index], format="rgb24")
            frame = frame.reformat(format="yuv420p", dst_colorspace="ITU601", dst_color_range="MPEG")
            frame.pts = index
            container.mux(vstream.encode(frame))
        container.mux(vstream.encode(None))
        if astream is not None:
            step = 1024  # one AAC frame
            for start in range(0, stereo.shape[1], step):
                chunk = np.ascontiguousarray(stereo[:, start : start + step])
                aframe = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
                aframe.sample_rate = sample_rate
                aframe.pts = start
                aframe.time_base = Fraction(1, sample_rate)
                container.mux(astream.encode(aframe))
            container.mux(astream.encode(None))


def write_mp4(
    path: str | os.PathLike,
    frames: Any,
    audio: Any = None,
    fps: float = H3_FPS,
    sample_rate: int = H3_SAMPLE_RATE,
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
        _encode_mp4(partial, frames, audio, fps, sample_rate, crf, audio_bitrate)
        os.chmod(partial, 0o644)  # mkstemp made it 0600; an output file is meant to be shared
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def encode_mp4_bytes(
    frames: Any,
    audio: Any = None,
    fps: float = H3_FPS,
    sample_rate: int = H3_SAMPLE_RATE,
    crf: int = 18,
    audio_bitrate: int = 192_000,
) -> bytes:
    """The bytes :func:`write_mp4` would write for the same arguments (it goes through a temporary file)."""
    with tempfile.TemporaryDirectory(prefix="h3-mp4-") as directory:
        path = write_mp4(os.path.join(directory, "clip.mp4"), frames, audio, fps, sample_rate, crf, audio_bitrate)
        with open(path, "rb") as file:
            return file.read()


# --------------------------------------------------------------------------------------------------------------
# probe


def _seconds(value, time_base) -> float | None:
    if value is None or time_base is None:
        return None
    return float(value * time_base)


@_releases_on_failure
def probe(src: Source) -> dict[str, Any]:
    """Container facts from the headers only (no frame is decoded), for cheap validation.

    Returns ``{"format", "duration", "streams", "width", "height", "fps", "frames", "sample_rate", "channels"}``:
    ``streams`` lists every stream (``type``, ``codec``, ``duration`` in seconds, and ``width``/``height``/``fps``/
    ``frames`` for video, ``sample_rate``/``channels``/``layout`` for audio); the top-level video and audio keys
    describe the first stream of each kind, ``None`` where absent or undeclared. ``width``/``height`` are the coded
    size: a display-matrix rotation (applied by :func:`read_video`) is not visible in the headers PyAV exposes.
    Images open too (one video stream).
    """
    data, label = _load_source(src, "media")
    with _wrap_errors("media", label), _av_open(data) as container:
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
