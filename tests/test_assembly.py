"""Encoding in parts (the ComfyUI graph's way) equals the encoder stage's one call, bit for bit."""

import pytest
import torch

from h3_core import assembly
from h3_core.contract import H3Conditioning
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.testing import CASES


@pytest.fixture(scope="module", autouse=True)
def _parity_threads(parity_threads):
    """Bitwise comparisons: the thread count is pinned (conftest.parity_threads)."""


@pytest.fixture(scope="module")
def stages(tiny_dir):
    source = ModelSource.from_path(tiny_dir)
    full = EncoderStage(source)
    modules = {"text_encoder": full.text_encoder, "tokenizer": full.tokenizer, "processor": full.processor}
    text = EncoderStage(modules=modules, pipeline_config=source.pipeline_config, fingerprint=full.fingerprint)
    video = EncoderStage(modules={"vae": full.vae}, pipeline_config=source.pipeline_config)
    audio = EncoderStage(modules={"audio_vae": full.audio_vae}, pipeline_config=source.pipeline_config)
    return full, text, video, audio


def _same(a, b):
    assert a.task == b.task and (a.width, a.height, a.num_frames) == (b.width, b.height, b.num_frames)
    assert torch.equal(a.prompt_embeds, b.prompt_embeds) and torch.equal(a.text_token_tags, b.text_token_tags)
    assert len(a.condition_latents) == len(b.condition_latents)
    assert all(torch.equal(x, y) for x, y in zip(a.condition_latents, b.condition_latents))
    assert len(a.audio_condition_latents) == len(b.audio_condition_latents)
    assert all(torch.equal(x, y) for x, y in zip(a.audio_condition_latents, b.audio_condition_latents))
    assert a.references == b.references and a.keyframe_anchors == b.keyframe_anchors


@pytest.mark.parametrize("case", sorted(CASES))
def test_parts_equal_one_call(case, stages):
    full, text, video, audio = stages
    request = CASES[case][0]
    parts = assembly.start(request, full.pipeline_config)
    parts = assembly.add_text(parts, text)
    core = assembly.to_core(parts)
    parts = assembly.from_core(core)
    if parts is not None:
        parts = assembly.add_audio(assembly.add_video(parts, video), audio)
        core = assembly.to_core(parts)
    _same(assembly.conditioning_from_core(core), full.encode(request))


def test_missing_encoder_is_named(stages):
    full, text, _, _ = stages
    request = CASES["ref2va-image-video-audio-seed2"][0]
    parts = assembly.add_text(assembly.start(request, full.pipeline_config), text)
    with pytest.raises(assembly.IncompleteConditioning, match=r"video VAE \(MiniMax H3 Video VAE Encode\).*audio VAE"):
        assembly.conditioning_from_core(assembly.to_core(parts))


def test_stage_without_a_component_refuses_work_that_needs_it(stages):
    _, text, _, _ = stages
    from h3_core.encoder import StageError

    request = CASES["fl2va-first-last-seed1"][0]
    with pytest.raises(StageError, match="built without the video encoder"):
        text.encode(request)


def test_complete_core_form_carries_core_keys(stages):
    full, *_ = stages
    request = CASES["fl2va-first-last-seed1"][0]
    _, text, video, _ = stages
    parts = assembly.add_video(assembly.add_text(assembly.start(request, full.pipeline_config), text), video)
    extras = assembly.to_core(parts)[0][1]
    assert len(extras["minimax_keyframes"]) == 2 and extras["minimax_keyframes"][1]["resolved_frame_index"] == 123


def test_complete_conditioning_is_the_contract_alone(stages):
    """Once complete, the CONDITIONING is the contract's core form: no encode parts, no media ride on."""
    full, text, video, audio = stages
    request = CASES["ref2va-image-video-audio-seed2"][0]
    parts = assembly.add_text(assembly.start(request, full.pipeline_config), text)
    incomplete = assembly.to_core(parts)
    assert set(incomplete[0][1]) == {"minimax_token_tags", assembly.PARTS_KEY}
    held = assembly.from_core(incomplete).normalised
    normalised = held.prepared
    assert normalised is not None  # shared down the chain: the VAE nodes do not normalise again
    with_video = assembly.add_video(assembly.from_core(incomplete), video)
    assert with_video.media() is normalised
    complete = assembly.to_core(assembly.add_audio(with_video, audio))
    assert held.prepared is None  # released: the cached Text Encode output no longer holds the media
    cond = full.encode(request)
    assert set(complete[0][1]) == set(cond.to_comfy()[0][1])
    assert assembly.from_core(complete) is None
    # a VAE node running again from the cached, released chain normalises again and gets the same result
    again = assembly.to_core(assembly.add_audio(assembly.add_video(assembly.from_core(incomplete), video), audio))
    assert H3Conditioning.from_comfy(again) == H3Conditioning.from_comfy(complete)


def test_the_sampler_reads_what_the_conditioning_holds(stages):
    """An edit to the core keys is what the contract holds (no rebuild from encode parts)."""
    full, text, *_ = stages
    request = CASES["t2va-64x64-seed0"][0]
    core = assembly.to_core(assembly.add_text(assembly.start(request, full.pipeline_config), text))
    edited = [[torch.zeros_like(core[0][0]), dict(core[0][1])]]
    assert torch.count_nonzero(assembly.conditioning_from_core(edited).prompt_embeds) == 0
    assert torch.equal(assembly.conditioning_from_core(core).prompt_embeds, core[0][0])
