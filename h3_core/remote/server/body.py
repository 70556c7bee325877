"""Reading an encode request's body with its caps, engine-neutral: the JSON request, then the media parts.

The body arrives as a stream answering four calls of aiohttp's `StreamReader` interface (`read`, `readline`,
`at_eof`, `unread_data`): aiohttp's own request payload, or `engines/streams.ChunkReader` over another engine's chunks
(Ray Serve's ASGI receive). Every byte is counted into the request's `Admission` as it arrives and every read waits
at most what the minimum upload rate allows, so the caps and the slow-upload rule hold whichever engine received the
connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from functools import partial
from typing import Any, Mapping

from aiohttp import MultipartReader
from aiohttp.http_exceptions import HttpProcessingError

from .. import protocol
from ..protocol import Limits, ProtocolError
from . import ingest, request_schema
from .admission import Admission
from .ingest import Part
from .service import EncoderService

# aiohttp raises these when the body itself is broken (bad chunked framing, corrupt Content-Encoding): the
# caller answers 400 bad_encoding. Engines add their own (`aiohttp.web.RequestPayloadError`).
BODY_ERRORS: tuple[type[BaseException], ...] = (HttpProcessingError,)


def declared_length(headers: Mapping[str, str], limits: Limits) -> int:
    raw = headers.get("Content-Length")
    if raw is None:
        return limits.max_body_bytes  # chunked: reserve the cap
    if not re.fullmatch(r"[0-9]{1,20}", raw):
        raise ProtocolError(400, "bad_request", "Content-Length must be a non-negative integer", "Content-Length")
    length = int(raw)
    if length > limits.max_body_bytes:
        raise ProtocolError(413, "too_large", f"the request body declares {length} bytes, over the limit of "
                                              f"max_body_bytes={limits.max_body_bytes}", "Content-Length")
    return length


def content_type_of(headers: Mapping[str, str]) -> str:
    """The media type without parameters, lower case (aiohttp's `request.content_type`, octet-stream if absent)."""
    raw = headers.get("Content-Type")
    if not raw:
        return "application/octet-stream"
    return raw.split(";", 1)[0].strip().lower()


async def _read_part_bytes(read, cap: int, where: str, slot: Admission) -> bytes:
    """All of one part (`read()` returns its next chunk, b"" at the end), counted into the body budget."""
    chunks, size = [], 0
    while True:
        chunk = await slot.read(read())
        if not chunk:
            break
        size += len(chunk)
        slot.budget.take(len(chunk))
        if size > cap:
            limit = "max_json_bytes" if where == protocol.REQUEST_PART else f"{cap} bytes"
            raise ProtocolError(413, "too_large", f"{where}: over the limit of {limit}={cap}"
                                if where == protocol.REQUEST_PART else f"{where}: over the limit of {cap} bytes", where)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_spec(raw: bytes, service: EncoderService) -> request_schema.RequestSpec:
    """The JSON request, validated; refused here (before any media is read) if an encoder it needs is missing."""
    limits = service.limits
    spec = request_schema.parse_request(request_schema.parse_request_json(raw, limits), limits,
                                        service.config.max_deadline_s)
    service.check_components(spec)
    return spec


async def read_body(headers: Mapping[str, str], content: Any, service: EncoderService, slot: Admission, *,
                    max_field_size: int = 8190, max_headers: int = 128, passthrough: tuple = ()
                    ) -> tuple[request_schema.RequestSpec, bytes, dict[str, Part]]:
    """(spec, the raw JSON request, parts). `passthrough`: the engine's own body errors, re-raised as they are."""
    limits = service.limits
    content_type = content_type_of(headers)
    if content_type == "application/json":
        raw = await _read_part_bytes(partial(content.read, 64 * 1024), limits.max_json_bytes,
                                     protocol.REQUEST_PART, slot)
        spec = parse_spec(raw, service)
        missing = sorted(spec.part_kinds())
        if missing:
            raise ProtocolError(400, "bad_request", f"the request names media parts {missing[:8]} but was sent as "
                                                    "application/json; send multipart/form-data", "body")
        return spec, raw, {}
    if content_type != "multipart/form-data":
        raise ProtocolError(415, "unsupported_media_type",
                            f"POST {protocol.ENCODE_PATH} takes multipart/form-data (a JSON part named "
                            f"{protocol.REQUEST_PART!r} then the media parts) or application/json (no media), got "
                            f"{content_type[:64]!r}", "Content-Type")
    try:
        reader = MultipartReader(headers, content, client_max_size=limits.max_json_bytes + 1,
                                 max_field_size=max_field_size, max_headers=max_headers)
    except (ValueError, AssertionError, KeyError, TypeError) as error:
        raise ProtocolError(400, "bad_multipart", f"malformed multipart body: {str(error)[:200]}", "body") from None
    try:
        first = await slot.read(reader.next())
        if first is None or getattr(first, "name", None) != protocol.REQUEST_PART:
            raise ProtocolError(400, "bad_request", f"the first part must be the JSON request named "
                                                    f"{protocol.REQUEST_PART!r}", "body")
        if isinstance(first, type(reader)):
            raise ProtocolError(400, "bad_multipart", "nested multipart bodies are not accepted", "body")
        declared = (first.headers.get("Content-Type") or "application/json").split(";")[0].strip().lower()
        if declared != "application/json":
            raise ProtocolError(415, "unsupported_media_type",
                                f"the {protocol.REQUEST_PART!r} part must be application/json, got {declared[:64]!r}",
                                protocol.REQUEST_PART)
        raw = await _read_part_bytes(partial(first.read_chunk, 64 * 1024), limits.max_json_bytes,
                                     protocol.REQUEST_PART, slot)
        spec = parse_spec(raw, service)
        wanted = spec.part_kinds()
        parts: dict[str, Part] = {}
        count = 1
        while True:
            item = await slot.read(reader.next())
            if item is None:
                break
            count += 1
            if count > limits.max_parts:
                raise ProtocolError(413, "too_large", f"more than max_parts={limits.max_parts} parts", "body")
            if isinstance(item, type(reader)):
                raise ProtocolError(400, "bad_multipart", "nested multipart bodies are not accepted", "body")
            name = item.name
            if name is None or name not in wanted:
                shown = (name or "(unnamed)")[:80]
                raise ProtocolError(400, "unexpected_part", f"part {shown!r} is not named by the request "
                                                            f"(expected {sorted(wanted)[:16]})", "body")
            if name in parts:
                raise ProtocolError(400, "duplicate_part", f"part {name!r} appears twice", name)
            kind, where = wanted[name]
            ingest.check_filename(item.filename, where)
            part_type = item.headers.get("Content-Type")
            ingest.content_type_family(part_type, kind, where)
            data = await _read_part_bytes(partial(item.read_chunk, 256 * 1024), ingest.max_part_bytes(kind, limits),
                                          where, slot)
            if len(data) > 1 << 20:  # hashing hundreds of MB would stall the event loop; hashlib drops the GIL
                digest = await asyncio.to_thread(sha256, data)
            else:
                digest = sha256(data)
            part = Part(name=name, content_type=part_type or "", data=data, sha256=digest)
            ingest.check_part(part, kind, where, limits)
            parts[name] = part
    except ProtocolError:
        raise
    except (asyncio.CancelledError, ConnectionError, asyncio.TimeoutError, *BODY_ERRORS, *passthrough):
        raise
    except Exception as error:  # noqa: BLE001 - aiohttp raises assorted errors on hostile multipart framing
        raise ProtocolError(400, "bad_multipart", f"malformed multipart body ({type(error).__name__}: "
                                                  f"{str(error)[:200]})", "body") from None
    missing = sorted(set(wanted) - set(parts))
    if missing:
        raise ProtocolError(400, "missing_part", f"the request names part(s) {missing} that the body does not "
                                                 "contain", wanted[missing[0]][1])
    return spec, raw, parts


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
