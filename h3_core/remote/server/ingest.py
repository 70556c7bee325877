"""Server-side media ingestion: the parts of a request body -> the `EncodeRequest` the encoder stage takes.

* `check_part`: the declared content type is allowed for the slot, the bytes are that format (magic number),
  the size is within the slot's cap.
* `build_request`: every media item's header is read first (pixels, frames, seconds, sample rates), each is
  checked against its cap, then the arrays are decoded with the CLI's functions (`EncodeRequest.from_sources`
  with `h3_core.media.read_*`), with caps only a refused input can reach. Reference videos are decoded straight
  onto what the encoder makes of them (24 fps, the output length, the canvas of the pipeline's rule:
  `media.VideoTarget`), which is exactly what its own normalisation of the whole clip gives, so the conditioning
  equals a local encode while a 4K clip never exists at 4K; the decoded-bytes bound counts that output size.
* Guides (the request's "guides"): an image as a reference image is; a clip decoded whole (the encoder crops its
  frames onto the canvas itself), at most `guides.MAX_GUIDE_FRAMES` frames, refused by its header first; an audio
  cut at `protocol.GUIDE_AUDIO_SECONDS` while decoding (the encoder keeps less), never refused for its length.

Every parse of untrusted media bytes goes through `decode_media`, which runs it in a sandboxed worker process
(`h3_core.media.sandbox`: address-space cap, timeout; a crash is a 422 for that request). Nothing here unpickles
or evaluates anything; part and file names are never paths (the sandbox passes bytes through a private tmpfs
directory of its own).
"""

from __future__ import annotations

import io
import math
import re
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ... import guides, media, rules
from ...guides import GuideMedia
from ...media import sandbox as media_sandbox
from ...progress import check_cancel
from ...request import AudioInput, EncodeRequest, VideoInput
from ..protocol import GUIDE_AUDIO_SECONDS, Limits, ProtocolError, bad, invalid, too_large
from .request_schema import GuideRef, MediaRef, RequestSpec

__all__ = ["Part", "sniff", "check_filename", "content_type_family", "check_part", "max_part_bytes",
           "allowed_content_types", "decode_media", "DecodeSettings", "build_request"]

_DEFAULT_LIMITS = Limits()

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


def check_part(part: Part, kind: str, where: str, limits: Limits = _DEFAULT_LIMITS) -> None:
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
# THE DECODING SEAM. Every parse of untrusted media bytes (headers included) happens inside `decode_media`. By
# default it runs the parse in a forked worker under an address-space cap and a timeout (`media_sandbox`): a native
# crash, runaway allocation or endless loop in FFmpeg/PyAV/Pillow costs that one request a 422, not the server.


@dataclass(frozen=True)
class DecodeSettings:
    """How the server decodes a request's media.

    ``isolate``: in the sandbox (the default; False decodes in the server process, for debugging only).
    ``timeout_s``: wall-clock limit of one decode (the server derives it from the request's deadline).
    ``canvas_short_edge`` / ``canvas_max_pixels``: the pipeline's canvas rule; when set, reference videos are
    decoded straight onto what the encoder will use (24 fps, the output length, the canvas), never at full size.
    """

    isolate: bool = True
    timeout_s: float = 120.0
    canvas_short_edge: int | None = None
    canvas_max_pixels: int | None = None

    @classmethod
    def for_pipeline(cls, pipeline_config: Mapping[str, Any] | None, **kwargs: Any) -> "DecodeSettings":
        config = pipeline_config or {}
        return cls(canvas_short_edge=config.get("canvas_short_edge"), canvas_max_pixels=config.get("canvas_max_pixels"),
                   **kwargs)


_IN_PROCESS_HEADERS = ["PNG", "JPEG"]
"""Image formats whose size is read in the server process: Pillow parses these headers in pure Python (chunks and
markers up to the first pixel data) and decodes no pixel; WebP opens through libwebp's native demuxer, so its size
is read from the fixed header fields below instead."""


