"""Headless block streaming (h3_core.offload): diffusers' group offloading of the DiT blocks and the
text-encoder layers, CPU to CPU through the same hooks a GPU run uses, equals the resident run bit for bit."""

import pytest
import torch
from diffusers.hooks import group_offloading
from safetensors.torch import load_file

from h3_core import cli, offload
from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.testing import CASES, STEPS


@pytest.fixture(scope="module", autouse=True)
def _parity_threads(parity_threads):
    """Bitwise comparisons: the thread count is pinned (conftest.parity_threads)."""


@pytest.fixture
def onloads(monkeypatch):
    """Counts group onloads per streamed module (proves the hooks really ran)."""
    seen = []
    original = group_offloading.ModuleGroup.onload_

    def counting(self):
        seen.append(self.onload_leader)
        return original(self)

    monkeypatch.setattr(group_offloading.ModuleGroup, "onload_", counting)
    return seen


@pytest.fixture(scope="module")
def source(tiny_dir):
    return ModelSource.from_path(tiny_dir, layout="comfyui")


def test_streamed_text_encoder_equals_resident(source, onloads):
    request = CASES["ref2va-image-video-audio-seed2"][0]  # an image reference: the vision tower runs too
    resident = EncoderStage(source, components=("text",))
    prepared = resident.prepare(request)
    expected = resident.encode_text(prepared)
    assert not onloads
    stage = EncoderStage(source, components=("text",), offload="block")
    model = stage.text_encoder.model
    assert stage.streaming.mode == "block"
    assert stage.streaming.groups == len(model.language_model.layers) + len(model.visual.blocks) + len(
        model.visual.deepstack_merger_list)
    streamed = stage.encode_text(prepared)
    assert torch.equal(streamed[0], expected[0]) and torch.equal(streamed[1], expected[1])
    leaders = {id(module) for module in onloads}
    assert id(model.language_model.layers[0]) in leaders and id(model.language_model.layers[49]) in leaders
    assert id(model.visual.blocks[0]) in leaders


def test_streamed_dit_equals_resident_and_moves_every_block(source, onloads):
    request, _, seed = CASES["t2va-64x64-seed0"]
    cond = EncoderStage(source, components=("text",)).encode(request)
    options = SamplingOptions(steps=STEPS, seed=seed)
    expected = DiffusionStage(source).sample(cond, options)
    assert not onloads
    stage = DiffusionStage(source, offload="block")
    streamed = stage.sample(cond, options)
    assert torch.equal(streamed.video, expected.video) and torch.equal(streamed.audio, expected.audio)
    dit = stage.transformer("t2va")
    info = stage.streaming["transformer"]
    assert info.mode == "block" and info.groups == len(dit.transformer_blocks)
    assert info.moved_per_forward == offload.module_bytes(dit)
    assert info.resident + sum(offload.module_bytes(b) for b in dit.transformer_blocks) == info.moved_per_forward
    # every block onloaded once per DiT forward (STEPS - 1 forwards: the last sigma is 0)
    assert sum(module is dit.transformer_blocks[0] for module in onloads) == STEPS - 1


def test_cli_generate_offload_block_equals_none_bitwise(tiny_dir, tmp_path):
    request = CASES["t2va-64x64-seed0"][0]
    cond_path = tmp_path / "cond.safetensors"
    EncoderStage(ModelSource.from_path(tiny_dir), components=("text",)).encode(request).save(cond_path)
    dumps = {}
    for mode in ("none", "block"):
        dumps[mode] = tmp_path / f"{mode}.safetensors"
        code = cli.main(["generate", "--models", str(tiny_dir), "--cond", str(cond_path), "--out",
                         str(tmp_path / f"{mode}.mp4"), "--steps", "3", "--seed", "1", "--offload", mode,
                         "--dump", str(dumps[mode])])
        assert code == 0
    expected, got = load_file(str(dumps["none"])), load_file(str(dumps["block"]))
    assert set(got) == set(expected) == {"video", "audio", "latents", "audio_latents"}
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_auto_chooses_from_free_memory_and_the_planner():
    gib = 1 << 30
    assert offload.choose(10 * gib, 4 * gib, "cuda", free_bytes=24 * gib) == "none"
    assert offload.choose(21 * gib, 4 * gib, "cuda", free_bytes=24 * gib) == "block"
    assert offload.choose(100 * gib, 4 * gib, "cpu") == "none"  # host RAM: nothing to stream to
    module = torch.nn.Linear(4, 4)
    placed = offload.place(module, "vae", "cpu", "block")
    assert placed.mode == "none"  # VAEs never stream
    with pytest.raises(ValueError, match="offload must be"):
        offload.place(module, "transformer", "cpu", "disk")


