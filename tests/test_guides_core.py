"""Guides sampled by the pack and by ComfyUI core 0.33's own H3 agree (issue 37 item 1), and continuation works end to
end on the tiny model.

diffusers anchors keyframes at the first and last frame only; guides at any frame (images, clips, audio, clips with
their soundtrack) are laid out by the pack (`h3_core/guide_layout.py`) after core's `PackedLayout`, so core is their
reference: the same tiny weights, the same conditioning (the pack's guides under core's `minimax_keyframes` key), the
same noise. Bars as `test_core_fidelity.py` (relative, fp32, CPU): one forward <= 1e-4, a whole sampling with core's
own sampler <= 1e-3. Skips, saying why, when core 0.33 is not provisioned.
"""

import numpy as np
import pytest
import torch
from support import core_reference as core
from support.core_reference import core_ready  # noqa: F401  (a fixture: skips without core 0.33)

from h3_core import facts, guides, testing
from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.models import ModelSource
from h3_core.request import EncodeRequest

FORWARD_BAR, SAMPLING_BAR = core.FORWARD_BAR, core.SAMPLING_BAR
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def _threads(parity_threads):
    """One thread count here and in the core worker (docs/ARCHITECTURE.md §2.1, trap 5)."""


@pytest.fixture(scope="module")
def diffusion(tiny_dir):
    return DiffusionStage(ModelSource.from_path(tiny_dir))


def _clip(seconds=1.0):
    return testing.video(seconds, 64, 64)


def _requests():
    clip = _clip()
    tone = np.asarray(testing.tone(0.5), np.float32).reshape(-1, int(0.5 * facts.AUDIO_SAMPLE_RATE))
    return {
        # an image in the middle of the video and an audio alone, chained
        "middle-image+audio": [guides.GuideMedia(40, frames=testing.image(3, 64, 64)[None]),
                               guides.GuideMedia(10, audio=tone, sample_rate=facts.AUDIO_SAMPLE_RATE)],
        # a first-frame keyframe (diffusers' anchor) and a clip without sound ending 8 frames before the end
        "keyframe+clip": [guides.GuideMedia(-30, frames=clip.frames)],
        # continuation: a clip with its soundtrack at frame 0
        "clip+soundtrack": [guides.continuation(clip.frames, clip.fps, clip.audio, clip.sample_rate, 22)],
    }


CASES = sorted(_requests())


@pytest.fixture(scope="module")
def replayed(core_ready, encoder_stage, diffusion, tiny_dir, tmp_path_factory):
    made = {}

    def get(case):
        if case not in made:
            request = EncodeRequest(prompt="a cat walks", width=64, height=64, num_frames=124,
                                    first_frame=testing.image(1, 64, 64) if case == "keyframe+clip" else None,
                                    guides=_requests()[case])
            cond = encoder_stage.encode(request)
            trace = core.diffusers_trace(diffusion, cond, STEPS, seed=5)
            job = core.job_for(core.tiny_dit(tiny_dir, "fl2va"), cond, trace, 5, loops=("core",))
            made[case] = (cond, trace, *core.run(job, tmp_path_factory.mktemp("core")))
        return made[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_guides_sample_as_in_core(case, replayed):
    """Every traced forward and core's own whole sampling agree with the pack's, for each kind of guide."""
    cond, trace, out, _ = replayed(case)
    assert cond.task == "fl2va" and cond.guides
    worst = {}
    for step, (video, audio) in enumerate(trace.velocities):
        for stream, ref in (("video", video), ("audio", audio)):
            _, rel = core.fidelity(out[f"step{step}.{stream}"], ref)
            assert rel <= FORWARD_BAR, (case, step, stream, rel)
            worst[f"forward {stream}"] = max(worst.get(f"forward {stream}", 0.0), rel)
    for stream, ref in (("video", trace.final_video), ("audio", trace.final_audio)):
        _, rel = core.fidelity(out[f"core.{stream}"], ref)
        assert rel <= SAMPLING_BAR, (case, stream, rel)
        worst[f"sampling {stream}"] = rel
    print(f"\n[guides vs core] {case}: " + ", ".join(f"{name} {value:.2g}" for name, value in worst.items()))


def test_the_guides_are_what_the_conditioning_says(replayed):
    """What each case's conditioning holds: frames resolved as core resolves them, clip latents of 17k+5 frames,
    audio cut to what the output leaves."""
    cond, *_ = replayed("middle-image+audio")
    assert [(g.frame, g.video, g.audio) for g in cond.guides] == [(40, True, False), (10, False, True)]
    assert cond.audio_condition_latents[0].shape == (2 * 20, 32)  # 0.5 s at 40 latents/s
    cond, *_ = replayed("keyframe+clip")
    assert cond.keyframe_anchors == ("first",) and [g.frame for g in cond.guides] == [94]
    assert cond.condition_latents[1].shape[2] == facts.video_latent_frames(22)  # 24 frames cut down to 22


def test_a_guide_moves_the_result(encoder_stage, diffusion):
    """The guide is read, not carried along: the same image at another frame changes the sampled latents, while the
    text part of the conditioning stays the t2va one (guides add no vision block, as core's AddGuide)."""
    image = testing.image(3, 64, 64)[None]
    made = []
    for frame in (None, 10, 100):
        request = EncodeRequest(prompt="a cat walks", width=64, height=64, num_frames=124,
                                guides=[] if frame is None else [guides.GuideMedia(frame, frames=image)])
        cond = encoder_stage.encode(request)
        made.append((cond, diffusion.sample(cond, SamplingOptions(steps=3, seed=1)).video))
    (plain, v0), (at10, v10), (at100, v100) = made
    assert torch.equal(plain.prompt_embeds, at10.prompt_embeds)
    assert not torch.equal(v0, v10) and not torch.equal(v10, v100)


def test_continuation_mp4_starts_from_the_source(encoder_stage, diffusion, tmp_path):
    """Continue a 2 s clip: the guide is the clip's last 22 frames and the soundtrack under them, at frame 0; the
    job runs to an mp4 of the requested length. (The tiny model's weights are random, so what it paints is noise;
    that the new video starts from the source is the guide's content and place, checked here.)"""
    from h3_core import media
    from h3_core.vae_encode import encode_condition

    clip = _clip(2.0)
    guide = guides.continuation(clip.frames, clip.fps, clip.audio, clip.sample_rate, 22)
    assert np.array_equal(guide.frames, clip.frames[-22:])
    cond = encoder_stage.encode(EncodeRequest(prompt="the cat keeps walking", width=64, height=64, num_frames=124,
                                              guides=[guide]))
    assert [(g.frame, g.video, g.audio) for g in cond.guides] == [(0, True, True)]
    pixels = torch.from_numpy(np.ascontiguousarray(clip.frames[-22:])).permute(3, 0, 1, 2)[None]
    tail = encode_condition(encoder_stage.vae, pixels, facts.PIXEL_MEAN, facts.PIXEL_STD,
                            encode_seed=facts.KEYFRAME_ENCODE_SEED)
    assert torch.equal(cond.condition_latents[0], tail)  # the source's last frames, encoded as the guide
    latents = diffusion.sample(cond, SamplingOptions(steps=3, seed=2))
    out = diffusion.decode_to_mp4(latents, tmp_path / "continued.mp4")
    video = media.read_video(out)
    assert video.frames.shape[0] == 124 and video.audio is not None