def _image_header(data: bytes) -> dict[str, int]:
    if sniff(data) == "webp":
        size = _webp_size(bytes(data[:30]))
        if size is None:
            raise media.MediaError("not a WebP image with a VP8, VP8L or VP8X header")
        return {"width": size[0], "height": size[1]}
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data), formats=_IN_PROCESS_HEADERS) as image:
            width, height = image.size
    return {"width": width, "height": height}


def _webp_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) from a WebP file's first 30 bytes: the VP8X canvas, the VP8L or the VP8 key-frame header."""
    chunk = head[12:16]
    if chunk == b"VP8X" and len(head) >= 30:
        return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
    if chunk == b"VP8L" and len(head) >= 25 and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 " and len(head) >= 30 and head[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(head[26:28], "little") & 0x3FFF, int.from_bytes(head[28:30], "little") & 0x3FFF
    return None


_DECODERS = {"header": "probe", "image": "read_image", "audio": "read_audio", "video": "read_video"}


def decode_media(
    kind: str, data: bytes, caps: Mapping[str, Any], settings: DecodeSettings = DecodeSettings(),
    memory_cap: int | None = None,
) -> Any:
    """Parse untrusted media bytes. `kind`: ``"image_header"`` -> ``{"width", "height"}``; ``"header"`` ->
    `media.probe`'s dict; ``"image"`` -> uint8 [H, W, 3]; ``"audio"`` -> ``(float32 [C, S], rate)``; ``"video"``
    -> `media.VideoClip`. `caps` are the decode function's keyword arguments (``max_pixels``, ``max_seconds``,
    ``max_frames``, ``target``, ``fps``). Everything but ``"image_header"`` runs in the sandbox unless
    ``settings.isolate`` is off; `memory_cap` is the worker's address-space allowance (default: from `caps`)."""
    if kind == "image_header":
        return _image_header(data)
    if kind not in _DECODERS:
        raise ValueError(f"unknown media operation {kind!r}")
    if settings.isolate:
        return media_sandbox.decode_isolated(_DECODERS[kind], data, timeout_s=settings.timeout_s,
                                             memory_cap=memory_cap, **caps)
    return getattr(media, _DECODERS[kind])(data, **caps)


# --------------------------------------------------------------------------------------------------------------
# headers -> caps and decoded size (nothing decoded yet)


@dataclass
class _Plan:
    """One part after its header checks: the caps to decode it with, the bytes its arrays will take in the server,
    and the address space its sandboxed decode may use (None: the sandbox's default for the caps)."""

    kind: str
    where: str
    caps: dict[str, Any] = field(default_factory=dict)
    decoded_bytes: int = 0
    memory_cap: int | None = None


def _probe(data: bytes, where: str, settings: DecodeSettings) -> dict[str, Any]:
    try:
        return decode_media("header", data, {}, settings)
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


def _plan_image(data: bytes, where: str, limits: Limits, settings: DecodeSettings, ref: MediaRef | None,
                num_frames: int) -> _Plan:
    from PIL import Image

    try:
        size = decode_media("image_header", data, {}, settings)
    except Image.DecompressionBombError as error:
        raise too_large(f"{where}: {error}", where, "too_many_pixels") from None
    except Exception as error:  # noqa: BLE001 - any Pillow failure on hostile bytes is a media error
        raise invalid(f"{where}: could not read the image header ({type(error).__name__}: {str(error)[:200]})",
                      where, "invalid_media") from None
    width, height = size["width"], size["height"]
    if width * height > limits.max_image_pixels:
        raise too_large(f"{where}: image is {width}x{height} = {width * height} pixels, over the limit of "
                        f"max_image_pixels={limits.max_image_pixels}", where, "too_many_pixels")
    caps = {"max_pixels": limits.max_image_pixels}
    # The worker's allowance is sized for the header's pixels; an image that decodes larger hits it (422).
    memory_cap = media_sandbox.default_memory_cap("read_image", len(data), {"max_pixels": max(1, width * height)})
    return _Plan("image", where, caps, width * height * 3, memory_cap)