def test_load_progress_bar_on_stderr(tiny_dir, capsys):
    """The CLI shows weight loading as a bar on stderr (one line per tenth when stderr is not a terminal)."""
    import io

    from h3_core import loadbar, progress

    other, out = [], io.StringIO()
    with progress.reporting(loadbar.wrap(lambda *report: other.append(report), stream=out)):
        ModelSource.from_path(tiny_dir, layout="comfyui").load("text_encoder")
        progress.report("denoise", 1, 3)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("load [..............................]   0% 0.00/0.05 GB")
    assert lines[-1].startswith("load [##############################] 100% 0.05/0.05 GB")
    assert 2 <= len(lines) <= 12 and other == [("denoise", 1, 3)]


def _twin(tiny_dir, folder, name):
    path = tiny_dir / "comfyui" / folder / name
    if not path.is_file():
        pytest.skip(f"this tiny build has no {name} (built before the quantised twins)")
    return path


def test_quantised_text_encoder_streams_bitwise(tiny_dir, onloads):
    """int8 + ConvRot language linears (QuantLinear): their int8 storage and scales stream as stored."""
    path = _twin(tiny_dir, "text_encoders", "qwen3vl_minimax_h3_tiny_int8_convrot.safetensors")
    source = ModelSource.from_path(tiny_dir, layout="comfyui")
    source.paths["text_encoder"] = path
    prepared = EncoderStage(source, components=("text",)).prepare(CASES["t2va-64x64-seed0"][0])
    resident = EncoderStage(source, components=("text",))
    stage = EncoderStage(source, components=("text",), offload="block")
    int8 = [p for p in stage.text_encoder.model.language_model.layers[0].parameters() if p.dtype == torch.int8]
    assert int8  # quantised storage, streamed at its stored size
    expected, streamed = resident.encode_text(prepared), stage.encode_text(prepared)
    assert torch.equal(streamed[0], expected[0])
    assert any(module is stage.text_encoder.model.language_model.layers[3] for module in onloads)


def test_pruned_int8_dit_streams_bitwise(tiny_dir, onloads):
    """The pruned AdaLN-curve DiT with int8 + ConvRot block linears: streamed sampling equals resident."""
    dit = _twin(tiny_dir, "diffusion_models", "minimax_h3_tiny_fl2va_pruned_int8_convrot.safetensors")
    source = ModelSource.from_path(tiny_dir, layout="comfyui")
    source.paths["transformer"] = dit
    request, _, seed = CASES["t2va-64x64-seed0"]
    cond = EncoderStage(source, components=("text",)).encode(request)
    options = SamplingOptions(steps=STEPS, seed=seed)
    expected = DiffusionStage(source).sample(cond, options)
    stage = DiffusionStage(source, offload="block")
    streamed = stage.sample(cond, options)
    assert torch.equal(streamed.video, expected.video) and torch.equal(streamed.audio, expected.audio)
    blocks = stage.transformer("t2va").transformer_blocks
    assert any(p.dtype == torch.int8 for p in blocks[0].parameters())
    assert sum(module is blocks[1] for module in onloads) == STEPS - 1
