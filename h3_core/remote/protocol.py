"""The H3 encoder protocol, version 1: one schema shared by the server and the client.

Wire (docs/PROTOCOL.md has the full text):

    GET  /v1/health        liveness + load; no auth; 200 {"status": "ok", ...} or 503 while draining
    GET  /v1/capabilities  protocol version, model fingerprint, loaded components, limits   (auth)
    POST /v1/encode        multipart/form-data: a JSON part named "request", then one part per media item;
                           200 -> the conditioning contract as safetensors bytes      (auth)

Everything a request can get wrong is a `ProtocolError` carrying the HTTP status, a stable `code`, the
offending `field` and a message that names the constraint; the server sends it as
``{"error": {"code", "message", "field", "request_id"}}``.

Media conversion is the CLI's (h3_core/cli.py `_build_request`): bytes -> `h3_core.media.read_*` ->
`EncodeRequest`, so the server builds exactly the arrays a local run builds from the same files. The client
sends the arrays of an `EncodeRequest` losslessly (PNG, lossless H.264 RGB in mp4 with the exact frame rate in
the JSON, float32 WAV), so a remote encode is bit-identical to a local one.

Nothing here unpickles, evaluates or writes to the filesystem; part and file names are never used as paths.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import secrets
import threading
import warnings
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, Iterable, Mapping

import numpy as np

from .. import media, rules
from ..progress import check_cancel
from ..request import AudioInput, EncodeRequest, VideoInput

__all__ = [
    "PROTOCOL_NAME",
    "PROTOCOL_VERSION",
    "HEALTH_PATH",
    "CAPABILITIES_PATH",
    "ENCODE_PATH",
    "DEFAULT_TOKEN_ENV",
    "CONDITIONING_CONTENT_TYPE",
    "Limits",
    "ProtocolError",
    "MediaRef",
    "RequestSpec",
    "Part",
    "parse_request_json",
    "parse_request",
    "check_part",
    "sniff",
    "build_request",
    "cache_key",
    "request_to_wire",
    "encode_multipart",
    "error_body",
    "error_from_exception",
]

PROTOCOL_NAME = "h3-encoder"
PROTOCOL_VERSION = 1
HEALTH_PATH = "/v1/health"
CAPABILITIES_PATH = "/v1/capabilities"
ENCODE_PATH = "/v1/encode"
DEFAULT_TOKEN_ENV = "H3_ENCODER_TOKEN"
CONDITIONING_CONTENT_TYPE = "application/octet-stream"
REQUEST_PART = "request"
# Identity of the bytes -> arrays conversion, part of every cache key: bump it when h3_core.media changes how a
# file decodes, so a cache never answers with conditioning made from differently decoded media.
CONVERSION_ID = "h3_core.media.read_*/1"

# Response / request headers (all optional for third-party clients except Authorization when a token is set).
H_PROTOCOL = "X-H3-Protocol"
H_MODEL = "X-H3-Model"
H_CACHE = "X-H3-Cache"
H_SHA256 = "X-H3-Sha256"
H_FORMAT = "X-H3-Format"
H_REQUEST_ID = "X-Request-Id"
H_QUEUE_S = "X-H3-Queue-Seconds"
H_ENCODE_S = "X-H3-Encode-Seconds"

MiB = 1024 * 1024


# --------------------------------------------------------------------------------------------------------------
# limits


@dataclass(frozen=True)
class Limits:
    """Caps the server enforces before and while decoding; published by /v1/capabilities.

    Reference counts, output frames, canvas rules and clip durations are H3's own (h3_core.rules); the numbers
    here bound memory and CPU: bytes on the wire, pixels per image or frame (decompression bombs), decoded frames,
    seconds and sample rates read from the headers before any sample is decoded.
    """

    max_body_bytes: int = 512 * MiB
    max_json_bytes: int = 64 * 1024
    max_image_bytes: int = 64 * MiB
    max_video_bytes: int = 384 * MiB
    max_audio_bytes: int = 64 * MiB
    max_parts: int = 1 + rules.MAX_KEYFRAMES + rules.MAX_REFS + rules.MAX_REF_VIDEOS  # request + media + soundtracks
    max_prompt_chars: int = 16384
    max_image_pixels: int = 4096 * 4096
    max_video_pixels: int = 3840 * 2160  # per frame
    max_video_frames: int = 1800  # decoded frames per reference video (15 s at 120 fps)
    max_video_decoded_bytes: int = 3 * 1024 * MiB  # frames x H x W x 3, per reference video
    max_media_seconds: float = rules.MAX_AUDIO_CLIP_S  # videos and audio clips (H3 refuses longer ones anyway)
    decode_slack_seconds: float = 1.0  # decoded past max_media_seconds before refusing, so H3's message wins
    max_sample_rate: int = 192_000
    max_audio_channels: int = 8
    max_fps: float = 240.0
    max_canvas_edge: int = 4096
    max_canvas_pixels: int = 4096 * 2304

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(
            max_keyframes=rules.MAX_KEYFRAMES,
            max_ref_images=rules.MAX_REF_IMAGES,
            max_ref_videos=rules.MAX_REF_VIDEOS,
            max_ref_audios=rules.MAX_REF_AUDIOS,
            max_refs=rules.MAX_REFS,
            num_frames=[rules.MIN_FRAMES, rules.MAX_FRAMES],
            frame_grid="17k+5",
            canvas_multiple=rules.CANVAS_MULTIPLE,
        )
        return out


# --------------------------------------------------------------------------------------------------------------
# errors


class ProtocolError(ValueError):
    """A request the protocol refuses: HTTP `status`, stable `code`, offending `field`, message naming the rule."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field

    def body(self, request_id: str | None = None) -> dict[str, Any]:
        return error_body(self.code, self.message, self.field, request_id)