def _plan_audio(data: bytes, where: str, limits: Limits, settings: DecodeSettings, ref: MediaRef | None,
                num_frames: int) -> _Plan:
    info = _probe(data, where, settings)
    if not any(s["type"] == "audio" for s in info["streams"]):
        raise invalid(f"{where}: no audio stream", where, "invalid_media")
    _check_audio_header(info, where, limits, "audio")
    cap = limits.max_media_seconds + limits.decode_slack_seconds
    seconds = _audio_duration(info)
    if seconds is not None and seconds > cap:
        raise too_large(f"{where}: audio is {seconds:.2f} s long, over the limit of "
                        f"max_media_seconds={limits.max_media_seconds:g}", where, "too_long")
    return _Plan("audio", where, {"max_seconds": cap}, _audio_bytes(info, limits, cap))


def _video_target(width: int, height: int, num_frames: int, settings: DecodeSettings) -> media.VideoTarget | None:
    """What a reference video becomes in the encoder, or None to decode it whole (no canvas rule configured, no
    size in the header, or a size whose canvas the canvas rule would move again: decoding onto the target is
    then not known to equal the encoder's own normalisation, so the server keeps the full decode it always did)."""
    if not (settings.canvas_short_edge and settings.canvas_max_pixels and width > 0 and height > 0):
        return None
    rule = (settings.canvas_short_edge, settings.canvas_max_pixels)
    try:
        for w, h in ((width, height), (height, width)):  # the display matrix may turn the coded picture
            media.canvas_size(*media.canvas_size(w, h, *rule), *rule)
    except media.MediaError:
        return None
    return media.VideoTarget(rules.snap_frames_up(max(1, num_frames)), *rule)


def _target_pixels(width: int, height: int, target: media.VideoTarget) -> int:
    """Pixels of one output frame: the canvas of the clip's aspect ratio, or the decoded size when the canvas rule
    applied to that canvas would pick another one (`media.read_video` keeps the decoded size then); the larger
    of the two orientations, since the headers do not show the display matrix."""
    rule = (target.canvas_short_edge, target.canvas_max_pixels, target.canvas_multiple)
    pixels = 0
    for w, h in ((width, height), (height, width)):
        canvas = media.canvas_size(w, h, *rule)
        pixels = max(pixels, canvas[0] * canvas[1] if media.canvas_size(*canvas, *rule) == canvas else w * h)
    return pixels


def _video_header(data: bytes, where: str, limits: Limits, settings: DecodeSettings) -> tuple[dict, int, int, float]:
    """A video part's probed header, held to the pixel cap: (info, width, height, the seconds any stream may last)."""
    info = _probe(data, where, settings)
    if not any(s["type"] == "video" for s in info["streams"]):
        raise invalid(f"{where}: no video stream", where, "invalid_media")
    width, height = info.get("width") or 0, info.get("height") or 0
    if width * height > limits.max_video_pixels:
        raise too_large(f"{where}: video frames are {width}x{height} = {width * height} pixels, over the limit "
                        f"of max_video_pixels={limits.max_video_pixels}", where, "too_many_pixels")
    return info, width, height, limits.max_media_seconds + limits.decode_slack_seconds


def _soundtrack_bytes(info: dict, where: str, limits: Limits, cap_s: float, label: str = "soundtrack",
                      hint: str = "") -> int:
    """The bytes a video's own audio stream decodes to (0 without one), its header and length checked first."""
    if not any(s["type"] == "audio" for s in info["streams"]):
        return 0
    _check_audio_header(info, where, limits, "soundtrack")
    seconds = _audio_duration(info)
    if seconds is not None and seconds > cap_s:
        raise too_large(f"{where}: {label} is {seconds:.2f} s long, over the limit of "
                        f"max_media_seconds={limits.max_media_seconds:g}{hint}", where, "too_long")
    return _audio_bytes(info, limits, cap_s)


