"""Server-side media ingestion: the parts of a request body -> the `EncodeRequest` the encoder stage takes.

* `check_part`: the declared content type is allowed for the slot, the bytes are that format (magic number),
  the size is within the slot's cap.
* `build_request`: every media item's header is read first (pixels, frames, seconds, sample rates), each is
  checked against its cap, then the arrays are decoded exactly as the CLI decodes files
  (`EncodeRequest.from_sources` with `h3_core.media.read_*`), with caps only a refused input can reach, so an
  accepted input decodes to the same arrays as an uncapped local read.

Every parse of untrusted media bytes goes through `decode_media` (the seam for running it in an isolated child
process). Nothing here unpickles, evaluates or writes to the filesystem; part and file names are never paths.
"""

from __future__ import annotations

import io
import re
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .. import media
from ..progress import check_cancel
from ..request import AudioInput, EncodeRequest, VideoInput
from .protocol import Limits, MediaRef, ProtocolError, RequestSpec
from .protocol import _bad as bad
from .protocol import _invalid as invalid
from .protocol import _too_large as too_large

__all__ = ["Part", "sniff", "check_filename", "content_type_family", "check_part", "max_part_bytes",
           "allowed_content_types", "decode_media", "build_request"]

# --------------------------------------------------------------------------------------------------------------
# parts: content types, magic bytes, sizes

# Declared content type -> the container formats its bytes may sniff as.
_CONTENT_TYPES: dict[str, dict[str, tuple[str, ...]]] = {
    "image": {
        "image/png": ("png",),
        "image/jpeg": ("jpeg",),
        "image/jpg": ("jpeg",),
        "image/webp": ("webp",),
    },
    "video": {
        "video/mp4": ("isobmff",),
        "video/quicktime": ("isobmff",),
        "video/webm": ("ebml",),
        "video/x-matroska": ("ebml",),
    },
    "audio": {
        "audio/wav": ("wav",),
        "audio/x-wav": ("wav",),
        "audio/wave": ("wav",),
        "audio/vnd.wave": ("wav",),
        "audio/flac": ("flac",),
        "audio/x-flac": ("flac",),
        "audio/mpeg": ("mp3",),
        "audio/mp3": ("mp3",),
        "audio/ogg": ("ogg",),
    },
}


def sniff(data: bytes) -> str | None:
    """The container format from the first bytes, or None."""
    head = bytes(data[:16])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:4] in (b"RIFF", b"RF64") and head[8:12] == b"WAVE":
        return "wav"
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"ID3") or (len(head) >= 2 and head[0] == 0xFF and (head[1] & 0xE0) == 0xE0):
        return "mp3"
    if head[4:8] == b"ftyp":
        return "isobmff"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "ebml"
    return None


def allowed_content_types(kind: str) -> list[str]:
    return sorted(_CONTENT_TYPES[kind])


def max_part_bytes(kind: str, limits: Limits) -> int:
    return {"image": limits.max_image_bytes, "video": limits.max_video_bytes, "audio": limits.max_audio_bytes}[kind]


_UNSAFE_FILENAME = re.compile(r"[\x00-\x1f\x7f/\\:]")


def check_filename(filename: str | None, where: str) -> None:
    """File names in Content-Disposition are never used, but a hostile one is refused rather than ignored."""
    if filename is None:
        return
    if (len(filename) > 255 or _UNSAFE_FILENAME.search(filename) or filename in (".", "..")
            or filename.startswith(".") or ".." in filename):
        raise bad(f"{where}: unsafe file name {filename[:80]!r} (no path separators, '..', leading dots or control "
                   "characters; file names are never used as paths)", where)


def content_type_family(content_type: str | None, kind: str, where: str) -> tuple[str, ...]:
    """The sniff formats a declared content type allows for a media kind; 415 for anything else."""
    declared = (content_type or "").split(";", 1)[0].strip().lower()
    allowed = _CONTENT_TYPES[kind]
    if declared not in allowed:
        raise ProtocolError(415, "unsupported_media_type",
                            f"{where}: content type {declared[:64] or '(none)'!r} is not accepted for a {kind}; "
                            f"use one of {', '.join(sorted(allowed))}", where)
    return allowed[declared]


