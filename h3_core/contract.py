"""The MiniMax-H3 conditioning contract between the encoder stage and the diffusion stage.

`H3Conditioning` holds exactly what diffusers' stage 1 (the `denoise.*` + `decode.*` blocks of
`MiniMaxH3Blocks().get_workflow(task)`) reads from stage 0 (shared/h3/STAGE_SPLIT.md, "Fields that
cross the cut"): `prompt_embeds`, `text_token_tags`, `condition_latents`, `audio_condition_latents`,
`keyframe_anchors`, the `(kind, has_audio)` pairs of `normalized_references`, and the canvas
(`height`, `width`, `num_frames`), plus the task name and free provenance metadata.

It is validated on construction and on receipt (every violation is a `ContractError`, a
`ValueError` that names the field and the constraint), serialises to one safetensors byte string
(never pickle) and converts, losslessly, to and from

* ComfyUI core's H3 CONDITIONING (`to_comfy` / `from_comfy`), and
* vLLM-Omni's unified stage-0 payload (`to_vllm` / `from_vllm`).

This module never imports ComfyUI, diffusers or vLLM: ComfyUI's CONDITIONING is plain Python lists,
dicts and tensors, and is built and read here as such.

Facts relied on (read from public code; no code copied):

* Latent normalisation. ComfyUI core's video VAE `encode` returns the posterior mean already
  normalised per channel, `(mean - latents_mean) / latents_std`, and its audio VAE `encode` returns
  normalised `[B, 32, 2, T]` latents (Comfy-Org/ComfyUI:comfy/ldm/minimax/vae.py `encode`,
  comfy/ldm/minimax/audio_vae.py `encode`). `model_base.MiniMaxH3.extra_conds` passes
  `minimax_keyframes[i]["latent"]`, `minimax_refs[i]["latent"]` and `[...]["audio_latent"]` to the DiT
  untouched, and the DiT patchifies / packs them directly with no further normalisation
  (Comfy-Org/ComfyUI:comfy/model_base.py `class MiniMaxH3`, comfy/ldm/minimax/model.py
  `_cond_video_rows`, `_cond_audio_rows`). So core's condition latents are *normalised* VAE latents,
  the same values as diffusers' `condition_latents` / `audio_condition_latents`, and the
  conversions need no VAE statistics. (Values differ only in how they were *produced*: core uses
  the posterior mean, diffusers/vLLM sample the video posterior under seed 42; SPEC.md section 8.3.)
* Patchify order (all three implementations agree): a video latent `[1, C, T, H, W]` becomes rows
  `[T*(H/2)*(W/2), C*1*2*2]`, rows ordered t, then h, then w; each row is the 1x2x2 patch flattened
  channel-major, i.e. `einsum("nctrhpwq->nthwcrpq")` (Comfy-Org/ComfyUI:comfy/ldm/minimax/model.py
  `patchify_video`; diffusers `modular_pipelines/minimax_h3/before_denoise.py`
  `patchify_video_latents`; for vLLM-Omni, SPEC.md section 1.1 records the same einsum).
* Audio rows are channel-major stereo: `[2*T, 32]` = channel 0 frames 0..T-1, then channel 1.
  Core keeps `[1, 32, 2, T]` and packs with `latent[0].permute(1, 2, 0).reshape(2*T, 32)`
  (comfy/ldm/minimax/model.py `pack_audio` / `unpack_audio`); diffusers' rows are the same
  (`encoders.py`, `MiniMaxH3Ref2VAReferenceEncoderStep`).
* vLLM-Omni wire form, layout vector, task/ref-kind codes, image ref rows without `latent_t`,
  keyframe indices 0/-1: vllm-project/vllm-omni:vllm_omni/model_executor/models/minimax_h3/
  conditioning.py (`MiniMaxH3EncoderConditioning.to_omni_payload` / `from_omni_payload`,
  `MiniMaxH3EncoderMediaConditioning.to_omni_components`) and encoder_processing.py (`encode_media`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "AUDIO_CHANNELS",
    "AUDIO_LATENTS_PER_SECOND",
    "AUDIO_LATENT_CHANNELS",
    "CANVAS_MULTIPLE",
    "COMFY_PACK_KEY",
    "FORMAT_ID",
    "FORMAT_VERSION",
    "FPS",
    "HEADER_KEY",
    "KEYFRAME_ANCHOR_SETS",
    "MAX_AUDIO_BUDGET_LATENTS",
    "MAX_AUDIO_LATENTS",
    "MAX_AUDIO_REFERENCES",
    "MAX_IMAGE_REFERENCES",
    "MAX_NUM_FRAMES",
    "MAX_REFERENCES",
    "MAX_VIDEO_REFERENCES",
    "MIN_AUDIO_LATENTS",
    "MIN_NUM_FRAMES",
    "PATCH_SIZE",
    "PROMPT_EMBED_DTYPES",
    "REFERENCE_KINDS",
    "TASKS",
    "VAE_FRAMES_PER_CHUNK",
    "VAE_LATENTS_PER_CHUNK",
    "VAE_SPATIAL_FACTOR",
    "VLLM_LAYOUT_KEY",
    "VLLM_STAGE_SCHEMA_VERSION",
    "VLLM_WIRE_SCHEMA_ID",
    "ContractError",
    "H3Conditioning",
    "H3Reference",
    "audio_latent_frames",
    "audio_latent_to_rows",
    "audio_rows_to_latent",
    "patchify_video_latent",
    "unpatchify_video_rows",
    "video_latent_frames",
]

# --- model facts ---------------------------------------------------------------------------------
FPS = 24
AUDIO_LATENTS_PER_SECOND = 40
AUDIO_LATENT_CHANNELS = 32  # A: audio VAE latent width (release and the tiny H3 alike)
AUDIO_CHANNELS = 2  # stereo, packed channel-major
VAE_SPATIAL_FACTOR = 16
VAE_FRAMES_PER_CHUNK = 17  # pixel frames of one VAE clip: valid counts are 17n + 5
VAE_LATENTS_PER_CHUNK = 5  # latent frames of one VAE clip: valid counts are 5n + 2
PATCH_SIZE = (1, 2, 2)  # the DiT's (t, h, w) patch
CANVAS_MULTIPLE = VAE_SPATIAL_FACTOR * PATCH_SIZE[2]  # 32

# --- limits (module constants so a fine-tune that needs others can change them in one place) --
# diffusers accepts 5-15 s *after* snapping to 17n + 5 at 24 fps (MiniMaxH3ModularPipeline.min_duration /
# max_duration): 120..360 frames, i.e. the valid counts 124, 141, ..., 345.
MIN_NUM_FRAMES = 124
MAX_NUM_FRAMES = 360
# vLLM-Omni: every audio condition 2-15 s (80-600 latents at 40/s); embedded soundtracks and standalone audio
# references are budgeted SEPARATELY, each <= 600 latents in total (encoder_processing.py, `encode_media`).
MIN_AUDIO_LATENTS = 80
MAX_AUDIO_LATENTS = 600
MAX_AUDIO_BUDGET_LATENTS = 600
MAX_IMAGE_REFERENCES = 9
MAX_VIDEO_REFERENCES = 3
MAX_AUDIO_REFERENCES = 3
MAX_REFERENCES = 12

TASKS = ("t2va", "fl2va", "ref2va")
KEYFRAME_ANCHOR_SETS = (("first",), ("last",), ("first", "last"))
REFERENCE_KINDS = ("image", "video", "audio")
PROMPT_EMBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# --- serialisation -------------------------------------------------------------------------------
FORMAT_ID = "minimax-h3-conditioning"
FORMAT_VERSION = 1
HEADER_KEY = "minimax_h3_conditioning"  # the one key of the safetensors `__metadata__`
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own cap
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
_HEADER_FIELDS = frozenset(
    {
        "format",
        "version",
        "task",
        "height",
        "width",
        "num_frames",
        "keyframe_anchors",
        "references",
        "metadata",
        "num_condition_latents",
        "num_audio_condition_latents",
        "tensor_count",
        "sha256",
    }
)

# --- ComfyUI core --------------------------------------------------------------------------------
COMFY_PACK_KEY = "minimax_h3_pack"  # our extra key in the cond dict; core's extra_conds never reads it
_COMFY_UNREPRESENTABLE_KEYS = ("minimax_visual_cond_noise_aug", "minimax_audio_cond_noise_aug")

# --- vLLM-Omni ----------------------------------------------------------------------------------
VLLM_LAYOUT_KEY = "minimax_h3_encoder_layout"
VLLM_WIRE_SCHEMA_ID = 1
VLLM_STAGE_SCHEMA_VERSION = 2
_VLLM_HEADER_LEN = {1: 12, 2: 15}  # v2 appends video_edit_rows, audio_edit_rows, audio_edit_source_t
_VLLM_TASK_CODES = {"t2va": 1, "fl2va": 2, "ref2va": 3}
_VLLM_CODE_TASKS = {code: task for task, code in _VLLM_TASK_CODES.items()}
_VLLM_REF_KIND_CODES = {"image": 1, "video": 2, "video_audio": 3, "audio": 4}
_VLLM_CODE_REF_KINDS = {code: kind for kind, code in _VLLM_REF_KIND_CODES.items()}
_VLLM_KEYFRAME_INDEX = {"first": 0, "last": -1}
_VLLM_INDEX_KEYFRAME = {index: anchor for anchor, index in _VLLM_KEYFRAME_INDEX.items()}


class ContractError(ValueError):
    """A conditioning payload violates the H3 contract. `field` names the offending field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def _fail(field_name: str, constraint: str) -> ContractError:
    return ContractError(f"{field_name}: {constraint}", field=field_name)