def _plan_video(data: bytes, where: str, limits: Limits, settings: DecodeSettings, ref: MediaRef | None,
                num_frames: int) -> _Plan:
    info, width, height, cap_s = _video_header(data, where, limits, settings)
    if info.get("duration") is not None and info["duration"] > cap_s:
        raise too_large(f"{where}: video is {info['duration']:.2f} s long, over the limit of "
                        f"max_media_seconds={limits.max_media_seconds:g}", where, "too_long")
    soundtrack_bytes = _soundtrack_bytes(info, where, limits, cap_s)
    max_frames = limits.max_video_frames
    if width and height:
        max_frames = max(1, min(max_frames, limits.max_video_decoded_bytes // (width * height * 3)))
    frame_bytes = (width * height or limits.max_video_pixels) * 3  # undeclared size: the decoder's pixel cap
    declared = info.get("frames")
    if declared and declared > max_frames:
        raise too_large(f"{where}: video declares {declared} frames, over the limit of {max_frames} decoded frames "
                        f"(max_video_frames={limits.max_video_frames}, "
                        f"max_video_decoded_bytes={limits.max_video_decoded_bytes})", where, "too_many_frames")
    fps = None if ref is None else ref.fps
    caps: dict[str, Any] = {"max_frames": max_frames, "max_pixels": limits.max_video_pixels, "fps": fps}
    target = _video_target(width, height, num_frames, settings)
    # The worker's allowance (address space): the frames it may store, 48 decoded frames of the header's size in
    # flight (reference frames, frame threads, conversions), the soundtrack three times (chunks, joined, transposed).
    in_flight = media_sandbox.BASE_BYTES + 48 * frame_bytes + 3 * soundtrack_bytes
    if target is None:
        frames = declared or max_frames  # undeclared: the decoder stops at max_frames
        return _Plan("video", where, caps, frames * frame_bytes + soundtrack_bytes,
                     in_flight + max_frames * frame_bytes)
    # Decoded onto the target: the server receives at most target.num_frames frames of the output size (fewer for
    # a clip shorter than the output: its frame count on the 24 fps clock), whatever the source resolution.
    caps["target"] = target
    out_frame = _target_pixels(width, height, target) * 3
    out_frames = target.num_frames
    source_fps = fps or info.get("fps")
    if declared and source_fps:
        out_frames = min(out_frames, math.floor(declared * target.fps / source_fps + 0.5))
    # The worker stores the output at its largest (the header's frame count may be wrong), never the source.
    return _Plan("video", where, caps, out_frames * out_frame + soundtrack_bytes,
                 in_flight + target.num_frames * out_frame)


_PLANNERS = {"image": _plan_image, "audio": _plan_audio, "video": _plan_video}


def _plan_guide_video(data: bytes, where: str, limits: Limits, settings: DecodeSettings, ref: MediaRef | None,
                      num_frames: int) -> _Plan:
    """A guide clip: decoded whole (no target: the encoder cover-crops its frames itself, as a local encode does),
    at most `guides.MAX_GUIDE_FRAMES` frames (fewer where max_video_decoded_bytes says so); a container's own
    soundtrack is checked as a reference video's is (the decoder reads it), then dropped."""
    info, width, height, cap_s = _video_header(data, where, limits, settings)
    soundtrack_bytes = _soundtrack_bytes(info, where, limits, cap_s, "the clip's own soundtrack",
                                         " (a guide's audio goes in its \"audio\" part)")
    frame_bytes = (width * height or limits.max_video_pixels) * 3
    declared = info.get("frames")
    if declared and declared > guides.MAX_GUIDE_FRAMES:
        raise too_large(f"{where}: a guide clip anchors at most {guides.MAX_GUIDE_FRAMES} frames, the clip "
                        f"declares {declared}: cut it (the client sends only the frames a guide anchors)", where,
                        "too_many_frames")
    max_frames = max(1, min(guides.MAX_GUIDE_FRAMES, limits.max_video_frames,
                            limits.max_video_decoded_bytes // frame_bytes))
    if declared and declared > max_frames:
        raise too_large(f"{where}: video declares {declared} frames, over the limit of {max_frames} decoded frames "
                        f"(max_video_frames={limits.max_video_frames}, "
                        f"max_video_decoded_bytes={limits.max_video_decoded_bytes})", where, "too_many_frames")
    caps: dict[str, Any] = {"max_frames": max_frames, "max_pixels": limits.max_video_pixels}
    frames = declared or max_frames
    in_flight = media_sandbox.BASE_BYTES + 48 * frame_bytes + 3 * soundtrack_bytes
    return _Plan("video", where, caps, frames * frame_bytes + soundtrack_bytes, in_flight + max_frames * frame_bytes)


def _plan_guide_audio(data: bytes, where: str, limits: Limits, settings: DecodeSettings, ref: MediaRef | None,
                      num_frames: int) -> _Plan:
    """A guide's audio: its header checked as a reference audio's is, but not its length: the decoder stops at
    `GUIDE_AUDIO_SECONDS` (a local encode cuts a guide's audio too, and to less)."""
    info = _probe(data, where, settings)
    if not any(s["type"] == "audio" for s in info["streams"]):
        raise invalid(f"{where}: no audio stream", where, "invalid_media")
    _check_audio_header(info, where, limits, "audio")
    return _Plan("audio", where, {"max_seconds": GUIDE_AUDIO_SECONDS}, _audio_bytes(info, limits, GUIDE_AUDIO_SECONDS))


_GUIDE_PLANNERS = {"image": _plan_image, "audio": _plan_guide_audio, "video": _plan_guide_video}


# --------------------------------------------------------------------------------------------------------------
# decoding, with the caps planned from the headers


def _decode(data: bytes, plan: _Plan, settings: DecodeSettings) -> Any:
    try:
        return decode_media(plan.kind, data, plan.caps, settings, plan.memory_cap)
    except media.MediaError as error:  # a refusal, a crash, the memory cap or the timeout: name the part
        raise invalid(f"{plan.where}: {error}", plan.where, "invalid_media") from None


def _decode_audio(data: bytes, plan: _Plan, limits: Limits, settings: DecodeSettings) -> AudioInput:
    waveform, rate = _decode(data, plan, settings)
    if waveform.shape[1] >= int(plan.caps["max_seconds"] * rate):
        raise too_large(f"{plan.where}: audio is longer than max_media_seconds={limits.max_media_seconds:g}",
                        plan.where, "too_long")
    return AudioInput(waveform=waveform, sample_rate=rate)


def _decode_video(data: bytes, plan: _Plan, settings: DecodeSettings) -> media.VideoClip:
    try:
        return decode_media("video", data, plan.caps, settings, plan.memory_cap)
    except media.TooManyFrames as error:
        raise too_large(f"{plan.where}: {error}", plan.where, "too_many_frames") from None
    except media.MediaError as error:
        raise invalid(f"{plan.where}: {error}", plan.where, "invalid_media") from None


def build_request(
    spec: RequestSpec,
    parts: Mapping[str, Part],
    limits: Limits = _DEFAULT_LIMITS,
    cancel: threading.Event | None = None,
    settings: DecodeSettings = DecodeSettings(),
) -> EncodeRequest:
    """Check every part's header against the caps, then decode the parts into the `EncodeRequest`.

    Header-level caps (pixels, seconds, sample rates, declared frames) are checked for every part before any
    pixel or sample is decoded; decoding runs with caps that only a refused input can reach. `settings` says
    where (sandbox or in-process) and onto what (the pipeline's canvas rule) the media is decoded.
    """
    videos = {ref.part: ref for ref in spec.ref_videos}
    guide_parts = {ref.part for guide in spec.guides for ref in guide.media()}
    plans: dict[str, _Plan] = {}
    for name, (kind, where) in spec.part_kinds().items():
        if name not in parts:  # the server checks this while reading; kept for in-process callers
            raise bad(f"{where}: part {name!r} is missing from the request body", where)
        check_cancel(cancel, f"before reading the header of {where}")
        planners = _GUIDE_PLANNERS if name in guide_parts else _PLANNERS
        plans[name] = planners[kind](parts[name].data, where, limits, settings, videos.get(name), spec.num_frames)
    total = sum(plan.decoded_bytes for plan in plans.values())
    if total > limits.max_request_decoded_bytes:
        largest = max(plans.values(), key=lambda plan: plan.decoded_bytes)
        raise too_large(f"the request's media would decode to {total} bytes (largest: {largest.where}, "
                        f"{largest.decoded_bytes} bytes), over the limit of max_request_decoded_bytes="
                        f"{limits.max_request_decoded_bytes}", largest.where, "too_large_decoded")

    def image(ref: MediaRef) -> np.ndarray:
        check_cancel(cancel, f"before decoding {ref.field}")
        return _decode(parts[ref.part].data, plans[ref.part], settings)

    def audio(ref: MediaRef) -> AudioInput:
        check_cancel(cancel, f"before decoding {ref.field}")
        return _decode_audio(parts[ref.part].data, plans[ref.part], limits, settings)

    def video(ref: MediaRef) -> VideoInput:
        check_cancel(cancel, f"before decoding {ref.field}")
        clip = _decode_video(parts[ref.part].data, plans[ref.part], settings)
        sound, rate = clip.audio, clip.sample_rate
        if ref.soundtrack is False:
            sound, rate = None, None
        elif isinstance(ref.soundtrack, str):
            check_cancel(cancel, f"before decoding {ref.field}.soundtrack")
            track = _decode_audio(parts[ref.soundtrack].data, plans[ref.soundtrack], limits, settings)
            sound, rate = track.waveform, track.sample_rate
        # A clip decoded onto its target is truncated to the output length: H3's 2-15 s rule reads the length
        # of the stream as decoded (`source_seconds`), which is what the untruncated frames would show.
        return VideoInput(frames=clip.frames, fps=clip.fps, audio=sound, sample_rate=rate,
                          source_seconds=clip.source_seconds)

    request = EncodeRequest.from_sources(
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
    request.guides = [_guide(guide, index, spec.num_frames, parts, plans, cancel, settings)
                      for index, guide in enumerate(spec.guides, start=1)]
    return request


def _guide(guide: GuideRef, number: int, num_frames: int, parts: Mapping[str, Part], plans: Mapping[str, _Plan],
           cancel: threading.Event | None, settings: DecodeSettings) -> GuideMedia:
    """One guide decoded into the `GuideMedia` a local request holds, its fit on the output checked (`guides.check`'s
    words) with the part that decides it named."""
    frames = audio = rate = None
    if guide.image is not None:
        check_cancel(cancel, f"before decoding {guide.image.field}")
        frames = _decode(parts[guide.image.part].data, plans[guide.image.part], settings)[None]
    elif guide.video is not None:
        check_cancel(cancel, f"before decoding {guide.video.field}")
        frames = _decode_video(parts[guide.video.part].data, plans[guide.video.part], settings).frames
    if guide.audio is not None:
        check_cancel(cancel, f"before decoding {guide.audio.field}")
        audio, rate = _decode(parts[guide.audio.part].data, plans[guide.audio.part], settings)
    media_guide = GuideMedia(frame_index=guide.frame_index, frames=frames, audio=audio, sample_rate=rate)
    problem = guides.fit_error(guide.frame_index, media_guide.frame_count, num_frames, audio=audio is not None)
    if problem:
        where = guide.video.field if guide.video is not None else f"{guide.field}.frame_index"
        raise invalid(f"guide {number}: {problem}", where)
    return media_guide