@dataclass
class Part:
    """A received media part: its bytes, declared content type and digest."""

    name: str
    content_type: str
    data: bytes
    sha256: str


def check_part(part: Part, kind: str, where: str, limits: Limits = Limits()) -> None:
    """Content type allowed for the slot, bytes of that format (magic number), size within the cap."""
    family = content_type_family(part.content_type, kind, where)
    cap = max_part_bytes(kind, limits)
    if len(part.data) > cap:
        raise too_large(f"{where}: {len(part.data)} bytes, over the limit of max_{kind}_bytes={cap}", where)
    if not part.data:
        raise invalid(f"{where}: the part is empty (0 bytes)", where, "invalid_media")
    found = sniff(part.data)
    if found not in family:
        raise ProtocolError(415, "unsupported_media_type",
                            f"{where}: declared {part.content_type.split(';')[0]!r} but the bytes are "
                            f"{found or 'not a recognised media format'}", where)


# --------------------------------------------------------------------------------------------------------------
# THE DECODING SEAM. Every parse of untrusted media bytes (headers included) happens inside `decode_media`, so it
# can be moved into an isolated child process (memory/CPU rlimits, no network) without touching the callers:
# its arguments and results are plain bytes, dicts and numpy arrays.


def decode_media(kind: str, data: bytes, caps: Mapping[str, Any]) -> Any:
    """Parse untrusted media bytes. `kind`: ``"image_header"`` -> ``{"width", "height"}``; ``"header"`` ->
    `media.probe`'s dict; ``"image"`` -> uint8 [H, W, 3]; ``"audio"`` -> ``(float32 [C, S], rate)``; ``"video"``
    -> `media.VideoClip`. `caps` are the decode caps (``max_pixels``, ``max_seconds``, ``max_frames``)."""
    if kind == "image_header":
        from PIL import Image

        with warnings.catch_warnings():  # header only: Pillow reads the size without decoding pixels
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
        return {"width": width, "height": height}
    if kind == "header":
        return media.probe(data)
    if kind == "image":
        return media.read_image(data, max_pixels=caps["max_pixels"])
    if kind == "audio":
        return media.read_audio(data, max_seconds=caps["max_seconds"])
    if kind == "video":
        return media.read_video(data, max_frames=caps["max_frames"], max_pixels=caps["max_pixels"])
    raise ValueError(f"unknown media operation {kind!r}")


# --------------------------------------------------------------------------------------------------------------
# headers -> caps and decoded size (nothing decoded yet)


@dataclass
class _Plan:
    """One part after its header checks: the caps to decode it with and the bytes its arrays will take."""

    kind: str
    where: str
    caps: dict[str, Any] = field(default_factory=dict)
    decoded_bytes: int = 0


def _probe(data: bytes, where: str) -> dict[str, Any]:
    try:
        return decode_media("header", data, {})
    except media.MediaError as error:
        raise invalid(f"{where}: {error}", where, "invalid_media") from None


def _check_audio_header(info: dict[str, Any], where: str, limits: Limits, what: str) -> None:
    rate, channels = info.get("sample_rate"), info.get("channels")
    if rate is not None and rate > limits.max_sample_rate:
        raise too_large(f"{where}: {what} sample rate {rate} Hz is over the limit of "
                        f"max_sample_rate={limits.max_sample_rate}", where)
    if channels is not None and channels > limits.max_audio_channels:
        raise too_large(f"{where}: {what} has {channels} channels, over the limit of "
                        f"max_audio_channels={limits.max_audio_channels}", where)


def _audio_duration(info: dict[str, Any]) -> float | None:
    stream = next((s for s in info["streams"] if s["type"] == "audio"), None)
    if stream is not None and stream.get("duration"):
        return stream["duration"]
    return info.get("duration")


