"""The contract's wire form: one safetensors byte string (never pickle), to and from `H3Conditioning`.

Layout (version `WIRE_VERSION`): the safetensors length prefix and JSON header, then the tensors' own bytes in
the order of their offsets (8-byte dtypes first, so every tensor starts aligned for its dtype). The header's
`__metadata__` holds two keys: `HEADER_KEY`, a canonical JSON object with the non-tensor fields and the tensor
counts, and `CHECKSUM_KEY`, one xxh3-128 over the contract header, the tensor table and the data (`_seal`).

Writing never joins the pieces: `encode` returns the header bytes and a memoryview of each tensor's storage
(`Encoded`), which a socket or a file takes one after the other. Reading takes one buffer (`from_buffer`: a
received bytearray, or a memory-mapped file) and cuts the tensors out of it as views, after checking what is
specific to the contract: the header schema, the exact tensor set (counts bounded before any name list is
built), that the tensors tile the data exactly (so no offset points outside the buffer), and the checksum.
Then the constructor validates the contract itself. Parsing the safetensors header is
`h3_core.safetensors_header`'s job; files (`save`, `load`) are `contract.files`'.

Form 3 (`STREAM_VERSION`) exists on the wire only, for a client that asks for it: the same bytes, but
`CHECKSUM_KEY` says `TRAILING_CHECKSUM` and the same xxh3-128 digest follows the data (`TRAILER_BYTES`), so a sender
hashes each piece as it sends it (`Encoded.pieces`) instead of reading the whole data once before its first byte
can leave (on 2 cores that pass was most of what the wire cost over a raw socket: bench/wire.py).

Version 1 (a sha256 per tensor in the contract header, no checksum key) is still read. No error message
repeats bytes from the payload: sizes and counts are stated as numbers, names are escaped and cut short.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from .. import facts
from .. import safetensors_header as st
from .errors import ChecksumError, ContractError, is_int, preview

FORMAT_ID = "minimax-h3-conditioning"
FORMAT_VERSION = 1  # the contract's fields, shared by every outside form (the ComfyUI and vLLM pack keys too)
WIRE_VERSION = 2  # this safetensors form (files, and answers by default); 1 carried a sha256 per tensor
# Form 3, on the wire only, for a client that asks (docs/PROTOCOL.md): form 2's bytes, but the checksum's 16 bytes
# follow the data (`TRAILER_BYTES`) and the header says so (`TRAILING_CHECKSUM`), so the sender hashes each piece as
# it sends it instead of making a whole pass over the data before the first byte can leave.
STREAM_VERSION = 3
READ_VERSIONS = (1, 2, 3)
HEADER_KEY = "minimax_h3_conditioning"  # the contract header inside the safetensors `__metadata__`
CHECKSUM_KEY = "minimax_h3_checksum"  # "xxh3-128:<32 hex digits>" (version 2)
CHECKSUM_ALGORITHM = "xxh3-128"
TRAILING_CHECKSUM = f"{CHECKSUM_ALGORITHM}:trailing"  # form 3's CHECKSUM_KEY value: the digest follows the data
TRAILER_BYTES = 16  # form 3: the xxh3-128 digest (big-endian, as `hexdigest` writes it) after the last tensor
_BASE_FIELDS = frozenset({
    "format", "version", "task", "height", "width", "num_frames", "keyframe_anchors", "references", "metadata",
    "num_condition_latents", "num_audio_condition_latents", "tensor_count",
})
HEADER_FIELDS = {1: _BASE_FIELDS | {"sha256"}, 2: _BASE_FIELDS, 3: _BASE_FIELDS}
# Fields a header carries only when they are not empty, so a conditioning without them keeps its bytes (and its
# fingerprint) and a reader of an older build refuses one that has them by name ("unknown fields ['guides']").
OPTIONAL_FIELDS = frozenset({"guides"})
WIRE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
# Upper bounds a valid conditioning never exceeds (a latent per visual reference, audio rows per soundtrack
# and standalone audio); a header claiming more is refused before any list of names is built from it.
MAX_CONDITION_LATENTS = max(facts.MAX_REFS, facts.MAX_KEYFRAMES + facts.MAX_GUIDES)  # 18: keyframes + guides
MAX_AUDIO_CONDITIONS = max(facts.MAX_REF_VIDEOS + facts.MAX_REF_AUDIOS, facts.MAX_GUIDES)  # 16: one per guide
_ALIGN = 8  # the data starts on this boundary (safetensors pads its header with spaces to it)
MAX_TENSORS = 2 + MAX_CONDITION_LATENTS + MAX_AUDIO_CONDITIONS  # 36
# A conditioning's header is a few KB: at most `MAX_TENSORS` table entries (short names, <= 5 dims, two offsets:
# under 256 bytes each), the contract header (fixed fields, <= 12 references or <= 16 guides, <= 2 anchors: under
# 2 KiB) and the free metadata, capped at `MAX_METADATA_BYTES` of canonical JSON. The contract header sits in the
# safetensors header as a JSON string, so escaping can double it. A header claiming more than this is refused from
# the 8-byte length prefix, before it is read (safetensors' generic cap let a 93 MB header take minutes and GBs to
# parse).
# tests/test_contract_wire_hostile.py builds the largest valid header and checks it fits.
MAX_METADATA_BYTES = 16 << 10
MAX_HEADER_BYTES = MAX_TENSORS * 256 + 2 * ((2 << 10) + MAX_METADATA_BYTES) + 256  # 46.3 KB
_FINITE_PIECE = 1 << 18  # elements per finiteness pass: a bounded temporary (512 KiB-1 MiB) whatever the size
_SCAN_PIECE = 1 << 20  # bytes hashed and tested per step of `from_buffer`'s one pass (fits in the CPU's L2)

# The largest tensors a valid conditioning holds (facts: "the largest conditioning the encoder makes"). Every reader
# holds a conditioning to them: `plan` from the tensor table, before any data is read or allocated (a file claiming a
# 512 x 512 latent or 10^6 prompt rows is refused unread), the constructor again on the tensors themselves (files,
# wire payloads and a graph's CONDITIONING alike), where it also knows the task and the references.
# A condition latent is a keyframe or a reference: a reference video is at most 15 s (its own bound, whatever the
# output's length, which may reach facts.MAX_FRAMES) and is encoded snapped down to 17k+5, so 345 frames -> 102.
MAX_REFERENCE_FRAMES = int(facts.MAX_AUDIO_CLIP_S * facts.FPS)  # 360: 15 s at 24 fps
MAX_LATENT_FRAMES = facts.video_latent_frames(
    (MAX_REFERENCE_FRAMES - facts.LATENTS_PER_CLIP) // facts.FRAMES_PER_CLIP * facts.FRAMES_PER_CLIP
    + facts.LATENTS_PER_CLIP)  # 102
# The short side: an image reference's 2048 px, or a keyframe's / guide's on the largest canvas (4096x2304: 2304 px)
MAX_LATENT_SHORT_SIDE = max(facts.REFERENCE_IMAGE_SHORT_EDGE, math.isqrt(facts.MAX_CANVAS_PIXELS)) \
    // facts.VAE_SPATIAL_FACTOR  # 192
MAX_LATENT_LONG_SIDE = facts.MAX_REFERENCE_IMAGE_EDGE // facts.VAE_SPATIAL_FACTOR  # 512
MAX_AUDIO_ROWS = facts.AUDIO_CHANNELS * facts.audio_latents(facts.MAX_AUDIO_CLIP_S)  # 1200: 15 s, stereo
# Widths are model configuration, not facts: these are loose caps (the release has D=5120 and C=24), the same ones
# the client's answer-size bound uses (h3_core/remote/client/packing.py); the loaded model checks the exact ones.
MAX_TEXT_WIDTH = 8192
MAX_LATENT_CHANNELS = 128


def max_prompt_rows(kinds: list[str], keyframes: int, num_frames: int) -> int:
    """The most prompt_embeds rows the encoder makes for a conditioning with references `kinds`, `keyframes`
    keyframes and `num_frames` output frames: `facts.MAX_TEXT_TOKENS` of text and labels, plus
    each vision block's tokens and its start/end markers. An image reference is at most 2048 x 8192 px (one token
    per 32 x 32); a keyframe lies on the output's canvas (at most MAX_CANVAS_PIXELS), every block of a video reference
    on the canvas rule's (at most TRAINED_CANVAS_PIXELS), never under Qwen's 64-token floor; a video reference, cut
    to the output's length and read at 2 fps, has one block per two sampled frames."""
    token_px = facts.VISION_TOKEN_PX ** 2
    keyframe_block = max(facts.MAX_CANVAS_PIXELS // token_px, 64) + 2  # a keyframe lies on the output's canvas
    canvas_block = max(facts.TRAINED_CANVAS_PIXELS // token_px, 64) + 2  # a video reference on the canvas rule's
    image_block = facts.REFERENCE_IMAGE_SHORT_EDGE * facts.MAX_REFERENCE_IMAGE_EDGE // token_px + 2
    clip = min(num_frames, MAX_REFERENCE_FRAMES)  # a reference video: cut to the output, and at most 15 s
    sampled = -(-clip * facts.REFERENCE_VIDEO_READ_FPS // facts.FPS)  # ceil: frames read at 2 fps
    video_blocks = int(-(-sampled // facts.VISION_MERGE))
    rows = facts.MAX_TEXT_TOKENS + keyframes * keyframe_block
    rows += kinds.count("image") * image_block + kinds.count("video") * video_blocks * canvas_block
    return min(rows, facts.TEXT_ENCODER_MAX_POSITIONS)


def shape_bound_error(name: str, shape: tuple[int, ...]) -> str | None:
    """Why a tensor's shape is beyond any conditioning the encoder makes (whatever the task), or None. Only shapes of
    the expected rank are judged here; the constructor refuses the others."""
    if name == "prompt_embeds" and len(shape) == 3:
        if shape[1] > facts.TEXT_ENCODER_MAX_POSITIONS:
            return (f"has {shape[1]} rows (tokens), over the text encoder's {facts.TEXT_ENCODER_MAX_POSITIONS}-token "
                    "maximum sequence")
        if shape[2] > MAX_TEXT_WIDTH:
            return f"has width D={shape[2]}, over the {MAX_TEXT_WIDTH} any H3 text encoder has"
    elif name == "text_token_tags" and len(shape) == 1 and shape[0] > facts.TEXT_ENCODER_MAX_POSITIONS:
        return (f"has {shape[0]} tags, over the text encoder's {facts.TEXT_ENCODER_MAX_POSITIONS}-token maximum "
                "sequence")
    elif name.startswith("condition_latents") and len(shape) == 5:
        channels, frames, height, width = shape[1:]
        if channels > MAX_LATENT_CHANNELS:
            return f"has C={channels} channels, over the {MAX_LATENT_CHANNELS} any H3 video VAE has"
        if frames > MAX_LATENT_FRAMES:
            return (f"has T={frames} latent frames, over the {MAX_LATENT_FRAMES} of the longest reference video "
                    f"({facts.MAX_AUDIO_CLIP_S:g} s)")
        if min(height, width) > MAX_LATENT_SHORT_SIDE or max(height, width) > MAX_LATENT_LONG_SIDE:
            return (f"is {height}x{width} latents, larger than any the encoder makes (at most {MAX_LATENT_SHORT_SIDE} "
                    f"on the short side and {MAX_LATENT_LONG_SIDE} on the long side: a keyframe on the largest canvas, "
                    f"{facts.MAX_CANVAS_EDGE}x{facts.MAX_CANVAS_PIXELS // facts.MAX_CANVAS_EDGE} px, or an image "
                    f"reference's {facts.REFERENCE_IMAGE_SHORT_EDGE} px short edge at aspects up to 4:1, /"
                    f"{facts.VAE_SPATIAL_FACTOR})")
    elif name.startswith("audio_condition_latents") and len(shape) == 2 and shape[0] > MAX_AUDIO_ROWS:
        return (f"has {shape[0]} rows, over the {MAX_AUDIO_ROWS} of a {facts.MAX_AUDIO_CLIP_S:g} s stereo clip")
    return None


def _bad(msg: str) -> ContractError:
    return ContractError(f"payload: {msg}", field="payload")


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


# --- writing -----------------------------------------------------------------------------------------


class Encoded:
    """A conditioning's wire form, not joined: `head` (length prefix + JSON header), then `views` (each tensor's
    storage, in data order), then in form 3 the checksum's `TRAILER_BYTES`. `checksum` is the one in the header
    (form 2), or None in form 3, whose digest is made while `pieces` hands the data out. `len()` is the total byte
    count. The views keep the tensors alive and share their memory: nothing may write to those tensors while this is
    being sent."""

    __slots__ = ("head", "views", "checksum", "nbytes", "_prefix", "_cond", "_forms")

    def __init__(self, head: bytes, views: tuple[memoryview, ...], checksum: str | None,
                 prefix: bytes | None = None, cond: Any = None):
        # `prefix` (form 3 only): what the trailing digest covers before the data (`_seal_prefix`)
        self.head, self.views, self.checksum, self._prefix, self._cond = head, views, checksum, prefix, cond
        self.nbytes = len(head) + sum(view.nbytes for view in views) + (TRAILER_BYTES if prefix is not None else 0)
        self._forms: dict[int, Encoded] = {}

    @property
    def version(self) -> int:
        return STREAM_VERSION if self._prefix is not None else WIRE_VERSION

    def __len__(self) -> int:
        return self.nbytes

    def form(self, version: int) -> Encoded:
        """The same conditioning in wire form `version` (2 or 3): itself, or made once and kept. Form 2 from form 3
        costs the checksum pass; form 3 from form 2 only a header."""
        if version == self.version:
            return self
        if version not in self._forms:
            self._forms[version] = encode(self._cond, version)
        return self._forms[version]

    def pieces(self, size: int) -> Iterator[bytes | memoryview]:
        """The bytes in order, the tensors cut into pieces of at most `size` bytes (views: nothing is copied). In
        form 3 each piece is hashed just before it is handed out, so the sender's copy of it reads it from the
        CPU's cache, and the digest comes last."""
        hasher = xxhash.xxh3_128(self._prefix) if self._prefix is not None else None
        yield self.head
        for view in self.views:
            for offset in range(0, view.nbytes, size):
                piece = view[offset:offset + size]
                if hasher is not None:
                    hasher.update(piece)
                yield piece
        if hasher is not None:
            yield hasher.digest()

    def buffers(self) -> list[bytes | memoryview]:
        if self._prefix is None:
            return [self.head, *self.views]
        return [self.head, *self.views, _digest(self._prefix, list(self.views))]

    def tobytes(self) -> bytes:
        """The joined bytes (one copy): for callers that need a single `bytes`."""
        return b"".join(self.buffers())


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _wire_tensors(cond) -> dict[str, torch.Tensor]:
    tensors = {"prompt_embeds": cond.prompt_embeds, "text_token_tags": cond.text_token_tags}
    tensors.update({f"condition_latents.{i}": t for i, t in enumerate(cond.condition_latents)})
    tensors.update({f"audio_condition_latents.{i}": t for i, t in enumerate(cond.audio_condition_latents)})
    return {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}


def identity_fields(cond) -> dict[str, Any]:
    """The format tag and the scalar fields every serialised form of a conditioning carries (file header, and the
    pack's own key inside a ComfyUI CONDITIONING)."""
    return {
        "format": FORMAT_ID,
        "version": FORMAT_VERSION,
        "task": cond.task,
        "height": cond.height,
        "width": cond.width,
        "num_frames": cond.num_frames,
    }


def _header(cond, count: int, version: int = WIRE_VERSION) -> dict[str, Any]:
    return {
        **identity_fields(cond),
        "version": version,
        "keyframe_anchors": list(cond.keyframe_anchors),
        "references": [{"kind": r.kind, "has_audio": r.has_audio} for r in cond.references],
        "metadata": dict(cond.metadata),
        "num_condition_latents": len(cond.condition_latents),
        "num_audio_condition_latents": len(cond.audio_condition_latents),
        "tensor_count": count,
        **({"guides": [[g.frame, g.video, g.audio] for g in cond.guides]} if cond.guides else {}),
    }


def _seal_prefix(contract_header: str, entries: list[st.TensorEntry]) -> bytes:
    """What the checksum covers before the data: the contract header text and the tensor table (in data order),
    so a flipped bit in a shape, a dtype, an offset or a metadata value fails the checksum like one in the data."""
    table = [[e.name, e.dtype, list(e.shape), e.begin, e.end] for e in entries]
    return _canonical([contract_header, table]).encode("ascii")


def _digest(prefix: bytes, data: list[memoryview] | memoryview) -> bytes:
    hasher = xxhash.xxh3_128(prefix)
    for view in data if isinstance(data, list) else [data]:
        hasher.update(view)
    return hasher.digest()


def _seal(prefix: bytes, data: list[memoryview] | memoryview) -> str:
    return f"{CHECKSUM_ALGORITHM}:{_digest(prefix, data).hex()}"


def encode(cond, version: int = WIRE_VERSION) -> Encoded:
    """The wire form of `cond`: header bytes plus the tensors' storages as they are (no copy). Deterministic for
    equal contents (canonical JSON, fixed order). Form 2 (files, and answers by default) costs one checksum pass over
    the data here; form 3 (`STREAM_VERSION`, answers to a client that asks) none: its digest is made as it is sent
    (`Encoded.pieces`)."""
    if version not in (WIRE_VERSION, STREAM_VERSION):
        raise ValueError(f"writes wire forms {WIRE_VERSION} and {STREAM_VERSION}, not {version!r}")
    tensors = _wire_tensors(cond)
    # Widest dtypes first (stable: the contract's field order within a width), so every tensor starts aligned.
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())
    entries, views, offset = [], [], 0
    for name in order:
        t = tensors[name]
        view = _tensor_bytes(t) if t.numel() else memoryview(b"")
        entries.append(st.TensorEntry(name, st.DTYPE_TAGS[t.dtype], tuple(int(s) for s in t.shape), offset,
                                      offset + view.nbytes))
        views.append(view)
        offset += view.nbytes
    contract_header = _canonical(_header(cond, len(tensors), version))
    prefix = _seal_prefix(contract_header, entries)
    checksum = _seal(prefix, views) if version == WIRE_VERSION else None
    table = {e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]} for e in entries}
    text = json.dumps({"__metadata__": {HEADER_KEY: contract_header, CHECKSUM_KEY: checksum or TRAILING_CHECKSUM},
                       **table}, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-(8 + len(text)) % _ALIGN)
    return Encoded(len(text).to_bytes(8, "little") + text, tuple(v for v in views if v.nbytes), checksum,
                   None if checksum else prefix, cond)


def to_bytes(cond) -> bytes:
    """`encode(cond)` joined into one byte string."""
    return encode(cond).tobytes()


def fingerprint(cond) -> str:
    """sha256 (hex) of `to_bytes(cond)`, hashed piece by piece (no joined copy). A content key for caches: computed
    on demand, never on the transfer path."""
    hasher = hashlib.sha256()
    for buffer in encode(cond).buffers():
        hasher.update(buffer)
    return hasher.hexdigest()


# --- reading -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A checked header: what to cut out of the data buffer, and the contract fields around it."""

    header: dict[str, Any]
    entries: dict[str, st.TensorEntry]  # in expected (name) order
    n_cond: int
    n_audio: int
    data_len: int
    seal_prefix: bytes | None  # versions 2 and 3: what the checksum covers before the data
    checksum: str | None  # the header's CHECKSUM_KEY value (None: version 1)
    trailing: bool = False  # version 3: the digest is the TRAILER_BYTES after the data

    def expected_checksum(self, buf, data_start: int) -> str | None:
        """The checksum the payload states: its header's, or in form 3 the digest after the data (in `buf`, whose
        data section starts at `data_start`)."""
        if not self.trailing:
            return self.checksum
        end = data_start + self.data_len
        return f"{CHECKSUM_ALGORITHM}:{bytes(memoryview(buf)[end:end + TRAILER_BYTES]).hex()}"


def _contract_header(parsed: st.ParsedHeader) -> tuple[str, dict[str, Any]]:
    meta = parsed.metadata
    if not isinstance(meta, dict) or not isinstance(meta.get(HEADER_KEY), str):
        raise _bad(f"wrong format: no {HEADER_KEY!r} entry in the safetensors metadata (not an H3 conditioning file)")
    try:
        header = st.loads_bounded(meta[HEADER_KEY], what=f"the {HEADER_KEY!r} header")
    except st.HeaderError as error:
        raise _bad(str(error)) from None
    if not isinstance(header, dict):
        raise _bad("corrupted: the contract header is not a JSON object")
    if header.get("format") != FORMAT_ID:
        raise _bad(f"wrong format: expected format {FORMAT_ID!r}, got {header.get('format')!r:.40}")
    version = header.get("version")
    if not is_int(version) or version not in READ_VERSIONS:
        raise _bad(f"unsupported version {version!r:.40} of {FORMAT_ID!r}; this build reads versions "
                   f"{', '.join(map(str, READ_VERSIONS))} (writes {WIRE_VERSION}, and {STREAM_VERSION} on the wire "
                   "for a client that asks)")
    missing, extra = HEADER_FIELDS[version] - set(header), set(header) - HEADER_FIELDS[version] - OPTIONAL_FIELDS
    if missing or extra:
        raise _bad(f"corrupted header: missing fields {preview(missing)}, unknown fields {preview(extra)}")
    return meta[HEADER_KEY], header


def _checked_counts(header: dict[str, Any]) -> list[str]:
    """The tensor names the header's counts imply, after bounding the counts and the lists."""
    n_cond, n_audio, count = header["num_condition_latents"], header["num_audio_condition_latents"], \
        header["tensor_count"]
    if not all(is_int(v) and v >= 0 for v in (n_cond, n_audio, count)):
        raise _bad("corrupted header: tensor counts must be non-negative ints")
    if n_cond > MAX_CONDITION_LATENTS or n_audio > MAX_AUDIO_CONDITIONS:
        raise _bad(f"corrupted header: {n_cond} condition latents and {n_audio} audio conditions, a conditioning "
                   f"holds at most {MAX_CONDITION_LATENTS} and {MAX_AUDIO_CONDITIONS}")
    header.setdefault("guides", [])
    for name, limit in (("references", facts.MAX_REFS), ("keyframe_anchors", facts.MAX_KEYFRAMES),
                        ("guides", facts.MAX_GUIDES)):
        if not isinstance(header[name], list) or len(header[name]) > limit:
            got = len(header[name]) if isinstance(header[name], list) else type(header[name]).__name__
            raise _bad(f"corrupted header: {name} must be a list of at most {limit} entries, got {got}")
    if not isinstance(header["metadata"], dict):
        raise _bad("corrupted header: metadata must be an object")
    expected = ["prompt_embeds", "text_token_tags"]
    expected += [f"condition_latents.{i}" for i in range(n_cond)]
    expected += [f"audio_condition_latents.{i}" for i in range(n_audio)]
    if count != len(expected):
        raise _bad(f"corrupted header: tensor_count {count} does not match the {len(expected)} tensors the counts "
                   f"imply")
    return expected


def _prompt_rows_bound(header: dict[str, Any]) -> int | None:
    """`max_prompt_rows` for the header's task, references and frames, or None when they are not well formed yet
    (the constructor refuses those, after the absolute bounds above held the read)."""
    task, refs, anchors, frames = header["task"], header["references"], header["keyframe_anchors"], \
        header["num_frames"]
    if task not in ("t2va", "fl2va", "ref2va") or not is_int(frames) or not 0 < frames <= facts.MAX_FRAMES:
        return None
    if not all(isinstance(r, dict) and isinstance(r.get("kind"), str) for r in refs):
        return None
    return max_prompt_rows([r["kind"] for r in refs], len(anchors), frames)


def plan(parsed: st.ParsedHeader, payload_len: int) -> Plan:
    """Every check that needs only the header and the length of what follows it (`payload_len`: the data, and in
    form 3 the digest after it), run before any data is read or viewed."""
    contract_header, header = _contract_header(parsed)
    trailing = header["version"] == STREAM_VERSION
    if trailing and parsed.metadata.get(CHECKSUM_KEY) != TRAILING_CHECKSUM:
        raise _bad(f"corrupted header: form {STREAM_VERSION}'s {CHECKSUM_KEY!r} must be {TRAILING_CHECKSUM!r} (its "
                   "checksum follows the data)")
    data_len = payload_len - TRAILER_BYTES if trailing else payload_len
    if data_len < 0:
        raise _bad(f"truncated: form {STREAM_VERSION} ends with its {TRAILER_BYTES}-byte checksum, the payload holds "
                   f"{payload_len} bytes after its header")
    expected = _checked_counts(header)
    present = set(parsed.tensors)
    if present != set(expected):
        raise _bad(f"tensor set mismatch: missing {preview(set(expected) - present)}, "
                   f"unexpected {preview(present - set(expected))}")
    entries = {name: parsed.tensors[name] for name in expected}
    for name, entry in entries.items():
        if entry.dtype not in WIRE_DTYPES:
            raise _bad(f"tensor {name!r} has dtype {entry.dtype!r:.20}, not one the contract uses")
    in_order = sorted(entries.values(), key=lambda e: (e.begin, e.end))
    cursor = 0  # the tensors must tile the data exactly: no gaps, no overlaps, nothing after, nothing outside
    for entry in in_order:
        if entry.begin != cursor:
            raise _bad(f"corrupted: tensor {entry.name!r} starts at byte {entry.begin}, expected {cursor}")
        cursor = entry.end
    if cursor != data_len:
        kind = "truncated" if cursor > data_len else "corrupted"
        raise _bad(f"{kind}: tensors need {cursor} data bytes, the payload holds {data_len}")
    # The shapes against the largest conditioning the encoder makes, once the table is known to tile the data
    # and before any of it is read: the sampler would size its work by these shapes.
    for name, entry in entries.items():
        too_large = shape_bound_error(name, tuple(entry.shape))
        if too_large:
            field = f"{name.replace('.', '[', 1)}]" if "." in name else name  # as the constructor names it
            raise ContractError(f"{field}: {too_large}", field=field)
    rows = _prompt_rows_bound(header)
    prompt_rows = entries["prompt_embeds"].shape[1] if len(entries["prompt_embeds"].shape) == 3 else 0
    if rows is not None and prompt_rows > rows:
        raise ContractError(f"prompt_embeds: {prompt_rows} rows (tokens) are more than the encoder makes for this "
                            f"{header['task']} conditioning (at most {rows}: {facts.MAX_TEXT_TOKENS} of text for a "
                            f"prompt of up to {facts.MAX_PROMPT_CHARS} characters, plus its vision blocks)",
                            field="prompt_embeds")
    if header["version"] == 1:
        digests = header["sha256"]
        if not isinstance(digests, dict) or set(digests) != set(expected):
            raise _bad("corrupted header: sha256 must list every tensor")
        return Plan(header, entries, header["num_condition_latents"], header["num_audio_condition_latents"],
                    data_len, None, None)
    checksum = parsed.metadata.get(CHECKSUM_KEY)
    if not isinstance(checksum, str) or not checksum.startswith(f"{CHECKSUM_ALGORITHM}:") or len(checksum) > 64 \
            or not trailing and checksum == TRAILING_CHECKSUM:
        raise _bad(f"corrupted header: {CHECKSUM_KEY!r} must be an {CHECKSUM_ALGORITHM} checksum")
    return Plan(header, entries, header["num_condition_latents"], header["num_audio_condition_latents"], data_len,
                _seal_prefix(contract_header, in_order), checksum, trailing)


def verify(plan_: Plan, data: memoryview) -> None:
    """One pass over `data` (the data section, `plan_.data_len` bytes): the checksum, else `ChecksumError`. Forms 1
    and 2 only: form 3's digest lies after the data section, and its readers (`from_buffer`, `Receiving`) check it;
    files refuse form 3 before reading."""
    if plan_.checksum is not None:
        if _seal(plan_.seal_prefix, data) != plan_.checksum:
            raise ChecksumError(f"payload: corrupted: {CHECKSUM_ALGORITHM} checksum mismatch (the header, the "
                                "tensor table or the data changed after it was written)", field="payload")
        return
    for name, entry in plan_.entries.items():  # version 1
        if hashlib.sha256(data[entry.begin:entry.end]).hexdigest() != plan_.header["sha256"][name]:
            raise ChecksumError(f"payload: corrupted: checksum mismatch for tensor {name!r}", field="payload")


def metadata_size(metadata: Mapping[str, str]) -> int:
    """Bytes the metadata takes in the contract header (canonical JSON): what `MAX_METADATA_BYTES` bounds."""
    return len(_canonical(dict(metadata)))


#: dtype -> (integer view, mask of the magnitude bits, the exponent's all-ones pattern): a float is NaN or infinite
#: exactly when its exponent bits are all ones, i.e. when (bits & magnitude) >= that pattern.
_NONFINITE_BITS = {
    torch.bfloat16: (np.int16, 0x7FFF, 0x7F80),
    torch.float16: (np.int16, 0x7FFF, 0x7C00),
    torch.float32: (np.int32, 0x7FFFFFFF, 0x7F800000),
}


def _first_nonfinite(words: np.ndarray, magnitude: int, exponent: int, scratch: np.ndarray) -> int:
    """The index of the first NaN or infinity among `words` (a float tensor's bits as integers), or -1: an integer
    AND and max per `_FINITE_PIECE` elements, into `scratch` (at least that long, or as long as `words`)."""
    for start in range(0, words.size, _FINITE_PIECE):
        piece = scratch[:min(_FINITE_PIECE, words.size - start)]
        np.bitwise_and(words[start:start + piece.size], magnitude, out=piece)
        if piece.max() >= exponent:
            return start + int(np.flatnonzero(piece >= exponent)[0])
    return -1


def check_finite(name: str, t: torch.Tensor) -> None:
    """Refuse a NaN or an infinity in a floating-point tensor: one pass, in bounded pieces.

    The wire's dtypes are tested on their bits (an integer AND and max per piece, vectorised by numpy), not with
    `torch.isfinite`, which has no vectorised bf16 kernel on the CPU: on a 70 MB bf16 prompt it took ~140 ms on a
    quiet machine (0.4 s busy), most of the receiver's CPU, against ~16 ms for the bit test. A payload read through
    `from_buffer` has its tensors tested by `_Scan` instead, in the same pass as its checksum."""
    if not t.is_floating_point() or not t.numel():
        return
    flat = t.reshape(-1)
    bits = _NONFINITE_BITS.get(t.dtype)
    if bits is not None:
        view, magnitude, exponent = bits
        words = flat.view(torch.int16 if view is np.int16 else torch.int32).numpy()
        bad = _first_nonfinite(words, magnitude, exponent, np.empty(min(_FINITE_PIECE, words.size), dtype=view))
        if bad >= 0:
            _refuse_nonfinite(name, flat, bad)
        return
    for start in range(0, flat.numel(), _FINITE_PIECE):
        piece = flat[start:start + _FINITE_PIECE]
        if not bool(torch.isfinite(piece).all()):
            _refuse_nonfinite(name, flat, start + int((~torch.isfinite(piece)).nonzero()[0, 0]))


class _Scan:
    """The one pass over a version-2 payload's data section, front to back: each piece is hashed (the checksum) and
    the floating-point tensors' elements in it are tested for NaN and infinity (`check_finite`'s bit test) while the
    piece is in the CPU's cache, so neither test reads the data from memory again. `update(view, end)` takes
    bytes up to `end` of the whole buffer `view` (any piece sizes; an element split across pieces is tested once
    whole). The first non-finite element of each tensor is recorded, not raised: `build` raises it, after the
    checksum, for the first tensor in the contract's order, exactly as `check_finite` would. With `finite=False` it
    only hashes (`Receiving`: see there), and `build` tests each float tensor once after."""

    __slots__ = ("hasher", "done", "stop", "finite", "nonfinite", "_floats", "_next", "_cursor", "_scratch")

    def __init__(self, plan_: Plan, data_start: int, finite: bool = True):
        self.hasher = xxhash.xxh3_128(plan_.seal_prefix)
        self.done = data_start  # bytes [data_start, done) of the buffer are hashed
        self.stop = data_start + plan_.data_len  # the end of the data (form 3's digest follows it, unhashed)
        self.finite: set[str] = set()  # tensors every element of which was tested finite
        self.nonfinite: dict[str, int] = {}  # tensor -> its first non-finite element
        floats = sorted((e for e in plan_.entries.values() if finite and e.end > e.begin
                         and WIRE_DTYPES[e.dtype] in _NONFINITE_BITS), key=lambda e: e.begin)
        self._floats = [(data_start + e.begin, data_start + e.end, e.name, _NONFINITE_BITS[WIRE_DTYPES[e.dtype]])
                        for e in floats]
        self._next = 0  # the tensor being tested
        self._cursor = self._floats[0][0] if self._floats else 0  # tested up to here (an element boundary)
        self._scratch: dict[type, np.ndarray] = {}

    def update(self, view: memoryview, end: int) -> None:
        end = min(end, self.stop)
        if end <= self.done:
            return
        self.hasher.update(view[self.done:end])
        self.done = end
        while self._next < len(self._floats):
            begin, stop, name, (word, magnitude, exponent) = self._floats[self._next]
            size = np.dtype(word).itemsize
            count = (min(end, stop) - self._cursor) // size
            if count <= 0:
                return
            words = np.frombuffer(view, dtype=word, count=count, offset=self._cursor)
            scratch = self._scratch.get(word)
            if scratch is None:
                scratch = self._scratch[word] = np.empty(_FINITE_PIECE, dtype=word)
            bad = _first_nonfinite(words, magnitude, exponent, scratch)
            if bad >= 0:
                self.nonfinite[name] = (self._cursor - begin) // size + bad
                self._cursor = stop  # its first one is known: the rest of this tensor is only hashed
            else:
                self._cursor += count * size
            if self._cursor < stop:
                return
            if name not in self.nonfinite:
                self.finite.add(name)
            self._next += 1
            if self._next < len(self._floats):
                self._cursor = self._floats[self._next][0]

    def checksum(self) -> str:
        return f"{CHECKSUM_ALGORITHM}:{self.hasher.hexdigest()}"


def _refuse_nonfinite(name: str, flat: torch.Tensor, bad: int) -> None:
    raise ContractError(f"{name}: must be finite, got {float(flat[bad])} at element {bad} (a corrupted or "
                        "diverged encode)", field=name.split(".")[0])


def build(cls, plan_: Plan, buf, data_start: int, scan: _Scan | None = None):
    """Cut the tensors out of `buf` as views (they share and keep alive its memory), check every value is finite
    (the checksum proves the bytes are the writer's, not that the writer's numbers were sane; a `scan` that read
    this buffer already tested them), and construct the conditioning. `plan` has checked every offset against the
    buffer's length."""
    tensors = {}
    for name, entry in plan_.entries.items():
        dtype = WIRE_DTYPES[entry.dtype]
        if entry.end == entry.begin:
            t = torch.empty(entry.shape, dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype, count=(entry.end - entry.begin) // dtype.itemsize,
                                 offset=data_start + entry.begin).reshape(entry.shape)
            if t.data_ptr() % t.element_size():
                t = t.clone()  # another writer's layout: keep kernels on aligned memory
            if scan is not None and name in scan.nonfinite:
                _refuse_nonfinite(name, t.reshape(-1), scan.nonfinite[name])
            if scan is None or name not in scan.finite and t.is_floating_point():
                check_finite(name, t)
        tensors[name] = t
    header = plan_.header
    return cls(
        task=header["task"],
        height=header["height"],
        width=header["width"],
        num_frames=header["num_frames"],
        prompt_embeds=tensors["prompt_embeds"],
        text_token_tags=tensors["text_token_tags"],
        condition_latents=tuple(tensors[f"condition_latents.{i}"] for i in range(plan_.n_cond)),
        audio_condition_latents=tuple(tensors[f"audio_condition_latents.{i}"] for i in range(plan_.n_audio)),
        keyframe_anchors=tuple(header["keyframe_anchors"]),
        references=tuple(header["references"]),
        metadata=header["metadata"],
        guides=tuple(header["guides"]),
    )


def new_buffer(length: int) -> np.ndarray:
    """A fresh, uninitialised byte buffer for a payload of `length` bytes, for a receiver to fill and `from_buffer`
    to take over. Not a bytearray: bytearray(n) writes n zeros first (a full pass, plus a page fault per 4 KiB),
    while numpy leaves the memory untouched and asks the kernel for huge pages on large allocations, so filling
    it faults once per 2 MiB."""
    return np.empty(length, dtype=np.uint8)


def _is_buffer(buf: Any) -> bool:
    if isinstance(buf, bytearray):
        return True
    return (isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous
            and buf.flags.writeable)


class Receiving:
    """The checksum pass of a payload done while it arrives: a receiver that fills `buf` front to back calls
    `advance(end)` each time bytes [0, end) are in place, so each piece is hashed while it is still in the CPU's
    cache (one pass over memory instead of two), and hands this to `from_buffer`. Once the header is in, it is
    checked (`plan`) before anything after it is hashed; any defect just stops the early pass, and `from_buffer`
    then runs every check itself and reports it. `Receiving.new(length)` brings its own `new_buffer`."""

    @classmethod
    def new(cls, length: int) -> Receiving:
        return cls(new_buffer(length))

    def __init__(self, buf: bytearray | np.ndarray):
        self.buf, self._view = buf, memoryview(buf)
        self.plan: Plan | None = None
        self.data_start = 0
        self._scan: _Scan | None = None
        self._received = 0  # bytes [0, _received) of `buf` are in place
        self._stopped = False
        self.refusal: Exception | None = None  # a defect of the header: no later byte can make the payload valid

    def advance(self, end: int) -> None:
        self._received = max(self._received, end)
        if self._stopped:
            return
        try:
            if self._scan is None:
                if end < 8:
                    return
                n = st.header_length(self._view[:8], MAX_HEADER_BYTES)
                if end < 8 + n:
                    return
                parsed = st.parse_header(self._view[8:8 + n], n, MAX_TENSORS)
                self.plan = plan(parsed, len(self.buf) - parsed.data_start)
                if self.plan.checksum is None:  # version 1: per-tensor digests, checked by from_buffer
                    self._stopped = True
                    return
                self.data_start = parsed.data_start
                # Hashing only: the finiteness test per piece in this (receiving) thread measured slower end to end
                # than one `check_finite` pass per tensor after the last byte (client CPU +4.5 ms per 70 MB contract
                # on 2 shared cores, bench/wire.py), so `build` runs that pass.
                self._scan = _Scan(self.plan, parsed.data_start, finite=False)
            self._scan.update(self._view, end)
        except (st.HeaderError, ContractError) as error:
            self._stopped, self.refusal = True, error

    def checked_plan(self) -> Plan | None:
        """The plan, once every data byte has been hashed and the checksum matched (`ChecksumError` if it did not);
        None if this pass did not cover the payload."""
        if self._stopped or self._scan is None or self._received != len(self.buf) \
                or self._scan.done != self._scan.stop:
            return None
        if self._scan.checksum() != self.plan.expected_checksum(self.buf, self.data_start):
            raise ChecksumError(f"payload: corrupted: {CHECKSUM_ALGORITHM} checksum mismatch (the header, the "
                                "tensor table or the data changed after it was written)", field="payload")
        return self.plan


def from_buffer(cls, buf: bytearray | np.ndarray, receiving: Receiving | None = None):
    """Parse, check and validate a whole payload held in `buf` (a bytearray or a `new_buffer`), which the returned
    tensors then share (no copy): the caller hands it over and must not reuse it. With `receiving` (that filled
    `buf` and hashed it on the way in), the checksum is not computed again. Any defect raises `ContractError`
    (`ChecksumError` for corruption); never unpickles."""
    if not _is_buffer(buf):
        raise ContractError(f"payload: expected a bytearray or a writable uint8 buffer to take over, got "
                            f"{type(buf).__name__}", field="payload")
    checked = receiving.checked_plan() if receiving is not None and receiving.buf is buf else None
    if checked is not None:
        return build(cls, checked, buf, receiving.data_start, receiving._scan)
    try:
        parsed = st.read_header(memoryview(buf), MAX_HEADER_BYTES, max_tensors=MAX_TENSORS)
    except st.HeaderError as error:
        raise _bad(str(error)) from None
    checked = plan(parsed, len(buf) - parsed.data_start)
    if checked.checksum is None:  # version 1: a sha256 per tensor
        verify(checked, memoryview(buf)[parsed.data_start:])
        return build(cls, checked, buf, parsed.data_start)
    scan, view = _Scan(checked, parsed.data_start), memoryview(buf)
    for end in range(parsed.data_start + _SCAN_PIECE, len(buf) + _SCAN_PIECE, _SCAN_PIECE):
        scan.update(view, min(end, len(buf)))  # checksum and finiteness, piece by piece while it is in cache
    if scan.checksum() != checked.expected_checksum(buf, parsed.data_start):
        raise ChecksumError(f"payload: corrupted: {CHECKSUM_ALGORITHM} checksum mismatch (the header, the tensor "
                            "table or the data changed after it was written)", field="payload")
    return build(cls, checked, buf, parsed.data_start, scan)


def from_bytes(cls, data: bytes | bytearray | memoryview):
    """`from_buffer` on a private copy of `data` (the caller's buffer stays its own)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ContractError(f"payload: expected bytes, got {type(data).__name__}", field="payload")
    return from_buffer(cls, bytearray(data))


def checksum_of(contract_header: str, table: Mapping[str, Mapping[str, Any]], data: bytes | memoryview) -> str:
    """The `CHECKSUM_KEY` value for a payload with this contract header text, safetensors tensor table and data
    section: for tools (and tests) that assemble a payload by other means than `encode`."""
    entries = [st.TensorEntry(name, info["dtype"], tuple(info["shape"]), *info["data_offsets"])
               for name, info in table.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    return _seal(_seal_prefix(contract_header, entries), memoryview(data))
