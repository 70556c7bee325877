"""The encode request's JSON part (protocol version 2): its schema, the strict reader, and the cache key.

`parse_request_json` reads the bytes (UTF-8, bounded, no NaN, no duplicate keys); `parse_request` turns the object
into a `RequestSpec`, reading the fields `_SCHEMA` declares (type, bounds, default) in their order, and checks
every H3 rule that needs no media (counts, frames, canvas, task, where each guide stands). The optional "guides"
list (protocol feature "guides", `protocol.FEATURES`) is additive: a request without it parses, and keys its cache,
exactly as before. Every refusal is a `protocol.ProtocolError` naming the field. The media bytes are read later, by
`ingest.py`; `RequestSpec.needed_components()` says which encoders they need before any is read.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Collection, Mapping

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
_GUIDE_MEDIA = ("image", "video", "audio")  # a guide's media keys, each its own kind of part


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


# --------------------------------------------------------------------------------------------------------------
# the schema: what a field can be (its refusals), then `_SCHEMA`, the request's fields in the order they are read

_MAX_INT = 10**9  # no integer field means anything near this; past it the value is refused, not used
_MAX_LIST = 16  # absolute cap on any media list before H3's own counts are checked


def _shown_number(value: int | float) -> str:
    """A number for a message: an integer of up to 64 digits may arrive; the message keeps it short."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...e{len(text) - 1} ({len(text)} digits)"


def _require_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{where} must be an integer, got {type(value).__name__}", where)
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


def _check_keys(obj: Mapping, allowed: Collection[str], where: str) -> None:
    unknown = sorted(str(key)[:64] for key in obj if key not in allowed)
    if unknown:
        raise bad(f"unknown field(s) {unknown} in {where}; allowed: {sorted(allowed)}", where)