def _bad(message: str, field: str | None = None, code: str = "bad_request") -> ProtocolError:
    return ProtocolError(400, code, message, field)


def _invalid(message: str, field: str | None = None, code: str = "invalid_request") -> ProtocolError:
    return ProtocolError(422, code, message, field)


def _too_large(message: str, field: str | None = None, code: str = "too_large") -> ProtocolError:
    return ProtocolError(413, code, message, field)


def error_body(code: str, message: str, field: str | None = None, request_id: str | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "field": field, "request_id": request_id}}


def error_from_exception(error: BaseException) -> ProtocolError | None:
    """The protocol error for an exception raised while decoding or encoding, or None for a server fault."""
    from ..contract import ContractError

    if isinstance(error, ProtocolError):
        return error
    if isinstance(error, rules.H3InputError):
        return ProtocolError(422, "invalid_request", str(error))
    if isinstance(error, media.MediaError):
        return ProtocolError(422, "invalid_media", str(error))
    if isinstance(error, ContractError):
        return ProtocolError(422, "contract_violation", str(error), getattr(error, "field", None))
    try:
        from ..encoder import StageError
    except ImportError:  # pragma: no cover - the encoder needs torch/diffusers; the protocol does not
        StageError = ()  # type: ignore[assignment]
    if StageError and isinstance(error, StageError):
        return ProtocolError(422, "component_not_loaded", str(error))
    return None


# --------------------------------------------------------------------------------------------------------------
# request schema

_PART_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_TOP_KEYS = frozenset(
    {
        "protocol",
        "prompt",
        "task",
        "width",
        "height",
        "num_frames",
        "first_frame",
        "last_frame",
        "ref_images",
        "ref_videos",
        "ref_audios",
        "model",
        "deadline_s",
    }
)
_MEDIA_KEYS = frozenset({"part"})
_VIDEO_KEYS = frozenset({"part", "fps", "soundtrack"})
_MAX_LIST = 16  # absolute cap on any media list before H3's own counts are checked


@dataclass(frozen=True)
class MediaRef:
    """One media item of a request: the multipart part holding its bytes, and where it goes."""

    field: str  # e.g. "ref_videos[0]" (for messages)
    part: str
    kind: str  # "image" | "video" | "audio"
    fps: float | None = None  # videos: the clip's frame rate (None: the container's)
    soundtrack: str | bool | None = None  # videos: part name of its audio, False for none, None for the container's


