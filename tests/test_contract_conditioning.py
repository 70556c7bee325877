"""Construction, validation (one test per rule), derived values, equality of `H3Conditioning`."""

import dataclasses

import pytest
import torch
from support.contract_cases import KINDS, D, _randn, _tags, make

from h3_core import facts
from h3_core.contract import (
    ContractError,
    H3Reference,
)

# --- construction happy paths -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_construct_each_task(kind):
    c = make(kind)
    assert c.task == kind.split("_")[0]
    assert isinstance(c.condition_latents, tuple) and isinstance(c.references, tuple)
    assert all(isinstance(r, H3Reference) for r in c.references)
    assert "H3Conditioning(" in repr(c)


def test_derived_properties():
    c = make("t2va")
    assert (c.latent_t, c.audio_t, c.latent_height, c.latent_width) == (37, 207, 4, 4)
    assert c.duration_s == pytest.approx(124 / 24)
    assert (c.text_len, c.text_dim, c.latent_channels) == (24, 64, None)
    assert make("fl2va").latent_channels == 24
    for frames, lat, aud in ((209, 62, 348), (345, 102, 575), (141, 42, 235)):
        c = make("t2va", num_frames=frames)
        assert (c.latent_t, c.audio_t) == (lat, aud)
    assert (facts.MIN_FRAMES, facts.MAX_FRAMES) == (5, 3592)  # ComfyUI core's lengths; H3 was trained on 124-345
    for frames, lat, aud in ((5, 2, 8), (481, 142, 802), (3592, 1057, 5987)):  # outside the trained range: valid
        c = make("t2va", num_frames=frames)
        assert (c.latent_t, c.audio_t) == (lat, aud)


def test_prompt_dtype_kept_not_cast():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        c = make("ref2va", prompt_dtype=dtype)
        assert c.prompt_embeds.dtype == dtype


def test_frozen_and_readonly_metadata():
    c = make("ref2va")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.task = "t2va"
    with pytest.raises(TypeError):
        c.metadata["x"] = "y"
    with pytest.raises(TypeError):
        hash(c)


def test_equality_is_bit_exact():
    a, b = make("ref2va_video"), make("ref2va_video")
    assert a == b
    lat = b.condition_latents[1].clone()
    lat.view(torch.int32)[0, 0, 0, 0, 0] ^= 1  # one ulp
    assert a != dataclasses.replace(b, condition_latents=(b.condition_latents[0], lat))
    assert a != dataclasses.replace(b, metadata={"k": "v"})
    zero = make("t2va", prompt_embeds=torch.zeros(1, 24, D))
    assert zero != make("t2va", prompt_embeds=-torch.zeros(1, 24, D))  # -0.0 differs bitwise


def test_separate_audio_budgets_accept_600_each():
    # 600 latents of embedded soundtrack AND 600 of standalone audio: separate budgets, so valid.
    video = _randn(1, 24, 7, 4, 4, seed=30)
    c = make("ref2va", condition_latents=[video, video],
             audio_condition_latents=[_randn(600, 32, seed=s) for s in range(4)],
             references=[("video", True), ("video", True), ("audio", True), ("audio", True)])
    assert len(c.audio_condition_latents) == 4


def test_reference_limits_accept_maximum():
    refs = [("image", False)] * 9 + [("video", False)] * 2 + [("audio", True)]
    lat_i, lat_v = _randn(1, 24, 1, 2, 2, seed=31), _randn(1, 24, 2, 2, 2, seed=32)
    c = make("ref2va", references=refs, condition_latents=[lat_i] * 9 + [lat_v] * 2,
             audio_condition_latents=[_randn(160, 32, seed=33)])
    assert len(c.references) == 12


def test_check_compatible():
    c = make("ref2va")
    c.check_compatible(text_dim=64, latent_channels=24, audio_channels=32)
    with pytest.raises(ContractError, match=r"prompt_embeds: width D=64 does not match the model's text_dim 5120"):
        c.check_compatible(text_dim=5120)
    with pytest.raises(ContractError, match=r"condition_latents\[0\]: C=24 .* latent channels 16"):
        c.check_compatible(latent_channels=16)
    with pytest.raises(ContractError, match="audio channels 16"):
        c.check_compatible(audio_channels=16)
    make("t2va").check_compatible(latent_channels=16)  # nothing to check


# --- one test per validation rule -----------------------------------------------------------------

_VIDEO = _randn(1, 24, 7, 4, 4, seed=40)
_IMAGE = _randn(1, 24, 1, 4, 6, seed=41)
_ROWS = _randn(240, 32, seed=42)
_KF = _randn(1, 24, 1, 4, 4, seed=43)
_BAD_TAGS = _tags(24)
_BAD_TAGS[2] = 2

