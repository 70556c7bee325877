"""The contract's wire form: one safetensors byte string (never pickle), to and from `H3Conditioning`.

Layout: the tensors `prompt_embeds`, `text_token_tags`, `condition_latents.{i}` and
`audio_condition_latents.{i}`, plus one `__metadata__` key (`HEADER_KEY`) holding a canonical JSON header:
the non-tensor fields, the tensor counts and a sha256 per tensor. Parsing the safetensors header itself is
`h3_core.safetensors_header`'s job; this module checks what is specific to the contract: the header schema,
the exact tensor set (with counts bounded before any name list is built), that the tensors tile the data
buffer exactly, and every checksum. Then the constructor validates the contract itself.

`load` reads the 8-byte prefix and the header first and checks them against the file's size before it
reads (or allocates for) the data, and refuses anything but a regular file without opening it for a read
that could block (a FIFO, a device). No error message repeats bytes from the payload: sizes and counts
are stated as numbers, names are escaped and cut short.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import safetensors_header as st
from ..facts import MAX_KEYFRAMES, MAX_REF_AUDIOS, MAX_REF_VIDEOS, MAX_REFS
from .errors import ContractError, is_int, preview

FORMAT_ID = "minimax-h3-conditioning"
FORMAT_VERSION = 1
HEADER_KEY = "minimax_h3_conditioning"  # the one key of the safetensors `__metadata__`
HEADER_FIELDS = frozenset({
    "format", "version", "task", "height", "width", "num_frames", "keyframe_anchors", "references", "metadata",
    "num_condition_latents", "num_audio_condition_latents", "tensor_count", "sha256",
})
WIRE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
# Upper bounds a valid conditioning never exceeds (a latent per visual reference, audio rows per soundtrack
# and standalone audio); a header claiming more is refused before any list of names is built from it.
MAX_CONDITION_LATENTS = MAX_REFS
MAX_AUDIO_CONDITIONS = MAX_REF_VIDEOS + MAX_REF_AUDIOS


def _bad(msg: str) -> ContractError:
    return ContractError(f"payload: {msg}", field="payload")


# --- writing -----------------------------------------------------------------------------------------


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _wire_tensors(cond) -> dict[str, torch.Tensor]:
    tensors = {"prompt_embeds": cond.prompt_embeds, "text_token_tags": cond.text_token_tags}
    tensors.update({f"condition_latents.{i}": t for i, t in enumerate(cond.condition_latents)})
    tensors.update({f"audio_condition_latents.{i}": t for i, t in enumerate(cond.audio_condition_latents)})
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:  # safetensors refuses tensors that share storage
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


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


def _header(cond, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    return {
        **identity_fields(cond),
        "keyframe_anchors": list(cond.keyframe_anchors),
        "references": [{"kind": r.kind, "has_audio": r.has_audio} for r in cond.references],
        "metadata": dict(cond.metadata),
        "num_condition_latents": len(cond.condition_latents),
        "num_audio_condition_latents": len(cond.audio_condition_latents),
        "tensor_count": len(tensors),
        "sha256": {name: hashlib.sha256(_tensor_bytes(t)).hexdigest() for name, t in tensors.items()},
    }


def to_bytes(cond) -> bytes:
    """The tensors plus a versioned JSON header in `__metadata__`. Deterministic for equal contents (the
    header is canonical JSON, the metadata holds one key)."""
    from safetensors.torch import save

    tensors = _wire_tensors(cond)
    header = json.dumps(_header(cond, tensors), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return save(tensors, metadata={HEADER_KEY: header})


def save(cond, path: str | os.PathLike) -> None:
    """Write `to_bytes()` to `path` atomically (a temporary file in the same folder, then a rename)."""
    data = to_bytes(cond)
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def fingerprint(cond) -> str:
    return hashlib.sha256(to_bytes(cond)).hexdigest()


# --- reading -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """A checked header: what to cut out of the data buffer, and the contract fields around it."""

    header: dict[str, Any]
    entries: dict[str, st.TensorEntry]  # in expected order
    n_cond: int
    n_audio: int
    data_len: int


def _contract_header(parsed: st.ParsedHeader) -> dict[str, Any]:
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
    if header.get("version") != FORMAT_VERSION:
        raise _bad(f"unsupported version {header.get('version')!r:.40} of {FORMAT_ID!r}; this build reads version "
                   f"{FORMAT_VERSION}")
    missing, extra = HEADER_FIELDS - set(header), set(header) - HEADER_FIELDS
    if missing or extra:
        raise _bad(f"corrupted header: missing fields {preview(missing)}, unknown fields {preview(extra)}")
    return header


def _plan(parsed: st.ParsedHeader, data_len: int) -> _Plan:
    """Every check that needs only the header and the data length, so `load` runs them before reading data."""
    header = _contract_header(parsed)
    n_cond, n_audio, count = header["num_condition_latents"], header["num_audio_condition_latents"], \
        header["tensor_count"]
    if not all(is_int(v) and v >= 0 for v in (n_cond, n_audio, count)):
        raise _bad("corrupted header: tensor counts must be non-negative ints")
    if n_cond > MAX_CONDITION_LATENTS or n_audio > MAX_AUDIO_CONDITIONS:
        raise _bad(f"corrupted header: {n_cond} condition latents and {n_audio} audio conditions, a conditioning "
                   f"holds at most {MAX_CONDITION_LATENTS} and {MAX_AUDIO_CONDITIONS}")
    for name, limit in (("references", MAX_REFS), ("keyframe_anchors", MAX_KEYFRAMES)):
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
    present = set(parsed.tensors)
    if present != set(expected):
        raise _bad(f"tensor set mismatch: missing {preview(set(expected) - present)}, "
                   f"unexpected {preview(present - set(expected))}")
    digests = header["sha256"]
    if not isinstance(digests, dict) or set(digests) != set(expected):
        raise _bad("corrupted header: sha256 must list every tensor")

    entries = {name: parsed.tensors[name] for name in expected}
    for name, entry in entries.items():
        if entry.dtype not in WIRE_DTYPES:
            raise _bad(f"tensor {name!r} has dtype {entry.dtype!r:.20}, not one the contract uses")
    cursor = 0  # the tensors must tile the data buffer exactly: no gaps, no overlaps, nothing after
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != cursor:
            raise _bad(f"corrupted: tensor {entry.name!r} starts at byte {entry.begin}, expected {cursor}")
        cursor = entry.end
    if cursor != data_len:
        kind = "truncated" if cursor > data_len else "corrupted"
        raise _bad(f"{kind}: tensors need {cursor} data bytes, the payload holds {data_len}")
    return _Plan(header, entries, n_cond, n_audio, data_len)


def _build(cls, plan: _Plan, buf: bytearray, data_start: int):
    """Checksum and cut the tensors out of `buf` (which they then own), and construct the conditioning."""
    view = memoryview(buf)
    tensors = {}
    for name, entry in plan.entries.items():
        begin, end = data_start + entry.begin, data_start + entry.end
        if hashlib.sha256(view[begin:end]).hexdigest() != plan.header["sha256"][name]:
            raise _bad(f"corrupted: checksum mismatch for tensor {name!r}")
        dtype = WIRE_DTYPES[entry.dtype]
        if end == begin:
            t = torch.empty(entry.shape, dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=begin)
            t = t.reshape(entry.shape)
            if t.data_ptr() % t.element_size():
                t = t.clone()  # keep kernels on aligned memory
        tensors[name] = t
    header = plan.header
    return cls(
        task=header["task"],
        height=header["height"],
        width=header["width"],
        num_frames=header["num_frames"],
        prompt_embeds=tensors["prompt_embeds"],
        text_token_tags=tensors["text_token_tags"],
        condition_latents=tuple(tensors[f"condition_latents.{i}"] for i in range(plan.n_cond)),
        audio_condition_latents=tuple(tensors[f"audio_condition_latents.{i}"] for i in range(plan.n_audio)),
        keyframe_anchors=tuple(header["keyframe_anchors"]),
        references=tuple(header["references"]),
        metadata=header["metadata"],
    )


def from_bytes(cls, data: bytes | bytearray | memoryview):
    """Parse and validate `to_bytes()` output. Any defect raises `ContractError`; never unpickles."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ContractError(f"payload: expected bytes, got {type(data).__name__}", field="payload")
    buf = bytearray(data)  # a private, writable copy the tensors can own
    try:
        parsed = st.read_header(buf)
    except st.HeaderError as error:
        raise _bad(str(error)) from None
    return _build(cls, _plan(parsed, len(buf) - parsed.data_start), buf, parsed.data_start)


def load(cls, path: str | os.PathLike):
    """Read and validate a file written by `save`: prefix and header first, the data only once they pass."""
    path = os.fspath(path)
    shown = ascii(path) if len(path) <= 200 else ascii(path[:200]) + "..."
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        raise _bad(f"cannot read {shown}: {error.strerror}") from None
    if not stat.S_ISREG(mode):  # a directory, FIFO, socket or device: refuse without opening it
        raise _bad(f"{shown} is not a regular file")
    try:  # O_NONBLOCK: should the path be swapped for a FIFO after the check, opening it cannot hang
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as error:
        raise _bad(f"cannot read {shown}: {error.strerror}") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise _bad(f"{shown} is not a regular file")
        try:
            parsed = st.read_header(f, size=info.st_size)
        except st.HeaderError as error:
            raise _bad(str(error)) from None
        plan = _plan(parsed, info.st_size - parsed.data_start)
        buf = bytearray(plan.data_len)
        view, got = memoryview(buf), 0
        while got < plan.data_len:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    if got != plan.data_len:
        raise _bad(f"truncated: read {got} of {plan.data_len} data bytes from {shown} (changed while reading?)")
    return _build(cls, plan, buf, 0)
