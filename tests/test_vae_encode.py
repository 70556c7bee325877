"""The streamed video-VAE encode of a condition (h3_core/vae_encode.py) equals diffusers' `encode_vae_condition`.

Reference: diffusers' own helper on the same uint8 frames, on the tiny VAE with tiling forced onto small tiles (so a
clip is several tiles), for videos of one clip, several clips, and a length that needs the last clip padded; and a
single frame (keyframe / image), which goes through diffusers' helper unchanged. Also: the encoder stage reports one
progress unit per clip.
"""

import pytest
import torch

from h3_core import diffusers_adapter, facts, progress, vae_encode
from h3_core.models import ModelSource

SEED = facts.KEYFRAME_ENCODE_SEED


@pytest.fixture(scope="module")
def vae(tiny_dir, parity_threads):
    model = ModelSource.from_path(tiny_dir).load("vae")
    model.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_min_overlap_height=16,
                        tile_sample_min_overlap_width=16)
    return model


def frames(count, height=96, width=80, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, 3, count, height, width), generator=generator, dtype=torch.uint8)


def diffusers_latents(vae, pixels):
    return diffusers_adapter.encode_vae_condition(vae, pixels, facts.PIXEL_MEAN, facts.PIXEL_STD, encode_seed=SEED)


@pytest.mark.parametrize("count", [1, 22, 39, 30])
def test_streamed_encode_is_bitwise_diffusers(vae, count):
    pixels = frames(count)
    calls = []
    got = vae_encode.encode_condition(vae, pixels, facts.PIXEL_MEAN, facts.PIXEL_STD, SEED,
                                      on_clip=lambda: calls.append(1))
    expected = diffusers_latents(vae, pixels)
    assert got.dtype == expected.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(got, expected)
    assert len(calls) == vae_encode.units(vae, count) == (1 if count == 1 else -(-count // vae.config.clip_length))


def test_permuted_frames_like_a_decoded_reference(vae):
    """A reference video arrives as [F, H, W, 3] frames permuted to [1, 3, F, H, W] (not contiguous)."""
    video = frames(22).permute(0, 2, 3, 4, 1)[0].contiguous()  # [F, H, W, 3]
    pixels = video.permute(3, 0, 1, 2)[None]
    assert not pixels.is_contiguous()
    assert torch.equal(vae_encode.encode_condition(vae, pixels, facts.PIXEL_MEAN, facts.PIXEL_STD, SEED),
                       diffusers_latents(vae, pixels))


def test_encoder_stage_reports_a_unit_per_clip(tiny_dir, parity_threads):
    import numpy as np

    from h3_core.encoder import EncoderStage
    from h3_core.request import EncodeRequest, VideoInput

    stage = EncoderStage(ModelSource.from_path(tiny_dir), components=("text", "video"))
    video = np.random.default_rng(0).integers(0, 256, (56, 64, 64, 3), dtype=np.uint8)
    request = EncodeRequest(prompt="<Video 1> a reference", ref_videos=[VideoInput(frames=video, fps=24.0)])
    seen = []
    with progress.reporting(lambda phase, done, total: seen.append((done, total)) if phase == "video_vae" else None):
        stage.encode(request)
    prepared = stage.prepare(request)
    clips = sum(vae_encode.units(stage.vae, int(ref.frames.shape[0])) for ref in prepared.references)
    assert clips >= 2 and seen[0] == (0, clips) and seen[-1] == (clips, clips)
