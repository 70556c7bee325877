"""Guides at any frame (issue 37): core's AddGuide rules, the contract field and its outside forms, continuation picks,
the guided layout's rows and positions, and the CLI's `--guide` syntax. No model is loaded here; sampling with guides
against core's own H3 is `test_guides_core.py`."""

import numpy as np
import pytest
import torch

from h3_core import facts, guide_layout, guides
from h3_core.contract import ContractError, H3Conditioning
from h3_core.contract.conditioning import H3Guide
from h3_core.request import EncodeRequest
from h3_core.rules import H3InputError


def _cond(**kw):
    base = dict(task="fl2va", height=64, width=64, num_frames=124, prompt_embeds=torch.randn(1, 7, 16),
                text_token_tags=torch.ones(7, dtype=torch.int64))
    return H3Conditioning(**{**base, **kw})


def _guided():
    return _cond(condition_latents=(torch.randn(1, 24, 1, 4, 4), torch.randn(1, 24, 1, 4, 4),
                                    torch.randn(1, 24, 7, 4, 4)),
                 audio_condition_latents=(torch.randn(2 * 40, 32), torch.randn(2 * 20, 32)),
                 keyframe_anchors=("first",), guides=((60, True, False), (94, True, True), (10, False, True)))


@pytest.mark.parametrize("batch, kept", [(1, 1), (4, 1), (5, 5), (21, 5), (22, 22), (400, 396)])
def test_clip_frames_follow_core(batch, kept):
    """Core's AddGuide: fewer than 5 frames anchor the first image, longer batches are cut down to 17k+5."""
    assert guides.clip_frames(batch) == kept


def test_fit_rules_name_the_constraint():
    assert guides.resolve_index(-1, 124) == 123
    assert guides.fit_error(123, 1, 124) is None and guides.fit_error(-1, 1, 124) is None
    assert "outside the video's 124 frames" in guides.fit_error(124, 1, 124)
    assert "outside the video's 124 frames" in guides.fit_error(-125, 1, 124)
    assert "does not fit in the video's 124 frames (it would end at frame 131)" in guides.fit_error(110, 22, 124)
    assert guides.fit_error(-22, 22, 124) is None  # a clip ending on the last frame
    assert "at most 345 frames" in guides.fit_error(0, 362, 481)
    assert guides.audio_latent_cap(0, 124) == 207 and guides.audio_latent_cap(120, 124) == 7
    assert guides.audio_latent_cap(0, 481) == guides.MAX_GUIDE_AUDIO_LATENTS  # and at most 15 s
    assert guides.fit_error(123, 0, 124, audio=True) is None  # the last frame still leaves one audio latent


def test_requests_with_guides_are_fl2va_and_checked_before_encoding():
    still = np.zeros((1, 32, 32, 3), np.uint8)
    request = EncodeRequest(prompt="p", num_frames=124, guides=[guides.GuideMedia(40, frames=still)])
    assert request.validate() == "fl2va" and request.needed_encoders() == ("text", "video")
    audio_only = EncodeRequest(prompt="p", guides=[guides.GuideMedia(0, audio=np.zeros((2, 800), np.float32),
                                                                     sample_rate=32000)])
    assert audio_only.needed_encoders() == ("text", "audio")
    for bad, fragment in [
        (dict(guides=[guides.GuideMedia(124, frames=still)]), "guide 1: frame_idx 124 is outside"),
        (dict(guides=[guides.GuideMedia(0)]), "guide 1 needs an image, a clip or an audio"),
        (dict(guides=[guides.GuideMedia(0, frames=still)] * 17), "at most 16 guides"),
        (dict(task="t2va", guides=[guides.GuideMedia(0, frames=still)]), "t2va takes a prompt only"),
        (dict(ref_images=[still[0]], guides=[guides.GuideMedia(0, frames=still)]), "references, not guides"),
    ]:
        with pytest.raises(H3InputError, match=fragment):
            EncodeRequest(prompt="p", **bad).validate()


