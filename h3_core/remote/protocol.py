"""The H3 encoder protocol, version 2: the schema shared by the server and the client.

Wire (docs/PROTOCOL.md has the full text):

    GET  /v1/health        liveness + load; no auth; 200 {"status": "ok", ...} or 503 while draining
    GET  /v1/capabilities  protocol version, model fingerprint, loaded components, limits   (auth)
    POST /v1/encode        multipart/form-data: a JSON part named "request", then one part per media item;
                           200 -> the conditioning contract as safetensors bytes      (auth)

Version 2 answers carry the contract's wire form 2 (`h3_core.contract.wire`: one xxh3-128 checksum inside the
body instead of a sha256 per tensor and an X-H3-Sha256 header); the request side is unchanged from version 1.

Everything a request can get wrong is a `ProtocolError` carrying the HTTP status, a stable `code`, the
offending `field` and a message that names the constraint; the server sends it as
``{"error": {"code", "message", "field", "request_id"}}``.

This module is the schema only: constants, `Limits`, the error model, `RequestSpec` and its parser, the cache
key. Turning received bytes into arrays is `ingest.py` (server side); turning an `EncodeRequest` into a
multipart body is `packing.py` (client side).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .. import facts, media, rules
from ..request import needed_encoders

__all__ = ["PROTOCOL_NAME", "PROTOCOL_VERSION", "HEALTH_PATH", "CAPABILITIES_PATH", "ENCODE_PATH", "DEFAULT_TOKEN_ENV",
           "CONDITIONING_CONTENT_TYPE", "Limits", "ProtocolError", "MediaRef", "RequestSpec", "parse_request_json",
           "parse_request", "cache_key", "is_loopback", "error_body", "error_from_exception", "bad", "invalid",
           "too_large"]


PROTOCOL_NAME = "h3-encoder"
PROTOCOL_VERSION = 2  # 1: answers in wire form 1 with an X-H3-Sha256 header
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
H_CACHE_COMPONENTS = "X-H3-Cache-Components"  # computed answers: each encoder part's tier or miss
H_CHECKSUM = "X-H3-Checksum"  # the body's own checksum, repeated for logs and proxies
H_FORMAT = "X-H3-Format"
H_REQUEST_ID = "X-Request-Id"
H_QUEUE_S = "X-H3-Queue-Seconds"
H_ENCODE_S = "X-H3-Encode-Seconds"

MiB = 1024 * 1024
# All request header lines together (names, values, separators). aiohttp's parser refuses a field over 8190 bytes
# by itself; Ray Serve's proxy buffers headers of any size, so the one request handling refuses them too (431).
MAX_REQUEST_HEADER_BYTES = 16 * 1024


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
    max_parts: int = 1 + facts.MAX_KEYFRAMES + facts.MAX_REFS + facts.MAX_REF_VIDEOS  # request + media + soundtracks
    max_prompt_chars: int = 16384
    max_image_pixels: int = 4096 * 4096
    max_video_pixels: int = 3840 * 2160  # per frame
    max_video_frames: int = 1800  # decoded frames per reference video (15 s at 120 fps)
    max_video_decoded_bytes: int = 3 * 1024 * MiB  # frames x H x W x 3, per reference video
    # All decoded media of ONE request (frames x H x W x 3 + samples x channels x 4 over every part), counted from
    # the headers before decoding: with max_body_bytes it bounds the memory a request can make the server take.
    max_request_decoded_bytes: int = 3 * 1024 * MiB
    max_media_seconds: float = facts.MAX_AUDIO_CLIP_S  # videos and audio clips (H3 refuses longer ones anyway)
    decode_slack_seconds: float = 1.0  # decoded past max_media_seconds before refusing, so H3's message wins
    max_sample_rate: int = 192_000
    max_audio_channels: int = 8
    max_fps: float = 240.0
    max_canvas_edge: int = facts.MAX_CANVAS_EDGE  # H3's trained range; an operator may only lower them
    max_canvas_pixels: int = facts.MAX_CANVAS_PIXELS

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(
            max_keyframes=facts.MAX_KEYFRAMES,
            max_ref_images=facts.MAX_REF_IMAGES,
            max_ref_videos=facts.MAX_REF_VIDEOS,
            max_ref_audios=facts.MAX_REF_AUDIOS,
            max_refs=facts.MAX_REFS,
            num_frames=[facts.MIN_FRAMES, facts.MAX_FRAMES],
            frame_grid="17k+5",
            canvas_multiple=facts.CANVAS_MULTIPLE,
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


def bad(message: str, field: str | None = None, code: str = "bad_request") -> ProtocolError:
    """400: the request is malformed (wrong type, unknown field, unreadable part)."""
    return ProtocolError(400, code, message, field)


def invalid(message: str, field: str | None = None, code: str = "invalid_request") -> ProtocolError:
    """422: the request is well formed but breaks a rule (a value out of range, media H3 refuses)."""
    return ProtocolError(422, code, message, field)


def too_large(message: str, field: str | None = None, code: str = "too_large") -> ProtocolError:
    """413: the request or one of its parts is over a size limit."""
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
    from ..media.sandbox import DecoderStopped

    if isinstance(error, DecoderStopped):  # a stop or restart reached the decoder: the request was fine, retry it
        return ProtocolError(503, "decoder_stopped", f"{error}; retry")
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
_TOP_KEYS = frozenset({"protocol", "prompt", "task", "width", "height", "num_frames", "first_frame", "last_frame",
                       "ref_images", "ref_videos", "ref_audios", "model", "deadline_s"})
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
    num_frames: int = facts.MIN_FRAMES
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
        """The encoders this request needs (`h3_core.request.needed_encoders`), known before any media is read.

        The client checks it against an endpoint's capabilities before uploading; the server checks it before
        reading the media or queueing the job (422 ``component_not_loaded``). A video whose soundtrack is
        null (the container's own audio) counts as needing the audio encoder: only decoding could tell.
        """
        return needed_encoders(
            keyframes=int(self.first_frame is not None) + int(self.last_frame is not None),
            images=len(self.ref_images),
            videos=len(self.ref_videos),
            audios=len(self.ref_audios),
            # a video's soundtrack may come from the container: cannot know before decoding
            soundtracks=sum(ref.soundtrack is not False for ref in self.ref_videos),
        )

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
        raise too_large(
            f"the JSON request is {len(data)} bytes, over the limit of max_json_bytes={limits.max_json_bytes}",
            REQUEST_PART,
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad(f"the JSON request is not valid UTF-8 ({error.reason} at byte {error.start})",
                   REQUEST_PART) from None
    try:
        return json.loads(
            text, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except RecursionError:
        raise bad("the JSON request is nested too deeply", REQUEST_PART) from None
    except ValueError as error:
        raise bad(f"the JSON request is not valid JSON: {str(error)[:200]}", REQUEST_PART) from None


def _int(obj: Mapping, key: str, default: Any = None, *, required: bool = False) -> Any:
    if key not in obj or obj[key] is None:
        if required:
            raise bad(f"{key} is required", key)
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{key} must be an integer, got {type(value).__name__}", key)
    if abs(value) > 10**9:
        raise invalid(f"{key} is out of range, got {value}", key)
    return value


def _check_keys(obj: Mapping, allowed: frozenset, where: str) -> None:
    unknown = sorted(str(key)[:64] for key in obj if key not in allowed)
    if unknown:
        raise bad(f"unknown field(s) {unknown} in {where}; allowed: {sorted(allowed)}", where)


def _part_name(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{where} must be a part name (string), got {type(value).__name__}", where)
    if not _PART_NAME.match(value) or ".." in value:
        raise bad(
            f"{where} {value[:80]!r} is not a safe part name: 1-64 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit, no '..'",
            where,
        )
    if value == REQUEST_PART:
        raise bad(f"{where} may not be {REQUEST_PART!r} (reserved for the JSON request)", where)
    return value


def _media_ref(value: Any, where: str, kind: str, limits: Limits) -> MediaRef:
    if not isinstance(value, dict):
        raise bad(f"{where} must be an object {{\"part\": NAME}}, got {type(value).__name__}", where)
    allowed = _VIDEO_KEYS if kind == "video" else _MEDIA_KEYS
    _check_keys(value, allowed, where)
    if "part" not in value:
        raise bad(f"{where}.part is required", f"{where}.part")
    part = _part_name(value["part"], f"{where}.part")
    fps, soundtrack = None, None
    if kind == "video":
        fps = _video_fps(value.get("fps"), f"{where}.fps", limits)
        soundtrack = _video_soundtrack(value.get("soundtrack"), f"{where}.soundtrack")
    return MediaRef(field=where, part=part, kind=kind, fps=fps, soundtrack=soundtrack)


def _video_fps(fps: Any, where: str, limits: Limits) -> float | None:
    """A video's frame rate as a float, or None (absent/null: the container's own rate)."""
    if fps is None:
        return None
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps):
        raise bad(f"{where} must be a number, got {type(fps).__name__}", where)
    if not 0 < fps <= limits.max_fps:
        raise invalid(f"{where} must be in (0, {limits.max_fps:g}] frames per second, got {fps}", where)
    return float(fps)


def _video_soundtrack(soundtrack: Any, where: str) -> str | bool | None:
    """A video's soundtrack: a part name, False (none) or None (the container's own audio); `true` is refused:
    it names no part."""
    if soundtrack is True:
        raise bad(f"{where} must be a part name, false (no soundtrack) or absent/null "
                  "(the container's own audio)", where)
    if isinstance(soundtrack, str):
        return _part_name(soundtrack, where)
    if soundtrack not in (None, False):
        raise bad(f"{where} must be a part name, false or null, got {type(soundtrack).__name__}", where)
    return soundtrack


def _keyframe_ref(obj: Mapping, key: str, limits: Limits) -> MediaRef | None:
    """`first_frame` / `last_frame`: an image part, or None when absent or null."""
    return None if obj.get(key) is None else _media_ref(obj[key], key, "image", limits)


def _media_list(obj: Mapping, key: str, kind: str, limits: Limits) -> tuple[MediaRef, ...]:
    value = obj.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad(f"{key} must be a list, got {type(value).__name__}", key)
    if len(value) > _MAX_LIST:
        raise invalid(f"{key} has {len(value)} entries; H3 accepts at most {facts.MAX_REFS} references", key)
    return tuple(_media_ref(item, f"{key}[{index}]", kind, limits) for index, item in enumerate(value))


def parse_request(obj: Any, limits: Limits = Limits(), max_deadline_s: float | None = None) -> RequestSpec:
    """Validate a decoded JSON request and every rule that needs no media (H3's counts, frames, canvas, task).

    Raises `ProtocolError` (400 malformed, 413 over a size cap, 422 against an H3 rule).
    """
    # One reader per field, run in this order: each raises on the first thing it refuses, so the order decides
    # which error a request with several faults gets (clients and the tests rely on it).
    if not isinstance(obj, dict):
        raise bad(f"the JSON request must be an object, got {type(obj).__name__}", REQUEST_PART)
    _check_keys(obj, _TOP_KEYS, "the request")
    _check_protocol(obj)
    prompt = _prompt(obj, limits)
    task = _task(obj)
    num_frames = _num_frames(obj)
    width, height = _canvas(obj, limits)
    first, last = _keyframe_ref(obj, "first_frame", limits), _keyframe_ref(obj, "last_frame", limits)
    images = _media_list(obj, "ref_images", "image", limits)
    videos = _media_list(obj, "ref_videos", "video", limits)
    audios = _media_list(obj, "ref_audios", "audio", limits)
    model = _model(obj)
    deadline = _deadline(obj, max_deadline_s)
    summary = _media_summary(first, last, images, videos, audios)
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
        resolved_task=_resolved_task(task, prompt, summary, num_frames),
    )
    _check_parts(spec, limits)
    return spec


def _check_protocol(obj: Mapping) -> None:
    """The protocol version, required and exactly this server's: a mismatch is its own code so clients can say so."""
    version = obj.get("protocol")
    if version is None:
        raise bad(f"protocol is required (this server speaks {PROTOCOL_NAME} version {PROTOCOL_VERSION})",
                  "protocol")
    if isinstance(version, bool) or not isinstance(version, int):
        raise bad(f"protocol must be an integer, got {type(version).__name__}", "protocol")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(400, "protocol_mismatch",
                            f"this server speaks {PROTOCOL_NAME} version {PROTOCOL_VERSION}; the request declares "
                            f"version {version} (update the client or the server so they match)", "protocol")


def _prompt(obj: Mapping, limits: Limits) -> str:
    """The prompt: a string within max_prompt_chars that the text encoder can take (UTF-8, no NUL, not blank)."""
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        raise bad(f"prompt is required and must be a string, got {type(prompt).__name__}", "prompt")
    if len(prompt) > limits.max_prompt_chars:
        raise too_large(f"prompt has {len(prompt)} characters, over the limit of "
                        f"max_prompt_chars={limits.max_prompt_chars}", "prompt")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise bad("prompt contains unpaired UTF-16 surrogates (not encodable as UTF-8)", "prompt") from None
    if "\x00" in prompt:
        raise bad("prompt contains a NUL character", "prompt")
    if not prompt.strip():
        raise invalid("prompt must be a non-empty string", "prompt")
    return prompt


def _task(obj: Mapping) -> str | None:
    """One of H3's tasks, or None: inferred from the media once they are counted (`_resolved_task`)."""
    task = obj.get("task")
    if task is not None and task not in rules.TASKS:
        shown = task[:32] if isinstance(task, str) else type(task).__name__
        raise invalid(f"task must be one of {', '.join(rules.TASKS)} or null (inferred), got {shown!r}", "task")
    return task


def _num_frames(obj: Mapping) -> int:
    """Output frames on H3's grid (rules.check_output_frames); absent means the shortest clip."""
    num_frames = _int(obj, "num_frames", facts.MIN_FRAMES)
    try:
        rules.check_output_frames(num_frames)
    except rules.H3InputError as error:
        raise invalid(str(error), "num_frames") from None
    return num_frames


def _canvas(obj: Mapping, limits: Limits) -> tuple[int | None, int | None]:
    """Width and height in pixels, both or neither (neither: the media decide); within H3's and this server's caps."""
    width, height = _int(obj, "width"), _int(obj, "height")
    if (width is None) != (height is None):
        raise invalid("width and height must be given together, or neither", "width" if width is None else "height")
    if width is not None:
        _check_canvas_size(width, height, limits)
        try:
            rules.check_canvas(width, height)
        except rules.H3InputError as error:
            raise invalid(str(error), "width") from None
    return width, height


def _check_canvas_size(width: int, height: int, limits: Limits) -> None:
    """413 for a canvas over H3's or this server's size caps, checked before H3's other canvas rules (422): a canvas
    too large is 413 whatever else is wrong with it. Non-positive sizes are left to those rules."""
    if width <= 0 or height <= 0:
        return
    oversize = rules.canvas_size_error(width, height)
    if oversize:
        raise too_large(oversize, "width")
    if max(width, height) > limits.max_canvas_edge or width * height > limits.max_canvas_pixels:
        raise too_large(
            f"canvas {width}x{height} is over this server's limits (max_canvas_edge={limits.max_canvas_edge}, "
            f"max_canvas_pixels={limits.max_canvas_pixels})", "width")


def _model(obj: Mapping) -> str | None:
    """The model fingerprint the client expects (checked against the loaded one later), or None for any."""
    model = obj.get("model")
    if model is not None and (not isinstance(model, str) or not re.fullmatch(r"[0-9a-f]{1,64}", model)):
        raise bad("model must be the hex model fingerprint from /v1/capabilities, or null", "model")
    return model


def _deadline(obj: Mapping, max_deadline_s: float | None) -> float | None:
    """The client's deadline in seconds (positive, at most the server's max_deadline_s when it sets one), or None."""
    deadline = obj.get("deadline_s")
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
        raise bad(f"deadline_s must be a number of seconds, got {type(deadline).__name__}", "deadline_s")
    if deadline <= 0 or (max_deadline_s is not None and deadline > max_deadline_s):
        raise invalid(f"deadline_s must be in (0, {max_deadline_s:g}] seconds, got {deadline}"
                      if max_deadline_s is not None else f"deadline_s must be positive, got {deadline}",
                      "deadline_s")
    return float(deadline)


def _media_summary(first: MediaRef | None, last: MediaRef | None, images: tuple[MediaRef, ...],
                   videos: tuple[MediaRef, ...], audios: tuple[MediaRef, ...]) -> rules.MediaSummary:
    """The request's media counts for H3's rules, with placeholder (valid) durations: the real durations are checked
    by EncodeRequest.validate() after decoding, with the same messages as a local run."""
    return rules.MediaSummary(
        keyframes=int(first is not None) + int(last is not None),
        image_refs=len(images),
        video_ref_seconds=(facts.MIN_REFERENCE_VIDEO_S,) * len(videos),
        soundtrack_seconds=(None,) * len(videos),
        audio_ref_seconds=(facts.MIN_AUDIO_CLIP_S,) * len(audios),
    )


def _resolved_task(task: str | None, prompt: str, summary: rules.MediaSummary, num_frames: int) -> str:
    """The task (given, or inferred from the media counts), checked against H3's own rules on counts and task."""
    resolved = task or rules.infer_task(summary)
    try:
        rules.check_request(resolved, prompt, summary, num_frames)
    except rules.H3InputError as error:
        raise invalid(str(error), "task" if task else None) from None
    return resolved


def _check_parts(spec: RequestSpec, limits: Limits) -> None:
    """Each media item (and soundtrack) names its own part, and the parts fit max_parts (the JSON part counts too)."""
    seen: dict[str, str] = {}
    for ref in spec.media():
        for name, where in ((ref.part, f"{ref.field}.part"),
                            (ref.soundtrack, f"{ref.field}.soundtrack")):
            if not isinstance(name, str):
                continue
            if name in seen:
                raise bad(f"part {name!r} is named twice ({seen[name]} and {where}); each media item needs its "
                          "own part", where)
            seen[name] = where
    if len(seen) + 1 > limits.max_parts:
        raise too_large(f"the request names {len(seen)} media parts, over the limit of "
                        f"max_parts={limits.max_parts - 1}", REQUEST_PART)


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


def is_loopback(host: str) -> bool:
    """Only IP literals in 127.0.0.0/8 or ::1 (bracketed or not), and the name `localhost`, count as loopback.

    No DNS lookups: a name that resolves to 127.0.0.1 today may not tomorrow. Used by the server (may it bind
    without a token?) and by the client (may it send a token over plain HTTP without a warning?).
    """
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
