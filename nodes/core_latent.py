"""MiniMax H3 Empty Latent from Conditioning: the pack's stage 0 feeding core's own stage 1.

In ComfyUI cores with their own H3 (0.33+: `comfy_extras/nodes_minimax_h3.py`), the pack's complete CONDITIONING is
core's H3 CONDITIONING (`h3_core/contract/comfy.py`), so it samples with core's nodes: UNETLoader ->
ModelSamplingMiniMaxH3 -> KSampler / SamplerCustomAdvanced. Core's EmptyMiniMaxH3LatentAV asks for width, height
and length again; this node reads them from the conditioning (the canvas and frame count it was encoded for), so the
latent cannot disagree with the keyframe / reference latents inside it, and it refuses by name what core's sampler
would take silently and mean nothing by:

* a conditioning still missing an encoder part (Text Encode straight into core's sampler, without H3 Video / Audio
  VAE Encode): core ignores the pack's parts key and would sample with no references or keyframes;
* a conditioning core's conditioning nodes edited in a way the pack refuses (ConditioningCombine, Concat, ...);
* a CONDITIONING that carries no canvas (core's own MiniMax H3 nodes' or another model's): use core's
  EmptyMiniMaxH3LatentAV there.

Core's LATENT decodes with MiniMax H3 VAE Decode (the same NestedTensor pair the pack's Sampler outputs).
"""

from __future__ import annotations

import torch
from comfy_api.latest import io

from ..h3_core import assembly, facts
from ..h3_core.contract import COMFY_PACK_KEY
from . import comfy_bridge as bridge
from .types import LATENT_CATEGORY, Schema

CORE_EMPTY_LATENT = "Empty MiniMax H3 AV Latent (EmptyMiniMaxH3LatentAV)"


def _from_the_pack(conditioning) -> bool:
    """Whether some entry carries the pack's canvas (its key, complete) or its encoder parts (incomplete)."""
    if assembly.from_core(conditioning) is not None:
        return True
    try:
        return any(isinstance(extras, dict) and COMFY_PACK_KEY in extras for _, extras in conditioning)
    except (TypeError, ValueError):
        return False


def empty_latent(conditioning) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """(video [1, 24, T, H/16, W/16], audio [1, 32, 2, Ta], width, height, num_frames) for this conditioning, or an
    error naming what to do. Zeros, as core's EmptyMiniMaxH3LatentAV: the sampler replaces them with noise."""
    if not _from_the_pack(conditioning):
        raise ValueError(
            "this CONDITIONING does not say its canvas and length (it is not from the MiniMax H3 encode nodes, "
            f"Remote Encode or Load Conditioning): use core's {CORE_EMPTY_LATENT} with the width, height and length "
            "it was made for")
    cond = assembly.conditioning_from_core(conditioning)  # complete and valid, core nodes' edits judged by name
    video = torch.zeros(1, facts.VIDEO_LATENT_CHANNELS, cond.latent_t, cond.latent_height, cond.latent_width)
    audio = torch.zeros(1, facts.AUDIO_LATENT_CHANNELS, facts.AUDIO_CHANNELS, cond.audio_t)
    return video, audio, cond.width, cond.height, cond.num_frames


class EmptyLatentFromConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return Schema(
            node_id="H3SplitEmptyLatentFromConditioning",
            display_name="MiniMax H3 Empty Latent from Conditioning",
            category=LATENT_CATEGORY,
            description="The empty AV latent for sampling the pack's conditioning with core's own H3 nodes (ComfyUI "
            "0.33+: UNETLoader -> ModelSamplingMiniMaxH3 -> KSampler, cfg 1): canvas and length come from the "
            "conditioning, so they match its keyframes and references. Decode core's result with MiniMax H3 VAE "
            "Decode. Refuses a conditioning that is still missing an encoder node (core would sample it without its "
            "references).",
            inputs=[
                io.Conditioning.Input(
                    "conditioning", tooltip="From the MiniMax H3 encode nodes, Remote Encode or Load Conditioning."
                ),
            ],
            outputs=[
                io.Latent.Output(display_name="latent", tooltip="AV latent: video [1,24,T,H/16,W/16] + audio "
                                 "[1,32,2,Ta], zeros (the sampler adds the noise)."),
                io.Int.Output(display_name="width"),
                io.Int.Output(display_name="height"),
                io.Int.Output(display_name="length"),
            ],
        )

    @classmethod
    def execute(cls, conditioning) -> io.NodeOutput:
        video, audio, width, height, length = empty_latent(conditioning)
        return io.NodeOutput(bridge.av_latent(video, audio), width, height, length)


NODES = [EmptyLatentFromConditioning]