def test_contract_round_trips_guides_in_every_form():
    cond = _guided()
    assert H3Conditioning.from_bytes(cond.to_bytes()) == cond
    core = cond.to_comfy()
    entries = core[0][1]["minimax_keyframes"]
    assert [e["resolved_frame_index"] for e in entries] == [0, 60, 94, 10]
    assert [sorted(e) for e in entries] == [["latent", "resolved_frame_index"], ["latent", "resolved_frame_index"],
                                            ["audio_latent", "latent", "resolved_frame_index"],
                                            ["audio_latent", "resolved_frame_index"]]
    assert tuple(entries[3]["audio_latent"].shape) == (1, 32, 2, 20)  # core's [B, 32, 2, T]
    assert H3Conditioning.from_comfy(core) == cond
    with pytest.raises(ContractError, match="no slot in vLLM-Omni's stage-0 payload") as info:
        cond.to_vllm()
    assert info.value.field == "guides"


def test_a_conditioning_without_guides_keeps_its_bytes():
    """The header carries `guides` only when there are some: older conditionings' bytes and fingerprints hold."""
    plain = _cond(condition_latents=(torch.randn(1, 24, 1, 4, 4),), keyframe_anchors=("last",))
    assert b'"guides"' not in plain.to_bytes() and b"guides" in _guided().to_bytes()


def test_core_guides_in_any_order_read_back():
    """Core's list as AddGuide chains make it (a guide before the keyframes, last before first) reads as the same
    contract; one image at frame 0 or num_frames - 1 is a keyframe anchor, anything else a guide."""
    core = _guided().to_comfy()
    entries = core[0][1]["minimax_keyframes"]
    core[0][1]["minimax_keyframes"] = [entries[2], entries[0], entries[1], entries[3]]
    back = H3Conditioning.from_comfy(core)
    assert back.keyframe_anchors == ("first",) and [g.frame for g in back.guides] == [94, 60, 10]
    two = _cond(condition_latents=(torch.randn(1, 24, 1, 4, 4), torch.randn(1, 24, 1, 4, 4)),
                keyframe_anchors=("first", "last")).to_comfy()
    two[0][1]["minimax_keyframes"].reverse()
    assert H3Conditioning.from_comfy(two).keyframe_anchors == ("first", "last")


@pytest.mark.parametrize("kw, fragment, field", [
    (dict(condition_latents=(torch.randn(1, 24, 3, 4, 4),), guides=((0, True, False),)), "T=3", None),
    (dict(condition_latents=(torch.randn(1, 24, 2, 2, 2),), guides=((0, True, False),)), "output canvas", None),
    (dict(condition_latents=(torch.randn(1, 24, 2, 4, 4),), guides=((120, True, False),)), "does not fit",
     "guides[0]"),
    (dict(audio_condition_latents=(torch.randn(2 * 100, 32),), guides=((0, False, True), (0, False, True))),
     "one audio condition per guide", "audio_condition_latents"),
    (dict(audio_condition_latents=(torch.randn(2 * 10, 32),), guides=((120, False, True),)), "more than the 7",
     "guides[0]"),
    (dict(guides=((0, False, False),)), "anchors neither video nor audio", "guides"),
    (dict(guides=((-1, True, False),)), "frame must be an int >= 0", "guides"),
])
def test_contract_refuses_guides_that_do_not_fit(kw, fragment, field):
    with pytest.raises(ContractError, match=fragment) as info:
        _cond(**kw)
    if field:
        assert info.value.field == field


def test_ref2va_and_t2va_carry_no_guides():
    with pytest.raises(ContractError, match="t2va carries text only"):
        _cond(task="t2va", condition_latents=(torch.randn(1, 24, 1, 4, 4),), guides=((3, True, False),))


