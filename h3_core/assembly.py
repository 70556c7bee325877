"""Encoding one request in parts, one encoder at a time, as the ComfyUI graph does.

The graph has a node per encoder (Text Encode -> Video VAE Encode -> Audio VAE Encode), each
adding its part to the conditioning that flows between them. `EncodingParts` is that partial
state; `complete()` turns it into the validated `H3Conditioning` and names the node that is
missing when a part is. The parts are produced by the very `EncoderStage` methods that
`EncoderStage.encode` runs, so a graph's result is bit-identical to `h3_core`'s encoder stage.

In ComfyUI the parts ride in core's CONDITIONING form (`to_core` / `from_core`): `cross_attn` +
`minimax_token_tags`, plus our `minimax_h3_parts` key that core ignores. Once complete, core's own
`minimax_keyframes` / `minimax_refs` keys are added too, so core H3 nodes can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .contract import H3Conditioning
from .encoder import EncoderStage, Prepared, assemble, prepare
from .request import EncodeRequest

PARTS_KEY = "minimax_h3_parts"


class IncompleteConditioning(ValueError):
    """A part the request needs was never encoded (a node is missing from the graph)."""


@dataclass(frozen=True)
class EncodingParts:
    prepared: Prepared  # the request after media normalisation: task, canvas, frames, media
    pipeline_config: dict
    prompt_embeds: torch.Tensor | None = None
    text_token_tags: torch.Tensor | None = None
    condition_latents: tuple[torch.Tensor, ...] | None = None  # None: video VAE not run yet
    audio_condition_latents: tuple[torch.Tensor, ...] | None = None  # None: audio VAE not run yet
    metadata: dict = field(default_factory=dict)

    @property
    def missing(self) -> list[str]:
        """The encoders this request still needs, as the node a user would add."""
        needs = []
        if self.prompt_embeds is None:
            needs.append("text (H3 Text Encode)")
        if self.condition_latents is None and self.prepared.needs_video_vae:
            needs.append("video VAE (H3 Video VAE Encode)")
        if self.audio_condition_latents is None and self.prepared.needs_audio_vae:
            needs.append("audio VAE (H3 Audio VAE Encode)")
        return needs

    @property
    def is_complete(self) -> bool:
        return not self.missing

    def complete(self) -> H3Conditioning:
        if self.missing:
            raise IncompleteConditioning(
                f"this {self.prepared.task} conditioning still needs the {' and the '.join(self.missing)} "
                "encoder: add that node between the text encoder and the sampler"
            )
        return assemble(
            self.prepared,
            self.prompt_embeds,
            self.text_token_tags,
            list(self.condition_latents or ()),
            list(self.audio_condition_latents or ()),
            metadata=self.metadata,
        )


def start(request: EncodeRequest, pipeline_config: dict) -> EncodingParts:
    """Validate and normalise a request (no model needed); every encoder part starts from this."""
    return EncodingParts(prepared=prepare(request, pipeline_config), pipeline_config=dict(pipeline_config))


def add_text(parts: EncodingParts, stage: EncoderStage) -> EncodingParts:
    prompt_embeds, tags = stage.encode_text(parts.prepared)
    metadata = {**parts.metadata, "text_model": stage.fingerprint} if stage.fingerprint else parts.metadata
    return replace(parts, prompt_embeds=prompt_embeds, text_token_tags=tags, metadata=metadata)


def add_video(parts: EncodingParts, stage: EncoderStage) -> EncodingParts:
    return replace(parts, condition_latents=tuple(stage.encode_video(parts.prepared)))


def add_audio(parts: EncodingParts, stage: EncoderStage) -> EncodingParts:
    return replace(parts, audio_condition_latents=tuple(stage.encode_audio(parts.prepared)))


# --- ComfyUI core CONDITIONING form (plain lists and dicts: no ComfyUI import) -------------------


def to_core(parts: EncodingParts) -> list:
    """`[[cross_attn, extras]]`; core's keyframe/reference keys are added once the parts are complete."""
    if parts.prompt_embeds is None:
        raise IncompleteConditioning("the text encoder part comes first: a conditioning starts at H3 Text Encode")
    extras = {"minimax_token_tags": parts.text_token_tags, PARTS_KEY: parts}
    if parts.is_complete:
        core = parts.complete().to_comfy()
        extras = {**core[0][1], **extras}
    return [[parts.prompt_embeds, extras]]


def from_core(conditioning) -> EncodingParts | None:
    """The parts a conditioning carries, or None when it came from elsewhere (core, a file)."""
    if not isinstance(conditioning, list) or not conditioning:
        return None
    entry = conditioning[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], dict):
        return None
    parts = entry[1].get(PARTS_KEY)
    return parts if isinstance(parts, EncodingParts) else None


def conditioning_from_core(conditioning) -> H3Conditioning:
    """Whatever H3 CONDITIONING reaches the sampler, as the validated contract."""
    parts = from_core(conditioning)
    if parts is not None:
        return parts.complete()
    return H3Conditioning.from_comfy(conditioning)
