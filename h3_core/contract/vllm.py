"""vLLM-Omni's unified stage-0 payload, to and from `H3Conditioning`.

The payload (vLLM-Omni's MiniMax-H3 `MiniMaxH3EncoderConditioning.to_omni_payload` / `from_omni_payload`)
carries the text hidden states, every condition latent patchified into one row block, every audio condition
as channel-major rows in another, and a flat int64 "layout vector" that says how to cut them apart again:
a fixed header (schema id, version, task code, canvas, frame counts, entry counts, three edit fields since
version 2), then per-entry shapes, reference rows and keyframe indices. This module maps it field for field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import facts
from .comfy import COMFY_PACK_KEY
from .errors import fail, shape
from .layout import patchify_video_latent, unpatchify_video_rows
from .wire import FORMAT_ID, FORMAT_VERSION

VLLM_LAYOUT_KEY = "minimax_h3_encoder_layout"
VLLM_WIRE_SCHEMA_ID = 1
VLLM_STAGE_SCHEMA_VERSION = 2
HEADER_LEN = {1: 12, 2: 15}  # v2 appends video_edit_rows, audio_edit_rows, audio_edit_source_t
TASK_CODES = {"t2va": 1, "fl2va": 2, "ref2va": 3}
CODE_TASKS = {code: task for task, code in TASK_CODES.items()}
REF_KIND_CODES = {"image": 1, "video": 2, "video_audio": 3, "audio": 4}
CODE_REF_KINDS = {code: kind for kind, code in REF_KIND_CODES.items()}
KEYFRAME_INDEX = {"first": 0, "last": -1}
INDEX_KEYFRAME = {index: anchor for anchor, index in KEYFRAME_INDEX.items()}


def encode(cond, *, include_pack_metadata: bool = False) -> dict[str, Any]:
    """vLLM-Omni's unified stage-0 payload (schema 1, version 2, zero edit rows).

    Mapping (vllm-project/vllm-omni:vllm_omni/model_executor/models/minimax_h3/conditioning.py,
    `MiniMaxH3EncoderConditioning.to_omni_payload`; encoder_processing.py `encode_media`):

    * `hidden_states.output` <- prompt_embeds[0] `[L, D]` (dtype kept; vLLM's own reader insists on
      bf16 `[L, 5120]`, so a release-bound payload should come from a bf16 encoder)
    * `meta.token_role_ids`  <- text_token_tags int64 `[L]` (as `to_omni_payload` emits; the stage wire
      reshapes to `[L, 1]`, which `from_vllm` also accepts)
    * `embed.embedding`      <- every condition latent patchified (1x2x2, `patchify_video_latent`),
      concatenated in packed order: fp32 `[sum t*(h/2)*(w/2), 4C]` (96 = 4*24), or fp32 `[0]` when none
    * `embed.speech_feat`    <- every audio condition's channel-major rows concatenated in packed
      order: fp32 `[2*sum T, 32]`, or fp32 `[0]`
    * `kv_metadata.minimax_h3_encoder_layout` <- int64 `[1, 2, task_code (t2va 1, fl2va 2, ref2va 3),
      height, width, num_frames, latent_t, audio_t, n_visual, n_audio, n_ref, n_keyframe, 0, 0, 0]`
      + `(T, h, w)` per condition latent + T per audio condition + `[kind_code, ref_audio_t, latent_t,
      latent_h, latent_w]` per reference (image 1 with latent_t 0, video 2, video_audio 3, audio 4 with
      zero geometry) + keyframe frame indices (first 0, last -1).

    `metadata` has no slot in vLLM's payload: with `include_pack_metadata=True` it rides in an extra
    top-level `minimax_h3_pack` key (vLLM's reader ignores unknown keys), otherwise it is dropped.
    """
    if cond.guides:  # vLLM's layout anchors single-frame keyframes at its frame indices, with no clip or audio slot
        frames = [g.frame for g in cond.guides]
        raise fail("guides", f"{len(cond.guides)} guide(s) at frames {frames} (core's AddGuide: any frame, clips, "
                             "audio) have no slot in vLLM-Omni's stage-0 payload, which carries "
                             "first/last keyframes only; sample this conditioning with the pack or core")
    visual_rows = [patchify_video_latent(lat) for lat in cond.condition_latents]
    embedding = torch.cat(visual_rows) if visual_rows else torch.empty((0,), dtype=torch.float32)
    speech = (torch.cat([rows.contiguous() for rows in cond.audio_condition_latents])
              if cond.audio_condition_latents else torch.empty((0,), dtype=torch.float32))

    ref_rows: list[list[int]] = []
    visual = iter(cond.condition_latents)
    audio = iter(cond.audio_condition_latents)
    for ref in cond.references:
        if ref.kind == "image":
            lat = next(visual)
            ref_rows.append([REF_KIND_CODES["image"], 0, 0, int(lat.shape[3]), int(lat.shape[4])])
        elif ref.kind == "video":
            lat = next(visual)
            rt = int(next(audio).shape[0]) // facts.AUDIO_CHANNELS if ref.has_audio else 0
            ref_rows.append([REF_KIND_CODES["video_audio" if ref.has_audio else "video"], rt,
                             int(lat.shape[2]), int(lat.shape[3]), int(lat.shape[4])])
        else:
            rt = int(next(audio).shape[0]) // facts.AUDIO_CHANNELS
            ref_rows.append([REF_KIND_CODES["audio"], rt, 0, 0, 0])

    layout = [VLLM_WIRE_SCHEMA_ID, VLLM_STAGE_SCHEMA_VERSION, TASK_CODES[cond.task], cond.height,
              cond.width, cond.num_frames, cond.latent_t, cond.audio_t, len(cond.condition_latents),
              len(cond.audio_condition_latents), len(ref_rows), len(cond.keyframe_anchors), 0, 0, 0]
    layout += [int(d) for lat in cond.condition_latents for d in lat.shape[2:]]
    layout += [int(rows.shape[0]) // facts.AUDIO_CHANNELS for rows in cond.audio_condition_latents]
    layout += [v for row in ref_rows for v in row]
    layout += [KEYFRAME_INDEX[a] for a in cond.keyframe_anchors]

    payload: dict[str, Any] = {
        "hidden_states": {"output": cond.prompt_embeds[0].contiguous()},
        "embed": {"embedding": embedding, "speech_feat": speech},
        "meta": {"token_role_ids": cond.text_token_tags.contiguous()},
        "kv_metadata": {VLLM_LAYOUT_KEY: torch.tensor(layout, dtype=torch.int64)},
    }
    if include_pack_metadata:
        payload[COMFY_PACK_KEY] = {"format": FORMAT_ID, "version": FORMAT_VERSION,
                                   "metadata": dict(cond.metadata)}
    return payload


def decode(cls, payload: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None):
    """Read vLLM-Omni's unified stage-0 payload (inverse of `to_vllm`; mapping documented there).

    Accepts layout versions 2 (current) and 1 (12-int header, no edit fields). Latent-mask editing
    (non-zero v2 edit rows) is not representable and raises. `metadata` (explicit) wins over a
    `minimax_h3_pack` key; without either the metadata is empty.
    """
    hidden_states, tags, visual, speech, layout = _slots(payload)
    header = _Header.read(layout)
    condition_latents = _visual_slot(visual, header.shapes)
    audio_rows = _audio_slot(speech, header.lengths)
    anchors, references = _keyframes_and_references(header)
    if metadata is None:
        pack = payload.get(COMFY_PACK_KEY)
        if isinstance(pack, Mapping) and pack.get("format") == FORMAT_ID:
            metadata = pack.get("metadata") or {}

    cond = cls(
        task=header.task,
        height=header.height,
        width=header.width,
        num_frames=header.num_frames,
        prompt_embeds=hidden_states.unsqueeze(0),
        text_token_tags=tags,
        condition_latents=tuple(condition_latents),
        audio_condition_latents=tuple(audio_rows),
        keyframe_anchors=tuple(anchors),
        references=tuple(references),
        metadata=metadata or {},
    )
    if (header.latent_t, header.audio_t) != (cond.latent_t, cond.audio_t):
        raise fail(LAYOUT_FIELD, f"latent_t/audio_t = {(header.latent_t, header.audio_t)} disagree with num_frames "
                                 f"{header.num_frames} (expected {(cond.latent_t, cond.audio_t)})")
    return cond


LAYOUT_FIELD = f"kv_metadata.{VLLM_LAYOUT_KEY}"


def _slots(payload: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """The payload's five tensors (hidden states, token tags, visual and speech slots, layout header), checked."""
    if not isinstance(payload, Mapping):
        raise fail("payload", f"must be a mapping, got {type(payload).__name__}")
    hidden = payload.get("hidden_states")
    embed = payload.get("embed")
    meta = payload.get("meta")
    kv = payload.get("kv_metadata")
    hidden_states = hidden.get("output") if isinstance(hidden, Mapping) else None
    tags = meta.get("token_role_ids") if isinstance(meta, Mapping) else None
    visual = embed.get("embedding") if isinstance(embed, Mapping) else None
    speech = embed.get("speech_feat") if isinstance(embed, Mapping) else None
    layout = kv.get(VLLM_LAYOUT_KEY) if isinstance(kv, Mapping) else None
    for name, value in (("hidden_states.output", hidden_states), ("meta.token_role_ids", tags),
                        ("embed.embedding", visual), ("embed.speech_feat", speech), (LAYOUT_FIELD, layout)):
        if not isinstance(value, torch.Tensor):
            raise fail(name, f"missing or not a tensor (got {type(value).__name__})")
    if hidden_states.ndim != 2:
        raise fail("hidden_states.output", f"must be [L, D], got {shape(hidden_states)}")
    if tags.ndim == 2 and tags.shape[-1] == 1:
        tags = tags.reshape(-1)
    return hidden_states, tags, visual, speech, layout


@dataclass(frozen=True)
class _Header:
    """The layout header's integers: the numbers, then one row per visual shape, audio length, reference, keyframe."""

    task: str
    height: int
    width: int
    num_frames: int
    latent_t: int
    audio_t: int
    shapes: list  # (T, h, w) per visual condition
    lengths: list  # rows per audio condition
    ref_rows: list  # (kind code, audio_t, latent_t, h, w) per reference
    kf_indices: list  # 0 (first) / -1 (last) per keyframe

    @classmethod
    def read(cls, layout: torch.Tensor) -> _Header:
        if layout.ndim != 1 or layout.dtype.is_floating_point or layout.dtype.is_complex or layout.dtype == torch.bool:
            raise fail(LAYOUT_FIELD, f"must be a 1-D integer tensor, got {layout.dtype} {shape(layout)}")
        values = [int(v) for v in layout.tolist()]
        if len(values) < 2:
            raise fail(LAYOUT_FIELD, f"header truncated ({len(values)} ints)")
        schema_id, version = values[:2]
        if schema_id != VLLM_WIRE_SCHEMA_ID or version not in HEADER_LEN:
            raise fail(LAYOUT_FIELD, f"unsupported wire schema {schema_id}:{version} (expected "
                                     f"{VLLM_WIRE_SCHEMA_ID}:1 or {VLLM_WIRE_SCHEMA_ID}:{VLLM_STAGE_SCHEMA_VERSION})")
        header_len = HEADER_LEN[version]
        if len(values) < header_len:
            raise fail(LAYOUT_FIELD, f"header truncated ({len(values)} of {header_len} ints)")
        (task_code, height, width, num_frames, latent_t, audio_t, n_visual, n_audio, n_ref,
         n_kf) = values[2:12]
        edit = values[12:15] if version >= 2 else [0, 0, 0]
        if any(edit):
            raise fail(LAYOUT_FIELD, f"latent-mask editing (video_edit_rows, audio_edit_rows, audio_edit_source_t = "
                                     f"{tuple(edit)}) is not representable in H3Conditioning")
        task = CODE_TASKS.get(task_code)
        if task is None:
            raise fail(LAYOUT_FIELD, f"unknown task code {task_code}")
        if min(n_visual, n_audio, n_ref, n_kf) < 0:
            raise fail(LAYOUT_FIELD, "counts must be non-negative")
        expected_len = header_len + 3 * n_visual + n_audio + 5 * n_ref + n_kf
        if len(values) != expected_len:
            raise fail(LAYOUT_FIELD, f"has {len(values)} ints, the header's counts imply {expected_len}")
        cursor = header_len
        shapes = [tuple(values[cursor + 3 * i:cursor + 3 * i + 3]) for i in range(n_visual)]
        cursor += 3 * n_visual
        lengths = values[cursor:cursor + n_audio]
        cursor += n_audio
        ref_rows = [values[cursor + 5 * i:cursor + 5 * i + 5] for i in range(n_ref)]
        cursor += 5 * n_ref
        kf_indices = values[cursor:cursor + n_kf]
        if any(min(s) <= 0 or s[1] % 2 or s[2] % 2 for s in shapes):
            raise fail(LAYOUT_FIELD, f"visual shapes must be positive (T, h, w) with even h, w, got {shapes}")
        if any(length <= 0 for length in lengths):
            raise fail(LAYOUT_FIELD, f"audio lengths must be positive, got {lengths}")
        return cls(task, height, width, num_frames, latent_t, audio_t, shapes, lengths, ref_rows, kf_indices)


def _visual_slot(visual: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """The visual slot's rows, back to one latent [1, C, T, h, w] per visual condition."""
    if not shapes:
        if visual.dtype != torch.float32 or shape(visual) != (0,):
            raise fail("embed.embedding", f"empty slot must be fp32 [0], got {visual.dtype} {shape(visual)}")
        return []
    n_rows = sum(t * (h // 2) * (w // 2) for t, h, w in shapes)
    if visual.dtype != torch.float32 or visual.ndim != 2 or visual.shape[0] != n_rows or \
            visual.shape[1] % 4 or visual.shape[1] == 0:
        raise fail("embed.embedding", f"must be fp32 [{n_rows}, 4*C], got {visual.dtype} {shape(visual)}")
    channels = visual.shape[1] // 4
    condition_latents, start = [], 0
    for t, h, w in shapes:
        n = t * (h // 2) * (w // 2)
        condition_latents.append(unpatchify_video_rows(visual[start:start + n], t, h, w, channels))
        start += n
    return condition_latents


def _audio_slot(speech: torch.Tensor, lengths: list) -> list[torch.Tensor]:
    """The speech slot's rows, split into one channel-major block per audio condition."""
    if not lengths:
        if speech.dtype != torch.float32 or shape(speech) != (0,):
            raise fail("embed.speech_feat", f"empty slot must be fp32 [0], got {speech.dtype} {shape(speech)}")
        return []
    n_rows = facts.AUDIO_CHANNELS * sum(lengths)
    if speech.dtype != torch.float32 or speech.ndim != 2 or speech.shape[0] != n_rows:
        raise fail("embed.speech_feat", f"must be fp32 [{n_rows}, {facts.AUDIO_LATENT_CHANNELS}], got "
                                       f"{speech.dtype} {shape(speech)}")
    audio_rows, start = [], 0
    for length in lengths:
        audio_rows.append(speech[start:start + facts.AUDIO_CHANNELS * length].contiguous())
        start += facts.AUDIO_CHANNELS * length
    return audio_rows


def _keyframes_and_references(header: _Header) -> tuple[list, list]:
    """Keyframe anchors, and (kind, has_audio) per reference, each row checked against the slots it uses."""
    anchors = []
    for index in header.kf_indices:
        if index not in INDEX_KEYFRAME:
            raise fail(LAYOUT_FIELD, f"keyframe frame index must be 0 (first) or -1 (last), got {index}")
        anchors.append(INDEX_KEYFRAME[index])
    shapes, lengths = header.shapes, header.lengths
    references = []
    vis_i = aud_i = 0
    for i, (code, rt, rlt, rlh, rlw) in enumerate(header.ref_rows):
        kind = CODE_REF_KINDS.get(code)
        where = f"{LAYOUT_FIELD} ref row {i}"
        if kind is None:
            raise fail(LAYOUT_FIELD, f"ref row {i}: unknown kind code {code}")
        if kind != "audio":
            if vis_i >= len(shapes):
                raise fail(LAYOUT_FIELD, f"ref row {i}: more visual references than visual shapes ({len(shapes)})")
            t, h, w = shapes[vis_i]
            vis_i += 1
            ok_t = rlt in (0, 1) if kind == "image" else rlt == t
            if not ok_t or (rlh, rlw) != (h, w):
                raise fail(where, f"geometry (latent_t={rlt}, h={rlh}, w={rlw}) does not match visual shape "
                                   f"{(t, h, w)}")
        if kind in ("video_audio", "audio"):
            if aud_i >= len(lengths) or lengths[aud_i] != rt:
                raise fail(where, f"ref_audio_t={rt} does not match the next audio length "
                                   f"{lengths[aud_i] if aud_i < len(lengths) else 'none'}")
            aud_i += 1
            if kind == "audio" and (rlt, rlh, rlw) != (0, 0, 0):
                raise fail(where, f"an audio reference has no geometry, got {(rlt, rlh, rlw)}")
        elif rt:
            raise fail(where, f"kind {kind!r} carries no audio, got ref_audio_t={rt}")
        references.append(("video" if kind == "video_audio" else kind, kind in ("video_audio", "audio")))
    if header.ref_rows and (vis_i != len(shapes) or aud_i != len(lengths)):
        raise fail(LAYOUT_FIELD, f"references use {vis_i} visual and {aud_i} audio conditions, the payload holds "
                                 f"{len(shapes)} and {len(lengths)}")
    return anchors, references