def test_guided_layout_rows_and_positions():
    """Core's PackedLayout arithmetic: each guide's rows start at text_len + 5/3 * frame; video rows step 5/3 *
    (1, 4, 4, 4, 4) per latent frame; audio rows one per latent, channel-major; targets last."""
    tags = torch.tensor([1, 1, 0, 1])
    entries = [guide_layout.GuideRows(0, 1, 0), guide_layout.GuideRows(60, 2, 3)]
    layout = guide_layout.build(tags, 7, 4, 4, 10, entries)
    rows_per_frame = 4  # (4/2) * (4/2)
    assert layout["num_condition_video_rows"] == 3 * rows_per_frame and layout["num_condition_audio_rows"] == 6
    pos = layout["position_ids"]
    assert pos.shape == (4 + 12 + 6 + 20 + 28, 3)
    assert pos[4, 0] == 4.0  # the frame-0 keyframe at text_len
    second = 4 + rows_per_frame
    assert pos[second, 0] == pytest.approx(4 + 60 * 5 / 3) and pos[second + 4, 0] == pytest.approx(4 + 61 * 5 / 3)
    audio = 4 + 12
    assert pos[audio:audio + 3, 0].tolist() == pytest.approx([4 + 100 + k for k in range(3)])
    assert pos[audio, 2] == pos[audio + 3 + 0, 2] * 0 + pos[audio, 2] and pos[audio + 3, 2] > pos[audio, 2]
    assert layout["video_indices"][:12].tolist() == list(range(4, 8)) + list(range(8, 16))
    assert layout["audio_indices"][:6].tolist() == list(range(16, 22))
    assert layout["token_tags"][16:22].unique().tolist() == [2] and layout["token_tags"][-1] == 0
    assert layout["video_indices"][-1] == pos.shape[0] - 1  # the target video is the last segment


def test_continuation_takes_the_last_frames_and_their_soundtrack():
    frames = np.arange(48, dtype=np.uint8)[:, None, None, None] * np.ones((1, 8, 8, 3), np.uint8)
    audio = np.arange(64000, dtype=np.float32)[None].repeat(2, 0)
    guide = guides.continuation(frames, 24.0, audio, 32000, 22)
    assert guide.frame_index == 0 and guide.frames[:, 0, 0, 0].tolist() == list(range(26, 48))
    assert guide.audio.shape == (2, 29333) and guide.audio[0, -1] == 63999
    at_30 = guides.continuation(frames[:40], 30.0, None, None, 25)  # 25 is cut down to 22; frames picked by time
    assert at_30.frames.shape[0] == 22 and at_30.frames[-1, 0, 0, 0] == 39 and at_30.audio is None
    with pytest.raises(H3InputError, match="shorter than the 22 frames"):
        guides.continuation(frames[:10], 24.0, None, None, 22)


def test_cli_guide_syntax(tmp_path):
    from h3_core import cli

    with pytest.raises(ValueError, match="FRAME:PATH"):
        cli._guide("still.png")
    from PIL import Image

    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "s.png")
    guide = cli._guide(f"-1:{tmp_path / 's.png'}")
    assert guide.frame_index == -1 and guide.frames.shape == (1, 16, 16, 3) and guide.audio is None


def test_h3guide_coerce_forms():
    assert H3Guide.coerce([3, True, False]) == H3Guide.coerce({"frame": 3, "video": True, "audio": False})
    with pytest.raises(ContractError):
        H3Guide.coerce("x")


def test_the_largest_guided_header_fits_the_cap():
    """Two keyframes, 16 guides each with a clip and audio, and the most metadata: the header stays under the cap the
    readers refuse from the length prefix (wire.MAX_HEADER_BYTES)."""
    from h3_core.contract import wire

    n = facts.MAX_GUIDES
    cond = _cond(num_frames=3592,
                 condition_latents=(torch.randn(1, 24, 1, 4, 4),) * 2 + (torch.randn(1, 24, 2, 4, 4),) * n,
                 audio_condition_latents=(torch.randn(2, 32),) * n, keyframe_anchors=("first", "last"),
                 guides=[(3000 + k, True, True) for k in range(n)],
                 metadata={"k" * 8: "\u0000" * (wire.MAX_METADATA_BYTES // 6 - 20)})
    data = cond.to_bytes()
    header_len = int.from_bytes(data[:8], "little")
    assert header_len <= wire.MAX_HEADER_BYTES
    assert H3Conditioning.from_bytes(data) == cond
