"""The split equals diffusers' monolithic pipeline: encode -> contract bytes -> generate, bit for bit.

Done-when of the stages issue: on the tiny model at >= 124 frames, for t2va, fl2va and ref2va
(image, video + soundtrack and audio references), max |difference| <= 1e-5 in fp32 on CPU
(measured: exactly 0) against `MiniMaxH3ModularPipeline` on the same folder, inputs and seed.
"""

import numpy as np
import pytest
import torch

from h3_core.contract import H3Conditioning
from h3_core.diffusion import DiffusionStage
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.request import AudioInput, EncodeRequest, VideoInput
from h3_reference import monolithic

STEPS = 4


def _image(seed: int, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    return np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)


def _tone(seconds: float, rate: int = 32000, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return np.stack([0.3 * np.sin(2 * np.pi * freq * t), 0.3 * np.sin(2 * np.pi * freq * 1.5 * t)]).astype(np.float32)


def _video(seconds: float, height=64, width=64, fps=24.0, audio=True) -> VideoInput:
    frames = np.stack([np.roll(_image(7, height, width), 3 * i, axis=1) for i in range(int(seconds * fps))])
    return VideoInput(frames=frames, fps=fps, audio=_tone(seconds, freq=220.0) if audio else None,
                      sample_rate=32000 if audio else None)


CASES = {
    "t2va-64x64-seed0": (EncodeRequest(prompt="A red fox in the snow.", width=64, height=64, num_frames=124), "t2va", 0),
    "t2va-default-canvas-seed5": (EncodeRequest(prompt="Rain on a tin roof, distant thunder.", num_frames=141), "t2va", 5),
    "fl2va-first-last-seed1": (
        EncodeRequest(prompt="The door opens.", first_frame=_image(1, 64, 96), last_frame=_image(2, 80, 96), num_frames=124),
        "fl2va",
        1,
    ),
    "ref2va-image-video-audio-seed2": (
        EncodeRequest(
            prompt="<Picture 1> walks in, <Video 1> moves, <Audio 2> plays.",
            ref_images=[_image(3, 64, 96)],
            ref_videos=[_video(2.0)],
            ref_audios=[AudioInput(_tone(3.0), 32000)],
            num_frames=124,
        ),
        "ref2va",
        2,
    ),
}


@pytest.fixture(scope="module")
def stages(tiny_dir):
    source = ModelSource.from_path(tiny_dir)
    return EncoderStage(source), DiffusionStage(source)


@pytest.mark.parametrize("case", sorted(CASES))
def test_split_matches_monolithic(case, stages, tiny_dir):
    request, task, seed = CASES[case]
    encoder, diffusion = stages
    cond = encoder.encode(request)
    assert cond.task == task
    received = H3Conditioning.from_bytes(cond.to_bytes())  # what crosses the wire or a file
    latents, decoded = diffusion.generate(received, seed=seed, steps=STEPS)

    ref = monolithic(tiny_dir / "diffusers", request, task, seed, STEPS)
    assert torch.equal(received.prompt_embeds, ref["prompt_embeds"].cpu())
    assert decoded.video.shape == ref["video"].shape
    assert decoded.video.shape[0] == request.num_frames
    video_diff = (decoded.video - ref["video"]).abs().max().item()
    samples = decoded.audio.shape[1]
    audio_diff = (decoded.audio - ref["audio"][:, :samples]).abs().max().item()
    assert video_diff <= 1e-5 and audio_diff <= 1e-5, (video_diff, audio_diff)
    assert torch.equal(latents.video, ref["latents"]) and torch.equal(latents.audio, ref["audio_latents"])
    # Audio is trimmed to the video's duration (diffusers returns audio_t * 800 samples).
    assert samples == round(request.num_frames / 24 * 32000)