def _audio_bytes(info: dict[str, Any], limits: Limits, cap_s: float) -> int:
    """float32 samples x channels the decoder can produce, from the header (the caps where it is silent)."""
    rate = info.get("sample_rate") or limits.max_sample_rate
    channels = info.get("channels") or limits.max_audio_channels
    seconds = min(_audio_duration(info) or cap_s, cap_s)
    return int(seconds * rate + 1) * channels * 4


def _plan_image(data: bytes, where: str, limits: Limits) -> _Plan:
    from PIL import Image

    try:
        size = decode_media("image_header", data, {})
    except Image.DecompressionBombError as error:
        raise too_large(f"{where}: {error}", where, "too_many_pixels") from None
    except Exception as error:  # noqa: BLE001 - any Pillow failure on hostile bytes is a media error
        raise invalid(f"{where}: could not read the image header ({type(error).__name__}: {str(error)[:200]})",
                      where, "invalid_media") from None
    width, height = size["width"], size["height"]
    if width * height > limits.max_image_pixels:
        raise too_large(f"{where}: image is {width}x{height} = {width * height} pixels, over the limit of "
                        f"max_image_pixels={limits.max_image_pixels}", where, "too_many_pixels")
    return _Plan("image", where, {"max_pixels": limits.max_image_pixels}, width * height * 3)


def _plan_audio(data: bytes, where: str, limits: Limits) -> _Plan:
    info = _probe(data, where)
    if not any(s["type"] == "audio" for s in info["streams"]):
        raise invalid(f"{where}: no audio stream", where, "invalid_media")
    _check_audio_header(info, where, limits, "audio")
    cap = limits.max_media_seconds + limits.decode_slack_seconds
    seconds = _audio_duration(info)
    if seconds is not None and seconds > cap:
        raise too_large(f"{where}: audio is {seconds:.2f} s long, over the limit of "
                        f"max_media_seconds={limits.max_media_seconds:g}", where, "too_long")
    return _Plan("audio", where, {"max_seconds": cap}, _audio_bytes(info, limits, cap))