@dataclass(frozen=True)
class RequestSpec:
    """A validated JSON request: everything but the media bytes."""

    prompt: str
    task: str | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int = rules.MIN_FRAMES
    first_frame: MediaRef | None = None
    last_frame: MediaRef | None = None
    ref_images: tuple[MediaRef, ...] = ()
    ref_videos: tuple[MediaRef, ...] = ()
    ref_audios: tuple[MediaRef, ...] = ()
    model: str | None = None
    deadline_s: float | None = None
    resolved_task: str = "t2va"

    def media(self) -> list[MediaRef]:
        items = [ref for ref in (self.first_frame, self.last_frame) if ref is not None]
        return items + list(self.ref_images) + list(self.ref_videos) + list(self.ref_audios)

    def part_kinds(self) -> dict[str, tuple[str, str]]:
        """Every part the request names -> (kind, field); soundtracks are audio parts."""
        out: dict[str, tuple[str, str]] = {}
        for ref in self.media():
            out[ref.part] = (ref.kind, ref.field)
            if isinstance(ref.soundtrack, str):
                out[ref.soundtrack] = ("audio", f"{ref.field}.soundtrack")
        return out

    def needed_components(self) -> tuple[str, ...]:
        needs = ["text"]
        if self.first_frame or self.last_frame or self.ref_images or self.ref_videos:
            needs.append("video")
        if self.ref_audios or any(ref.soundtrack is not False for ref in self.ref_videos):
            needs.append("audio")  # a video's soundtrack may come from the container: cannot know before decoding
        return tuple(needs)

    def canonical(self, digests: Mapping[str, str]) -> dict[str, Any]:
        """What determines the output: numbers, prompt and media digests in slot order (not deadline/model)."""

        def ref(item: MediaRef | None):
            if item is None:
                return None
            out: dict[str, Any] = {"sha256": digests[item.part]}
            if item.kind == "video":
                out["fps"] = None if item.fps is None else repr(float(item.fps))
                out["soundtrack"] = (
                    digests[item.soundtrack] if isinstance(item.soundtrack, str) else item.soundtrack
                )
            return out

        return {
            "prompt": self.prompt,
            "task": self.resolved_task,
            "width": self.width,
            "height": self.height,
            "num_frames": self.num_frames,
            "first_frame": ref(self.first_frame),
            "last_frame": ref(self.last_frame),
            "ref_images": [ref(item) for item in self.ref_images],
            "ref_videos": [ref(item) for item in self.ref_videos],
            "ref_audios": [ref(item) for item in self.ref_audios],
        }


def _reject_constant(value: str):
    raise ValueError(f"{value} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:64]!r}")
        out[key] = value
    return out


