"""Every request rule (vLLM-Omni's serving rules, diffusers' limits) fed a violating input; the error names the rule."""

import numpy as np
import pytest

from h3_core import facts, rules
from h3_core.request import AudioInput, EncodeRequest, VideoInput
from h3_core.rules import H3InputError, MediaSummary


def test_frame_grid():
    assert [rules.snap_frames_up(n) for n in (1, 5, 6, 22, 23, 120, 124)] == [5, 5, 22, 22, 39, 124, 124]
    assert rules.snap_frames_down(123) == 107 and rules.snap_frames_down(3) == 5
    assert facts.video_latent_frames(124) == 37 and facts.video_latent_frames(1) == 1
    assert facts.video_latent_frames(345) == 102
    assert facts.audio_latent_frames(124) == 207 and facts.audio_latent_frames(209) == 348


@pytest.mark.parametrize("frames", [23, 100, 125])
def test_off_grid_frames_refused(frames):
    with pytest.raises(H3InputError, match="17k\\+5"):
        rules.check_output_frames(frames)


@pytest.mark.parametrize("frames", [5, 22, 107, 362, 481, 3592])
def test_lengths_core_allows_are_valid_outside_the_trained_range_with_a_warning(frames):
    """ComfyUI core's EmptyMiniMaxH3LatentAV allows 5..3600 frames on the 17k+5 grid: so does the pack, and outside
    H3's trained 5-15 s (124-345 frames) it warns instead of refusing."""
    assert rules.check_output_frames(frames) == frames
    warning = rules.trained_range_warning(frames)
    assert warning and "trained range" in warning and "124-345 frames" in warning and str(frames) in warning


@pytest.mark.parametrize("frames", [124, 141, 345])
def test_the_trained_range_has_no_warning(frames):
    assert rules.check_output_frames(frames) == frames and rules.trained_range_warning(frames) is None


@pytest.mark.parametrize("frames", [3609, 17 * 1000 + 5])
def test_longer_than_core_allows_refused_naming_the_bound(frames):
    with pytest.raises(H3InputError, match="within 5-3592 frames"):
        rules.check_output_frames(frames)


def test_duration_bounds_are_inclusive():
    assert rules.check_output_frames(5) == 5 and rules.check_output_frames(3592) == 3592


def test_a_soundtrack_cut_under_2_s_by_a_short_output_names_the_output():
    summary = MediaSummary(image_refs=0, video_ref_seconds=(5.0,), soundtrack_seconds=(5.0,))
    with pytest.raises(H3InputError, match="cut to the output's 0.92 s.*at least 56 frames"):
        rules.check_reference_durations(summary, 22)
    rules.check_reference_durations(summary, 56)  # 2.33 s: the soundtrack is 2.33 s once cut


@pytest.mark.parametrize("width,height", [(100, 64), (64, 70), (0, 64), (-32, 64)])
def test_canvas_must_be_positive_multiples_of_32(width, height):
    with pytest.raises(H3InputError, match="multiple of 32|positive integer"):
        rules.check_canvas(width, height)


def test_canvas_aspect_limits():
    with pytest.raises(H3InputError, match="1:4 and 4:1"):
        rules.check_canvas(32 * 20, 32 * 4)


def test_resolve_canvas_matches_release_table():
    table = {(21, 9): (1536, 672), (16, 9): (1344, 768), (4, 3): (1024, 768), (1, 1): (768, 768), (9, 16): (768, 1344)}
    for (aw, ah), expected in table.items():
        assert rules.resolve_canvas(aw, ah, 768, 768 * 1344) == expected


@pytest.mark.parametrize(
    "counts,match",
    [
        ((10, 0, 0), "at most 9 image"),
        ((1, 4, 0), "at most 3 video"),
        ((1, 0, 4), "at most 3 audio"),
        ((0, 0, 1), "cannot be the only one"),
    ],
)
def test_reference_counts(counts, match):
    with pytest.raises(H3InputError, match=match):
        rules.check_reference_counts(*counts)


def test_total_reference_cap():
    with pytest.raises(H3InputError, match="at most 12 references"):
        rules.check_reference_counts(9, 3, 1)


def _ref2va(**kwargs):
    base = dict(image_refs=1)
    base.update(kwargs)
    return MediaSummary(**base)


