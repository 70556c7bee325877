"""Audio in: decoding any channel count up to 7.1 to float32, resampling onto H3's rate, WAV bytes.

Part of :mod:`h3_core.media` (import from there).
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from typing import Any

import av
import numpy as np

from .. import facts
from .base import MediaError, Source, av_open, load_source, releases_on_failure, to_numpy, wrap_errors


def waveform_to_numpy(waveform: Any, kind: str = "waveform") -> np.ndarray:
    x = to_numpy(waveform)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2 or x.shape[0] < 1:
        raise MediaError(f"a {kind} must be [channels, samples] (or [samples] for mono), got shape {tuple(x.shape)}")
    if x.dtype.kind != "f":
        raise MediaError(f"a {kind} must be floating point (float32 over [-1, 1]), got dtype {x.dtype}")
    return x.astype(np.float32, copy=False)


def to_stereo(x: np.ndarray) -> np.ndarray:
    """Mono duplicated to both channels; channels beyond the first two dropped (the reference rule). A new array."""
    if x.shape[0] == 1:
        return np.repeat(x, 2, axis=0)
    return np.array(x[:2], dtype=np.float32, copy=True, order="C")


def check_rate(sample_rate: Any, what: str) -> int:
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


def resampled_length(num_samples: int, sample_rate: int, target_rate: int = facts.AUDIO_SAMPLE_RATE) -> int:
    """Length :func:`resample_audio` returns: ``ceil(S * target / rate)``, evaluated like ``torchaudio``'s
    ``Resample`` (rates reduced by their gcd, the quotient rounded to float32 before the ceiling), so lengths
    match what diffusers' torchaudio path would produce."""
    g = math.gcd(sample_rate, target_rate)
    quotient = np.float32((target_rate // g) * num_samples / (sample_rate // g))
    return int(np.ceil(quotient))


def resample_audio(waveform: Any, sample_rate: int, target_rate: int = facts.AUDIO_SAMPLE_RATE) -> np.ndarray:
    """A waveform ``[C, S]`` (numpy or torch, float) -> float32 stereo ``[2, S']`` at ``target_rate``.

    Mono is duplicated to both channels and channels beyond two are dropped (the reference implementation duplicates
    mono and drops extra channels; it does not down-mix). At ``sample_rate == target_rate`` the samples are
    returned untouched (a new array). Otherwise they go through FFmpeg's resampler (PyAV ``AudioResampler``,
    FFmpeg's default windowed-sinc filter, deterministic) in one pass: the input is followed by zeros so the
    filter's tail is fully flushed, and the output is cut to exactly :func:`resampled_length` =
    ``ceil(S * target / rate)`` samples, time-aligned with the input (no leading delay). The values are not
    torchaudio's (different filter), the length is.
    """
    x = to_stereo(waveform_to_numpy(waveform))
    sample_rate = check_rate(sample_rate, "sample_rate")
    target_rate = check_rate(target_rate, "target_rate")
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


def decode_audio_stream(container, stream, kind: str, label: str, max_samples: int | None) -> np.ndarray:
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


@releases_on_failure
def read_audio(src: Source, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Decode the first audio stream of a file (WAV, FLAC, MP3, AAC/M4A, or a video's soundtrack) to
    ``(float32 [C, S], sample_rate)`` at the file's own rate and channel count (pass it to :func:`resample_audio`
    for H3).

    ``max_seconds`` stops decoding after ``int(max_seconds * sample_rate)`` samples and cuts there (the cut
    diffusers applies). Lossy codecs may carry up to one codec frame of encoder padding past the declared
    duration; it is kept, as FFmpeg and diffusers keep it.
    """
    data, label = load_source(src, "audio")
    with wrap_errors("audio", label), av_open(data) as container:
        if not container.streams.audio:
            raise MediaError(f"audio {label} has no audio stream")
        stream = container.streams.audio[0]
        rate = int(stream.codec_context.sample_rate or 0)
        if rate <= 0:
            raise MediaError(f"audio {label} has no sample rate in its header")
        max_samples = None if max_seconds is None else int(max_seconds * rate)
        waveform = decode_audio_stream(container, stream, "audio", label, max_samples)
    if waveform.shape[1] == 0:
        raise MediaError(f"audio {label} is zero-length (no samples decoded)")
    return waveform, rate


def encode_wav_bytes(waveform: Any, sample_rate: int, sample_format: str = "f32") -> bytes:
    """WAV bytes of a waveform ``[C, S]`` (or ``[S]``). ``sample_format="f32"`` (IEEE float, lossless:
    ``read_audio`` gives the same float32 samples back) or ``"s16"`` (16-bit PCM, ``round(x * 32768)`` clipped to
    the int16 range)."""
    x = waveform_to_numpy(waveform)
    sample_rate = check_rate(sample_rate, "sample_rate")
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