# --- frame arithmetic ---------------------------------------------------------------------------


def video_latent_frames(num_frames: int) -> int:
    """Latent frames the video VAE produces for a `17n + 5` frame count: `5n + 2`."""
    return (num_frames - 5) // VAE_FRAMES_PER_CHUNK * VAE_LATENTS_PER_CHUNK + 2


def audio_latent_frames(num_frames: int) -> int:
    """Audio latents (per stereo channel) covering `num_frames` video frames: `round(num_frames / 24 * 40)`."""
    return int(round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND))


# --- patchify helpers (also exactly what the DiT sees) -------------------------------------------


def patchify_video_latent(latent: torch.Tensor, patch_size: Sequence[int] = PATCH_SIZE) -> torch.Tensor:
    """`[1, C, T, H, W]` -> `[(T/pt)*(H/ph)*(W/pw), C*pt*ph*pw]` rows, t-major then h then w, each patch
    flattened channel-major (`einsum("nctrhpwq->nthwcrpq")`). Contiguous; a pure reshuffle (bit exact)."""
    if not isinstance(latent, torch.Tensor) or latent.ndim != 5 or latent.shape[0] != 1:
        raise ContractError("latent: must be a [1, C, T, H, W] tensor", field="latent")
    pt, ph, pw = (int(p) for p in patch_size)
    _, c, t, h, w = latent.shape
    if t % pt or h % ph or w % pw:
        raise ContractError(f"latent: shape {tuple(latent.shape)} is not divisible by the patch {tuple(patch_size)}",
                            field="latent")
    x = latent.reshape(1, c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # n t h w c r p q
    return x.reshape(-1, c * pt * ph * pw).contiguous()


def unpatchify_video_rows(
    rows: torch.Tensor,
    latent_t: int,
    latent_h: int,
    latent_w: int,
    channels: int,
    patch_size: Sequence[int] = PATCH_SIZE,
) -> torch.Tensor:
    """Inverse of `patchify_video_latent`: rows -> `[1, channels, latent_t, latent_h, latent_w]`, contiguous."""
    pt, ph, pw = (int(p) for p in patch_size)
    if latent_t % pt or latent_h % ph or latent_w % pw:
        raise ContractError(f"rows: latent shape {(latent_t, latent_h, latent_w)} is not divisible by the patch "
                            f"{tuple(patch_size)}", field="rows")
    n = (latent_t // pt) * (latent_h // ph) * (latent_w // pw)
    width = channels * pt * ph * pw
    if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or tuple(rows.shape) != (n, width):
        got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ContractError(f"rows: expected shape ({n}, {width}), got {got}", field="rows")
    x = rows.reshape(1, latent_t // pt, latent_h // ph, latent_w // pw, channels, pt, ph, pw)
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)  # n c t r h p w q
    return x.reshape(1, channels, latent_t, latent_h, latent_w).contiguous()


def audio_latent_to_rows(latent: torch.Tensor) -> torch.Tensor:
    """ComfyUI-layout audio latent `[1, A, 2, T]` -> channel-major rows `[2*T, A]` (ch0 t0..T-1, then ch1)."""
    if not isinstance(latent, torch.Tensor) or latent.ndim != 4 or latent.shape[0] != 1 \
            or latent.shape[2] != AUDIO_CHANNELS:
        got = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
        raise ContractError(f"audio_latent: must be a [1, A, 2, T] tensor, got {got}", field="audio_latent")
    a, _, t = latent.shape[1:]
    return latent[0].permute(1, 2, 0).reshape(AUDIO_CHANNELS * t, a).contiguous()


def audio_rows_to_latent(rows: torch.Tensor) -> torch.Tensor:
    """Channel-major rows `[2*T, A]` -> ComfyUI-layout audio latent `[1, A, 2, T]`, contiguous."""
    if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or rows.shape[0] % AUDIO_CHANNELS:
        got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ContractError(f"audio rows: must be [2*T, A], got {got}", field="audio_rows")
    t = rows.shape[0] // AUDIO_CHANNELS
    return rows.reshape(AUDIO_CHANNELS, t, rows.shape[1]).permute(2, 0, 1).unsqueeze(0).contiguous()


# --- the contract --------------------------------------------------------------------------------


@dataclass(frozen=True)
class H3Reference:
    """One ref2va reference as stage 1 sees it: its modality and whether it contributes audio rows."""

    kind: str  # 'image' | 'video' | 'audio'
    has_audio: bool

    def __post_init__(self):
        if self.kind not in REFERENCE_KINDS:
            raise _fail("references", f"kind must be one of {REFERENCE_KINDS}, got {self.kind!r}")
        if not isinstance(self.has_audio, bool):
            raise _fail("references", f"has_audio must be a bool, got {type(self.has_audio).__name__}")
        if self.kind == "image" and self.has_audio:
            raise _fail("references", "an image reference cannot have audio")
        if self.kind == "audio" and not self.has_audio:
            raise _fail("references", "an audio reference must have has_audio=True")

    @classmethod
    def coerce(cls, value: Any) -> "H3Reference":
        """An `H3Reference` from itself, a `(kind, has_audio)` pair or a `{"kind", "has_audio"}` mapping."""
        if isinstance(value, H3Reference):
            return value
        if isinstance(value, Mapping) and set(value) == {"kind", "has_audio"}:
            return cls(value["kind"], value["has_audio"])
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(value[0], value[1])
        raise _fail("references", f"each entry must be an H3Reference, a (kind, has_audio) pair or a "
                                  f"{{'kind', 'has_audio'}} mapping, got {value!r}")




def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a = a.detach().cpu().contiguous().reshape(-1)
    b = b.detach().cpu().contiguous().reshape(-1)
    if a.numel() == 0:
        return True
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True, eq=False, repr=False)
class H3Conditioning:
    """What crosses from the H3 encoder stage to the diffusion stage. Validated on construction.

    Tensors are held as given (not copied). Lists are stored as tuples, references as `H3Reference`,
    metadata as a read-only mapping. Equality (`==`) is bit-exact over every field.
    """

    task: str
    height: int
    width: int
    num_frames: int
    prompt_embeds: torch.Tensor  # [1, L, D] fp32/bf16/fp16, Qwen3-VL hidden_states[50]
    text_token_tags: torch.Tensor  # int64 [L], 0 = vision block (incl. start/end), 1 = text
    condition_latents: tuple[torch.Tensor, ...] = ()  # fp32 [1, C, T, h, w] normalised, packed order
    audio_condition_latents: tuple[torch.Tensor, ...] = ()  # fp32 [2*T, 32] channel-major, packed order
    keyframe_anchors: tuple[str, ...] = ()  # fl2va only, positional with condition_latents
    references: tuple[H3Reference, ...] = ()  # ref2va only, packed order
    metadata: Mapping[str, str] = field(default_factory=dict)  # free provenance, never interpreted

    # ---- construction / validation ------------------------------------------------------------
    def __post_init__(self):
        for name in ("condition_latents", "audio_condition_latents", "keyframe_anchors", "references"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Sequence):
                raise _fail(name, f"must be a sequence, got {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "references", tuple(H3Reference.coerce(r) for r in self.references))
        if not isinstance(self.metadata, Mapping):
            raise _fail("metadata", f"must be a mapping of str to str, got {type(self.metadata).__name__}")
        for key, value in self.metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise _fail("metadata", f"must map str to str, got {key!r}: {value!r}")
        object.__setattr__(self, "metadata", types.MappingProxyType(dict(self.metadata)))
        self._validate()

    def _validate(self) -> None:
        # canvas and duration
        if self.task not in TASKS:
            raise _fail("task", f"must be one of {TASKS}, got {self.task!r}")
        for name in ("height", "width"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0 or value % CANVAS_MULTIPLE:
                raise _fail(name, f"must be a positive int multiple of {CANVAS_MULTIPLE} px, got {value!r}")
        nf = self.num_frames
        if not _is_int(nf) or nf < 5 or (nf - 5) % VAE_FRAMES_PER_CHUNK:
            raise _fail("num_frames", f"must be an int of the form 17n+5, got {nf!r}")
        if not MIN_NUM_FRAMES <= nf <= MAX_NUM_FRAMES:
            raise _fail("num_frames", f"must be within [{MIN_NUM_FRAMES}, {MAX_NUM_FRAMES}] frames "
                                      f"({MIN_NUM_FRAMES / FPS:g}-{MAX_NUM_FRAMES / FPS:g} s at {FPS} fps), got {nf}")

        # text
        pe = self.prompt_embeds
        if not isinstance(pe, torch.Tensor):
            raise _fail("prompt_embeds", f"must be a torch.Tensor, got {type(pe).__name__}")
        if pe.dtype not in PROMPT_EMBED_DTYPES:
            raise _fail("prompt_embeds", f"dtype must be one of float32/bfloat16/float16 (kept as the encoder "
                                         f"produced it), got {pe.dtype}")
        if pe.ndim != 3 or pe.shape[0] != 1 or pe.shape[1] < 1 or pe.shape[2] < 1:
            raise _fail("prompt_embeds", f"must have shape [1, L, D] with L, D >= 1, got {_shape(pe)}")
        tags = self.text_token_tags
        if not isinstance(tags, torch.Tensor):
            raise _fail("text_token_tags", f"must be a torch.Tensor, got {type(tags).__name__}")
        if tags.dtype != torch.int64:
            raise _fail("text_token_tags", f"dtype must be int64, got {tags.dtype}")
        if tags.ndim != 1 or tags.shape[0] != pe.shape[1]:
            raise _fail("text_token_tags", f"must have shape [L] = [{pe.shape[1]}] (one tag per prompt_embeds "
                                           f"row), got {_shape(tags)}")
        if not bool(((tags == 0) | (tags == 1)).all()):
            bad = sorted(set(tags[(tags != 0) & (tags != 1)].tolist()))[:5]
            raise _fail("text_token_tags", f"values must be 0 (vision block) or 1 (text), got {bad}")

        # condition latents
        channels = None
        for i, lat in enumerate(self.condition_latents):
            name = f"condition_latents[{i}]"
            if not isinstance(lat, torch.Tensor):
                raise _fail(name, f"must be a torch.Tensor, got {type(lat).__name__}")
            if lat.dtype != torch.float32:
                raise _fail(name, f"dtype must be float32, got {lat.dtype}")
            if lat.ndim != 5 or lat.shape[0] != 1 or min(lat.shape[1:]) < 1:
                raise _fail(name, f"must have shape [1, C, T, h, w], got {_shape(lat)}")
            if lat.shape[3] % 2 or lat.shape[4] % 2:
                raise _fail(name, f"latent h and w must be even (1x2x2 patch), got {_shape(lat)}")
            if channels is None:
                channels = lat.shape[1]
            elif lat.shape[1] != channels:
                raise _fail(name, f"channel count C={lat.shape[1]} differs from condition_latents[0]'s C={channels}")

        # audio condition rows
        for i, rows in enumerate(self.audio_condition_latents):
            name = f"audio_condition_latents[{i}]"
            if not isinstance(rows, torch.Tensor):
                raise _fail(name, f"must be a torch.Tensor, got {type(rows).__name__}")
            if rows.dtype != torch.float32:
                raise _fail(name, f"dtype must be float32, got {rows.dtype}")
            if rows.ndim != 2 or rows.shape[1] != AUDIO_LATENT_CHANNELS:
                raise _fail(name, f"must have shape [2*T, {AUDIO_LATENT_CHANNELS}], got {_shape(rows)}")
            if rows.shape[0] == 0 or rows.shape[0] % AUDIO_CHANNELS:
                raise _fail(name, f"row count must be even and positive (2 stereo channels x T), got {rows.shape[0]}")
            t = rows.shape[0] // AUDIO_CHANNELS
            if not MIN_AUDIO_LATENTS <= t <= MAX_AUDIO_LATENTS:
                raise _fail(name, f"clip must be {MIN_AUDIO_LATENTS}-{MAX_AUDIO_LATENTS} latents "
                                  f"({MIN_AUDIO_LATENTS / AUDIO_LATENTS_PER_SECOND:g}-"
                                  f"{MAX_AUDIO_LATENTS / AUDIO_LATENTS_PER_SECOND:g} s at "
                                  f"{AUDIO_LATENTS_PER_SECOND}/s), got {t}")

        for i, anchor in enumerate(self.keyframe_anchors):
            if anchor not in ("first", "last"):
                raise _fail("keyframe_anchors", f"entry {i} must be 'first' or 'last', got {anchor!r}")

        getattr(self, f"_validate_{self.task}")()

    def _validate_t2va(self) -> None:
        for name in ("condition_latents", "audio_condition_latents", "keyframe_anchors", "references"):
            n = len(getattr(self, name))
            if n:
                raise _fail(name, f"t2va carries text only, got {n} entr{'y' if n == 1 else 'ies'}")

    def _validate_fl2va(self) -> None:
        if self.references:
            raise _fail("references", f"fl2va carries no references, got {len(self.references)}")
        if self.audio_condition_latents:
            raise _fail("audio_condition_latents",
                        f"fl2va carries no audio conditions, got {len(self.audio_condition_latents)}")
        n = len(self.condition_latents)
        if not 1 <= n <= 2:
            raise _fail("condition_latents", f"fl2va needs 1-2 keyframe latents, got {n}")
        if self.keyframe_anchors not in KEYFRAME_ANCHOR_SETS:
            raise _fail("keyframe_anchors", f"must be one of {KEYFRAME_ANCHOR_SETS}, got {self.keyframe_anchors}")
        if len(self.keyframe_anchors) != n:
            raise _fail("keyframe_anchors", f"needs one anchor per keyframe latent ({n}), got "
                                            f"{len(self.keyframe_anchors)}")
        expected = (1, self.latent_height, self.latent_width)
        for i, lat in enumerate(self.condition_latents):
            if _shape(lat)[2:] != expected:
                raise _fail(f"condition_latents[{i}]", f"a keyframe latent must be [1, C, 1, H/16, W/16] = "
                                                       f"[1, C, {expected[0]}, {expected[1]}, {expected[2]}], "
                                                       f"got {_shape(lat)}")

    def _validate_ref2va(self) -> None:
        if self.keyframe_anchors:
            raise _fail("keyframe_anchors", f"ref2va carries no keyframes, got {self.keyframe_anchors}")
        kinds = [r.kind for r in self.references]
        counts = {k: kinds.count(k) for k in REFERENCE_KINDS}
        if counts["image"] + counts["video"] == 0:
            raise _fail("references", "ref2va needs at least one image or video reference")
        for kind, limit in (("image", MAX_IMAGE_REFERENCES), ("video", MAX_VIDEO_REFERENCES),
                            ("audio", MAX_AUDIO_REFERENCES)):
            if counts[kind] > limit:
                raise _fail("references", f"at most {limit} {kind} references, got {counts[kind]}")
        if len(kinds) > MAX_REFERENCES:
            raise _fail("references", f"at most {MAX_REFERENCES} references in total, got {len(kinds)}")

        visual = [r for r in self.references if r.kind != "audio"]
        if len(self.condition_latents) != len(visual):
            raise _fail("condition_latents", f"needs one latent per image/video reference ({len(visual)}), "
                                             f"got {len(self.condition_latents)}")
        for i, (ref, lat) in enumerate(zip(visual, self.condition_latents)):
            t = lat.shape[2]
            if ref.kind == "image" and t != 1:
                raise _fail(f"condition_latents[{i}]", f"an image reference latent has T=1, got T={t}")
            if ref.kind == "video" and (t - 2) % VAE_LATENTS_PER_CHUNK:
                raise _fail(f"condition_latents[{i}]", f"a video reference latent has T of the form 5n+2, got T={t}")

        audio_refs = [r for r in self.references if r.has_audio]
        if len(self.audio_condition_latents) != len(audio_refs):
            raise _fail("audio_condition_latents", f"needs one audio condition per reference with audio "
                                                   f"({len(audio_refs)}), got {len(self.audio_condition_latents)}")
        embedded = standalone = 0
        for ref, rows in zip(audio_refs, self.audio_condition_latents):
            t = rows.shape[0] // AUDIO_CHANNELS
            if ref.kind == "video":
                embedded += t
            else:
                standalone += t
        for label, total in (("embedded video soundtracks", embedded), ("standalone audio references", standalone)):
            if total > MAX_AUDIO_BUDGET_LATENTS:
                raise _fail("audio_condition_latents", f"{label} total {total} latents, over the separate "
                                                       f"{MAX_AUDIO_BUDGET_LATENTS}-latent "
                                                       f"({MAX_AUDIO_BUDGET_LATENTS / AUDIO_LATENTS_PER_SECOND:g} s) "
                                                       f"budget")

    # ---- derived values -------------------------------------------------------------------------
    @property
    def latent_t(self) -> int:
        """Target video latent frames, `5n + 2`."""
        return video_latent_frames(self.num_frames)

    @property
    def audio_t(self) -> int:
        """Target audio latents per channel, `round(num_frames / 24 * 40)`."""
        return audio_latent_frames(self.num_frames)

    @property
    def latent_height(self) -> int:
        return self.height // VAE_SPATIAL_FACTOR

    @property
    def latent_width(self) -> int:
        return self.width // VAE_SPATIAL_FACTOR

    @property
    def duration_s(self) -> float:
        return self.num_frames / FPS

    @property
    def text_len(self) -> int:
        return int(self.prompt_embeds.shape[1])

    @property
    def text_dim(self) -> int:
        return int(self.prompt_embeds.shape[2])

    @property
    def latent_channels(self) -> int | None:
        """C of the condition latents, None when there are none."""
        return int(self.condition_latents[0].shape[1]) if self.condition_latents else None

    def check_compatible(self, *, text_dim: int | None = None, latent_channels: int | None = None,
                         audio_channels: int | None = None) -> None:
        """Hook for the diffusion stage: raise `ContractError` unless this conditioning fits the loaded DiT
        (`text_dim` = its context width, `latent_channels` = its in_channels, `audio_channels` = audio_in)."""
        if text_dim is not None and self.text_dim != text_dim:
            raise _fail("prompt_embeds", f"width D={self.text_dim} does not match the model's text_dim {text_dim}")
        if latent_channels is not None:
            for i, lat in enumerate(self.condition_latents):
                if lat.shape[1] != latent_channels:
                    raise _fail(f"condition_latents[{i}]", f"C={lat.shape[1]} does not match the model's "
                                                           f"latent channels {latent_channels}")
        if audio_channels is not None and audio_channels != AUDIO_LATENT_CHANNELS and self.audio_condition_latents:
            raise _fail("audio_condition_latents", f"width {AUDIO_LATENT_CHANNELS} does not match the model's "
                                                   f"audio channels {audio_channels}")

    # ---- equality / repr --------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, H3Conditioning):
            return NotImplemented
        if (self.task, self.height, self.width, self.num_frames, self.keyframe_anchors, self.references,
                dict(self.metadata)) != (other.task, other.height, other.width, other.num_frames,
                                         other.keyframe_anchors, other.references, dict(other.metadata)):
            return False
        if len(self.condition_latents) != len(other.condition_latents) or \
                len(self.audio_condition_latents) != len(other.audio_condition_latents):
            return False
        pairs = [(self.prompt_embeds, other.prompt_embeds), (self.text_token_tags, other.text_token_tags)]
        pairs += list(zip(self.condition_latents, other.condition_latents))
        pairs += list(zip(self.audio_condition_latents, other.audio_condition_latents))
        return all(_bit_equal(a, b) for a, b in pairs)

    __hash__ = None  # tensors are mutable; use fingerprint() as a cache key

    def __repr__(self) -> str:
        cond = ", ".join(str(_shape(t)) for t in self.condition_latents)
        audio = ", ".join(str(_shape(t)) for t in self.audio_condition_latents)
        refs = ", ".join(f"{r.kind}{'+audio' if r.has_audio and r.kind == 'video' else ''}" for r in self.references)
        return (f"H3Conditioning(task={self.task!r}, {self.width}x{self.height}, num_frames={self.num_frames}, "
                f"prompt_embeds={_shape(self.prompt_embeds)} {self.prompt_embeds.dtype}, "
                f"condition_latents=[{cond}], audio_condition_latents=[{audio}], "
                f"keyframe_anchors={self.keyframe_anchors}, references=[{refs}], metadata={dict(self.metadata)})")

    # ---- serialisation ----------------------------------------------------------------------------
    def _wire_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {"prompt_embeds": self.prompt_embeds, "text_token_tags": self.text_token_tags}
        tensors.update({f"condition_latents.{i}": t for i, t in enumerate(self.condition_latents)})
        tensors.update({f"audio_condition_latents.{i}": t for i, t in enumerate(self.audio_condition_latents)})
        out, seen = {}, set()
        for name, t in tensors.items():
            t = _cpu_contiguous(t)
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:  # safetensors refuses tensors that share storage
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
            out[name] = t
        return out

    def _header(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return {
            "format": FORMAT_ID,
            "version": FORMAT_VERSION,
            "task": self.task,
            "height": self.height,
            "width": self.width,
            "num_frames": self.num_frames,
            "keyframe_anchors": list(self.keyframe_anchors),
            "references": [{"kind": r.kind, "has_audio": r.has_audio} for r in self.references],
            "metadata": dict(self.metadata),
            "num_condition_latents": len(self.condition_latents),
            "num_audio_condition_latents": len(self.audio_condition_latents),
            "tensor_count": len(tensors),
            "sha256": {name: hashlib.sha256(_tensor_bytes(t)).hexdigest() for name, t in tensors.items()},
        }

    def to_bytes(self) -> bytes:
        """One safetensors byte string: the tensors plus a versioned JSON header in `__metadata__`.
        Deterministic for equal contents (the header is canonical JSON, the metadata holds one key)."""
        from safetensors.torch import save

        tensors = self._wire_tensors()
        header = json.dumps(self._header(tensors), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return save(tensors, metadata={HEADER_KEY: header})

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "H3Conditioning":
        """Parse and validate `to_bytes()` output. Any defect raises `ContractError`; never unpickles."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ContractError(f"payload: expected bytes, got {type(data).__name__}", field="payload")
        return cls._parse(bytearray(data))  # a private, writable copy the tensors can own

    def save(self, path: str | os.PathLike) -> None:
        """Write `to_bytes()` to `path` atomically (a temporary file in the same folder, then a rename)."""
        data = self.to_bytes()
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

    @classmethod
    def load(cls, path: str | os.PathLike) -> "H3Conditioning":
        """Read and validate a file written by `save`."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            n = f.readinto(buf)
        if n != size:
            raise ContractError(f"payload: short read ({n} of {size} bytes) from {os.fspath(path)!r}",
                                field="payload")
        return cls._parse(buf)

    def fingerprint(self) -> str:
        """sha256 (hex) of the canonical serialised bytes: a content cache key."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def _parse(cls, buf: bytearray) -> "H3Conditioning":
        def bad(msg: str) -> ContractError:
            return ContractError(f"payload: {msg}", field="payload")

        # safetensors layout: u64 little-endian header length N, N bytes of JSON header, then the data buffer.
        if len(buf) < 8:
            raise bad(f"truncated: {len(buf)} bytes is shorter than the 8-byte safetensors length prefix")
        n = int.from_bytes(buf[:8], "little")
        if n > _MAX_HEADER_BYTES:
            raise bad(f"corrupted: header length {n} exceeds the {_MAX_HEADER_BYTES}-byte limit")
        if 8 + n > len(buf):
            raise bad(f"truncated: header claims {n} bytes but only {len(buf) - 8} follow the length prefix")
        try:
            st_header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise bad(f"corrupted or not safetensors: header is not valid JSON ({exc})") from None
        if not isinstance(st_header, dict):
            raise bad("corrupted or not safetensors: header is not a JSON object")
        st_meta = st_header.pop("__metadata__", None)
        if not isinstance(st_meta, dict) or not isinstance(st_meta.get(HEADER_KEY), str):
            raise bad(f"wrong format: no {HEADER_KEY!r} entry in the safetensors metadata (not an H3 conditioning "
                      f"file)")
        try:
            header = json.loads(st_meta[HEADER_KEY])
        except ValueError as exc:
            raise bad(f"corrupted: the {HEADER_KEY!r} header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise bad("corrupted: the contract header is not a JSON object")
        if header.get("format") != FORMAT_ID:
            raise bad(f"wrong format: expected format {FORMAT_ID!r}, got {header.get('format')!r}")
        version = header.get("version")
        if version != FORMAT_VERSION:
            raise bad(f"unsupported version {version!r} of {FORMAT_ID!r}; this build reads version {FORMAT_VERSION}")
        missing = _HEADER_FIELDS - set(header)
        extra = set(header) - _HEADER_FIELDS
        if missing or extra:
            raise bad(f"corrupted header: missing fields {sorted(missing)}, unknown fields {sorted(extra)}")

        n_cond, n_audio, count = (header["num_condition_latents"], header["num_audio_condition_latents"],
                                  header["tensor_count"])
        if not all(_is_int(v) and v >= 0 for v in (n_cond, n_audio, count)):
            raise bad("corrupted header: tensor counts must be non-negative ints")
        expected = ["prompt_embeds", "text_token_tags"]
        expected += [f"condition_latents.{i}" for i in range(n_cond)]
        expected += [f"audio_condition_latents.{i}" for i in range(n_audio)]
        if count != len(expected):
            raise bad(f"corrupted header: tensor_count {count} does not match the {len(expected)} tensors the "
                      f"counts imply")
        present = set(st_header)
        if present != set(expected):
            raise bad(f"tensor set mismatch: missing {sorted(set(expected) - present)}, "
                      f"unexpected {sorted(present - set(expected))}")
        digests = header["sha256"]
        if not isinstance(digests, dict) or set(digests) != set(expected):
            raise bad("corrupted header: sha256 must list every tensor")

        # tensor table: dtype, shape, offsets tiling the data buffer exactly
        data_start = 8 + n
        data_len = len(buf) - data_start
        spans = []
        specs = {}
        for name in expected:
            info = st_header[name]
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise bad(f"corrupted tensor table entry for {name!r}")
            dtype = _ST_DTYPES.get(info["dtype"])
            if dtype is None:
                raise bad(f"tensor {name!r} has dtype {info['dtype']!r}, not one the contract uses")
            shape, offsets = info["shape"], info["data_offsets"]
            if not (isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)
                    and isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
                raise bad(f"corrupted tensor table entry for {name!r}")
            begin, end = offsets
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if begin < 0 or end - begin != nbytes:
                raise bad(f"corrupted: tensor {name!r} spans {end - begin} bytes, its shape needs {nbytes}")
            spans.append((begin, end, name))
            specs[name] = (dtype, shape, begin, end)
        cursor = 0
        for begin, end, name in sorted(spans):
            if begin != cursor:
                raise bad(f"corrupted: tensor {name!r} starts at byte {begin}, expected {cursor}")
            cursor = end
        if cursor != data_len:
            kind = "truncated" if cursor > data_len else "corrupted"
            raise bad(f"{kind}: tensors need {cursor} data bytes, the payload holds {data_len}")

        tensors = {}
        view = memoryview(buf)
        for name, (dtype, shape, begin, end) in specs.items():
            digest = hashlib.sha256(view[data_start + begin:data_start + end]).hexdigest()
            if digest != digests[name]:
                raise bad(f"corrupted: checksum mismatch for tensor {name!r}")
            if end == begin:
                t = torch.empty(shape, dtype=dtype)
            else:
                t = torch.frombuffer(buf, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                     offset=data_start + begin).reshape(shape)
                if t.data_ptr() % t.element_size():
                    t = t.clone()  # keep kernels on aligned memory
            tensors[name] = t

        anchors, refs, metadata = header["keyframe_anchors"], header["references"], header["metadata"]
        if not isinstance(anchors, list) or not isinstance(refs, list) or not isinstance(metadata, dict):
            raise bad("corrupted header: keyframe_anchors/references must be lists, metadata an object")
        return cls(
            task=header["task"],
            height=header["height"],
            width=header["width"],
            num_frames=header["num_frames"],
            prompt_embeds=tensors["prompt_embeds"],
            text_token_tags=tensors["text_token_tags"],
            condition_latents=tuple(tensors[f"condition_latents.{i}"] for i in range(n_cond)),
            audio_condition_latents=tuple(tensors[f"audio_condition_latents.{i}"] for i in range(n_audio)),
            keyframe_anchors=tuple(anchors),
            references=tuple(refs),
            metadata=metadata,
        )

    # ---- ComfyUI core CONDITIONING -------------------------------------------------------------
    def to_comfy(self) -> list:
        """ComfyUI core's H3 CONDITIONING: `[[prompt_embeds, extras]]`.

        Mapping (core form as Comfy-Org/ComfyUI:comfy_extras/nodes_minimax_h3.py builds it and
        comfy/model_base.py `MiniMaxH3.extra_conds` + comfy/ldm/minimax/model.py `PackedLayout` read it):

        * `cross_attn` (list item 0)          <- prompt_embeds `[1, L, D]`, dtype kept
        * `extras["minimax_token_tags"]`      <- text_token_tags int64 `[L]`
        * fl2va: `extras["minimax_keyframes"]` = one dict per keyframe, in order:
          `{"resolved_frame_index": 0 ('first') | num_frames - 1 ('last'), "latent": [1, C, 1, H/16, W/16]}`
          (core's MiniMaxH3ImageToVideo uses frame_count - 1 for the last frame)
        * ref2va: `extras["minimax_refs"]` = one dict per reference, in packed order:
          image: `{"kind": "image", "picture_index": i (ordinal among images), "latent_h", "latent_w", "latent"}`;
          video: `{"kind": "video_audio" if has_audio else "video", "latent_t", "latent_h", "latent_w",
          "ref_audio_t" (0 without audio), "latent", "audio_latent" ([1, 32, 2, T] or None)}`;
          audio: `{"kind": "audio", "ref_audio_t", "audio_latent" [1, 32, 2, T]}`.
          Audio rows `[2T, 32]` become core's `[1, 32, 2, T]` (channel-major unpack). Latents are the same
          normalised values core's VAEs produce, so no statistics are involved.
        * `extras["minimax_h3_pack"]` = `{"format", "version", "task", "height", "width", "num_frames",
          "metadata"}`: what core does not carry. Core's extra_conds never reads it.

        Tensors are shared, not copied (except the audio latents, which change layout).
        """
        extras: dict[str, Any] = {"minimax_token_tags": self.text_token_tags}
        if self.task == "fl2va":
            extras["minimax_keyframes"] = [
                {"resolved_frame_index": 0 if anchor == "first" else self.num_frames - 1, "latent": lat}
                for anchor, lat in zip(self.keyframe_anchors, self.condition_latents)
            ]
        elif self.task == "ref2va":
            refs = []
            visual = iter(self.condition_latents)
            audio = iter(self.audio_condition_latents)
            picture_index = 0
            for ref in self.references:
                if ref.kind == "image":
                    lat = next(visual)
                    refs.append({"kind": "image", "picture_index": picture_index, "latent_h": int(lat.shape[3]),
                                 "latent_w": int(lat.shape[4]), "latent": lat})
                    picture_index += 1
                elif ref.kind == "video":
                    lat = next(visual)
                    audio_latent = audio_rows_to_latent(next(audio)) if ref.has_audio else None
                    refs.append({"kind": "video_audio" if ref.has_audio else "video",
                                 "latent_t": int(lat.shape[2]), "latent_h": int(lat.shape[3]),
                                 "latent_w": int(lat.shape[4]),
                                 "ref_audio_t": int(audio_latent.shape[-1]) if audio_latent is not None else 0,
                                 "latent": lat, "audio_latent": audio_latent})
                else:
                    audio_latent = audio_rows_to_latent(next(audio))
                    refs.append({"kind": "audio", "ref_audio_t": int(audio_latent.shape[-1]),
                                 "audio_latent": audio_latent})
            extras["minimax_refs"] = refs
        extras[COMFY_PACK_KEY] = {
            "format": FORMAT_ID,
            "version": FORMAT_VERSION,
            "task": self.task,
            "height": self.height,
            "width": self.width,
            "num_frames": self.num_frames,
            "metadata": dict(self.metadata),
        }
        return [[self.prompt_embeds, extras]]

    @classmethod
    def from_comfy(cls, conditioning: Sequence, *, task: str | None = None, height: int | None = None,
                   width: int | None = None, num_frames: int | None = None,
                   metadata: Mapping[str, str] | None = None) -> "H3Conditioning":
        """Read ComfyUI core's H3 CONDITIONING (the inverse of `to_comfy`, mapping documented there).

        `task`/`height`/`width`/`num_frames`/`metadata` come from the `minimax_h3_pack` key when present;
        a CONDITIONING made by core's own nodes has none, so pass the canvas (e.g. from the LATENT) and the
        frame count explicitly; `task` is then inferred (refs -> ref2va, keyframes -> fl2va, else t2va).
        An explicit value that disagrees with the pack key is an error. Core features the contract cannot
        express raise `ContractError`: audio keyframes and interior frame indices (MiniMaxH3AddGuide),
        keyframes mixed with refs, and the `minimax_*_cond_noise_aug` overrides. `picture_index` is not
        read (core never consumes it). fp16/bf16 condition latents are upcast to fp32 (exact).
        """
        if not isinstance(conditioning, (list, tuple)) or len(conditioning) != 1:
            n = len(conditioning) if isinstance(conditioning, (list, tuple)) else type(conditioning).__name__
            raise _fail("conditioning", f"must be a list of exactly one [cross_attn, extras] entry (H3 runs batch "
                                        f"1), got {n}")
        entry = conditioning[0]
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], Mapping):
            raise _fail("conditioning", "entry must be [cross_attn tensor, extras dict]")
        cross_attn, extras = entry
        if "minimax_token_tags" not in extras:
            raise _fail("minimax_token_tags", "missing: the CONDITIONING was not made by the MiniMax H3 text encoder")
        for key in _COMFY_UNREPRESENTABLE_KEYS:
            if extras.get(key) is not None:
                raise _fail(key, "condition noise overrides are not representable in H3Conditioning")

        pack = extras.get(COMFY_PACK_KEY)
        if pack is not None:
            if not isinstance(pack, Mapping) or pack.get("format") != FORMAT_ID:
                raise _fail(COMFY_PACK_KEY, f"must be a mapping with format {FORMAT_ID!r}")
            if pack.get("version") != FORMAT_VERSION:
                raise _fail(COMFY_PACK_KEY, f"unsupported version {pack.get('version')!r}")
        pack = pack or {}

        def resolve(name: str, explicit: Any) -> Any:
            packed = pack.get(name)
            if explicit is not None and packed is not None and explicit != packed:
                raise _fail(name, f"explicit value {explicit!r} conflicts with {COMFY_PACK_KEY}[{name!r}]={packed!r}")
            return explicit if explicit is not None else packed

        keyframes = extras.get("minimax_keyframes") or []
        refs = extras.get("minimax_refs") or []
        if keyframes and refs:
            raise _fail("minimax_keyframes", "keyframes together with references are not representable (one task "
                                             "per conditioning)")
        task = resolve("task", task)
        if task is None:
            task = "ref2va" if refs else "fl2va" if keyframes else "t2va"
        height, width, num_frames = resolve("height", height), resolve("width", width), resolve("num_frames",
                                                                                               num_frames)
        for name, value in (("height", height), ("width", width), ("num_frames", num_frames)):
            if value is None:
                raise _fail(name, f"not carried by core's CONDITIONING and no {COMFY_PACK_KEY} key: pass it "
                                  f"explicitly (e.g. from the LATENT)")
        metadata = resolve("metadata", None if metadata is None else dict(metadata))

        def tensor(value: Any, name: str) -> torch.Tensor:
            if not isinstance(value, torch.Tensor):
                raise _fail(name, f"must be a torch.Tensor, got {type(value).__name__}")
            return value

        def f32(value: Any, name: str) -> torch.Tensor:
            value = tensor(value, name)
            if value.dtype in (torch.float16, torch.bfloat16):
                value = value.to(torch.float32)  # exact
            return value

        condition_latents, audio_rows, anchors, references = [], [], [], []
        for i, kf in enumerate(keyframes):
            name = f"minimax_keyframes[{i}]"
            if not isinstance(kf, Mapping):
                raise _fail(name, "must be a dict")
            if kf.get("audio_latent") is not None:
                raise _fail(name, "audio keyframes (MiniMaxH3AddGuide) are not representable in H3Conditioning")
            if kf.get("latent") is None:
                raise _fail(name, "has no video latent")
            index = kf.get("resolved_frame_index")
            if index == 0:
                anchors.append("first")
            elif _is_int(num_frames) and index == num_frames - 1:
                anchors.append("last")
            else:
                raise _fail(name, f"resolved_frame_index must be 0 (first) or num_frames-1 = "
                                  f"{num_frames - 1 if _is_int(num_frames) else '?'} (last), got {index!r}")
            condition_latents.append(f32(kf["latent"], f"{name}['latent']"))

        for i, ref in enumerate(refs):
            name = f"minimax_refs[{i}]"
            if not isinstance(ref, Mapping):
                raise _fail(name, "must be a dict")
            kind = ref.get("kind")
            if kind not in _VLLM_REF_KIND_CODES:
                raise _fail(name, f"kind must be image/video/video_audio/audio, got {kind!r}")
            if kind != "audio":
                lat = f32(ref.get("latent"), f"{name}['latent']")
                if lat.ndim != 5:
                    raise _fail(f"{name}['latent']", f"must be [1, C, T, h, w], got {_shape(lat)}")
                declared = [("latent_h", 3), ("latent_w", 4)] + ([("latent_t", 2)] if kind != "image" else [])
                for key, dim in declared:
                    if ref.get(key) != lat.shape[dim]:
                        raise _fail(name, f"{key}={ref.get(key)!r} does not match the latent shape {_shape(lat)}")
                condition_latents.append(lat)
            audio_latent = ref.get("audio_latent")
            ref_audio_t = ref.get("ref_audio_t", 0) or 0
            if kind in ("video_audio", "audio"):
                audio_latent = f32(audio_latent, f"{name}['audio_latent']")
                if audio_latent.ndim != 4 or audio_latent.shape[-1] != ref_audio_t:
                    raise _fail(name, f"ref_audio_t={ref_audio_t!r} does not match audio_latent "
                                      f"{_shape(audio_latent)}")
                audio_rows.append(audio_latent_to_rows(audio_latent))
            elif audio_latent is not None or ref_audio_t:
                raise _fail(name, f"kind {kind!r} must carry no audio (audio_latent None, ref_audio_t 0)")
            references.append(H3Reference("video" if kind == "video_audio" else kind,
                                          kind in ("video_audio", "audio")))

        return cls(
            task=task,
            height=height,
            width=width,
            num_frames=num_frames,
            prompt_embeds=tensor(cross_attn, "cross_attn"),
            text_token_tags=tensor(extras["minimax_token_tags"], "minimax_token_tags"),
            condition_latents=tuple(condition_latents),
            audio_condition_latents=tuple(audio_rows),
            keyframe_anchors=tuple(anchors),
            references=tuple(references),
            metadata=metadata or {},
        )

    # ---- vLLM-Omni unified stage-0 payload -------------------------------------------------------
    def to_vllm(self, *, include_pack_metadata: bool = False) -> dict[str, Any]:
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
        visual_rows = [patchify_video_latent(lat) for lat in self.condition_latents]
        embedding = torch.cat(visual_rows) if visual_rows else torch.empty((0,), dtype=torch.float32)
        speech = (torch.cat([rows.contiguous() for rows in self.audio_condition_latents])
                  if self.audio_condition_latents else torch.empty((0,), dtype=torch.float32))

        ref_rows: list[list[int]] = []
        visual = iter(self.condition_latents)
        audio = iter(self.audio_condition_latents)
        for ref in self.references:
            if ref.kind == "image":
                lat = next(visual)
                ref_rows.append([_VLLM_REF_KIND_CODES["image"], 0, 0, int(lat.shape[3]), int(lat.shape[4])])
            elif ref.kind == "video":
                lat = next(visual)
                rt = int(next(audio).shape[0]) // AUDIO_CHANNELS if ref.has_audio else 0
                ref_rows.append([_VLLM_REF_KIND_CODES["video_audio" if ref.has_audio else "video"], rt,
                                 int(lat.shape[2]), int(lat.shape[3]), int(lat.shape[4])])
            else:
                rt = int(next(audio).shape[0]) // AUDIO_CHANNELS
                ref_rows.append([_VLLM_REF_KIND_CODES["audio"], rt, 0, 0, 0])

        layout = [VLLM_WIRE_SCHEMA_ID, VLLM_STAGE_SCHEMA_VERSION, _VLLM_TASK_CODES[self.task], self.height,
                  self.width, self.num_frames, self.latent_t, self.audio_t, len(self.condition_latents),
                  len(self.audio_condition_latents), len(ref_rows), len(self.keyframe_anchors), 0, 0, 0]
        layout += [int(d) for lat in self.condition_latents for d in lat.shape[2:]]
        layout += [int(rows.shape[0]) // AUDIO_CHANNELS for rows in self.audio_condition_latents]
        layout += [v for row in ref_rows for v in row]
        layout += [_VLLM_KEYFRAME_INDEX[a] for a in self.keyframe_anchors]

        payload: dict[str, Any] = {
            "hidden_states": {"output": self.prompt_embeds[0].contiguous()},
            "embed": {"embedding": embedding, "speech_feat": speech},
            "meta": {"token_role_ids": self.text_token_tags.contiguous()},
            "kv_metadata": {VLLM_LAYOUT_KEY: torch.tensor(layout, dtype=torch.int64)},
        }
        if include_pack_metadata:
            payload[COMFY_PACK_KEY] = {"format": FORMAT_ID, "version": FORMAT_VERSION,
                                       "metadata": dict(self.metadata)}
        return payload

    @classmethod
    def from_vllm(cls, payload: Mapping[str, Any], *,
                  metadata: Mapping[str, str] | None = None) -> "H3Conditioning":
        """Read vLLM-Omni's unified stage-0 payload (inverse of `to_vllm`; mapping documented there).

        Accepts layout versions 2 (current) and 1 (12-int header, no edit fields). Latent-mask editing
        (non-zero v2 edit rows) is not representable and raises. `metadata` (explicit) wins over a
        `minimax_h3_pack` key; without either the metadata is empty.
        """
        def bad(name: str, msg: str) -> ContractError:
            return _fail(name, msg)

        if not isinstance(payload, Mapping):
            raise bad("payload", f"must be a mapping, got {type(payload).__name__}")
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
                            ("embed.embedding", visual), ("embed.speech_feat", speech),
                            (f"kv_metadata.{VLLM_LAYOUT_KEY}", layout)):
            if not isinstance(value, torch.Tensor):
                raise bad(name, f"missing or not a tensor (got {type(value).__name__})")
        if hidden_states.ndim != 2:
            raise bad("hidden_states.output", f"must be [L, D], got {_shape(hidden_states)}")
        if tags.ndim == 2 and tags.shape[-1] == 1:
            tags = tags.reshape(-1)

        lname = f"kv_metadata.{VLLM_LAYOUT_KEY}"
        if layout.ndim != 1 or layout.dtype.is_floating_point or layout.dtype.is_complex or layout.dtype == torch.bool:
            raise bad(lname, f"must be a 1-D integer tensor, got {layout.dtype} {_shape(layout)}")
        values = [int(v) for v in layout.tolist()]
        if len(values) < 2:
            raise bad(lname, f"header truncated ({len(values)} ints)")
        schema_id, version = values[:2]
        if schema_id != VLLM_WIRE_SCHEMA_ID or version not in _VLLM_HEADER_LEN:
            raise bad(lname, f"unsupported wire schema {schema_id}:{version} (expected {VLLM_WIRE_SCHEMA_ID}:1 or "
                             f"{VLLM_WIRE_SCHEMA_ID}:{VLLM_STAGE_SCHEMA_VERSION})")
        header_len = _VLLM_HEADER_LEN[version]
        if len(values) < header_len:
            raise bad(lname, f"header truncated ({len(values)} of {header_len} ints)")
        (task_code, height, width, num_frames, latent_t, audio_t, n_visual, n_audio, n_ref,
         n_kf) = values[2:12]
        edit = values[12:15] if version >= 2 else [0, 0, 0]
        if any(edit):
            raise bad(lname, f"latent-mask editing (video_edit_rows, audio_edit_rows, audio_edit_source_t = "
                             f"{tuple(edit)}) is not representable in H3Conditioning")
        task = _VLLM_CODE_TASKS.get(task_code)
        if task is None:
            raise bad(lname, f"unknown task code {task_code}")
        if min(n_visual, n_audio, n_ref, n_kf) < 0:
            raise bad(lname, "counts must be non-negative")
        expected_len = header_len + 3 * n_visual + n_audio + 5 * n_ref + n_kf
        if len(values) != expected_len:
            raise bad(lname, f"has {len(values)} ints, the header's counts imply {expected_len}")
        cursor = header_len
        shapes = [tuple(values[cursor + 3 * i:cursor + 3 * i + 3]) for i in range(n_visual)]
        cursor += 3 * n_visual
        lengths = values[cursor:cursor + n_audio]
        cursor += n_audio
        ref_rows = [values[cursor + 5 * i:cursor + 5 * i + 5] for i in range(n_ref)]
        cursor += 5 * n_ref
        kf_indices = values[cursor:cursor + n_kf]

        if any(min(s) <= 0 or s[1] % 2 or s[2] % 2 for s in shapes):
            raise bad(lname, f"visual shapes must be positive (T, h, w) with even h, w, got {shapes}")
        if any(length <= 0 for length in lengths):
            raise bad(lname, f"audio lengths must be positive, got {lengths}")

        # visual slot
        if n_visual == 0:
            if visual.dtype != torch.float32 or _shape(visual) != (0,):
                raise bad("embed.embedding", f"empty slot must be fp32 [0], got {visual.dtype} {_shape(visual)}")
            condition_latents = []
        else:
            n_rows = sum(t * (h // 2) * (w // 2) for t, h, w in shapes)
            if visual.dtype != torch.float32 or visual.ndim != 2 or visual.shape[0] != n_rows or \
                    visual.shape[1] % 4 or visual.shape[1] == 0:
                raise bad("embed.embedding", f"must be fp32 [{n_rows}, 4*C], got {visual.dtype} {_shape(visual)}")
            channels = visual.shape[1] // 4
            condition_latents, start = [], 0
            for t, h, w in shapes:
                n = t * (h // 2) * (w // 2)
                condition_latents.append(unpatchify_video_rows(visual[start:start + n], t, h, w, channels))
                start += n

        # audio slot
        if n_audio == 0:
            if speech.dtype != torch.float32 or _shape(speech) != (0,):
                raise bad("embed.speech_feat", f"empty slot must be fp32 [0], got {speech.dtype} {_shape(speech)}")
            audio_rows = []
        else:
            n_rows = AUDIO_CHANNELS * sum(lengths)
            if speech.dtype != torch.float32 or speech.ndim != 2 or speech.shape[0] != n_rows:
                raise bad("embed.speech_feat", f"must be fp32 [{n_rows}, {AUDIO_LATENT_CHANNELS}], got "
                                               f"{speech.dtype} {_shape(speech)}")
            audio_rows, start = [], 0
            for length in lengths:
                audio_rows.append(speech[start:start + AUDIO_CHANNELS * length].contiguous())
                start += AUDIO_CHANNELS * length

        # references / keyframes
        anchors = []
        for index in kf_indices:
            if index not in _VLLM_INDEX_KEYFRAME:
                raise bad(lname, f"keyframe frame index must be 0 (first) or -1 (last), got {index}")
            anchors.append(_VLLM_INDEX_KEYFRAME[index])
        references = []
        vis_i = aud_i = 0
        for i, (code, rt, rlt, rlh, rlw) in enumerate(ref_rows):
            kind = _VLLM_CODE_REF_KINDS.get(code)
            where = f"{lname} ref row {i}"
            if kind is None:
                raise bad(lname, f"ref row {i}: unknown kind code {code}")
            if kind != "audio":
                if vis_i >= len(shapes):
                    raise bad(lname, f"ref row {i}: more visual references than visual shapes ({len(shapes)})")
                t, h, w = shapes[vis_i]
                vis_i += 1
                ok_t = rlt in (0, 1) if kind == "image" else rlt == t
                if not ok_t or (rlh, rlw) != (h, w):
                    raise _fail(where, f"geometry (latent_t={rlt}, h={rlh}, w={rlw}) does not match visual shape "
                                       f"{(t, h, w)}")
            if kind in ("video_audio", "audio"):
                if aud_i >= len(lengths) or lengths[aud_i] != rt:
                    raise _fail(where, f"ref_audio_t={rt} does not match the next audio length "
                                       f"{lengths[aud_i] if aud_i < len(lengths) else 'none'}")
                aud_i += 1
                if kind == "audio" and (rlt, rlh, rlw) != (0, 0, 0):
                    raise _fail(where, f"an audio reference has no geometry, got {(rlt, rlh, rlw)}")
            elif rt:
                raise _fail(where, f"kind {kind!r} carries no audio, got ref_audio_t={rt}")
            references.append(H3Reference("video" if kind == "video_audio" else kind,
                                          kind in ("video_audio", "audio")))
        if n_ref and (vis_i != len(shapes) or aud_i != len(lengths)):
            raise bad(lname, f"references use {vis_i} visual and {aud_i} audio conditions, the payload holds "
                             f"{len(shapes)} and {len(lengths)}")

        if metadata is None:
            pack = payload.get(COMFY_PACK_KEY)
            if isinstance(pack, Mapping) and pack.get("format") == FORMAT_ID:
                metadata = pack.get("metadata") or {}

        cond = cls(
            task=task,
            height=height,
            width=width,
            num_frames=num_frames,
            prompt_embeds=hidden_states.unsqueeze(0),
            text_token_tags=tags,
            condition_latents=tuple(condition_latents),
            audio_condition_latents=tuple(audio_rows),
            keyframe_anchors=tuple(anchors),
            references=tuple(references),
            metadata=metadata or {},
        )
        if (latent_t, audio_t) != (cond.latent_t, cond.audio_t):
            raise bad(lname, f"latent_t/audio_t = {(latent_t, audio_t)} disagree with num_frames {num_frames} "
                             f"(expected {(cond.latent_t, cond.audio_t)})")
        return cond
