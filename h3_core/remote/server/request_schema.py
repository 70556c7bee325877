"""The encode request's JSON part (protocol version 2): its schema, the strict reader, and the cache key.

`parse_request_json` reads the bytes (UTF-8, bounded, no NaN, no duplicate keys); `parse_request` turns the object
into a `RequestSpec`, one reader per field in a fixed order, and checks every H3 rule that needs no media (counts,
frames, canvas, task, where each guide stands). The optional "guides" list (protocol feature "guides",
`protocol.FEATURES`) is additive: a request without it parses, and keys its cache, exactly as before. Every refusal
is a `protocol.ProtocolError` naming the field. The media bytes are read later, by `ingest.py`;
`RequestSpec.needed_components()` says which encoders they need before any is read.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ... import facts, guides, rules
from ...request import needed_encoders
from ..protocol import (
    CONVERSION_ID,
    PROTOCOL_NAME,
    PROTOCOL_VERSION,
    REQUEST_PART,
    Limits,
    ProtocolError,
    bad,
    invalid,
    too_large,
)

__all__ = ["MediaRef", "GuideRef", "RequestSpec", "parse_request_json", "parse_request", "cache_key"]

_PART_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_TOP_KEYS = frozenset({"protocol", "prompt", "task", "width", "height", "num_frames", "first_frame", "last_frame",
                       "ref_images", "ref_videos", "ref_audios", "guides", "model", "deadline_s"})
_MEDIA_KEYS = frozenset({"part"})
_VIDEO_KEYS = frozenset({"part", "fps", "soundtrack"})
_GUIDE_KEYS = frozenset({"frame_index", "image", "video", "audio"})
_GUIDE_MEDIA = ("image", "video", "audio")  # a guide's media keys, each its own kind of part
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
class GuideRef:
    """One entry of the request's "guides": where it anchors (`h3_core.guides`: a negative index counts from the
    end) and its parts: an image or a clip (`video`, its frames as decoded; a container's own audio is not read),
    and/or an audio."""

    field: str  # "guides[0]" (for messages)
    frame_index: int
    image: MediaRef | None = None
    video: MediaRef | None = None
    audio: MediaRef | None = None

    def media(self) -> list[MediaRef]:
        return [ref for ref in (self.image, self.video, self.audio) if ref is not None]


@dataclass(frozen=True)
class RequestSpec:
    """A validated JSON request: everything but the media bytes."""

    prompt: str
    task: str | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int = facts.DEFAULT_FRAMES
    first_frame: MediaRef | None = None
    last_frame: MediaRef | None = None
    ref_images: tuple[MediaRef, ...] = ()
    ref_videos: tuple[MediaRef, ...] = ()
    ref_audios: tuple[MediaRef, ...] = ()
    guides: tuple[GuideRef, ...] = ()
    model: str | None = None
    deadline_s: float | None = None
    resolved_task: str = "t2va"

    def media(self) -> list[MediaRef]:
        items = [ref for ref in (self.first_frame, self.last_frame) if ref is not None]
        items += list(self.ref_images) + list(self.ref_videos) + list(self.ref_audios)
        return items + [ref for guide in self.guides for ref in guide.media()]

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
            guide_frames=sum(guide.image is not None or guide.video is not None for guide in self.guides),
            guide_audios=sum(guide.audio is not None for guide in self.guides),
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

        out = {
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
        if self.guides:  # absent without guides: the keys of requests without them are what they always were
            out["guides"] = [
                {"frame_index": guide.frame_index,
                 **{key: None if item is None else {"sha256": digests[item.part]}
                    for key, item in zip(_GUIDE_MEDIA, (guide.image, guide.video, guide.audio))}}
                for guide in self.guides
            ]
        return out


class _Unreadable:
    """A JSON number no field can hold, kept in place while parsing so the refusal can name where it stands:
    NaN / Infinity (`reason` "finite"), a float beyond +-1.8e308 that Python would read as inf ("finite"), an
    integer of more than `_MAX_INT_DIGITS` digits ("range"). `parse_request_json` refuses the first one found."""

    __slots__ = ("text", "reason")

    def __init__(self, text: str, reason: str):
        self.text, self.reason = text, reason


# No field takes an integer beyond 10**9 (`_int`); 64 digits leave every honest value room, while the digits of a
# longer one are never turned into an int (CPython's int parsing is quadratic in the digits, and it refuses past 4300
# with a ValueError that would not say which field).
_MAX_INT_DIGITS = 64


def _constant(text: str) -> _Unreadable:
    return _Unreadable(text, "finite")


def _float(text: str) -> float | _Unreadable:
    value = float(text)
    return value if math.isfinite(value) else _Unreadable(text, "finite")


def _integer(text: str) -> int | _Unreadable:
    digits = len(text) - text.startswith("-")
    return int(text) if digits <= _MAX_INT_DIGITS else _Unreadable(text, "range")


def _first_unreadable(value: Any) -> tuple[str, _Unreadable] | None:
    """(path, marker) of the first `_Unreadable` in `value`, in document order; iterative, so a deeply nested
    document cannot overflow the stack here."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, _Unreadable):
            return path or REQUEST_PART, item
        if isinstance(item, dict):
            children = [(f"{path}.{key}" if path else str(key), child) for key, child in item.items()]
        elif isinstance(item, list):
            children = [(f"{path}[{index}]", child) for index, child in enumerate(item)]
        else:
            continue
        stack.extend(reversed(children))
    return None


def _shown_path(path: str) -> str:
    return path if len(path) <= 80 else f"{path[:80]}..."


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
        obj = json.loads(
            text, parse_constant=_constant, parse_float=_float, parse_int=_integer, object_pairs_hook=_unique_keys
        )
    except RecursionError:
        raise bad("the JSON request is nested too deeply", REQUEST_PART) from None
    except ValueError as error:
        raise bad(f"the JSON request is not valid JSON: {str(error)[:200]}", REQUEST_PART) from None
    # Refused here, still a 400 of the JSON reader, but naming the field that holds the number: a client that sent
    # 1e400 as ref_videos[0].fps learns which value to fix.
    found = _first_unreadable(obj)
    if found is not None:
        path, number = found
        path = _shown_path(path)
        shown = number.text if len(number.text) <= 32 else f"{number.text[:24]}... ({len(number.text)} characters)"
        if number.reason == "finite":
            raise bad(f"the JSON request is not valid JSON: {path} is {shown}, not a finite number (NaN, Infinity "
                      "and numbers beyond +-1.8e308 are refused)", path)
        raise bad(f"the JSON request is not valid JSON: {path} is an integer of more than {_MAX_INT_DIGITS} digits "
                  f"({shown}), out of range for any field", path)
    return obj


_MAX_INT = 10**9  # no integer field means anything near this; past it the value is refused, not used


def _shown_number(value: int | float) -> str:
    """A number for a message: an integer of up to 64 digits may arrive; the message keeps it short."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...e{len(text) - 1} ({len(text)} digits)"


def _int(obj: Mapping, key: str, default: Any = None, *, required: bool = False) -> Any:
    if key not in obj or obj[key] is None:
        if required:
            raise bad(f"{key} is required", key)
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{key} must be an integer, got {type(value).__name__}", key)
    if abs(value) > _MAX_INT:
        raise invalid(f"{key} is out of range, got {_shown_number(value)}", key)
    return value


def _finite_number(value: Any, where: str, what: str) -> float:
    """`value` as a float, else an error naming `where`: 400 for a bool, a non-number or a non-finite float, 422 for a
    magnitude over `_MAX_INT` (no seconds or frame rate is that large)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"{where} must be {what}, got {type(value).__name__}", where)
    # Never math.isfinite or float() on an int: for a 400-digit one both raise OverflowError, which was a 500.
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"{where} must be {what}, got {type(value).__name__}", where)
    if abs(value) > _MAX_INT:
        raise invalid(f"{where} is out of range, got {_shown_number(value)}", where)
    return float(value)


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
    _finite_number(fps, where, "a number")
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