def parse_request_json(data: bytes | str, limits: Limits = Limits()) -> Any:
    """Strict JSON: UTF-8, bounded size, no NaN/Infinity, no duplicate keys, bounded nesting."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if len(data) > limits.max_json_bytes:
        raise _too_large(
            f"the JSON request is {len(data)} bytes, over the limit of max_json_bytes={limits.max_json_bytes}",
            REQUEST_PART,
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _bad(f"the JSON request is not valid UTF-8 ({error.reason} at byte {error.start})", REQUEST_PART)
    try:
        return json.loads(
            text, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except RecursionError:
        raise _bad("the JSON request is nested too deeply", REQUEST_PART) from None
    except ValueError as error:
        raise _bad(f"the JSON request is not valid JSON: {str(error)[:200]}", REQUEST_PART) from None


def _int(obj: Mapping, key: str, default: Any = None, *, required: bool = False) -> Any:
    if key not in obj or obj[key] is None:
        if required:
            raise _bad(f"{key} is required", key)
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer, got {type(value).__name__}", key)
    if abs(value) > 10**9:
        raise _invalid(f"{key} is out of range, got {value}", key)
    return value


def _check_keys(obj: Mapping, allowed: frozenset, where: str) -> None:
    unknown = sorted(str(key)[:64] for key in obj if key not in allowed)
    if unknown:
        raise _bad(f"unknown field(s) {unknown} in {where}; allowed: {sorted(allowed)}", where)


def _part_name(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{where} must be a part name (string), got {type(value).__name__}", where)
    if not _PART_NAME.match(value) or ".." in value:
        raise _bad(
            f"{where} {value[:80]!r} is not a safe part name: 1-64 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit, no '..'",
            where,
        )
    if value == REQUEST_PART:
        raise _bad(f"{where} may not be {REQUEST_PART!r} (reserved for the JSON request)", where)
    return value


def _media_ref(value: Any, where: str, kind: str, limits: Limits) -> MediaRef:
    if not isinstance(value, dict):
        raise _bad(f"{where} must be an object {{\"part\": NAME}}, got {type(value).__name__}", where)
    allowed = _VIDEO_KEYS if kind == "video" else _MEDIA_KEYS
    _check_keys(value, allowed, where)
    if "part" not in value:
        raise _bad(f"{where}.part is required", f"{where}.part")
    part = _part_name(value["part"], f"{where}.part")
    fps, soundtrack = None, None
    if kind == "video":
        fps = value.get("fps")
        if fps is not None:
            if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps):
                raise _bad(f"{where}.fps must be a number, got {type(fps).__name__}", f"{where}.fps")
            if not 0 < fps <= limits.max_fps:
                raise _invalid(f"{where}.fps must be in (0, {limits.max_fps:g}] frames per second, got {fps}",
                               f"{where}.fps")
            fps = float(fps)
        soundtrack = value.get("soundtrack")
        if soundtrack is True:
            raise _bad(f"{where}.soundtrack must be a part name, false (no soundtrack) or absent/null "
                       "(the container's own audio)", f"{where}.soundtrack")
        if isinstance(soundtrack, str):
            soundtrack = _part_name(soundtrack, f"{where}.soundtrack")
        elif soundtrack not in (None, False):
            raise _bad(f"{where}.soundtrack must be a part name, false or null, got {type(soundtrack).__name__}",
                       f"{where}.soundtrack")
    return MediaRef(field=where, part=part, kind=kind, fps=fps, soundtrack=soundtrack)


def _media_list(obj: Mapping, key: str, kind: str, limits: Limits) -> tuple[MediaRef, ...]:
    value = obj.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad(f"{key} must be a list, got {type(value).__name__}", key)
    if len(value) > _MAX_LIST:
        raise _invalid(f"{key} has {len(value)} entries; H3 accepts at most {rules.MAX_REFS} references", key)
    return tuple(_media_ref(item, f"{key}[{index}]", kind, limits) for index, item in enumerate(value))


def parse_request(obj: Any, limits: Limits = Limits(), max_deadline_s: float | None = None) -> RequestSpec:
    """Validate a decoded JSON request and every rule that needs no media (H3's counts, frames, canvas, task).

    Raises `ProtocolError` (400 malformed, 413 over a size cap, 422 against an H3 rule).
    """
    if not isinstance(obj, dict):
        raise _bad(f"the JSON request must be an object, got {type(obj).__name__}", REQUEST_PART)
    _check_keys(obj, _TOP_KEYS, "the request")
    version = obj.get("protocol")
    if version is None:
        raise _bad(f"protocol is required (this server speaks {PROTOCOL_NAME} version {PROTOCOL_VERSION})",
                   "protocol")
    if isinstance(version, bool) or not isinstance(version, int):
        raise _bad(f"protocol must be an integer, got {type(version).__name__}", "protocol")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(400, "protocol_mismatch",
                            f"this server speaks {PROTOCOL_NAME} version {PROTOCOL_VERSION}; the request declares "
                            f"version {version}", "protocol")

    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        raise _bad(f"prompt is required and must be a string, got {type(prompt).__name__}", "prompt")
    if len(prompt) > limits.max_prompt_chars:
        raise _too_large(f"prompt has {len(prompt)} characters, over the limit of "
                         f"max_prompt_chars={limits.max_prompt_chars}", "prompt")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad("prompt contains unpaired UTF-16 surrogates (not encodable as UTF-8)", "prompt") from None
    if "\x00" in prompt:
        raise _bad("prompt contains a NUL character", "prompt")
    if not prompt.strip():
        raise _invalid("prompt must be a non-empty string", "prompt")

    task = obj.get("task")
    if task is not None and task not in rules.TASKS:
        shown = task[:32] if isinstance(task, str) else type(task).__name__
        raise _invalid(f"task must be one of {', '.join(rules.TASKS)} or null (inferred), got {shown!r}", "task")

    num_frames = _int(obj, "num_frames", rules.MIN_FRAMES)
    try:
        rules.check_output_frames(num_frames)
    except rules.H3InputError as error:
        raise _invalid(str(error), "num_frames") from None

    width, height = _int(obj, "width"), _int(obj, "height")
    if (width is None) != (height is None):
        raise _invalid("width and height must be given together, or neither", "width" if width is None else "height")
    if width is not None:
        try:
            rules.check_canvas(width, height)
        except rules.H3InputError as error:
            raise _invalid(str(error), "width") from None
        if max(width, height) > limits.max_canvas_edge or width * height > limits.max_canvas_pixels:
            raise _too_large(
                f"canvas {width}x{height} is over this server's limits (max_canvas_edge={limits.max_canvas_edge}, "
                f"max_canvas_pixels={limits.max_canvas_pixels})", "width")

    first = None if obj.get("first_frame") is None else _media_ref(obj["first_frame"], "first_frame", "image", limits)
    last = None if obj.get("last_frame") is None else _media_ref(obj["last_frame"], "last_frame", "image", limits)
    images = _media_list(obj, "ref_images", "image", limits)
    videos = _media_list(obj, "ref_videos", "video", limits)
    audios = _media_list(obj, "ref_audios", "audio", limits)

    model = obj.get("model")
    if model is not None and (not isinstance(model, str) or not re.fullmatch(r"[0-9a-f]{1,64}", model)):
        raise _bad("model must be the hex model fingerprint from /v1/capabilities, or null", "model")

    deadline = obj.get("deadline_s")
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
            raise _bad(f"deadline_s must be a number of seconds, got {type(deadline).__name__}", "deadline_s")
        if deadline <= 0 or (max_deadline_s is not None and deadline > max_deadline_s):
            raise _invalid(f"deadline_s must be in (0, {max_deadline_s:g}] seconds, got {deadline}"
                           if max_deadline_s is not None else f"deadline_s must be positive, got {deadline}",
                           "deadline_s")
        deadline = float(deadline)

    # H3's own rules on counts and the task, with placeholder (valid) durations: the real durations are
    # checked by EncodeRequest.validate() after decoding, with the same messages as a local run.
    keyframes = int(first is not None) + int(last is not None)
    summary = rules.MediaSummary(
        keyframes=keyframes,
        image_refs=len(images),
        video_ref_seconds=(rules.MIN_REFERENCE_VIDEO_S,) * len(videos),
        soundtrack_seconds=(None,) * len(videos),
        audio_ref_seconds=(rules.MIN_AUDIO_CLIP_S,) * len(audios),
    )
    resolved = task or rules.infer_task(summary)
    try:
        rules.check_request(resolved, prompt, summary, num_frames)
    except rules.H3InputError as error:
        raise _invalid(str(error), "task" if task else None) from None

    spec = RequestSpec(
        prompt=prompt,
        task=task,
        width=width,
        height=height,
        num_frames=num_frames,
        first_frame=first,
        last_frame=last,
        ref_images=images,
        ref_videos=videos,
        ref_audios=audios,
        model=model,
        deadline_s=deadline,
        resolved_task=resolved,
    )
    seen: dict[str, str] = {}
    for ref in spec.media():
        for name, where in ((ref.part, f"{ref.field}.part"),
                            (ref.soundtrack, f"{ref.field}.soundtrack")):
            if not isinstance(name, str):
                continue
            if name in seen:
                raise _bad(f"part {name!r} is named twice ({seen[name]} and {where}); each media item needs its "
                           "own part", where)
            seen[name] = where
    if len(seen) + 1 > limits.max_parts:
        raise _too_large(f"the request names {len(seen)} media parts, over the limit of "
                         f"max_parts={limits.max_parts - 1}", REQUEST_PART)
    return spec


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
        raise _bad(f"{where}: unsafe file name {filename[:80]!r} (no path separators, '..', leading dots or control "
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
        raise _too_large(f"{where}: {len(part.data)} bytes, over the limit of max_{kind}_bytes={cap}", where)
    if not part.data:
        raise _invalid(f"{where}: the part is empty (0 bytes)", where, "invalid_media")
    found = sniff(part.data)
    if found not in family:
        raise ProtocolError(415, "unsupported_media_type",
                            f"{where}: declared {part.content_type.split(';')[0]!r} but the bytes are "
                            f"{found or 'not a recognised media format'}", where)


# --------------------------------------------------------------------------------------------------------------
# bytes -> EncodeRequest (the server side; the CLI's conversion plus caps read from the headers first)


def _probe(data: bytes, where: str, kind: str) -> dict[str, Any]:
    try:
        return media.probe(data)
    except media.MediaError as error:
        raise _invalid(f"{where}: {error}", where, "invalid_media") from None


def _check_audio_header(info: dict[str, Any], where: str, limits: Limits, what: str) -> None:
    rate, channels = info.get("sample_rate"), info.get("channels")
    if rate is not None and rate > limits.max_sample_rate:
        raise _too_large(f"{where}: {what} sample rate {rate} Hz is over the limit of "
                         f"max_sample_rate={limits.max_sample_rate}", where)
    if channels is not None and channels > limits.max_audio_channels:
        raise _too_large(f"{where}: {what} has {channels} channels, over the limit of "
                         f"max_audio_channels={limits.max_audio_channels}", where)


def _audio_duration(info: dict[str, Any]) -> float | None:
    stream = next((s for s in info["streams"] if s["type"] == "audio"), None)
    if stream is not None and stream.get("duration"):
        return stream["duration"]
    return info.get("duration")


def _read_image(part: Part, where: str, limits: Limits) -> np.ndarray:
    from PIL import Image

    try:  # header only: Pillow reads the size without decoding pixels
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(part.data)) as image:
                width, height = image.size
    except Image.DecompressionBombError as error:
        raise _too_large(f"{where}: {error}", where, "too_many_pixels") from None
    except Exception as error:  # noqa: BLE001 - any Pillow failure on hostile bytes is a media error
        raise _invalid(f"{where}: could not read the image header ({type(error).__name__}: {str(error)[:200]})",
                       where, "invalid_media") from None
    if width * height > limits.max_image_pixels:
        raise _too_large(f"{where}: image is {width}x{height} = {width * height} pixels, over the limit of "
                         f"max_image_pixels={limits.max_image_pixels}", where, "too_many_pixels")
    return media.read_image(part.data, max_pixels=limits.max_image_pixels)


def _read_audio(part: Part, where: str, limits: Limits) -> tuple[np.ndarray, int]:
    info = _probe(part.data, where, "audio")
    if not any(s["type"] == "audio" for s in info["streams"]):
        raise _invalid(f"{where}: no audio stream", where, "invalid_media")
    _check_audio_header(info, where, limits, "audio")
    cap = limits.max_media_seconds + limits.decode_slack_seconds
    seconds = _audio_duration(info)
    if seconds is not None and seconds > cap:
        raise _too_large(f"{where}: audio is {seconds:.2f} s long, over the limit of "
                         f"max_media_seconds={limits.max_media_seconds:g}", where, "too_long")
    waveform, rate = media.read_audio(part.data, max_seconds=cap)
    if waveform.shape[1] >= int(cap * rate):
        raise _too_large(f"{where}: audio is longer than max_media_seconds={limits.max_media_seconds:g}",
                         where, "too_long")
    return waveform, rate


def _read_video(part: Part, where: str, limits: Limits) -> media.VideoClip:
    info = _probe(part.data, where, "video")
    if not any(s["type"] == "video" for s in info["streams"]):
        raise _invalid(f"{where}: no video stream", where, "invalid_media")
    width, height = info.get("width") or 0, info.get("height") or 0
    if width * height > limits.max_video_pixels:
        raise _too_large(f"{where}: video frames are {width}x{height} = {width * height} pixels, over the limit "
                         f"of max_video_pixels={limits.max_video_pixels}", where, "too_many_pixels")
    cap_s = limits.max_media_seconds + limits.decode_slack_seconds
    if info.get("duration") is not None and info["duration"] > cap_s:
        raise _too_large(f"{where}: video is {info['duration']:.2f} s long, over the limit of "
                         f"max_media_seconds={limits.max_media_seconds:g}", where, "too_long")
    if any(s["type"] == "audio" for s in info["streams"]):
        _check_audio_header(info, where, limits, "soundtrack")
        seconds = _audio_duration(info)
        if seconds is not None and seconds > cap_s:
            raise _too_large(f"{where}: soundtrack is {seconds:.2f} s long, over the limit of "
                             f"max_media_seconds={limits.max_media_seconds:g}", where, "too_long")
    max_frames = limits.max_video_frames
    if width and height:
        max_frames = max(1, min(max_frames, limits.max_video_decoded_bytes // (width * height * 3)))
    declared = info.get("frames")
    if declared and declared > max_frames:
        raise _too_large(f"{where}: video declares {declared} frames, over the limit of {max_frames} decoded frames "
                         f"(max_video_frames={limits.max_video_frames}, "
                         f"max_video_decoded_bytes={limits.max_video_decoded_bytes})", where, "too_many_frames")
    try:
        return media.read_video(part.data, max_frames=max_frames, max_pixels=limits.max_video_pixels)
    except media.MediaError as error:
        if "max_frames" in str(error):
            raise _too_large(f"{where}: {error}", where, "too_many_frames") from None
        raise


def build_request(
    spec: RequestSpec,
    parts: Mapping[str, Part],
    limits: Limits = Limits(),
    cancel: threading.Event | None = None,
) -> EncodeRequest:
    """Decode the parts exactly as the CLI decodes files (h3_core.media.read_*) and assemble the `EncodeRequest`.

    Header-level caps (pixels, seconds, sample rates, declared frames) are checked before any pixel or sample is
    decoded; decoding itself runs with caps that only a refused input can reach, so an accepted input decodes to
    the same arrays as an uncapped local read.
    """

    def part(name: str, where: str) -> Part:
        if name not in parts:  # the server checks this while reading; kept for in-process callers
            raise _bad(f"{where}: part {name!r} is missing from the request body", where)
        return parts[name]

    def image(ref: MediaRef | None) -> np.ndarray | None:
        if ref is None:
            return None
        check_cancel(cancel, f"before decoding {ref.field}")
        return _read_image(part(ref.part, ref.field), ref.field, limits)

    first, last = image(spec.first_frame), image(spec.last_frame)
    images = [image(ref) for ref in spec.ref_images]
    videos = []
    for ref in spec.ref_videos:
        check_cancel(cancel, f"before decoding {ref.field}")
        clip = _read_video(part(ref.part, ref.field), ref.field, limits)
        audio, rate = clip.audio, clip.sample_rate
        if ref.soundtrack is False:
            audio, rate = None, None
        elif isinstance(ref.soundtrack, str):
            where = f"{ref.field}.soundtrack"
            audio, rate = _read_audio(part(ref.soundtrack, where), where, limits)
        videos.append(VideoInput(frames=clip.frames, fps=clip.fps if ref.fps is None else ref.fps,
                                 audio=audio, sample_rate=rate))
    audios = []
    for ref in spec.ref_audios:
        check_cancel(cancel, f"before decoding {ref.field}")
        waveform, rate = _read_audio(part(ref.part, ref.field), ref.field, limits)
        audios.append(AudioInput(waveform=waveform, sample_rate=rate))
    return EncodeRequest(
        prompt=spec.prompt,
        task=spec.task,
        width=spec.width,
        height=spec.height,
        num_frames=spec.num_frames,
        first_frame=first,
        last_frame=last,
        ref_images=images,
        ref_videos=videos,
        ref_audios=audios,
    )


def cache_key(spec: RequestSpec, digests: Mapping[str, str], model_fingerprint: str) -> str:
    """Content address of a request: protocol, model, media conversion, numbers, prompt and media digests."""
    canonical = {
        "protocol": PROTOCOL_VERSION,
        "conversion": CONVERSION_ID,
        "model": model_fingerprint,
        "request": spec.canonical(digests),
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


# --------------------------------------------------------------------------------------------------------------
# EncodeRequest -> wire (the client side)


def _lossless_mp4(frames: np.ndarray, fps: float) -> bytes:
    """uint8 RGB frames -> an mp4 that `media.read_video` decodes to the same bytes.

    H.264 High 4:4:4 in RGB at qp 0 (libx264rgb) where FFmpeg has it, else PNG frames in the mp4 container;
    both are lossless for rgb24.
    """
    import av

    count, height, width = frames.shape[:3]
    rate = Fraction(float(fps)).limit_denominator(1_000_000)
    if rate <= 0:
        raise media.MediaError(f"reference video fps must be positive, got {fps!r}")
    codec = "libx264rgb" if "libx264rgb" in av.codecs_available else "png"
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "rgb24"
        if codec == "libx264rgb":
            stream.options = {"qp": "0", "preset": "veryfast"}
        for index in range(count):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[index]), format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def _lossy_mp4(frames: np.ndarray, fps: float) -> bytes:
    if frames.shape[1] % 2 or frames.shape[2] % 2:  # yuv420p needs even sizes
        return _lossless_mp4(frames, fps)
    return media.encode_mp4_bytes(frames, None, fps=fps)


def request_to_wire(
    request: EncodeRequest,
    *,
    lossless_video: bool = True,
    cancel: threading.Event | None = None,
) -> tuple[dict[str, Any], list[tuple[str, str, str, bytes]]]:
    """The JSON request and the media parts ``(name, content_type, filename, bytes)`` for an `EncodeRequest`.

    Images go as PNG and waveforms as float32 WAV (both lossless); videos as lossless mp4 with the exact frame
    rate in the JSON and their soundtrack as a separate float32 WAV part, so the server rebuilds the same arrays.
    ``lossless_video=False`` sends H.264 yuv420p at CRF 18 instead (far smaller, no longer bit-identical).
    """
    parts: list[tuple[str, str, str, bytes]] = []

    def add(name: str, content_type: str, extension: str, data: bytes) -> dict[str, str]:
        parts.append((name, content_type, f"{name}.{extension}", data))
        return {"part": name}

    def png(name: str, image: np.ndarray) -> dict[str, str]:
        check_cancel(cancel, "while packing the request media")
        return add(name, "image/png", "png", media.encode_png_bytes(image, compress_level=1))

    def wav(name: str, waveform: np.ndarray, rate: int) -> dict[str, str]:
        check_cancel(cancel, "while packing the request media")
        return add(name, "audio/wav", "wav", media.encode_wav_bytes(waveform, int(rate), sample_format="f32"))

    body: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "prompt": request.prompt,
        "task": request.task,
        "num_frames": int(request.num_frames),
    }
    if request.width is not None or request.height is not None:
        body["width"], body["height"] = request.width, request.height
    if request.first_frame is not None:
        body["first_frame"] = png("first_frame", request.first_frame)
    if request.last_frame is not None:
        body["last_frame"] = png("last_frame", request.last_frame)
    body["ref_images"] = [png(f"image{index}", image) for index, image in enumerate(request.ref_images)]
    videos = []
    for index, video in enumerate(request.ref_videos):
        check_cancel(cancel, "while packing the request media")
        frames = np.ascontiguousarray(video.frames)
        data = _lossless_mp4(frames, video.fps) if lossless_video else _lossy_mp4(frames, video.fps)
        entry: dict[str, Any] = add(f"video{index}", "video/mp4", "mp4", data)
        entry["fps"] = float(video.fps)
        if video.audio is not None:
            entry["soundtrack"] = wav(f"soundtrack{index}", video.audio, video.sample_rate)["part"]
        else:
            entry["soundtrack"] = False
        videos.append(entry)
    body["ref_videos"] = videos
    body["ref_audios"] = [wav(f"audio{index}", audio.waveform, audio.sample_rate)
                          for index, audio in enumerate(request.ref_audios)]
    return body, parts


def encode_multipart(request_json: Mapping[str, Any], parts: Iterable[tuple[str, str, str, bytes]]
                     ) -> tuple[str, bytes]:
    """``(content_type, body)`` of a multipart/form-data request: the JSON part first, then the media parts."""
    boundary = "h3-" + secrets.token_hex(16)
    chunks = []

    def part(name: str, content_type: str, data: bytes, filename: str | None = None) -> None:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        chunks.append(
            f"--{boundary}\r\nContent-Disposition: {disposition}\r\nContent-Type: {content_type}\r\n\r\n"
            .encode("ascii")
        )
        chunks.append(data)
        chunks.append(b"\r\n")

    part(REQUEST_PART, "application/json",
         json.dumps(request_json, ensure_ascii=True, separators=(",", ":")).encode("ascii"))
    for name, content_type, filename, data in parts:
        part(name, content_type, data, filename)
    chunks.append(f"--{boundary}--\r\n".encode("ascii"))
    return f"multipart/form-data; boundary={boundary}", b"".join(chunks)
