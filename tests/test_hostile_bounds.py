"""The contract holds every conditioning to the largest one the encoder makes, wherever it comes from: a file, a wire
payload, a graph's CONDITIONING.

Before, a conditioning with a 512 x 512 reference latent (the encoder never makes one over 192 on its short side) or
a 100,000-token prompt loaded, and sized the sampler's work (2 steps of the tiny H3: 14 s -> 50 s). The bounds come
from facts (the reference image's 2048 px short edge, the 1:4..4:1 aspects, the VAE's /16, the request rules'
16,384-character prompt, Qwen3-VL's 262,144 positions) and are pinned here against diffusers and the configs.
"""

from __future__ import annotations

import pytest
import torch
from support.contract_cases import _retamper, make

from h3_core import configs, facts
from h3_core.contract import ContractError, H3Conditioning, files, wire
from h3_core.remote.protocol import Limits

D = 8  # a narrow text width keeps the long prompts small in memory; the bounds are on rows


def _image_ref2va(latent: torch.Tensor, rows: int = 43, image_rows: int = 8, **changes) -> H3Conditioning:
    tags = torch.ones(rows, dtype=torch.int64)
    tags[3:3 + image_rows] = 0
    return make("ref2va", condition_latents=[latent], prompt_embeds=torch.zeros(1, rows, 64),
                text_token_tags=tags, **changes)


def _t2va(rows: int, vision_rows: int = 0) -> H3Conditioning:
    tags = torch.ones(rows, dtype=torch.int64)
    tags[:vision_rows] = 0
    return make("t2va", prompt_embeds=torch.zeros(1, rows, D), text_token_tags=tags)


def _error(build) -> ContractError:
    with pytest.raises(ContractError) as info:
        build()
    return info.value


# --- the facts the bounds stand on ---------------------------------------------------------------------------------


def test_bounds_stand_on_pinned_facts():
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

    defaults = {spec.name: spec.default for spec in MiniMaxH3Ref2VASetupStep().expected_configs}
    assert defaults["reference_image_short_edge"] == facts.REFERENCE_IMAGE_SHORT_EDGE
    assert configs.RELEASE_PIPELINE_CONFIG["reference_image_short_edge"] == facts.REFERENCE_IMAGE_SHORT_EDGE
    assert configs.TINY_PIPELINE_CONFIG["reference_image_short_edge"] <= facts.REFERENCE_IMAGE_SHORT_EDGE
    text = configs.RELEASE_TEXT_ENCODER.get("text_config", configs.RELEASE_TEXT_ENCODER)
    assert text["max_position_embeddings"] == facts.TEXT_ENCODER_MAX_POSITIONS
    assert Limits().max_prompt_chars == facts.MAX_PROMPT_CHARS
    # short side: a keyframe on the largest canvas (4096x2304 px); long side: an image reference at 4:1 (8192 px)
    assert (wire.MAX_LATENT_SHORT_SIDE, wire.MAX_LATENT_LONG_SIDE, wire.MAX_LATENT_FRAMES) == (192, 512, 102)
    # the richest presentation (9 images, 3 videos of the longest output, the longest prompt) fits Qwen3-VL
    kinds = ["image"] * facts.MAX_REF_IMAGES + ["video"] * facts.MAX_REF_VIDEOS
    assert wire.max_prompt_rows(kinds, 0, facts.MAX_FRAMES) < facts.TEXT_ENCODER_MAX_POSITIONS


# --- reference latents ------------------------------------------------------------------------------------------------


def test_the_largest_image_reference_latent_loads_and_a_larger_one_is_refused():
    largest = _image_ref2va(torch.zeros(1, 24, 1, 128, 512))  # a 2048 x 8192 px image (4:1)
    assert H3Conditioning.from_bytes(largest.to_bytes()) == largest
    for h, w in ((512, 512), (194, 194), (128, 514), (2, 1024)):
        error = _error(lambda h=h, w=w: _image_ref2va(torch.zeros(1, 1, 1, h, w)))
        assert error.field == "condition_latents[0]", error
        assert "at most 192 on the short side and 512 on the long side" in str(error), error


def test_video_reference_latents_are_held_to_the_canvas_and_the_output_length():
    base = make("ref2va_video")
    image, video = base.condition_latents
    assert base.latent_t == 37
    for latent, fragment in ((torch.zeros(1, 24, 42, 4, 4), "at most the output's T=37"),
                             (torch.zeros(1, 24, 2, 128, 128), "lies on a canvas of H3's canvas rule"),
                             (torch.zeros(1, 24, 107, 2, 2), "over the 102 of the longest reference video")):
        error = _error(lambda latent=latent: make("ref2va_video", condition_latents=[image, latent]))
        assert error.field == "condition_latents[1]" and fragment in str(error), error


