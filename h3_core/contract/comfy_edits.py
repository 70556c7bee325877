"""What ComfyUI core's conditioning nodes did to an H3 CONDITIONING: honoured, or refused naming the node.

The Sampler and Save Conditioning read the contract from what the CONDITIONING holds (`read`), so an edit made
by another node is what samples. Core's nodes change a CONDITIONING in ways that can be seen afterwards:

- ConditioningZeroOut zeroes `cross_attn` (and `pooled_output`), keeps the tags and media: honoured, the prompt
  embeddings are zero, as core's own H3 model then sees them.
- ConditioningAverage leaves s·to + (1−s)·from (cut or zero-padded to `to`'s length) with `to`'s tags and media,
  and averages `pooled_output` alike: honoured when both inputs were encoded from the same media; refused when the
  media differ (the averaged prompt would describe media the DiT never sees).
- ConditioningCombine makes a list of two entries: refused, an H3 job samples one prompt.
- ConditioningConcat leaves `cross_attn` longer than its token tags: refused, the appended tokens have no tag (text
  or vision).
- ConditioningSetTimestepRange adds `start_percent` / `end_percent`: honoured for the full range 0-1; part of the
  schedule would need a second conditioning for the rest (Combine), so it is refused.
- ConditioningSetArea* / SetMask add `area` / `mask`: refused, H3 has no regional prompts.

The media check rests on `pooled_output` carrying `comfy.media_signature` (see comfy.py): core averages it with the
same weights as the prompt and zeroes it with it, so it stays a multiple k ∈ [0, 1] of the signature of the media
the CONDITIONING holds exactly when every averaged input was made from those media.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .comfy import COMFY_PACK_KEY, MEDIA_SIGNATURE_KEY, media_signature

SIGNATURE_TOLERANCE = 1e-4  # relative, on the ratio pooled / signature (float32 products of weights in 0..1)


class RefusedEdit(ValueError):
    """A core conditioning node changed an H3 CONDITIONING in a way one H3 job cannot honour."""


def read(cls, conditioning: Sequence):
    """The `H3Conditioning` a (possibly edited) CONDITIONING holds; `RefusedEdit` naming the node that made it
    meaningless, `ContractError` for anything else that is not an H3 conditioning."""
    if isinstance(conditioning, (list, tuple)) and len(conditioning) > 1:
        raise RefusedEdit(
            f"this CONDITIONING holds {len(conditioning)} prompts (ConditioningCombine joins conditionings into a "
            "list); an H3 job samples one prompt: write everything into one MiniMax H3 Text Encode prompt, or "
            "sample each conditioning with its own MiniMax H3 Sampler"
        )
    entry = conditioning[0] if isinstance(conditioning, (list, tuple)) and conditioning else None
    extras = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 else None
    if isinstance(extras, Mapping):
        _check_timestep_range(extras)
        _check_regional(extras)
        _check_token_count(entry[0], extras)
    cond = cls.from_comfy(conditioning)
    if isinstance(extras, Mapping) and COMFY_PACK_KEY in extras:
        _check_media(cond, extras.get(MEDIA_SIGNATURE_KEY))
    return cond


def _check_timestep_range(extras: Mapping) -> None:
    start, end = extras.get("start_percent", 0.0), extras.get("end_percent", 1.0)
    if start > 0.0 or end < 1.0:
        raise RefusedEdit(
            f"ConditioningSetTimestepRange limited this H3 conditioning to {start:g}-{end:g} of the schedule; the H3 "
            "Sampler conditions every step on one conditioning: remove ConditioningSetTimestepRange (or set start "
            "0.0 and end 1.0)"
        )


def _check_regional(extras: Mapping) -> None:
    for key, node in (("area", "ConditioningSetArea"), ("mask", "ConditioningSetMask")):
        if extras.get(key) is not None:
            raise RefusedEdit(
                f"{node} gave this H3 conditioning a regional {key}; H3 conditions the whole video on one prompt: "
                f"remove {node}"
            )


def _check_token_count(cross_attn, extras: Mapping) -> None:
    tags = extras.get("minimax_token_tags")
    if not (isinstance(cross_attn, torch.Tensor) and isinstance(tags, torch.Tensor) and cross_attn.ndim == 3):
        return  # the contract's own checks name what is wrong
    extra = int(cross_attn.shape[1]) - int(tags.shape[-1])
    if extra > 0:
        raise RefusedEdit(
            f"ConditioningConcat appended {extra} token embeddings to this H3 prompt of {int(tags.shape[-1])} "
            "tokens; H3 needs each token's tag (text or vision) and the appended ones have none: write both texts "
            "into one MiniMax H3 Text Encode prompt"
        )


def _check_media(cond, pooled) -> None:
    if not isinstance(pooled, torch.Tensor):
        return  # written by an older pack or core's own nodes: nothing to compare with
    expected = media_signature(cond)
    if pooled.shape != expected.shape:
        raise RefusedEdit(
            f"pooled_output is {tuple(pooled.shape)}, not the pack's media signature {tuple(expected.shape)}: "
            "ConditioningAverage mixed this H3 conditioning with another model's conditioning; average only H3 "
            "conditionings"
        )
    ratio = pooled.float() / expected
    k = float(ratio[0, 0])
    if -SIGNATURE_TOLERANCE <= k <= 1 + SIGNATURE_TOLERANCE and torch.allclose(
        ratio, torch.full_like(ratio, k), rtol=0, atol=SIGNATURE_TOLERANCE
    ):
        return
    raise RefusedEdit(
        "ConditioningAverage mixed this H3 conditioning with one encoded from other media (reference images, "
        "videos, audios or keyframes); the averaged prompt would describe media the DiT does not see: average only "
        "conditionings encoded from the same media in the same order, or remove ConditioningAverage"
    )
