"""The lengths ComfyUI core allows (5..3592 frames on the 17k+5 grid) and text to image, on the tiny H3 through the CLI.

Outside H3's trained 124-345 frames a job is planned and run with a warning (the planner's report, the log), never
refused: a 20 s (481-frame) job, a 5-frame job. Text to image is core's: the shortest clip (5 frames), its first
frame, as a PNG (`generate --image`, or an --out ending in .png), the audio discarded. The 5-frame clip's two latent
frames are shorter than one decode chunk; they decode as core's decode does, by padding one chunk of the last latent.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from h3_core import cli, media, vae_stream
from h3_core.contract import H3Conditioning
from h3_core.diffusion import DiffusionStage
from h3_core.models import ModelSource

WARNING = "is outside H3's trained range of 5-15 s (124-345 frames): it runs, but its quality is untested"


def _models(tiny_dir) -> str:
    return str(tiny_dir / "diffusers")


def _encode(tiny_dir, path, frames: int) -> None:
    assert cli.main(["encode", "--models", _models(tiny_dir), "--prompt", "a red fox in the snow", "--frames",
                     str(frames), "--width", "64", "--height", "64", "--out", str(path)]) == 0


def _generate(tiny_dir, cond, out, *more: str) -> int:
    return cli.main(["generate", "--models", _models(tiny_dir), "--cond", str(cond), "--steps", "2", "--seed", "3",
                     "--out", str(out), *more])


def test_a_20_s_job_is_planned_and_runs_with_a_warning(tiny_dir, tmp_path, capsys, caplog):
    assert cli.main(["plan", "--models", _models(tiny_dir), "--vram", "24", "--ram", "64", "--width", "64",
                     "--height", "64", "--frames", "481"]) == 0
    report = capsys.readouterr().out
    assert f"warning: 481 frames (20.04 s) {WARNING}" in report and "job 64x64x481" in report
    assert "fits resident" in report  # planned for the machine like any other job

    cond = tmp_path / "c481.safetensors"
    _encode(tiny_dir, cond, 481)
    assert H3Conditioning.load(cond).num_frames == 481
    with caplog.at_level(logging.WARNING, logger="h3_core"):
        assert _generate(tiny_dir, cond, tmp_path / "v481.mp4") == 0
    assert any(f"481 frames (20.04 s) {WARNING}" in record.getMessage() for record in caplog.records)
    info = media.probe(tmp_path / "v481.mp4")
    assert info["frames"] == 481 and info["fps"] == 24.0 and (info["width"], info["height"]) == (64, 64)
    assert info["sample_rate"] == 32000 and info["duration"] == pytest.approx(481 / 24, abs=0.05)


def test_a_5_frame_job_and_text_to_image(tiny_dir, tmp_path, caplog):
    cond = tmp_path / "c5.safetensors"
    _encode(tiny_dir, cond, 5)
    with caplog.at_level(logging.WARNING, logger="h3_core"):
        assert _generate(tiny_dir, cond, tmp_path / "v5.mp4", "--dump", str(tmp_path / "d5.safetensors")) == 0
    assert any(f"5 frames (0.21 s) {WARNING}" in record.getMessage() for record in caplog.records)
    info = media.probe(tmp_path / "v5.mp4")
    assert info["frames"] == 5 and info["sample_rate"] == 32000
    dump = load_file(str(tmp_path / "d5.safetensors"))
    assert tuple(dump["video"].shape) == (5, 64, 64, 3) and tuple(dump["latents"].shape[2:]) == (2, 4, 4)

    # text to image: the same job's first frame, as a PNG (the mp4 writer's uint8 rounding of it)
    first = media.frames_to_uint8(dump["video"][:1])[0]
    assert _generate(tiny_dir, cond, tmp_path / "x.bin", "--image") == 0
    assert _generate(tiny_dir, cond, tmp_path / "x.png") == 0  # an .png --out means --image
    for name in ("x.bin", "x.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert (media.read_image(data) == first).all(), name
    assert cli.main(["generate", "--models", _models(tiny_dir), "--cond", str(cond), "--out", str(tmp_path / "y.png"),
                     "--dump", str(tmp_path / "y.safetensors")]) == 1  # the dump is the video's, not an image's
    assert not (tmp_path / "y.png").exists()


def test_two_latent_frames_decode_as_cores_padded_chunk(tiny_dir):
    """ComfyUI core decodes T=2 (5 frames) by repeating the last latent frame over one more chunk and cutting its
    frames off again: the 5 frames are the first 5 of the 22 a latent so padded (T=7) decodes to."""
    stage = DiffusionStage(ModelSource.from_path(tiny_dir / "diffusers"), device="cpu")
    vae = stage.vae
    z = torch.randn(1, 24, 2, 4, 4, generator=torch.Generator().manual_seed(5))
    padded = torch.cat([z, z[:, :, -1:].repeat(1, 1, 5, 1, 1)], dim=2)
    plan = vae_stream.plan(vae, z.shape)
    assert (plan.frames, plan.chunks, plan.pad_tokens) == (5, 1, 5)
    short, long = vae_stream.TensorSink(), vae_stream.TensorSink()
    with torch.no_grad():
        vae_stream.decode_video(vae, z, short)
        vae_stream.decode_video(vae, padded, long)
    assert tuple(short.video.shape) == (5, 64, 64, 3) and tuple(long.video.shape) == (22, 64, 64, 3)
    assert torch.equal(short.video, long.video[:5])


def test_a_canvas_beyond_the_trained_size_runs_with_a_warning(tiny_dir, tmp_path, caplog):
    """As ComfyUI core: a 2048 px wide canvas (beyond H3's trained 2016 px edge) is encoded and sampled, with the
    warning in the log, never refused; 5 frames keep the tiny job small."""
    cond = tmp_path / "wide.safetensors"
    assert cli.main(["encode", "--models", _models(tiny_dir), "--prompt", "a red fox in the snow", "--frames", "5",
                     "--width", "2048", "--height", "512", "--out", str(cond)]) == 0
    with caplog.at_level(logging.WARNING, logger="h3_core"):
        assert _generate(tiny_dir, cond, tmp_path / "wide.png") == 0
    assert "canvas 2048x512 is beyond H3's trained size" in caplog.text
    assert media.read_image(tmp_path / "wide.png").shape == (512, 2048, 3)
