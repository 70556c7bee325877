"""Live previews and named progress phases on the embedded tiny H3 (no ComfyUI).

Previews and progress only read what the model computes: results stay bit-exact with them on.
"""

from __future__ import annotations

import pytest
import torch

from h3_core import previews, progress
from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.testing import CASES, STEPS
from h3_core.weights.loaders import resolve


@pytest.fixture(scope="module")
def source(tiny_dir, parity_threads):
    return ModelSource.from_path(tiny_dir)


@pytest.fixture(scope="module")
def ref2va(source):
    """The ref2va parity case encoded with a phase sink: (conditioning, phase reports)."""
    request = CASES["ref2va-image-video-audio-seed2"][0]
    events = []
    with progress.reporting(lambda *event: events.append(event)):
        cond = EncoderStage(source).encode(request)
    return cond, events


def phases(events, name):
    return [(done, total) for phase, done, total in events if phase == name]


# --- the latent -> RGB map ---------------------------------------------------------------------------


def test_fit_recovers_a_linear_map_exactly():
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(500, 24, generator=generator)
    factors, bias = torch.randn(24, 3, generator=generator), torch.randn(3, generator=generator)
    fitted, fitted_bias = previews.fit_linear_rgb(latents, latents @ factors + bias)
    assert torch.allclose(fitted, factors, atol=1e-4) and torch.allclose(fitted_bias, bias, atol=1e-4)


def test_the_fallback_table_is_the_tiny_vae_fit(source):
    # The table in h3_core/previews.py is what `python -m h3_core.previews <tiny>` prints (4 decimals).
    factors, bias = previews.fit_from_vae(source.load("vae"))
    assert torch.allclose(factors, torch.tensor(previews.TINY_RGB_FACTORS), atol=1e-3)
    assert torch.allclose(bias, torch.tensor(previews.TINY_RGB_BIAS), atol=1e-3)


def test_preview_picture_is_one_latent_frame_in_uint8():
    video = torch.zeros(1, 24, 7, 4, 8)
    video[0, :, 3] = 1.0  # the middle frame is the one shown
    rgb = previews.preview_rgb(video)
    assert rgb.shape == (4, 8, 3) and rgb.dtype.name == "uint8"
    expected = torch.tensor(previews.TINY_RGB_FACTORS).sum(0) + torch.tensor(previews.TINY_RGB_BIAS)
    assert abs(int(rgb[0, 0, 0]) - round((float(expected[0]) + 1) * 127.5)) <= 1
    with pytest.raises(ValueError, match=r"\[24, 3\]"):
        previews.preview_rgb(video, factors=torch.zeros(16, 3))


# --- previews while sampling -------------------------------------------------------------------------


def test_sampler_previews_every_step_and_changes_nothing(source, ref2va):
    cond, _ = ref2va
    seed = CASES["ref2va-image-video-audio-seed2"][2]
    shown, counted = [], []
    options = SamplingOptions(steps=STEPS, seed=seed,
                              preview=lambda done, total, video: shown.append((done, total, video)),
                              progress=lambda done, total: counted.append((done, total)))
    with_preview = DiffusionStage(source).sample(cond, options)
    plain = DiffusionStage(source).sample(cond, SamplingOptions(steps=STEPS, seed=seed))

    assert [(done, total) for done, total, _ in shown] == [(k, STEPS - 1) for k in range(1, STEPS)]
    assert counted == [(0, STEPS - 1)]  # a step with a preview reports through it
    assert all(video.shape == plain.video.shape for _, _, video in shown)
    # At the last step sigma_next = 0: the estimate is the sampler's result.
    assert torch.allclose(shown[-1][2], plain.video, atol=1e-5)
    assert not torch.allclose(shown[0][2], plain.video, atol=1e-3)
    assert torch.equal(with_preview.video, plain.video) and torch.equal(with_preview.audio, plain.audio)


# --- named progress phases ---------------------------------------------------------------------------


def test_encoders_report_text_clips_and_audio(ref2va):
    _, events = ref2va
    layers = 51  # the tiny text encoder's stack (50 layers and the weightless 51st, as at release)
    assert phases(events, "text") == [(k, layers) for k in range(layers + 1)]
    # one unit for the reference image, one per 17-frame clip of the reference video (3 here)
    assert phases(events, "video_vae") == [(k, 4) for k in range(5)]
    assert phases(events, "audio_vae") == [(0, 2), (1, 2), (2, 2)]  # the video's soundtrack and the audio


def test_loading_reports_bytes_up_to_the_file_size(ref2va, source):
    _, events = ref2va
    loads = phases(events, "load")
    starts = [total for done, total in loads if done == 0]
    expected = [resolve(source.paths[name], name).header.total_bytes for name in ("text_encoder", "vae", "audio_vae")]
    assert starts == expected  # every byte of each file, in the order the encoder stage loads them
    ends = [(done, total) for done, total in loads if done == total]
    assert [total for _, total in ends] == starts
    assert all(b[0] >= a[0] for a, b in zip(loads, loads[1:], strict=False) if a[1] == b[1] and b[0] != 0)
    assert len(loads) <= 3 * 102  # thinned to whole percents, not one event per tensor


def test_decode_reports_every_tile_and_the_audio(source, ref2va):
    cond, _ = ref2va
    stage = DiffusionStage(source)
    latents = stage.sample(cond, SamplingOptions(steps=2, seed=0))
    calls = []
    handle = stage.vae.decoder.register_forward_hook(lambda *_: calls.append(1))
    events = []
    try:
        with progress.reporting(lambda *event: events.append(event)):
            with_sink = stage.decode(latents)
    finally:
        handle.remove()
    plain = stage.decode(latents)
    tiles = phases(events, "decode_video")
    assert tiles == [(k, len(calls)) for k in range(len(calls) + 1)]  # the estimate is the real count
    assert phases(events, "decode_audio") == [(0, 1), (1, 1)]
    assert torch.equal(with_sink.video, plain.video) and torch.equal(with_sink.audio, plain.audio)


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown progress phase"):
        progress.report("nope", 0, 1)