VIOLATIONS = [
    # (id, kind, changes, field, fragment of the message)
    ("task", "t2va", dict(task="i2va"), "task", "must be one of"),
    ("height_multiple", "t2va", dict(height=48), "height", "multiple of 32"),
    ("width_multiple", "t2va", dict(width=100), "width", "multiple of 32"),
    ("height_type", "t2va", dict(height=64.0), "height", "positive int"),
    ("height_bool", "t2va", dict(height=True), "height", "positive int"),
    ("num_frames_form", "t2va", dict(num_frames=125), "num_frames", "17n+5"),
    ("num_frames_off_grid", "t2va", dict(num_frames=107 + 1), "num_frames", "17n+5"),
    ("num_frames_too_long", "t2va", dict(num_frames=3609), "num_frames", "[5, 3592]"),
    ("prompt_type", "t2va", dict(prompt_embeds=[[0.0]]), "prompt_embeds", "torch.Tensor"),
    ("prompt_rank", "t2va", dict(prompt_embeds=_randn(24, D)), "prompt_embeds", "[1, L, D]"),
    ("prompt_batch", "t2va", dict(prompt_embeds=_randn(2, 24, D)), "prompt_embeds", "[1, L, D]"),
    ("prompt_dtype", "t2va", dict(prompt_embeds=_randn(1, 24, D).double()), "prompt_embeds", "dtype"),
    ("tags_dtype", "t2va", dict(text_token_tags=_tags(24).int()), "text_token_tags", "int64"),
    ("tags_length", "t2va", dict(text_token_tags=_tags(23)), "text_token_tags", "[L] = [24]"),
    ("tags_values", "t2va", dict(text_token_tags=_BAD_TAGS), "text_token_tags", "0 (vision block) or 1"),
    ("latent_dtype", "fl2va", dict(condition_latents=[_KF.bfloat16()]), "condition_latents[0]", "float32"),
    ("latent_rank", "fl2va", dict(condition_latents=[_KF[:, :, 0]]), "condition_latents[0]", "[1, C, T, h, w]"),
    ("latent_type", "fl2va", dict(condition_latents=[_KF.numpy()]), "condition_latents[0]", "torch.Tensor"),
    ("latent_odd_w", "ref2va", dict(condition_latents=[_randn(1, 24, 1, 4, 5)]), "condition_latents[0]", "even"),
    ("latent_channels_differ", "ref2va_video",
     dict(condition_latents=[_IMAGE, _randn(1, 16, 7, 4, 4)]), "condition_latents[1]", "differs"),
    ("audio_dtype", "ref2va", dict(audio_condition_latents=[_ROWS.double()]), "audio_condition_latents[0]",
     "float32"),
    ("audio_width", "ref2va", dict(audio_condition_latents=[_randn(240, 16)]), "audio_condition_latents[0]",
     "[2*T, 32]"),
    ("audio_rows_odd", "ref2va", dict(audio_condition_latents=[_randn(241, 32)]), "audio_condition_latents[0]",
     "even"),
    ("audio_too_short", "ref2va", dict(audio_condition_latents=[_randn(158, 32)]), "audio_condition_latents[0]",
     "80-600 latents"),
    ("audio_too_long", "ref2va", dict(audio_condition_latents=[_randn(1202, 32)]), "audio_condition_latents[0]",
     "80-600 latents"),
    ("anchor_value", "fl2va", dict(keyframe_anchors=("middle",)), "keyframe_anchors", "'first' or 'last'"),
    ("t2va_latents", "t2va", dict(condition_latents=[_KF]), "condition_latents", "t2va carries text only"),
    ("t2va_audio", "t2va", dict(audio_condition_latents=[_ROWS]), "audio_condition_latents", "t2va carries"),
    ("t2va_anchors", "t2va", dict(keyframe_anchors=("first",)), "keyframe_anchors", "t2va carries"),
    ("t2va_references", "t2va", dict(references=[("image", False)]), "references", "t2va carries"),
    ("fl2va_no_keyframe", "fl2va", dict(condition_latents=[], keyframe_anchors=()), "condition_latents",
     "1-2 keyframe"),
    ("fl2va_three_keyframes", "fl2va", dict(condition_latents=[_KF] * 3, keyframe_anchors=("first", "last")),
     "condition_latents", "1-2 keyframe"),
    ("fl2va_anchor_order", "fl2va", dict(condition_latents=[_KF] * 2, keyframe_anchors=("last", "first")),
     "keyframe_anchors", "must be one of"),
    ("fl2va_anchor_count", "fl2va", dict(condition_latents=[_KF] * 2, keyframe_anchors=("first",)),
     "keyframe_anchors", "one anchor per keyframe"),
    ("fl2va_keyframe_size", "fl2va", dict(condition_latents=[_randn(1, 24, 1, 4, 6)]), "condition_latents[0]",
     "[1, C, 1, H/16, W/16]"),
    ("fl2va_keyframe_frames", "fl2va", dict(condition_latents=[_randn(1, 24, 2, 4, 4)]), "condition_latents[0]",
     "[1, C, 1, H/16, W/16]"),
    ("fl2va_audio", "fl2va", dict(audio_condition_latents=[_ROWS]), "audio_condition_latents", "fl2va carries"),
    ("fl2va_references", "fl2va", dict(references=[("image", False)]), "references", "fl2va carries"),
    ("ref2va_anchors", "ref2va", dict(keyframe_anchors=("first",)), "keyframe_anchors", "ref2va carries no"),
    ("ref2va_no_reference", "ref2va", dict(references=[], condition_latents=[], audio_condition_latents=[]),
     "references", "at least one image or video"),
    ("ref2va_audio_only", "ref2va", dict(references=[("audio", True)], condition_latents=[]), "references",
     "at least one image or video"),
    ("ref2va_ten_images", "ref2va", dict(references=[("image", False)] * 10, condition_latents=[],
                                         audio_condition_latents=[]), "references", "at most 9 image"),
    ("ref2va_four_videos", "ref2va", dict(references=[("video", False)] * 4, condition_latents=[],
                                          audio_condition_latents=[]), "references", "at most 3 video"),
    ("ref2va_four_audios", "ref2va", dict(references=[("image", False)] + [("audio", True)] * 4),
     "references", "at most 3 audio"),
    ("ref2va_thirteen", "ref2va", dict(references=[("image", False)] * 9 + [("video", False)] * 3
                                       + [("audio", True)]), "references", "at most 12 references in total"),
    ("ref2va_latent_count", "ref2va", dict(condition_latents=[]), "condition_latents", "one latent per image/video"),
    ("ref2va_image_frames", "ref2va", dict(condition_latents=[_randn(1, 24, 2, 4, 6)]), "condition_latents[0]",
     "T=1"),
    ("ref2va_video_frames", "ref2va_silent_video", dict(condition_latents=[_randn(1, 24, 6, 4, 4)]),
     "condition_latents[0]", "5n+2"),
    ("ref2va_audio_count", "ref2va", dict(audio_condition_latents=[]), "audio_condition_latents",
     "one audio condition per reference with audio"),
    ("ref2va_embedded_budget", "ref2va", dict(references=[("video", True)] * 2, condition_latents=[_VIDEO] * 2,
                                              audio_condition_latents=[_randn(640, 32)] * 2),
     "audio_condition_latents", "embedded video soundtracks total 640"),
    ("ref2va_standalone_budget", "ref2va", dict(references=[("image", False), ("audio", True), ("audio", True)],
                                                audio_condition_latents=[_randn(640, 32)] * 2),
     "audio_condition_latents", "standalone audio references total 640"),
    ("ref_image_with_audio", "ref2va", dict(references=[("image", True)]), "references", "cannot have audio"),
    ("ref_audio_without_audio", "ref2va", dict(references=[("audio", False)]), "references", "has_audio=True"),
    ("ref_kind", "ref2va", dict(references=[("text", False)]), "references", "kind must be one of"),
    ("ref_has_audio_type", "ref2va", dict(references=[("video", 1)]), "references", "must be a bool"),
    ("ref_entry", "ref2va", dict(references=["image"]), "references", "each entry must be"),
    ("metadata_values", "t2va", dict(metadata={"a": 1}), "metadata", "str to str"),
    ("metadata_type", "t2va", dict(metadata=[("a", "b")]), "metadata", "mapping"),
    ("latents_not_sequence", "fl2va", dict(condition_latents=_KF), "condition_latents", "must be a sequence"),
]


@pytest.mark.parametrize("kind,changes,field_name,fragment", [v[1:] for v in VIOLATIONS],
                         ids=[v[0] for v in VIOLATIONS])
def test_validation_rule(kind, changes, field_name, fragment):
    with pytest.raises(ContractError) as info:
        make(kind, **changes)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field_name
    message = str(info.value)
    assert message.startswith(f"{field_name}: "), message
    assert fragment in message, message
