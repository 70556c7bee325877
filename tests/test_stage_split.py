"""The split equals diffusers' monolithic pipeline: encode -> contract bytes -> generate, bit for bit.

The stage split's acceptance bar: on the tiny model at >= 124 frames, for t2va, fl2va and ref2va
(image, video + soundtrack and audio references), max |difference| <= 1e-5 in fp32 on CPU
(measured: exactly 0) against `MiniMaxH3ModularPipeline` on the same folder, inputs and seed.
"""

import pytest
import torch
from support import warm_cli
from support.h3_reference import monolithic

from h3_core.contract import H3Conditioning
from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.request import EncodeRequest
from h3_core.testing import CASES, STEPS


@pytest.fixture(scope="module", autouse=True)
def _parity_threads(parity_threads):
    """Bitwise comparisons: the thread count is pinned (conftest.parity_threads)."""


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
    latents, decoded = diffusion.generate(received, SamplingOptions(steps=STEPS, seed=seed))

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


@pytest.mark.parametrize("layout", ["comfyui", "native"])
def test_every_layout_generates_the_same(layout, stages, tiny_dir):
    """The ComfyUI single files (50-layer text encoder, folded audio VAE, stacked QKV) and the native
    partitions (interleaved QKV) give the diffusers root's result exactly."""
    request, _, seed = CASES["ref2va-image-video-audio-seed2"]
    encoder, diffusion = stages
    _, expected = diffusion.generate(encoder.encode(request), SamplingOptions(steps=STEPS, seed=seed))
    source = ModelSource.from_path(tiny_dir, layout=layout)
    cond = EncoderStage(source).encode(request)
    _, decoded = DiffusionStage(source).generate(cond, SamplingOptions(steps=STEPS, seed=seed))
    assert torch.equal(decoded.video, expected.video) and torch.equal(decoded.audio, expected.audio)


def test_cli_encode_generate_dump(tiny_dir, tmp_path):
    """The headless path end to end: files in, mp4 + tensors out, equal to the in-process split."""
    from pathlib import Path

    from safetensors.torch import load_file

    from h3_core import media

    repo = Path(__file__).resolve().parents[1]
    first = tmp_path / "first.png"
    first.write_bytes(media.encode_png_bytes(CASES["fl2va-first-last-seed1"][0].first_frame))
    cond_path, out, dump = tmp_path / "c.safetensors", tmp_path / "o.mp4", tmp_path / "d.safetensors"
    env = {"H3_THREADS": "2"}
    import os

    env = {**os.environ, **env}
    run = lambda *args: warm_cli.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    enc = run("encode", "--models", str(tiny_dir), "--prompt", "The door opens.", "--first-frame", str(first),
              "--out", str(cond_path))
    assert enc.returncode == 0, enc.stderr
    gen = run("generate", "--models", str(tiny_dir), "--cond", str(cond_path), "--out", str(out), "--seed", "4",
              "--steps", str(STEPS), "--dump", str(dump))
    assert gen.returncode == 0, gen.stderr
    assert "denoise: step 3/3" in gen.stderr
    info = media.probe(out)
    assert info["frames"] == 124 and info["fps"] == 24.0 and info["sample_rate"] == 32000 and info["channels"] == 2
    tensors = load_file(str(dump))
    request = EncodeRequest(prompt="The door opens.", first_frame=media.read_image(first))
    ref = monolithic(tiny_dir / "diffusers", request, "fl2va", 4, STEPS)
    assert torch.equal(tensors["video"], ref["video"])
    assert torch.equal(tensors["audio"], ref["audio"][:, : tensors["audio"].shape[1]])
    bad = run("encode", "--models", str(tiny_dir), "--prompt", "x", "--frames", "23", "--out", str(cond_path))
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: frame count must be of the form 17k+5")