def _plan_video(data: bytes, where: str, limits: Limits) -> _Plan:
    info = _probe(data, where)
    if not any(s["type"] == "video" for s in info["streams"]):
        raise invalid(f"{where}: no video stream", where, "invalid_media")
    width, height = info.get("width") or 0, info.get("height") or 0
    if width * height > limits.max_video_pixels:
        raise too_large(f"{where}: video frames are {width}x{height} = {width * height} pixels, over the limit "
                        f"of max_video_pixels={limits.max_video_pixels}", where, "too_many_pixels")
    cap_s = limits.max_media_seconds + limits.decode_slack_seconds
    if info.get("duration") is not None and info["duration"] > cap_s:
        raise too_large(f"{where}: video is {info['duration']:.2f} s long, over the limit of "
                        f"max_media_seconds={limits.max_media_seconds:g}", where, "too_long")
    soundtrack_bytes = 0
    if any(s["type"] == "audio" for s in info["streams"]):
        _check_audio_header(info, where, limits, "soundtrack")
        seconds = _audio_duration(info)
        if seconds is not None and seconds > cap_s:
            raise too_large(f"{where}: soundtrack is {seconds:.2f} s long, over the limit of "
                            f"max_media_seconds={limits.max_media_seconds:g}", where, "too_long")
        soundtrack_bytes = _audio_bytes(info, limits, cap_s)
    max_frames = limits.max_video_frames
    if width and height:
        max_frames = max(1, min(max_frames, limits.max_video_decoded_bytes // (width * height * 3)))
    frame_bytes = (width * height or limits.max_video_pixels) * 3  # undeclared size: the decoder's pixel cap
    declared = info.get("frames")
    if declared and declared > max_frames:
        raise too_large(f"{where}: video declares {declared} frames, over the limit of {max_frames} decoded frames "
                        f"(max_video_frames={limits.max_video_frames}, "
                        f"max_video_decoded_bytes={limits.max_video_decoded_bytes})", where, "too_many_frames")
    frames = declared or max_frames  # undeclared: the decoder stops at max_frames
    caps = {"max_frames": max_frames, "max_pixels": limits.max_video_pixels}
    return _Plan("video", where, caps, frames * frame_bytes + soundtrack_bytes)


_PLANNERS = {"image": _plan_image, "audio": _plan_audio, "video": _plan_video}


# --------------------------------------------------------------------------------------------------------------
# decoding, with the caps planned from the headers


def _decode_image(data: bytes, plan: _Plan) -> np.ndarray:
    return decode_media("image", data, plan.caps)


def _decode_audio(data: bytes, plan: _Plan, limits: Limits) -> AudioInput:
    waveform, rate = decode_media("audio", data, plan.caps)
    if waveform.shape[1] >= int(plan.caps["max_seconds"] * rate):
        raise too_large(f"{plan.where}: audio is longer than max_media_seconds={limits.max_media_seconds:g}",
                        plan.where, "too_long")
    return AudioInput(waveform=waveform, sample_rate=rate)


def _decode_video(data: bytes, plan: _Plan) -> media.VideoClip:
    try:
        return decode_media("video", data, plan.caps)
    except media.MediaError as error:
        if "max_frames" in str(error):
            raise too_large(f"{plan.where}: {error}", plan.where, "too_many_frames") from None
        raise


def build_request(
    spec: RequestSpec,
    parts: Mapping[str, Part],
    limits: Limits = Limits(),
    cancel: threading.Event | None = None,
) -> EncodeRequest:
    """Check every part's header against the caps, then decode the parts into the `EncodeRequest`.

    Header-level caps (pixels, seconds, sample rates, declared frames) are checked for every part before any
    pixel or sample is decoded; decoding runs with caps that only a refused input can reach.
    """
    plans: dict[str, _Plan] = {}
    for name, (kind, where) in spec.part_kinds().items():
        if name not in parts:  # the server checks this while reading; kept for in-process callers
            raise bad(f"{where}: part {name!r} is missing from the request body", where)
        check_cancel(cancel, f"before reading the header of {where}")
        plans[name] = _PLANNERS[kind](parts[name].data, where, limits)
    total = sum(plan.decoded_bytes for plan in plans.values())
    if total > limits.max_request_decoded_bytes:
        largest = max(plans.values(), key=lambda plan: plan.decoded_bytes)
        raise too_large(f"the request's media would decode to {total} bytes (largest: {largest.where}, "
                        f"{largest.decoded_bytes} bytes), over the limit of max_request_decoded_bytes="
                        f"{limits.max_request_decoded_bytes}", largest.where, "too_large_decoded")

    def image(ref: MediaRef) -> np.ndarray:
        check_cancel(cancel, f"before decoding {ref.field}")
        return _decode_image(parts[ref.part].data, plans[ref.part])

    def audio(ref: MediaRef) -> AudioInput:
        check_cancel(cancel, f"before decoding {ref.field}")
        return _decode_audio(parts[ref.part].data, plans[ref.part], limits)

    def video(ref: MediaRef) -> VideoInput:
        check_cancel(cancel, f"before decoding {ref.field}")
        clip = _decode_video(parts[ref.part].data, plans[ref.part])
        sound, rate = clip.audio, clip.sample_rate
        if ref.soundtrack is False:
            sound, rate = None, None
        elif isinstance(ref.soundtrack, str):
            check_cancel(cancel, f"before decoding {ref.field}.soundtrack")
            track = _decode_audio(parts[ref.soundtrack].data, plans[ref.soundtrack], limits)
            sound, rate = track.waveform, track.sample_rate
        return VideoInput(frames=clip.frames, fps=clip.fps if ref.fps is None else ref.fps, audio=sound,
                          sample_rate=rate)

    return EncodeRequest.from_sources(
        spec.prompt,
        task=spec.task,
        width=spec.width,
        height=spec.height,
        num_frames=spec.num_frames,
        first_frame=spec.first_frame,
        last_frame=spec.last_frame,
        ref_images=spec.ref_images,
        ref_videos=spec.ref_videos,
        ref_audios=spec.ref_audios,
        read_image=image,
        read_video=video,
        read_audio=audio,
    )
