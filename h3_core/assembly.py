"""Encoding one request in parts, one encoder at a time, as the ComfyUI graph does.

The graph has a node per encoder (Text Encode -> Video VAE Encode -> Audio VAE Encode), each
adding its part to the conditioning that flows between them. `EncodingParts` is that partial
state; `complete()` turns it into the validated `H3Conditioning` and names the node that is
missing when a part is. The parts are produced by the very `EncoderStage` methods that
`EncoderStage.encode` runs, so a graph's result is bit-identical to `h3_core`'s encoder stage.

In ComfyUI the parts ride in core's CONDITIONING form (`to_core` / `from_core`): `cross_attn` +
`minimax_token_tags`, plus our `minimax_h3_parts` key, only while a part is missing. Once complete, the
CONDITIONING is the contract in core's form and nothing else (`H3Conditioning.to_comfy`: core's
`minimax_keyframes` / `minimax_refs`, the pack key and the media signature), so what samples is what the
CONDITIONING holds, after whatever core's nodes did to it (`conditioning_from_core`, stage-1 side, runs no
encoder code).

The request's normalised media (resized reference frames, resampled audio: at release size ~380 MB for one 5 s
reference video) are made once per chain and shared by its parts (`_Normalised`) until the chain completes; then
they are released, so no CONDITIONING in ComfyUI's cache keeps them alive. An encode node that runs again later
from a cached, released chain normalises again from the request (deterministic; the request's media are the media
node's own arrays, which ComfyUI caches anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .contract import H3Conditioning, H3Reference
from .encoder import EncoderStage, Prepared, assemble, prepare, references_table
from .request import EncodeRequest, NeedsEncoders

PARTS_KEY = "minimax_h3_parts"


class IncompleteConditioning(ValueError):
    """A part the request needs was never encoded (a node is missing from the graph)."""


@dataclass(frozen=True)
class Resolved(NeedsEncoders):
    """What media normalisation resolved for a request, without the media: all `complete()` needs."""

    task: str
    width: int
    height: int
    num_frames: int
    keyframe_anchors: tuple
    references: tuple[H3Reference, ...]
    encoders: tuple[str, ...]  # EncodeRequest.needed_encoders()
    guide_entries: tuple = ()  # contract H3Guide per guide (frame, video rows?, audio rows?)

    @classmethod
    def of(cls, prepared: Prepared) -> Resolved:
        return cls(prepared.task, prepared.width, prepared.height, prepared.num_frames,
                   tuple(prepared.keyframe_anchors), references_table(prepared), prepared.encoders,
                   prepared.guide_entries)


class _Normalised:
    """The normalised media of one encode chain, shared by all its parts; emptied when the chain completes."""

    __slots__ = ("prepared",)

    def __init__(self, prepared: Prepared | None = None):
        self.prepared = prepared


@dataclass(frozen=True)
class EncodingParts:
    request: EncodeRequest  # as the graph gave it: no copy of its media
    resolved: Resolved
    pipeline_config: dict
    prompt_embeds: torch.Tensor | None = None
    text_token_tags: torch.Tensor | None = None
    condition_latents: tuple[torch.Tensor, ...] | None = None  # None: video VAE not run yet
    audio_condition_latents: tuple[torch.Tensor, ...] | None = None  # None: audio VAE not run yet
    metadata: dict = field(default_factory=dict)
    normalised: _Normalised = field(default_factory=lambda: _Normalised(), compare=False, repr=False)

    def media(self) -> Prepared:
        """The request's media normalised as diffusers' `before_encode` does: the chain's, or made again when the
        chain already completed and released them."""
        if self.normalised.prepared is None:
            self.normalised.prepared = prepare(self.request, self.pipeline_config)
        return self.normalised.prepared

    @property
    def missing(self) -> list[str]:
        """The encoders this request still needs, as the node a user would add."""
        return missing_encoders(self)

    @property
    def is_complete(self) -> bool:
        return not self.missing

    def complete(self) -> H3Conditioning:
        if self.missing:
            raise IncompleteConditioning(incomplete_message(self))
        return assemble(
            self.resolved,  # assemble reads the canvas, anchors, guide entries and reference kinds only
            self.prompt_embeds,
            self.text_token_tags,
            list(self.condition_latents or ()),
            list(self.audio_condition_latents or ()),
            metadata=self.metadata,
        )


# Each encoder as the node a user adds to run it.
ENCODER_NODES = {"text": "text (MiniMax H3 Text Encode)", "video": "video VAE (MiniMax H3 Video VAE Encode)",
                 "audio": "audio VAE (MiniMax H3 Audio VAE Encode)"}


def missing_encoders(parts: EncodingParts) -> list[str]:
    """The encoders the request needs (`EncodeRequest.needed_encoders`) whose part is not encoded yet."""
    done = {"text": parts.prompt_embeds is not None, "video": parts.condition_latents is not None,
            "audio": parts.audio_condition_latents is not None}
    return [ENCODER_NODES[name] for name in parts.resolved.encoders if not done[name]]


def incomplete_message(parts: EncodingParts) -> str:
    return (f"this {parts.resolved.task} conditioning still needs the {' and the '.join(missing_encoders(parts))} "
            "encoder: add that node between the text encoder and the sampler")


def start(request: EncodeRequest, pipeline_config: dict) -> EncodingParts:
    """Validate and normalise a request (no model needed); every encoder part starts from this."""
    prepared = prepare(request, pipeline_config)
    return EncodingParts(request=request, resolved=Resolved.of(prepared), pipeline_config=dict(pipeline_config),
                         normalised=_Normalised(prepared))


def add_text(parts: EncodingParts, stage: EncoderStage) -> EncodingParts:
    prompt_embeds, tags = stage.encode_text(parts.media())
    metadata = {**parts.metadata, "text_model": stage.fingerprint} if stage.fingerprint else parts.metadata
    return replace(parts, prompt_embeds=prompt_embeds, text_token_tags=tags, metadata=metadata)


def add_video(parts: EncodingParts, stage: EncoderStage) -> EncodingParts:
    return replace(parts, condition_latents=tuple(stage.encode_video(parts.media())))


def add_audio(parts: EncodingParts, stage: EncoderStage) -> EncodingParts:
    return replace(parts, audio_condition_latents=tuple(stage.encode_audio(parts.media())))


# --- ComfyUI core CONDITIONING form (plain lists and dicts: no ComfyUI import) -------------------


def to_core(parts: EncodingParts) -> list:
    """Complete: the contract's core form, and nothing else (the chain's normalised media are released).
    Incomplete: `[[cross_attn, extras]]` with the parts for the next encode node."""
    if parts.prompt_embeds is None:
        raise IncompleteConditioning("the text encoder part comes first: a conditioning starts at "
                                     "MiniMax H3 Text Encode")
    if parts.is_complete:
        parts.normalised.prepared = None  # the chain is done: cached earlier outputs stop holding the media
        return parts.complete().to_comfy()
    return [[parts.prompt_embeds, {"minimax_token_tags": parts.text_token_tags, PARTS_KEY: parts}]]


def from_core(conditioning) -> EncodingParts | None:
    """The parts an incomplete conditioning carries, or None when it is complete or came from elsewhere."""
    if not isinstance(conditioning, list) or not conditioning:
        return None
    entry = conditioning[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], dict):
        return None
    parts = entry[1].get(PARTS_KEY)
    return parts if isinstance(parts, EncodingParts) else None


def is_untouched(conditioning, parts: EncodingParts) -> bool:
    """Whether an incomplete conditioning is exactly what `to_core` made: no other node edited it on the way."""
    if len(conditioning) != 1:
        return False
    cross_attn, extras = conditioning[0]
    return (cross_attn is parts.prompt_embeds and extras.get("minimax_token_tags") is parts.text_token_tags
            and set(extras) == {"minimax_token_tags", PARTS_KEY})


# --- stage 1 side: what the Sampler and Save Conditioning read ------------------------------------


def conditioning_from_core(conditioning) -> H3Conditioning:
    """Whatever H3 CONDITIONING reaches the sampler, as the validated contract: read from the core keys it holds,
    with core nodes' edits honoured or refused by name. Runs no encoder code."""
    parts = from_core(conditioning)
    if parts is not None:  # only an incomplete conditioning still carries parts
        raise IncompleteConditioning(incomplete_message(parts))
    return H3Conditioning.read_comfy(conditioning)
