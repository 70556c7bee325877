"""The streamed tiled video decode (h3_core/vae_stream.py) equals diffusers' decode step bit for bit.

Reference: diffusers' own `decode.video` block (latents de-normalised, `vae.decode`, pixel de-normalisation, clamp,
`output_type="pt"`) on the tiny VAE, with tiling forced onto small tiles so that one canvas has several rows and
columns of tiles, and latents long enough for several temporal clips (cross-faded), with and without the trailing
pad frames diffusers cuts off.
"""

import numpy as np
import pytest
import torch

from h3_core import media, progress, vae_stream
from h3_core.blocks import pipeline_for, workflow_blocks
from h3_core.diffusion import AVLatents, DiffusionStage
from h3_core.models import ModelSource

# (height, width, latent frames): 3x2 / 2x3 / 3x3 tiles of 64 px with 16..32 px overlaps; 2 and 3 clips; pad or not
CASES = [(160, 96, 12), (96, 160, 17), (128, 128, 3), (64, 64, 9)]


@pytest.fixture(scope="module")
def source(tiny_dir, parity_threads):
    return ModelSource.from_path(tiny_dir)


@pytest.fixture(scope="module")
def vae(source):
    model = source.load("vae")
    model.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_min_overlap_height=16,
                        tile_sample_min_overlap_width=16)
    return model


@pytest.fixture(scope="module")
def reference(source, vae):
    blocks = {name: b for name, b in workflow_blocks("t2va", ("decode",)).items() if name == "decode.video"}
    pipe = pipeline_for(blocks, {"vae": vae}, source.pipeline_config)

    def decode(latents):
        video = pipe(latents=latents, output_type="pt").get("videos")[0]
        return video.permute(0, 2, 3, 1).float().contiguous()  # [F, H, W, 3], as DiffusionStage.decode returns it

    return decode


def latents_for(height, width, frames, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 24, frames, height // 16, width // 16, generator=generator)


@pytest.mark.parametrize("height,width,frames", CASES)
def test_streamed_decode_is_bitwise_diffusers(vae, reference, height, width, frames):
    z = latents_for(height, width, frames)
    expected = reference(z)
    expected_u8 = media.frames_to_uint8(expected)  # the mp4 writer's input
    plan = vae_stream.plan(vae, z.shape)
    assert plan.frames == expected.shape[0] and (plan.height, plan.width) == (height, width)
    if height > 64:
        assert plan.tiles_per_clip >= 4
    sink = vae_stream.TensorSink()
    vae_stream.decode_video(vae, z, sink)
    assert torch.equal(sink.video, expected)
    clips = []
    vae_stream.decode_video(vae, z, vae_stream.WriterSink(lambda u8, out=clips: out.append(u8.copy())))
    assert np.array_equal(np.concatenate(clips), expected_u8)
    # a clip a time, the last one with its tail frames
    assert [len(clip) for clip in clips] == [plan.clip_frames(c) for c in range(plan.chunks)]


def test_several_clips_cross_fade_and_tiles_are_counted(vae):
    z = latents_for(160, 96, 17)
    plan = vae_stream.plan(vae, z.shape)
    assert plan.chunks == 3 and plan.tail > 0 and plan.tiles_per_clip == 6
    events, calls = [], []
    handle = vae.decoder.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with progress.reporting(lambda *event: events.append(event)):
            vae_stream.decode_video(vae, z, vae_stream.TensorSink())
    finally:
        handle.remove()
    tiles = [(done, total) for phase, done, total in events if phase == "decode_video"]
    assert len(calls) == plan.decoder_calls == 18
    assert tiles[0] == (0, 18) and tiles[-1] == (18, 18)


def test_overlaps_wider_than_half_a_tile_are_bitwise_diffusers(vae, reference):
    """A middle tile whose blends from above and into the row below overlap (48 + 48 > 64 px rows)."""
    vae.tile_sample_min_overlap_height = 48
    try:
        z = latents_for(96, 96, 3)
        plan = vae_stream.plan(vae, z.shape)
        assert [ov for _, _, ov in plan.ys] == [48, 48, 0]
        expected = reference(z)
        sink = vae_stream.TensorSink()
        vae_stream.decode_video(vae, z, sink)
        assert torch.equal(sink.video, expected)
    finally:
        vae.tile_sample_min_overlap_height = 16


def test_cancel_stops_between_tiles(vae):
    import threading

    cancel = threading.Event()
    cancel.set()
    with pytest.raises(progress.Cancelled, match="decoding video clip 1 of"):
        vae_stream.decode_video(vae, latents_for(96, 96, 7), vae_stream.TensorSink(), cancel=cancel)


def test_bad_latents_are_refused_with_the_constraint(vae):
    with pytest.raises(vae_stream.VaeStreamError, match=r"\[1, channels, frames, height, width\]"):
        vae_stream.plan(vae, (2, 24, 7, 4, 4))
    with pytest.raises(vae_stream.VaeStreamError, match="the video latent is empty"):
        vae_stream.plan(vae, (1, 24, 0, 4, 4))
    # Shorter than one decode chunk: padded by one chunk and cut again, as ComfyUI core decodes it (2 latent frames
    # are the 5-frame clip text to image makes; 1 is the causal VAE's first frame alone).
    assert [vae_stream.plan(vae, (1, 24, t, 4, 4)).frames for t in (1, 2)] == [1, 5]


def test_stage_decode_to_mp4_is_write_mp4_of_decode(source, tmp_path):
    """The CLI's streamed path writes exactly the file the whole-video path writes (default tiling)."""
    stage = DiffusionStage(source)
    generator = torch.Generator().manual_seed(3)
    latents = AVLatents(video=torch.randn(1, 24, 7, 4, 6, generator=generator),
                        audio=torch.randn(2, stage.audio_vae.config.latent_channels, 40, generator=generator))
    decoded = stage.decode(latents)
    whole = media.write_mp4(tmp_path / "whole.mp4", decoded.video, decoded.audio)
    streamed = stage.decode_to_mp4(latents, tmp_path / "streamed.mp4")
    assert open(whole, "rb").read() == open(streamed, "rb").read()
    assert decoded.video.shape == (22, 64, 96, 3) and decoded.audio.shape == (2, 29333)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["streamed.mp4", "whole.mp4"]  # no partial file left


def test_streamed_mp4_in_batches_equals_write_mp4(tmp_path):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (30, 64, 96, 3), dtype=np.uint8)
    audio = (rng.random((2, 40000), dtype=np.float32) - 0.5)
    whole = media.write_mp4(tmp_path / "whole.mp4", frames, audio)
    with media.streamed_mp4(tmp_path / "streamed.mp4", 96, 64, with_audio=True) as writer:
        for start in range(0, 30, 7):
            writer.write(frames[start: start + 7])
        writer.finish(audio)
    assert open(whole, "rb").read() == open(tmp_path / "streamed.mp4", "rb").read()
    with pytest.raises(media.MediaError, match="not finished"):
        with media.streamed_mp4(tmp_path / "never.mp4", 96, 64) as writer:
            writer.write(frames[:2])
    with pytest.raises(media.MediaError, match=r"uint8 \[n, 64, 96, 3\]"):
        with media.streamed_mp4(tmp_path / "never.mp4", 96, 64) as writer:
            writer.write(frames[:2, :32])
    assert not (tmp_path / "never.mp4").exists() and len(list(tmp_path.iterdir())) == 2