def _guides(obj: Mapping, num_frames: int) -> tuple[GuideRef, ...]:
    """The optional "guides" list: at most facts.MAX_GUIDES entries, each {"frame_index": int, "image" | "video":
    {"part": NAME}, "audio": {"part": NAME}}; where each stands is checked against the output length here (a clip's
    length only after decoding, `ingest.build_request`), with `guides.fit_error`'s words."""
    value = obj.get("guides")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad(f"guides must be a list, got {type(value).__name__}", "guides")
    if len(value) > facts.MAX_GUIDES:
        raise invalid(f"guides has {len(value)} entries; at most {facts.MAX_GUIDES} guides per request", "guides")
    return tuple(_guide(item, f"guides[{index}]", index + 1, num_frames) for index, item in enumerate(value))


def _guide(item: Any, where: str, number: int, num_frames: int) -> GuideRef:
    if not isinstance(item, dict):
        raise bad(f"{where} must be an object {{\"frame_index\": INT, \"image\" | \"video\": {{\"part\": NAME}}, "
                  f"\"audio\": {{\"part\": NAME}}}}, got {type(item).__name__}", where)
    _check_keys(item, _GUIDE_KEYS, where)
    index = item.get("frame_index")
    if index is None:
        raise bad(f"{where}.frame_index is required", f"{where}.frame_index")
    if isinstance(index, bool) or not isinstance(index, int):
        raise bad(f"{where}.frame_index must be an integer, got {type(index).__name__}", f"{where}.frame_index")
    if abs(index) > facts.MAX_FRAMES:
        raise invalid(f"{where}.frame_index must be within ±{facts.MAX_FRAMES} (negative counts from the end), got "
                      f"{_shown_number(index)}", f"{where}.frame_index")
    refs = {key: None if item.get(key) is None else _part_ref(item[key], f"{where}.{key}", key)
            for key in _GUIDE_MEDIA}
    if refs["image"] is not None and refs["video"] is not None:
        raise bad(f"{where} takes an image or a video, not both", f"{where}.video")
    if not any(refs.values()):
        raise invalid(f"{where} needs an image, a video or an audio to anchor", where)
    # Where it starts (a clip anchors at least one frame): the rest of its fit needs its decoded length.
    frames = int(refs["image"] is not None or refs["video"] is not None)
    problem = guides.fit_error(index, frames, num_frames, audio=refs["audio"] is not None)
    if problem:
        raise invalid(f"guide {number}: {problem}", f"{where}.frame_index")
    return GuideRef(field=where, frame_index=index, **refs)