def _part_name(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{where} must be a part name (string), got {type(value).__name__}", where)
    if not _PART_NAME.match(value) or ".." in value:
        raise bad(f"{where} {value[:80]!r} is not a safe part name: 1-64 characters from [A-Za-z0-9_.-], "
                  "starting with a letter or digit, no '..'", where)
    if value == REQUEST_PART:
        raise bad(f"{where} may not be {REQUEST_PART!r} (reserved for the JSON request)", where)
    return value


def _entries(value: Any, where: str, cap: int, over: str) -> list:
    """A list field's entries: none when absent or null, else a list of at most `cap` (past it: "...; `over`")."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad(f"{where} must be a list, got {type(value).__name__}", where)
    if len(value) > cap:
        raise invalid(f"{where} has {len(value)} entries; {over}", where)
    return value


@dataclass
class _Reading:
    """One request being read: the caps a field names (`Limits`' fields, and the server's max_deadline_s), and the
    request's fields read so far (a guide stands against num_frames)."""

    caps: dict[str, Any]
    request: dict[str, Any]


@dataclass(frozen=True)
class _Field:
    """One key of a JSON object; its type's `read(value, where, reading)` turns the value (None when absent or null)
    into the spec's, or raises a `ProtocolError` naming `where`, the key's path ("ref_videos[0].fps")."""

    name: str


_Check = Callable[[dict[str, Any], _Reading], None]  # a check across the fields read before it


def _read(obj: Mapping, schema: tuple[_Field | _Check, ...], reading: _Reading, values: dict[str, Any],
          prefix: str = "") -> dict[str, Any]:
    """`obj`'s fields into `values`, read (and checked) in the order `schema` declares them. Each raises on the first
    thing it refuses, so the order decides which error a request with several faults gets (clients and the tests
    rely on it)."""
    for row in schema:
        if isinstance(row, _Field):
            values[row.name] = row.read(obj.get(row.name), prefix + row.name, reading)
        else:
            row(values, reading)
    return values


@dataclass(frozen=True)
class _Version(_Field):
    """Required, an integer, exactly `version`: a mismatch is its own code (protocol_mismatch) so clients can say so."""

    version: int

    def read(self, value: Any, where: str, reading: _Reading) -> int:
        if value is None:
            raise bad(f"{where} is required (this server speaks {PROTOCOL_NAME} version {self.version})", where)
        if _require_int(value, where) != self.version:
            raise ProtocolError(400, "protocol_mismatch",
                                f"this server speaks {PROTOCOL_NAME} version {self.version}; the request declares "
                                f"version {_shown_number(value)} (update the client or the server so they match)",
                                where)
        return value


@dataclass(frozen=True)
class _Text(_Field):
    """Required text the text encoder can take: a string within the cap `cap` (characters), UTF-8, no NUL, not blank."""

    cap: str

    def read(self, value: Any, where: str, reading: _Reading) -> str:
        if not isinstance(value, str):
            raise bad(f"{where} is required and must be a string, got {type(value).__name__}", where)
        cap = reading.caps[self.cap]
        if len(value) > cap:
            raise too_large(f"{where} has {len(value)} characters, over the limit of {self.cap}={cap}", where)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad(f"{where} contains unpaired UTF-16 surrogates (not encodable as UTF-8)", where) from None
        if "\x00" in value:
            raise bad(f"{where} contains a NUL character", where)
        if not value.strip():
            raise invalid(f"{where} must be a non-empty string", where)
        return value


@dataclass(frozen=True)
class _OneOf(_Field):
    """One of `choices`, or None: inferred (the task: from the media once they are counted, `_resolved_task`)."""

    choices: tuple[str, ...]

    def read(self, value: Any, where: str, reading: _Reading) -> str | None:
        if value is not None and value not in self.choices:
            shown = value[:32] if isinstance(value, str) else type(value).__name__
            raise invalid(f"{where} must be one of {', '.join(self.choices)} or null (inferred), got {shown!r}", where)
        return value


@dataclass(frozen=True)
class _Int(_Field):
    """An integer within +-`_MAX_INT`, or `default` when absent or null."""

    default: int | None = None

    def read(self, value: Any, where: str, reading: _Reading) -> int | None:
        if value is None:
            return self.default
        if abs(_require_int(value, where)) > _MAX_INT:
            raise invalid(f"{where} is out of range, got {_shown_number(value)}", where)
        return value


@dataclass(frozen=True)
class _Frames(_Int):
    """An output length on H3's grid (`rules.check_output_frames`), at most the cap `cap` (`serve --max-frames`)."""

    cap: str = ""

    def read(self, value: Any, where: str, reading: _Reading) -> int:
        frames = super().read(value, where, reading)
        try:
            rules.check_output_frames(frames)
        except rules.H3InputError as error:
            raise invalid(str(error), where) from None
        cap = reading.caps[self.cap]
        if frames > cap:
            raise invalid(f"{where} {frames} ({frames / facts.FPS:.2f} s) is over this server's limit "
                          f"({self.cap}={cap}, `serve --max-frames`); H3 allows up to {facts.MAX_FRAMES}", where)
        return frames


@dataclass(frozen=True)
class _Index(_Field):
    """A required frame index within +-`reach` (`h3_core.guides`: a negative index counts from the end)."""

    reach: int

    def read(self, value: Any, where: str, reading: _Reading) -> int:
        if value is None:
            raise bad(f"{where} is required", where)
        if abs(_require_int(value, where)) > self.reach:
            raise invalid(f"{where} must be within ±{self.reach} (negative counts from the end), got "
                          f"{_shown_number(value)}", where)
        return value


@dataclass(frozen=True)
class _Number(_Field):
    """A finite number (`what`) in (0, the cap `cap`] (`unit`; no upper bound if it is None) as a float, or None."""

    what: str
    unit: str
    cap: str

    def read(self, value: Any, where: str, reading: _Reading) -> float | None:
        if value is None:
            return None
        _finite_number(value, where, self.what)
        high = reading.caps[self.cap]
        if value <= 0 or (high is not None and value > high):
            raise invalid(f"{where} must be in (0, {high:g}] {self.unit}, got {value}" if high is not None
                          else f"{where} must be positive, got {value}", where)
        return float(value)


@dataclass(frozen=True)
class _Match(_Field):
    """A string matching `pattern` in full (`what` in the refusal), or None."""

    pattern: str
    what: str

    def read(self, value: Any, where: str, reading: _Reading) -> str | None:
        if value is not None and (not isinstance(value, str) or not re.fullmatch(self.pattern, value)):
            raise bad(f"{where} must be {self.what}, or null", where)
        return value


@dataclass(frozen=True)
class _Soundtrack(_Field):
    """A video's soundtrack: a part name, False (none) or None (the container's own audio); `true` is refused: it
    names no part."""

    def read(self, value: Any, where: str, reading: _Reading) -> str | bool | None:
        if value is True:
            raise bad(f"{where} must be a part name, false (no soundtrack) or absent/null "
                      "(the container's own audio)", where)
        if isinstance(value, str):
            return _part_name(value, where)
        if value not in (None, False):
            raise bad(f"{where} must be a part name, false or null, got {type(value).__name__}", where)
        return value


@dataclass(frozen=True)
class _Media(_Field):
    """One media item {"part": NAME} of `kind` (and the fields `extras`), or None when absent or null; `soundtrack`
    is the item's when `extras` do not read one."""

    kind: str
    extras: tuple[_Field, ...] = ()
    soundtrack: bool | None = None

    def read(self, value: Any, where: str, reading: _Reading) -> MediaRef | None:
        return None if value is None else self.ref(value, where, reading)

    def ref(self, value: Any, where: str, reading: _Reading) -> MediaRef:
        if not isinstance(value, dict):
            raise bad(f"{where} must be an object {{\"part\": NAME}}, got {type(value).__name__}", where)
        _check_keys(value, {"part", *(extra.name for extra in self.extras)}, where)
        if "part" not in value:
            raise bad(f"{where}.part is required", f"{where}.part")
        part = _part_name(value["part"], f"{where}.part")
        extras = _read(value, self.extras, reading, {"soundtrack": self.soundtrack}, f"{where}.")
        return MediaRef(field=where, part=part, kind=self.kind, **extras)


@dataclass(frozen=True)
class _MediaList(_Media):
    """A list of at most `cap` such items, empty when absent or null (H3's own counts are checked after)."""

    cap: int = _MAX_LIST

    def read(self, value: Any, where: str, reading: _Reading) -> tuple[MediaRef, ...]:
        entries = _entries(value, where, self.cap, f"H3 accepts at most {facts.MAX_REFS} references")
        return tuple(self.ref(item, f"{where}[{index}]", reading) for index, item in enumerate(entries))


@dataclass(frozen=True)
class _Guides(_Field):
    """The optional guides (protocol feature "guides"): at most `cap` objects of the fields `schema`; where each
    stands is checked against the output length here (a clip's length only after decoding, `ingest.build_request`),
    with `guides.fit_error`'s words."""

    schema: tuple[_Field, ...]
    cap: int

    def read(self, value: Any, where: str, reading: _Reading) -> tuple[GuideRef, ...]:
        entries = _entries(value, where, self.cap, f"at most {self.cap} guides per request")
        return tuple(self.guide(item, f"{where}[{index}]", index + 1, reading) for index, item in enumerate(entries))

    def guide(self, item: Any, where: str, number: int, reading: _Reading) -> GuideRef:
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object {{\"frame_index\": INT, \"image\" | \"video\": {{\"part\": NAME}}, "
                      f"\"audio\": {{\"part\": NAME}}}}, got {type(item).__name__}", where)
        _check_keys(item, {row.name for row in self.schema}, where)
        found = _read(item, self.schema, reading, {}, f"{where}.")
        if found["image"] is not None and found["video"] is not None:
            raise bad(f"{where} takes an image or a video, not both", f"{where}.video")
        if not any(found[key] for key in _GUIDE_MEDIA):
            raise invalid(f"{where} needs an image, a video or an audio to anchor", where)
        # Where it starts (a clip anchors at least one frame): the rest of its fit needs its decoded length.
        frames = int(found["image"] is not None or found["video"] is not None)
        problem = guides.fit_error(found["frame_index"], frames, reading.request["num_frames"],
                                   audio=found["audio"] is not None)
        if problem:
            raise invalid(f"guide {number}: {problem}", f"{where}.frame_index")
        return GuideRef(field=where, **found)


def _canvas(values: dict[str, Any], reading: _Reading) -> None:
    """Width and height: both or neither (neither: the media decide). A canvas over H3's or this server's size caps is
    413 before H3's other canvas rules (422), whatever else is wrong with it; non-positive sizes are left to those."""
    width, height, caps = values["width"], values["height"], reading.caps
    if (width is None) != (height is None):
        raise invalid("width and height must be given together, or neither", "width" if width is None else "height")
    if width is None:
        return
    if width > 0 and height > 0:
        oversize = rules.canvas_size_error(width, height)
        if oversize:
            raise too_large(oversize, "width")
        if max(width, height) > caps["max_canvas_edge"] or width * height > caps["max_canvas_pixels"]:
            raise too_large(
                f"canvas {width}x{height} is over this server's limits (max_canvas_edge={caps['max_canvas_edge']}, "
                f"max_canvas_pixels={caps['max_canvas_pixels']}; by default H3's trained range, which an operator "
                f"may raise with serve --max-canvas-edge / --max-canvas-pixels up to {facts.MAX_CANVAS_EDGE} px and "
                f"{facts.MAX_CANVAS_PIXELS} px)", "width")
    try:
        rules.check_canvas(width, height)
    except rules.H3InputError as error:  # a rule on the height alone names the height; the others, the width
        raise invalid(str(error), "height" if str(error).startswith("height") else "width") from None


# A reference video's fields beside its "part".
_VIDEO_FIELDS = (
    _Number("fps", "a number", "frames per second", cap="max_fps"),  # null: the container's own rate
    _Soundtrack("soundtrack"),  # a part name, false (none) or null (the container's own audio)
)
# One guide: where it anchors, and an image or a clip (its frames as decoded), and/or an audio.
_GUIDE_FIELDS = (
    _Index("frame_index", reach=facts.MAX_FRAMES),
    _Media("image", "image"),
    _Media("video", "video", soundtrack=False),  # a guide clip's container audio is never read
    _Media("audio", "audio"),
)
# The request, row by row: name, type (its refusals are the type's), bounds (a string names the `Limits` field, or
# max_deadline_s, that holds the cap), default (absent and null alike: None, or empty for a list, unless given). Read
# in this order, the first refusal winning, the canvas checked before any media; then H3's rules on counts and task
# (`_resolved_task`) and the parts (`_check_parts`).
_SCHEMA: tuple[_Field | _Check, ...] = (
    _Version("protocol", PROTOCOL_VERSION),  # required
    _Text("prompt", cap="max_prompt_chars"),  # required
    _OneOf("task", rules.TASKS),  # null: inferred from the media
    _Frames("num_frames", default=facts.DEFAULT_FRAMES, cap="max_num_frames"),
    _Int("width"),
    _Int("height"),
    _canvas,  # both or neither; over a size cap is 413 before H3's canvas rules
    _Media("first_frame", "image"),
    _Media("last_frame", "image"),
    _MediaList("ref_images", "image", cap=_MAX_LIST),
    _MediaList("ref_videos", "video", extras=_VIDEO_FIELDS, cap=_MAX_LIST),
    _MediaList("ref_audios", "audio", cap=_MAX_LIST),
    _Guides("guides", _GUIDE_FIELDS, cap=facts.MAX_GUIDES),
    _Match("model", r"[0-9a-f]{1,64}", "the hex model fingerprint from /v1/capabilities"),  # null: any; checked later
    _Number("deadline_s", "a number of seconds", "seconds", cap="max_deadline_s"),  # serve's cap, when it sets one
)
_KEYS = frozenset(row.name for row in _SCHEMA if isinstance(row, _Field))


def parse_request(obj: Any, limits: Limits = Limits(), max_deadline_s: float | None = None) -> RequestSpec:
    """Validate a decoded JSON request and every rule that needs no media (H3's counts, frames, canvas, task).

    Raises `ProtocolError` (400 malformed, 413 over a size cap, 422 against an H3 rule).
    """
    if not isinstance(obj, dict):
        raise bad(f"the JSON request must be an object, got {type(obj).__name__}", REQUEST_PART)
    _check_keys(obj, _KEYS, "the request")
    caps = {cap.name: getattr(limits, cap.name) for cap in fields(limits)}
    reading = _Reading({**caps, "max_deadline_s": max_deadline_s}, {})
    values = _read(obj, _SCHEMA, reading, reading.request)
    del values["protocol"]  # checked, not kept
    spec = RequestSpec(**values)
    spec = replace(spec, resolved_task=_resolved_task(spec))
    _check_parts(spec, limits)
    return spec


def _resolved_task(spec: RequestSpec) -> str:
    """The task (given, or inferred from the media counts), checked against H3's own rules on counts and task. The
    durations are placeholders (valid): the real ones are checked by EncodeRequest.validate() after decoding, with
    the same messages as a local run."""
    summary = rules.MediaSummary(
        keyframes=int(spec.first_frame is not None) + int(spec.last_frame is not None),
        image_refs=len(spec.ref_images),
        video_ref_seconds=(facts.MIN_REFERENCE_VIDEO_S,) * len(spec.ref_videos),
        soundtrack_seconds=(None,) * len(spec.ref_videos),
        audio_ref_seconds=(facts.MIN_AUDIO_CLIP_S,) * len(spec.ref_audios),
        guides=len(spec.guides),
    )
    resolved = spec.task or rules.infer_task(summary)
    try:
        rules.check_request(resolved, spec.prompt, summary, spec.num_frames)
    except rules.H3InputError as error:
        raise invalid(str(error), "task" if spec.task else None) from None
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
