"""The H3 encoder protocol, version 2: the schema shared by the server and the client.

Wire (docs/PROTOCOL.md has the full text):

    GET  /v1/health        liveness + load; no auth; 200 {"status": "ok", ...} or 503 while draining
    GET  /v1/capabilities  protocol version, model fingerprint, loaded components, limits   (auth)
    POST /v1/encode        multipart/form-data: a JSON part named "request", then one part per media item;
                           200 -> the conditioning contract as safetensors bytes      (auth)

Version 2 answers carry the contract's wire form 2 (`h3_core.contract.wire`: one xxh3-128 checksum inside the
body instead of a sha256 per tensor and an X-H3-Sha256 header), or form 3 (the same digest after the data, hashed as
it is sent) to a request whose `X-H3-Accept-Format` lists it; the request side is version 1's, grown only by
optional fields a server announces in its capabilities' "features" (`FEATURES`: "guides"), so a request without
them is byte for byte what it was.

Everything a request can get wrong is a `ProtocolError` carrying the HTTP status, a stable `code`, the
offending `field` and a message that names the constraint; the server sends it as
``{"error": {"code", "message", "field", "request_id"}}``.

This module holds what both sides share: constants (paths, headers, the version), `Limits`, the error model and
the loopback rule. The request JSON's schema, its reader and the cache key are `server/request_schema.py`;
turning received bytes into arrays is `server/ingest.py` (server side); turning an `EncodeRequest` into a
multipart body is `client/packing.py` (client side).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, fields
from typing import Any

from .. import facts, guides, media, rules
from ..contract.wire import FORMAT_ID, STREAM_VERSION

__all__ = ["PROTOCOL_NAME", "PROTOCOL_VERSION", "FEATURES", "FEATURE_GUIDES", "HEALTH_PATH", "CAPABILITIES_PATH",
           "ENCODE_PATH", "DEFAULT_TOKEN_ENV", "CONDITIONING_CONTENT_TYPE", "H_ACCEPT_FORMAT", "STREAMED_FORMAT",
           "Limits", "ProtocolError", "is_loopback", "wants_streamed", "error_body", "error_from_exception", "bad",
           "invalid", "too_large"]


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
# What this server reads beyond version 2's first form, announced in /v1/capabilities as "features" (additive: a
# server without the list predates them all, and a client refuses, before sending, a request that needs one).
FEATURE_GUIDES = "guides"  # the request's "guides" list (h3_core/guides.py): media anchored at any output frame
FEATURES = (FEATURE_GUIDES,)
# A guide's audio is cut to what the output leaves, at most 15 s (`guides.prepare` keeps that plus a second before
# resampling); the client sends, and the server decodes, at most this many seconds of it: a second more than the
# encoder ever reads, so the cut never changes the conditioning, while a longer file costs no more.
GUIDE_AUDIO_SECONDS = guides.MAX_GUIDE_AUDIO_LATENTS / facts.AUDIO_LATENTS_PER_SECOND + 2.0  # 17 s

# Response / request headers (all optional for third-party clients except Authorization when a token is set).
H_PROTOCOL = "X-H3-Protocol"
H_MODEL = "X-H3-Model"
H_CACHE = "X-H3-Cache"
H_CACHE_COMPONENTS = "X-H3-Cache-Components"  # computed answers: each encoder part's tier or miss
H_CHECKSUM = "X-H3-Checksum"  # the body's own checksum, repeated for logs and proxies
H_FORMAT = "X-H3-Format"
# Request header: the conditioning forms the client reads beyond form 2, e.g. "minimax-h3-conditioning/3" (a comma
# list). Form 3 carries its checksum after the data, so the server hashes the answer as it sends it (no pass over
# the data before the first byte leaves). A server that does not know the header answers form 2, which every
# client reads; so does the Ray engine.
H_ACCEPT_FORMAT = "X-H3-Accept-Format"
STREAMED_FORMAT = f"{FORMAT_ID}/{STREAM_VERSION}"
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
    # request + keyframes + the larger of references (+ soundtracks, ref2va) and guides (frames + audio each, fl2va)
    max_parts: int = 1 + facts.MAX_KEYFRAMES + max(facts.MAX_REFS + facts.MAX_REF_VIDEOS, 2 * facts.MAX_GUIDES)
    # H3's prompt limit (facts.MAX_PROMPT_CHARS): the contract bounds a conditioning's text rows by what a prompt
    # this long can make, so an operator may only lower it.
    max_prompt_chars: int = facts.MAX_PROMPT_CHARS
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
    # H3's trained size by default; an operator may set them anywhere up to the absolute bound (facts.MAX_CANVAS_*)
    max_canvas_edge: int = facts.TRAINED_CANVAS_EDGE
    max_canvas_pixels: int = facts.TRAINED_CANVAS_PIXELS
    # The longest output a request may ask for (`serve --max-frames`): H3's trained 15 s by default; an operator may
    # raise it to the longest H3 allows (facts.MAX_FRAMES) or lower it. Longer is a 422 naming this setting.
    max_num_frames: int = facts.TRAINED_MAX_FRAMES

    def __post_init__(self):
        if not isinstance(self.max_num_frames, int) or not facts.MIN_FRAMES <= self.max_num_frames <= facts.MAX_FRAMES:
            raise ValueError(f"max_num_frames must be an integer within {facts.MIN_FRAMES}-{facts.MAX_FRAMES} "
                             f"(H3's lengths), got {self.max_num_frames!r}")

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(
            max_keyframes=facts.MAX_KEYFRAMES,
            max_ref_images=facts.MAX_REF_IMAGES,
            max_ref_videos=facts.MAX_REF_VIDEOS,
            max_ref_audios=facts.MAX_REF_AUDIOS,
            max_refs=facts.MAX_REFS,
            max_guides=facts.MAX_GUIDES,
            # the lengths this server accepts (its max_num_frames, at most H3's), and H3's trained range
            num_frames=[facts.MIN_FRAMES, min(self.max_num_frames, facts.MAX_FRAMES)],
            trained_num_frames=[facts.TRAINED_MIN_FRAMES, facts.TRAINED_MAX_FRAMES],
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


def wants_streamed(accept: str | None) -> bool:
    """Whether an `X-H3-Accept-Format` value lists the streamed form (`STREAMED_FORMAT`)."""
    return bool(accept) and STREAMED_FORMAT in (item.strip() for item in accept[:256].split(","))


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