def _part_ref(value: Any, where: str, kind: str) -> MediaRef:
    """A guide's {"part": NAME} of one kind; a guide clip's container audio is never read (soundtrack False)."""
    if not isinstance(value, dict):
        raise bad(f"{where} must be an object {{\"part\": NAME}}, got {type(value).__name__}", where)
    _check_keys(value, _MEDIA_KEYS, where)
    if "part" not in value:
        raise bad(f"{where}.part is required", f"{where}.part")
    return MediaRef(field=where, part=_part_name(value["part"], f"{where}.part"), kind=kind,
                    soundtrack=False if kind == "video" else None)


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
    num_frames = _num_frames(obj, limits)
    width, height = _canvas(obj, limits)
    first, last = _keyframe_ref(obj, "first_frame", limits), _keyframe_ref(obj, "last_frame", limits)
    images = _media_list(obj, "ref_images", "image", limits)
    videos = _media_list(obj, "ref_videos", "video", limits)
    audios = _media_list(obj, "ref_audios", "audio", limits)
    guide_refs = _guides(obj, num_frames)
    model = _model(obj)
    deadline = _deadline(obj, max_deadline_s)
    summary = _media_summary(first, last, images, videos, audios, len(guide_refs))
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
        guides=guide_refs,
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
                            f"version {_shown_number(version)} (update the client or the server so they match)",
                            "protocol")


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


def _num_frames(obj: Mapping, limits: Limits) -> int:
    """Output frames on H3's grid (rules.check_output_frames) and within this server's `max_num_frames`; absent means
    the default clip (facts.DEFAULT_FRAMES)."""
    num_frames = _int(obj, "num_frames", facts.DEFAULT_FRAMES)
    try:
        rules.check_output_frames(num_frames)
    except rules.H3InputError as error:
        raise invalid(str(error), "num_frames") from None
    if num_frames > limits.max_num_frames:
        raise invalid(f"num_frames {num_frames} ({num_frames / facts.FPS:.2f} s) is over this server's limit "
                      f"(max_num_frames={limits.max_num_frames}, `serve --max-frames`); H3 allows up to "
                      f"{facts.MAX_FRAMES}", "num_frames")
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
        except rules.H3InputError as error:  # a rule on the height alone names the height; the others, the width
            raise invalid(str(error), "height" if str(error).startswith("height") else "width") from None
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
            f"max_canvas_pixels={limits.max_canvas_pixels}; by default H3's trained range, which an operator may "
            f"raise with serve --max-canvas-edge / --max-canvas-pixels up to {facts.MAX_CANVAS_EDGE} px and "
            f"{facts.MAX_CANVAS_PIXELS} px)", "width")


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
    _finite_number(deadline, "deadline_s", "a number of seconds")
    if deadline <= 0 or (max_deadline_s is not None and deadline > max_deadline_s):
        raise invalid(f"deadline_s must be in (0, {max_deadline_s:g}] seconds, got {deadline}"
                      if max_deadline_s is not None else f"deadline_s must be positive, got {deadline}",
                      "deadline_s")
    return float(deadline)


def _media_summary(first: MediaRef | None, last: MediaRef | None, images: tuple[MediaRef, ...],
                   videos: tuple[MediaRef, ...], audios: tuple[MediaRef, ...], guide_count: int = 0
                   ) -> rules.MediaSummary:
    """The request's media counts for H3's rules, with placeholder (valid) durations: the real durations are checked
    by EncodeRequest.validate() after decoding, with the same messages as a local run."""
    return rules.MediaSummary(
        keyframes=int(first is not None) + int(last is not None),
        image_refs=len(images),
        video_ref_seconds=(facts.MIN_REFERENCE_VIDEO_S,) * len(videos),
        soundtrack_seconds=(None,) * len(videos),
        audio_ref_seconds=(facts.MIN_AUDIO_CLIP_S,) * len(audios),
        guides=guide_count,
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