def test_latent_channels_and_text_width_are_capped():
    error = _error(lambda: _image_ref2va(torch.zeros(1, 200, 1, 2, 2)))
    assert error.field == "condition_latents[0]" and "C=200" in str(error)
    error = _error(lambda: make("t2va", prompt_embeds=torch.zeros(1, 2, 9000)))
    assert error.field == "prompt_embeds" and "D=9000" in str(error)


# --- prompt tokens ----------------------------------------------------------------------------------------------------


def test_a_100000_token_prompt_is_refused_and_the_longest_prompt_loads():
    error = _error(lambda: _t2va(100_000))
    assert error.field == "prompt_embeds" and "100000 text rows" in str(error) and "66560" in str(error), error
    # all rows tagged vision in a t2va: no vision block to hold them, the whole presentation is over its bound
    error = _error(lambda: _t2va(100_000, vision_rows=100_000))
    assert error.field == "prompt_embeds" and "at most 66560" in str(error), error
    error = _error(lambda: _t2va(300_000))
    assert error.field == "prompt_embeds" and "262144-token maximum sequence" in str(error), error
    longest = _t2va(facts.MAX_TEXT_TOKENS)
    assert H3Conditioning.from_bytes(longest.to_bytes()) == longest


def test_vision_rows_are_allowed_per_reference():
    # one image reference may bring 16,386 vision rows (a 2048 x 8192 px image and its start/end markers)
    rows = facts.MAX_TEXT_TOKENS + 16_386
    assert _image_ref2va(torch.zeros(1, 24, 1, 4, 6), rows=rows, image_rows=16_386).text_len == rows
    error = _error(lambda: _image_ref2va(torch.zeros(1, 24, 1, 4, 6), rows=rows + 1, image_rows=16_387))
    assert error.field == "prompt_embeds" and f"at most {rows}" in str(error), error


def test_reference_counts_are_bounded_on_load():
    tags = torch.ones(43, dtype=torch.int64)
    error = _error(lambda: make("ref2va", prompt_embeds=torch.zeros(1, 43, 64), text_token_tags=tags,
                                condition_latents=[torch.zeros(1, 24, 1, 4, 6)] * 10,
                                references=[("image", False)] * 10, audio_condition_latents=[]))
    assert error.field == "references" and "at most 9 image references" in str(error)


# --- on the wire and in files: refused from the tensor table, before the data is read ---------------------------------


def _payload_with(kind: str, name: str, tensor: torch.Tensor, **tensors) -> bytes:
    def edit(found):
        found[name] = tensor
        found.update(tensors)

    return _retamper(make(kind).to_bytes(), edit_tensors=edit)


@pytest.mark.parametrize("kind, name, tensor, extra, field", [
    ("ref2va", "condition_latents.0", torch.zeros(1, 24, 1, 512, 512), {}, "condition_latents[0]"),
    ("t2va", "prompt_embeds", torch.zeros(1, 100_000, D),
     {"text_token_tags": torch.ones(100_000, dtype=torch.int64)}, "prompt_embeds"),
    ("t2va", "prompt_embeds", torch.zeros(1, 300_000, 1),
     {"text_token_tags": torch.ones(300_000, dtype=torch.int64)}, "prompt_embeds"),
    ("ref2va", "audio_condition_latents.0", torch.zeros(2000, 32), {}, "audio_condition_latents[0]"),
])
def test_oversized_tensors_are_refused_before_their_data_is_read(tmp_path, monkeypatch, kind, name, tensor, extra,
                                                                 field):
    data = _payload_with(kind, name, tensor, **extra)
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(data)

    def no_read(*args, **kwargs):
        raise AssertionError("the data was read before the shapes were bounded")

    monkeypatch.setattr(files, "_read_data", no_read)
    for read in (lambda: H3Conditioning.load(path), lambda: H3Conditioning.from_bytes(data)):
        error = _error(read)
        assert error.field == field, error
        assert len(str(error)) < 600


# --- in the graph: a CONDITIONING edited in ComfyUI is held to the same bounds ----------------------------------------


def test_a_graph_conditioning_is_held_to_the_bounds():
    conditioning = make("ref2va").to_comfy()
    conditioning[0][1]["minimax_refs"][0]["latent"] = torch.zeros(1, 24, 1, 512, 512)
    conditioning[0][1]["minimax_refs"][0]["latent_h"] = conditioning[0][1]["minimax_refs"][0]["latent_w"] = 512
    error = _error(lambda: H3Conditioning.from_comfy(conditioning))
    assert error.field == "condition_latents[0]" and "at most 192 on the short side" in str(error), error

    long = _t2va(24).to_comfy()
    long[0][0] = torch.zeros(1, 100_000, D)
    long[0][1]["minimax_token_tags"] = torch.ones(100_000, dtype=torch.int64)
    error = _error(lambda: H3Conditioning.from_comfy(long))
    assert error.field == "prompt_embeds" and "100000 text rows" in str(error), error
