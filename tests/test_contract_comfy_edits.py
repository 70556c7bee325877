"""What core's conditioning nodes leave in an H3 CONDITIONING is read as they mean it, or refused by name.

The edits below are the operations ComfyUI core's nodes perform on the list form (comfy_extras/nodes_*.py and
nodes.py, 0.3.75): the same tensor arithmetic on the same keys. tests/test_core_conditioning_comfyui.py runs the
real nodes inside a real ComfyUI.
"""

import pytest
import torch
from support.contract_cases import make

from h3_core.contract import H3Conditioning, RefusedEdit


def zero_out(cond):  # ConditioningZeroOut
    return [[torch.zeros_like(c), {**d, "pooled_output": torch.zeros_like(d["pooled_output"])}] for c, d in cond]


def average(to, frm, strength):  # ConditioningAverage (conditioning_to_strength)
    t1, t0 = to[0][0], frm[0][0][:, : to[0][0].shape[1]]
    if t0.shape[1] < t1.shape[1]:
        t0 = torch.cat([t0, torch.zeros((1, t1.shape[1] - t0.shape[1], t1.shape[2]))], dim=1)
    extras = dict(to[0][1])
    extras["pooled_output"] = extras["pooled_output"] * strength + frm[0][1]["pooled_output"] * (1.0 - strength)
    return [[t1 * strength + t0 * (1.0 - strength), extras]]


def test_unedited_reads_back_exactly():
    c = make("ref2va_video")
    assert H3Conditioning.read_comfy(c.to_comfy()) == c


def test_zero_out_is_honoured():
    c = make("fl2va_both")
    read = H3Conditioning.read_comfy(zero_out(c.to_comfy()))
    assert torch.count_nonzero(read.prompt_embeds) == 0
    assert read.condition_latents == c.condition_latents and read.keyframe_anchors == c.keyframe_anchors


def test_average_over_the_same_media_is_honoured():
    a = make("ref2va")
    b = make("ref2va", prompt_embeds=torch.randn(1, 43, 64))  # another prompt, the same media
    read = H3Conditioning.read_comfy(average(a.to_comfy(), b.to_comfy(), 0.25))
    assert torch.allclose(read.prompt_embeds, a.prompt_embeds * 0.25 + b.prompt_embeds * 0.75)
    # a zeroed conditioning of the same media scales the prompt
    read = H3Conditioning.read_comfy(average(a.to_comfy(), zero_out(b.to_comfy()), 0.5))
    assert torch.allclose(read.prompt_embeds, a.prompt_embeds * 0.5)


@pytest.mark.parametrize("strength", [0.0, 0.5, 0.999])
def test_average_over_other_media_is_refused(strength):
    a, other = make("ref2va"), make("ref2va_video")
    with pytest.raises(RefusedEdit, match="ConditioningAverage mixed this H3 conditioning with one encoded from"):
        H3Conditioning.read_comfy(average(a.to_comfy(), other.to_comfy(), strength))
    assert H3Conditioning.read_comfy(average(a.to_comfy(), other.to_comfy(), 1.0)) == a  # weight 1: `to` alone


def test_combine_concat_and_ranges_are_refused_by_name():
    a, b = make("t2va").to_comfy(), make("t2va", prompt_embeds=torch.randn(1, 24, 64)).to_comfy()
    with pytest.raises(RefusedEdit, match="2 prompts \\(ConditioningCombine"):
        H3Conditioning.read_comfy(a + b)
    concat = [[torch.cat((a[0][0], b[0][0]), 1), dict(a[0][1])]]
    with pytest.raises(RefusedEdit, match="ConditioningConcat appended 24 token embeddings"):
        H3Conditioning.read_comfy(concat)
    ranged = [[a[0][0], {**a[0][1], "start_percent": 0.5, "end_percent": 1.0}]]
    with pytest.raises(RefusedEdit, match="ConditioningSetTimestepRange limited this H3 conditioning to 0.5-1"):
        H3Conditioning.read_comfy(ranged)
    full = [[a[0][0], {**a[0][1], "start_percent": 0.0, "end_percent": 1.0}]]
    assert H3Conditioning.read_comfy(full) == make("t2va")


def test_conditioning_without_a_signature_reads_as_before():
    """Core's own H3 nodes leave pooled_output None; such a CONDITIONING is read without the media check."""
    core = make("ref2va").to_comfy()
    core[0][1]["pooled_output"] = None
    assert H3Conditioning.read_comfy(core) == make("ref2va")
