"""`H3Conditioning`: what crosses from the H3 encoder stage to the diffusion stage, validated on construction.

It holds exactly what diffusers' stage 1 (the `denoise.*` + `decode.*` blocks) reads from stage 0:
`prompt_embeds`, `text_token_tags`, `condition_latents`, `audio_condition_latents`, `keyframe_anchors`,
the `(kind, has_audio)` pairs of the normalised references and the canvas (`height`, `width`,
`num_frames`), plus the task name and free provenance metadata. Condition latents are *normalised* VAE
latents, the values ComfyUI core's and diffusers' VAE encoders both produce, so no conversion needs
VAE statistics.

This module holds the type, its validation and derived values. The outside forms live beside it, one module
each (`wire`: safetensors bytes; `files`: those bytes on disk; `comfy`: ComfyUI core's CONDITIONING; `vllm`:
vLLM-Omni's stage-0 payload); the methods here are one-line delegates so callers keep one API.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import facts, rules
from .. import guides as guide_rules
from . import comfy, comfy_edits, files, vllm, wire
from .errors import check_tensor, fail, is_int, shape

TASKS = ("t2va", "fl2va", "ref2va")
KEYFRAME_ANCHOR_SETS = (("first",), ("last",), ("first", "last"))
REFERENCE_KINDS = ("image", "video", "audio")
PROMPT_EMBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Every audio condition is 2-15 s; the embedded soundtracks and the standalone audios are budgeted separately.
MIN_AUDIO_LATENTS = facts.audio_latents(facts.MIN_AUDIO_CLIP_S)  # 80
MAX_AUDIO_LATENTS = facts.audio_latents(facts.MAX_AUDIO_CLIP_S)  # 600
AUDIO_BUDGETS = (("embedded video soundtracks", facts.audio_latents(facts.EMBEDDED_AUDIO_BUDGET_S)),
                 ("standalone audio references", facts.audio_latents(facts.STANDALONE_AUDIO_BUDGET_S)))


@dataclass(frozen=True)
class H3Guide:
    """One guide (ComfyUI core's `MiniMaxH3AddGuide`) as stage 1 sees it: the output pixel frame it is anchored at,
    and whether it brings video rows (its latent is the next of `condition_latents` after the keyframes') and audio
    rows (the next of `audio_condition_latents`). See `h3_core/guides.py` for the rules."""

    frame: int  # resolved: 0 <= frame < num_frames
    video: bool
    audio: bool

    def __post_init__(self):
        if not is_int(self.frame) or self.frame < 0:
            raise fail("guides", f"frame must be an int >= 0 (the resolved frame index), got {self.frame!r:.40}")
        if not isinstance(self.video, bool) or not isinstance(self.audio, bool):
            raise fail("guides", "video and audio must be bools")
        if not (self.video or self.audio):
            raise fail("guides", f"the guide at frame {self.frame} anchors neither video nor audio")

    @classmethod
    def coerce(cls, value: Any) -> H3Guide:
        """An `H3Guide` from itself, a `(frame, video, audio)` triple or a `{"frame", "video", "audio"}` mapping."""
        if isinstance(value, H3Guide):
            return value
        if isinstance(value, Mapping) and set(value) == {"frame", "video", "audio"}:
            return cls(value["frame"], value["video"], value["audio"])
        if isinstance(value, (tuple, list)) and len(value) == 3:
            return cls(*value)
        raise fail("guides", f"each entry must be an H3Guide, a (frame, video, audio) triple or a mapping, "
                             f"got {value!r:.80}")


@dataclass(frozen=True)
class H3Reference:
    """One ref2va reference as stage 1 sees it: its modality and whether it contributes audio rows."""

    kind: str  # 'image' | 'video' | 'audio'
    has_audio: bool

    def __post_init__(self):
        if self.kind not in REFERENCE_KINDS:
            raise fail("references", f"kind must be one of {REFERENCE_KINDS}, got {self.kind!r}")
        if not isinstance(self.has_audio, bool):
            raise fail("references", f"has_audio must be a bool, got {type(self.has_audio).__name__}")
        if self.kind == "image" and self.has_audio:
            raise fail("references", "an image reference cannot have audio")
        if self.kind == "audio" and not self.has_audio:
            raise fail("references", "an audio reference must have has_audio=True")

    @classmethod
    def coerce(cls, value: Any) -> H3Reference:
        """An `H3Reference` from itself, a `(kind, has_audio)` pair or a `{"kind", "has_audio"}` mapping."""
        if isinstance(value, H3Reference):
            return value
        if isinstance(value, Mapping) and set(value) == {"kind", "has_audio"}:
            return cls(value["kind"], value["has_audio"])
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(value[0], value[1])
        raise fail("references", f"each entry must be an H3Reference, a (kind, has_audio) pair or a "
                                 f"{{'kind', 'has_audio'}} mapping, got {value!r:.80}")


def _check_bound(name: str, t: torch.Tensor) -> None:
    """The shape bounds every reader holds a tensor to (`wire.shape_bound_error`), naming the field."""
    too_large = wire.shape_bound_error(name, shape(t))
    if too_large:
        raise fail(name, too_large)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a = a.detach().cpu().contiguous().reshape(-1)
    b = b.detach().cpu().contiguous().reshape(-1)
    if a.numel() == 0:
        return True
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


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
    # fl2va only: guides at any frame (core's AddGuide), after the keyframes; video latents follow the keyframes' in
    # condition_latents, audio rows are audio_condition_latents in order
    guides: tuple[H3Guide, ...] = ()

    # ---- construction / validation ------------------------------------------------------------
    def __post_init__(self):
        for name in ("condition_latents", "audio_condition_latents", "keyframe_anchors", "references", "guides"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Sequence):
                raise fail(name, f"must be a sequence, got {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "references", tuple(H3Reference.coerce(r) for r in self.references))
        object.__setattr__(self, "guides", tuple(H3Guide.coerce(g) for g in self.guides))
        if not isinstance(self.metadata, Mapping):
            raise fail("metadata", f"must be a mapping of str to str, got {type(self.metadata).__name__}")
        for key, value in self.metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise fail("metadata", f"must map str to str, got {key!r:.60}: {value!r:.60}")
        object.__setattr__(self, "metadata", types.MappingProxyType(dict(self.metadata)))
        if wire.metadata_size(self.metadata) > wire.MAX_METADATA_BYTES:
            raise fail("metadata", f"takes {wire.metadata_size(self.metadata)} bytes as JSON, over the "
                                   f"{wire.MAX_METADATA_BYTES}-byte limit (it is provenance, not payload)")
        self._validate()

    def _validate(self) -> None:
        # canvas and duration
        if self.task not in TASKS:
            raise fail("task", f"must be one of {TASKS}, got {self.task!r:.60}")
        for name in ("height", "width"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0 or value % facts.CANVAS_MULTIPLE:
                raise fail(name, f"must be a positive int multiple of {facts.CANVAS_MULTIPLE} px, got {value!r:.60}")
        too_large = rules.canvas_size_error(self.width, self.height)
        if too_large:  # a file may claim any canvas; a sampler would allocate for it
            raise fail("width" if self.width > self.height else "height", too_large)
        nf = self.num_frames
        if not is_int(nf) or nf < facts.LATENTS_PER_CLIP or (nf - facts.LATENTS_PER_CLIP) % facts.FRAMES_PER_CLIP:
            raise fail("num_frames", f"must be an int of the form 17n+5, got {nf!r:.60}")
        if not facts.MIN_FRAMES <= nf <= facts.MAX_FRAMES:
            raise fail("num_frames", f"must be within [{facts.MIN_FRAMES}, {facts.MAX_FRAMES}] frames "
                                     f"({facts.MIN_FRAMES / facts.FPS:g}-{facts.MAX_FRAMES / facts.FPS:g} s "
                                     f"at {facts.FPS} fps), got {nf}")

        # text
        pe = check_tensor("prompt_embeds", self.prompt_embeds, PROMPT_EMBED_DTYPES)
        if pe.ndim != 3 or pe.shape[0] != 1 or pe.shape[1] < 1 or pe.shape[2] < 1:
            raise fail("prompt_embeds", f"must have shape [1, L, D] with L, D >= 1, got {shape(pe)}")
        _check_bound("prompt_embeds", pe)
        tags = check_tensor("text_token_tags", self.text_token_tags, torch.int64)
        if tags.ndim != 1 or tags.shape[0] != pe.shape[1]:
            raise fail("text_token_tags", f"must have shape [L] = [{pe.shape[1]}] (one tag per prompt_embeds "
                                          f"row), got {shape(tags)}")
        if not bool(((tags == 0) | (tags == 1)).all()):
            bad = sorted(set(tags[(tags != 0) & (tags != 1)].tolist()))[:5]
            raise fail("text_token_tags", f"values must be 0 (vision block) or 1 (text), got {bad}")
        text_rows = int(tags.sum())  # tags are 0/1 here: the text rows
        if text_rows > facts.MAX_TEXT_TOKENS:  # the sampler's attention grows with every row
            raise fail("prompt_embeds", f"has {text_rows} text rows (tokens tagged 1), over the "
                                        f"{facts.MAX_TEXT_TOKENS} a prompt within H3's {facts.MAX_PROMPT_CHARS}-"
                                        "character limit makes (one token per UTF-8 byte at most, plus the labels)")

        # condition latents
        channels = None
        for i, lat in enumerate(self.condition_latents):
            name = f"condition_latents[{i}]"
            check_tensor(name, lat, torch.float32)
            if lat.ndim != 5 or lat.shape[0] != 1 or min(lat.shape[1:]) < 1:
                raise fail(name, f"must have shape [1, C, T, h, w], got {shape(lat)}")
            _check_bound(name, lat)
            if lat.shape[3] % 2 or lat.shape[4] % 2:
                raise fail(name, f"latent h and w must be even (1x2x2 patch), got {shape(lat)}")
            if channels is None:
                channels = lat.shape[1]
            elif lat.shape[1] != channels:
                raise fail(name, f"channel count C={lat.shape[1]} differs from condition_latents[0]'s C={channels}")

        # audio condition rows
        for i, rows in enumerate(self.audio_condition_latents):
            name = f"audio_condition_latents[{i}]"
            check_tensor(name, rows, torch.float32)
            if rows.ndim != 2 or rows.shape[1] != facts.AUDIO_LATENT_CHANNELS:
                raise fail(name, f"must have shape [2*T, {facts.AUDIO_LATENT_CHANNELS}], got {shape(rows)}")
            if rows.shape[0] == 0 or rows.shape[0] % facts.AUDIO_CHANNELS:
                raise fail(name, f"row count must be even and positive (2 stereo channels x T), got {rows.shape[0]}")
            t = rows.shape[0] // facts.AUDIO_CHANNELS
            if self.guides:  # a guide's audio is cut to what the output leaves (from 1 latent) and to 15 s
                if not 1 <= t <= MAX_AUDIO_LATENTS:
                    raise fail(name, f"a guide's audio has 1-{MAX_AUDIO_LATENTS} latents, got {t}")
            elif not MIN_AUDIO_LATENTS <= t <= MAX_AUDIO_LATENTS:
                raise fail(name, f"clip must be {MIN_AUDIO_LATENTS}-{MAX_AUDIO_LATENTS} latents "
                                 f"({facts.MIN_AUDIO_CLIP_S:g}-{facts.MAX_AUDIO_CLIP_S:g} s "
                                 f"at {facts.AUDIO_LATENTS_PER_SECOND}/s), "
                                 f"got {t}")

        for i, anchor in enumerate(self.keyframe_anchors):
            if anchor not in ("first", "last"):
                raise fail("keyframe_anchors", f"entry {i} must be 'first' or 'last', got {anchor!r:.60}")

        getattr(self, f"_validate_{self.task}")()

        # The whole presentation: text and the vision blocks of this task's keyframes and references (after the task's
        # own checks, so the references it counts are valid).
        most = wire.max_prompt_rows([r.kind for r in self.references], len(self.keyframe_anchors), nf)
        if pe.shape[1] > most:
            raise fail("prompt_embeds", f"has {pe.shape[1]} rows (tokens), more than the encoder makes for this "
                                        f"{self.task} conditioning (at most {most}: {facts.MAX_TEXT_TOKENS} of text "
                                        f"for a prompt of up to {facts.MAX_PROMPT_CHARS} characters, plus its vision "
                                        "blocks)")

    def _validate_t2va(self) -> None:
        for name in ("condition_latents", "audio_condition_latents", "keyframe_anchors", "references", "guides"):
            n = len(getattr(self, name))
            if n:
                raise fail(name, f"t2va carries text only, got {n} entr{'y' if n == 1 else 'ies'}")

    def _validate_fl2va(self) -> None:
        if self.references:
            raise fail("references", f"fl2va carries no references, got {len(self.references)}")
        if self.guides:
            self._validate_guides()
        elif self.audio_condition_latents:
            raise fail("audio_condition_latents",
                       f"fl2va carries no audio conditions without guides, got {len(self.audio_condition_latents)}")
        n = len(self.condition_latents) - sum(g.video for g in self.guides)
        if not (1 if not self.guides else 0) <= n <= 2:
            raise fail("condition_latents", f"fl2va needs 1-2 keyframe latents (or a guide), got {n}")
        if self.keyframe_anchors not in KEYFRAME_ANCHOR_SETS + ((),) or not (self.keyframe_anchors or self.guides):
            raise fail("keyframe_anchors", f"must be one of {KEYFRAME_ANCHOR_SETS}, got {self.keyframe_anchors}")
        if len(self.keyframe_anchors) != n:
            raise fail("keyframe_anchors", f"needs one anchor per keyframe latent ({n}), got "
                                           f"{len(self.keyframe_anchors)}")
        expected = (1, self.latent_height, self.latent_width)
        for i, lat in enumerate(self.condition_latents[:n]):
            if shape(lat)[2:] != expected:
                raise fail(f"condition_latents[{i}]", f"a keyframe latent must be [1, C, 1, H/16, W/16] = "
                                                      f"[1, C, {expected[0]}, {expected[1]}, {expected[2]}], "
                                                      f"got {shape(lat)}")

    def _validate_guides(self) -> None:
        """Guides (fl2va): counts match the latents after the keyframes', each fits the output (`guides.fit_error`)."""
        if len(self.guides) > facts.MAX_GUIDES:
            raise fail("guides", f"at most {facts.MAX_GUIDES} guides, got {len(self.guides)}")
        video = [g for g in self.guides if g.video]
        audio = [g for g in self.guides if g.audio]
        if len(video) > len(self.condition_latents):
            raise fail("condition_latents", f"{len(video)} guides anchor video but only "
                                            f"{len(self.condition_latents)} condition latents are given")
        if len(audio) != len(self.audio_condition_latents):
            raise fail("audio_condition_latents", f"needs one audio condition per guide with audio ({len(audio)}), "
                                                  f"got {len(self.audio_condition_latents)}")
        first_guide = len(self.condition_latents) - len(video)
        latents = iter(self.condition_latents[first_guide:])
        rows = iter(self.audio_condition_latents)
        for i, guide in enumerate(self.guides):
            frames = 0
            if guide.video:
                lat = next(latents)
                name = f"condition_latents[{first_guide + sum(g.video for g in self.guides[:i])}]"
                if shape(lat)[3:] != (self.latent_height, self.latent_width):
                    raise fail(name, f"a guide latent lies on the output canvas [.., {self.latent_height}, "
                                     f"{self.latent_width}], got {shape(lat)}")
                frames = guide_rules.frames_of_latent_t(lat.shape[2])
                if frames is None:
                    raise fail(name, f"a guide latent has T = 1 (an image) or 5n+2 (a 17n+5-frame clip), got "
                                     f"T={lat.shape[2]}")
            problem = guide_rules.fit_error(guide.frame, frames, self.num_frames, audio=guide.audio)
            if problem:
                raise fail(f"guides[{i}]", problem)
            if guide.audio:
                t = next(rows).shape[0] // facts.AUDIO_CHANNELS
                cap = guide_rules.audio_latent_cap(guide.frame, self.num_frames)
                if t > cap:
                    raise fail(f"guides[{i}]", f"its audio has {t} latents, more than the {cap} the output leaves "
                                               f"after frame {guide.frame}")

    def _validate_ref2va(self) -> None:
        if self.guides:
            raise fail("guides", "ref2va carries no guides (guides at any frame need task fl2va)")
        if self.keyframe_anchors:
            raise fail("keyframe_anchors", f"ref2va carries no keyframes, got {self.keyframe_anchors}")
        kinds = [r.kind for r in self.references]
        try:  # the request rules own the count limits; the contract only re-labels the error
            rules.check_reference_counts(kinds.count("image"), kinds.count("video"), kinds.count("audio"))
        except rules.H3InputError as error:
            raise fail("references", str(error)) from None

        visual = [r for r in self.references if r.kind != "audio"]
        if len(self.condition_latents) != len(visual):
            raise fail("condition_latents", f"needs one latent per image/video reference ({len(visual)}), "
                                            f"got {len(self.condition_latents)}")
        for i, (ref, lat) in enumerate(zip(visual, self.condition_latents, strict=False)):
            t = lat.shape[2]
            if ref.kind == "image" and t != 1:
                raise fail(f"condition_latents[{i}]", f"an image reference latent has T=1, got T={t}")
            if ref.kind == "video" and (t - 2) % facts.LATENTS_PER_CLIP:
                raise fail(f"condition_latents[{i}]", f"a video reference latent has T of the form 5n+2, got T={t}")
            if ref.kind == "video":
                # A reference video is cut to the output's length and lies on a canvas H3's canvas rule makes (at
                # most the trained size, whatever the output's canvas).
                if t > self.latent_t:
                    raise fail(f"condition_latents[{i}]", f"a video reference latent has at most the output's "
                                                          f"T={self.latent_t} ({self.num_frames} frames), got T={t}")
                px_h, px_w = lat.shape[3] * facts.VAE_SPATIAL_FACTOR, lat.shape[4] * facts.VAE_SPATIAL_FACTOR
                if rules.canvas_trained_warning(px_w, px_h):
                    raise fail(f"condition_latents[{i}]", f"a video reference latent lies on a canvas of H3's canvas "
                                                          f"rule (at most {facts.TRAINED_CANVAS_EDGE} px a side and "
                                                          f"{facts.TRAINED_CANVAS_PIXELS} pixels), got "
                                                          f"{lat.shape[3]}x{lat.shape[4]} latents ({px_w}x{px_h} px)")

        audio_refs = [r for r in self.references if r.has_audio]
        if len(self.audio_condition_latents) != len(audio_refs):
            raise fail("audio_condition_latents", f"needs one audio condition per reference with audio "
                                                  f"({len(audio_refs)}), got {len(self.audio_condition_latents)}")
        totals = [0, 0]  # embedded soundtracks, standalone audios
        for ref, rows in zip(audio_refs, self.audio_condition_latents, strict=False):
            totals[ref.kind != "video"] += rows.shape[0] // facts.AUDIO_CHANNELS
        for (label, budget), total in zip(AUDIO_BUDGETS, totals, strict=False):
            if total > budget:
                raise fail("audio_condition_latents", f"{label} total {total} latents, over the separate "
                                                      f"{budget}-latent "
                                                      f"({budget / facts.AUDIO_LATENTS_PER_SECOND:g} s) budget")

    # ---- derived values -------------------------------------------------------------------------
    @property
    def latent_t(self) -> int:
        """Target video latent frames, `5n + 2`."""
        return facts.video_latent_frames(self.num_frames)

    @property
    def audio_t(self) -> int:
        """Target audio latents per channel, `round(num_frames / 24 * 40)`."""
        return facts.audio_latent_frames(self.num_frames)

    @property
    def latent_height(self) -> int:
        return self.height // facts.VAE_SPATIAL_FACTOR

    @property
    def latent_width(self) -> int:
        return self.width // facts.VAE_SPATIAL_FACTOR

    @property
    def duration_s(self) -> float:
        return self.num_frames / facts.FPS

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
            raise fail("prompt_embeds", f"width D={self.text_dim} does not match the model's text_dim {text_dim}")
        if latent_channels is not None:
            for i, lat in enumerate(self.condition_latents):
                if lat.shape[1] != latent_channels:
                    raise fail(f"condition_latents[{i}]", f"C={lat.shape[1]} does not match the model's "
                                                          f"latent channels {latent_channels}")
        wrong_audio_width = audio_channels is not None and audio_channels != facts.AUDIO_LATENT_CHANNELS
        if wrong_audio_width and self.audio_condition_latents:
            raise fail("audio_condition_latents", f"width {facts.AUDIO_LATENT_CHANNELS} does not match the model's "
                                                  f"audio channels {audio_channels}")

    # ---- equality / repr --------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, H3Conditioning):
            return NotImplemented
        if (self.task, self.height, self.width, self.num_frames, self.keyframe_anchors, self.references,
                self.guides, dict(self.metadata)) != (other.task, other.height, other.width, other.num_frames,
                                                      other.keyframe_anchors, other.references, other.guides,
                                                      dict(other.metadata)):
            return False
        if len(self.condition_latents) != len(other.condition_latents) or \
                len(self.audio_condition_latents) != len(other.audio_condition_latents):
            return False
        pairs = [(self.prompt_embeds, other.prompt_embeds), (self.text_token_tags, other.text_token_tags)]
        pairs += list(zip(self.condition_latents, other.condition_latents, strict=False))
        pairs += list(zip(self.audio_condition_latents, other.audio_condition_latents, strict=False))
        return all(_bit_equal(a, b) for a, b in pairs)

    __hash__ = None  # tensors are mutable; use fingerprint() as a cache key

    def __repr__(self) -> str:
        cond = ", ".join(str(shape(t)) for t in self.condition_latents)
        audio = ", ".join(str(shape(t)) for t in self.audio_condition_latents)
        refs = ", ".join(f"{r.kind}{'+audio' if r.has_audio and r.kind == 'video' else ''}" for r in self.references)
        return (f"H3Conditioning(task={self.task!r}, {self.width}x{self.height}, num_frames={self.num_frames}, "
                f"prompt_embeds={shape(self.prompt_embeds)} {self.prompt_embeds.dtype}, "
                f"condition_latents=[{cond}], audio_condition_latents=[{audio}], "
                f"keyframe_anchors={self.keyframe_anchors}, references=[{refs}], metadata={dict(self.metadata)}"
                + (f", guides={[(g.frame, g.video, g.audio) for g in self.guides]}" if self.guides else "") + ")")

    # ---- the outside forms: one-line delegates to the codec modules --------------------------------
    def to_bytes(self) -> bytes:
        """One safetensors byte string (see `h3_core.contract.wire`). Deterministic for equal contents."""
        return wire.to_bytes(self)

    def to_wire(self) -> wire.Encoded:
        """The same bytes, not joined: the header, then each tensor's storage as it is (for sockets and files)."""
        return wire.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> H3Conditioning:
        """Parse and validate `to_bytes()` output (copied first); any defect raises `ContractError`; never
        unpickles."""
        return wire.from_bytes(cls, data)

    @classmethod
    def from_buffer(cls, buf, receiving: wire.Receiving | None = None) -> H3Conditioning:
        """`from_bytes` without the copy: the tensors are views of `buf` (a bytearray or `wire.new_buffer`), which
        the caller hands over (checked on arrival already if `receiving` filled it)."""
        return wire.from_buffer(cls, buf, receiving)

    def save(self, path) -> None:
        """Write the wire form to `path` atomically."""
        files.save(self, path)

    @classmethod
    def load(cls, path, *, mmap: bool | None = None) -> H3Conditioning:
        """Read and validate a file written by `save`: the header is checked before the data is read into memory
        (never memory-mapped: the file may be replaced under the reader), then the data after reading."""
        return files.load(cls, path, mmap=mmap)

    def fingerprint(self) -> str:
        """sha256 (hex) of the canonical serialised bytes: a content cache key."""
        return wire.fingerprint(self)

    def to_comfy(self) -> list:
        """ComfyUI core's H3 CONDITIONING `[[prompt_embeds, extras]]` (see `h3_core.contract.comfy`)."""
        return comfy.encode(self)

    @classmethod
    def from_comfy(cls, conditioning: Sequence, **kw: Any) -> H3Conditioning:
        """Read ComfyUI core's H3 CONDITIONING (keywords: task, height, width, num_frames, metadata)."""
        return comfy.decode(cls, conditioning, **kw)

    @classmethod
    def read_comfy(cls, conditioning: Sequence) -> H3Conditioning:
        """What an H3 CONDITIONING holds after core's conditioning nodes edited it: their edits honoured, or
        `RefusedEdit` naming the node (see `h3_core.contract.comfy_edits`)."""
        return comfy_edits.read(cls, conditioning)

    def to_vllm(self, **kw: Any) -> dict[str, Any]:
        """vLLM-Omni's unified stage-0 payload (see `h3_core.contract.vllm`)."""
        return vllm.encode(self, **kw)

    @classmethod
    def from_vllm(cls, payload: Mapping[str, Any], **kw: Any) -> H3Conditioning:
        """Read vLLM-Omni's unified stage-0 payload (keyword: metadata)."""
        return vllm.decode(cls, payload, **kw)