def test_reference_audio_clip_limits():
    with pytest.raises(H3InputError, match="reference audio 1 must be 2-15 s"):
        rules.check_request("ref2va", "p", _ref2va(audio_ref_seconds=(18.0,)), 124)
    with pytest.raises(H3InputError, match="reference audio 2 must be 2-15 s"):
        rules.check_request("ref2va", "p", _ref2va(audio_ref_seconds=(3.0, 1.5)), 124)


def test_reference_video_and_soundtrack_limits():
    with pytest.raises(H3InputError, match="reference video 1 must be 2-15 s"):
        rules.check_request("ref2va", "p", _ref2va(video_ref_seconds=(1.0,), soundtrack_seconds=(None,)), 124)
    with pytest.raises(H3InputError, match="soundtrack of reference video 1"):
        rules.check_request("ref2va", "p", _ref2va(video_ref_seconds=(3.0,), soundtrack_seconds=(1.0,)), 124)


def test_audio_budgets_are_separate():
    # Three 6 s standalone clips cut to a 14.4 s output are 18 s of standalone audio: refused.
    with pytest.raises(H3InputError, match="standalone reference audios must total at most 15 s"):
        rules.check_request("ref2va", "p", _ref2va(audio_ref_seconds=(6.0, 6.0, 6.0)), 345)
    # 12 s of soundtracks plus 12 s of standalone audio: each budget holds on its own.
    summary = _ref2va(
        video_ref_seconds=(6.0, 6.0), soundtrack_seconds=(6.0, 6.0), audio_ref_seconds=(6.0, 6.0)
    )
    rules.check_request("ref2va", "p", summary, 345)
    with pytest.raises(H3InputError, match="reference video soundtracks must total at most 15 s"):
        rules.check_request(
            "ref2va", "p", _ref2va(video_ref_seconds=(6.0,) * 3, soundtrack_seconds=(6.0,) * 3), 345
        )


def test_task_shapes():
    with pytest.raises(H3InputError, match="t2va takes a prompt only"):
        rules.check_request("t2va", "p", MediaSummary(keyframes=1), 124)
    with pytest.raises(H3InputError, match="fl2va needs 1 or 2 keyframes"):
        rules.check_request("fl2va", "p", MediaSummary(), 124)
    with pytest.raises(H3InputError, match="fl2va takes first/last keyframes and guides only"):
        rules.check_request("fl2va", "p", MediaSummary(keyframes=1, image_refs=1), 124)
    with pytest.raises(H3InputError, match="ref2va takes references, not keyframes"):
        rules.check_request("ref2va", "p", MediaSummary(keyframes=1, image_refs=1), 124)
    with pytest.raises(H3InputError, match="task must be one of"):
        rules.check_request("i2v", "p", MediaSummary(), 124)
    with pytest.raises(H3InputError, match="prompt must be a non-empty string"):
        rules.check_request("t2va", "  ", MediaSummary(), 124)


def test_task_inference():
    assert rules.infer_task(MediaSummary()) == "t2va"
    assert rules.infer_task(MediaSummary(keyframes=2)) == "fl2va"
    assert rules.infer_task(MediaSummary(image_refs=1)) == "ref2va"
    assert rules.infer_task(MediaSummary(audio_ref_seconds=(3.0,))) == "ref2va"


def test_request_validation_uses_real_media_lengths():
    rgb = np.zeros((64, 64, 3), np.uint8)
    long_audio = AudioInput(np.zeros((2, 32000 * 18), np.float32), 32000)
    with pytest.raises(H3InputError, match="reference audio 1 must be 2-15 s long, got 18.00 s"):
        EncodeRequest(prompt="p", ref_images=[rgb], ref_audios=[long_audio]).validate()
    short_video = VideoInput(np.zeros((24, 64, 64, 3), np.uint8), 24.0)
    with pytest.raises(H3InputError, match="reference video 1 must be 2-15 s long, got 1.00 s"):
        EncodeRequest(prompt="p", ref_videos=[short_video]).validate()
    with pytest.raises(H3InputError, match="at most 9 image references"):
        EncodeRequest(prompt="p", ref_images=[rgb] * 10).validate()
    with pytest.raises(H3InputError, match="uint8 RGB"):
        EncodeRequest(prompt="p", first_frame=np.zeros((64, 64, 3), np.float32)).validate()
    with pytest.raises(H3InputError, match="width and height must be given together"):
        EncodeRequest(prompt="p", width=64).validate()
    with pytest.raises(H3InputError, match="multiple of 32"):
        EncodeRequest(prompt="p", width=100, height=64).validate()
    assert EncodeRequest(prompt="p", first_frame=rgb, last_frame=rgb).validate() == "fl2va"
