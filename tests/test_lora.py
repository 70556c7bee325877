"""DiT LoRAs (Turbo distillations): every published naming, applied beside the weights, removed exactly."""

import copy

import pytest
import torch
from safetensors.torch import save_file
from support.lora_support import RANK
from support.lora_support import comfy_lora as _comfy_lora

from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.lora import LoRA, LoraError
from h3_core.models import ModelSource
from h3_core.testing import CASES, STEPS


@pytest.fixture(scope="module", autouse=True)
def _parity_threads(parity_threads):
    """Bitwise comparisons: the thread count is pinned (conftest.parity_threads)."""


@pytest.fixture(scope="module")
def setup(tiny_dir):
    source = ModelSource.from_path(tiny_dir)
    request = CASES["t2va-64x64-seed0"][0]
    return source, EncoderStage(source, ("text",)).encode(request), DiffusionStage(source)


def test_lora_changes_the_result_and_leaves_the_dit_untouched(setup, tmp_path):
    source, cond, stage = setup
    transformer = stage.transformer("t2va")
    _comfy_lora(tmp_path / "turbo.safetensors", transformer)
    lora = LoRA.load(tmp_path / "turbo.safetensors")
    assert len(lora.factors) == 4 * transformer.config.num_layers  # q, k, v split out of qkv_proj; ff.net.0.proj

    before = stage.sample(cond, SamplingOptions(steps=STEPS, seed=1))
    with_lora = stage.sample(cond, SamplingOptions(steps=STEPS, seed=1, lora=lora))
    after = stage.sample(cond, SamplingOptions(steps=STEPS, seed=1))
    assert not torch.equal(with_lora.video, before.video)
    assert torch.equal(after.video, before.video) and torch.equal(after.audio, before.audio)  # removed exactly
    half = stage.sample(cond, SamplingOptions(steps=STEPS, seed=1, lora=lora, lora_strength=0.0))
    assert torch.equal(half.video, before.video)


def test_lora_equals_merged_weights(setup, tmp_path):
    """y = W x + s B A x is the merged model W + s B A (alpha / rank = 8 / 4 folded by diffusers' converter)."""
    source, cond, stage = setup
    transformer = stage.transformer("t2va")
    _comfy_lora(tmp_path / "turbo.safetensors", transformer, seed=3)
    lora = LoRA.load(tmp_path / "turbo.safetensors")
    merged = copy.deepcopy(transformer)
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for name, (down, up, scale) in lora.factors.items():
            modules[name].weight += 0.7 * scale * (up @ down)
    reference = DiffusionStage(modules={"transformer": merged}, pipeline_config=source.pipeline_config)
    expected = reference.sample(cond, SamplingOptions(steps=STEPS, seed=2))
    got = stage.sample(cond, SamplingOptions(steps=STEPS, seed=2, lora=lora, lora_strength=0.7))
    assert (got.video - expected.video).abs().max() < 1e-4
    assert (got.audio - expected.audio).abs().max() < 1e-4


def test_bad_loras_are_refused(setup, tmp_path):
    _, _, stage = setup
    transformer = stage.transformer("t2va")
    wrong = tmp_path / "wrong.safetensors"
    save_file({"diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight": torch.zeros(RANK, 5),
               "diffusion_model.blocks.0.attn.qkv_proj.lora_B.weight": torch.zeros(3 * 64, RANK)}, str(wrong))
    with pytest.raises(LoraError, match="expects a LoRA of 64 -> 64"):
        LoRA.load(wrong).check(transformer)
    pickled = tmp_path / "turbo.pt"
    pickled.write_bytes(b"not read")
    with pytest.raises(LoraError, match="safetensors only"):
        LoRA.load(pickled)


def test_sampling_options_validate_and_are_immutable():
    import dataclasses

    from h3_core.rules import H3InputError

    for bad in (1, 0, 2.5, True, "8"):
        with pytest.raises(H3InputError, match="steps must be an integer >= 2"):
            SamplingOptions(steps=bad)
    options = SamplingOptions(steps=4, seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.steps = 5
    assert options.generator().initial_seed() == 3 and options.generator().device.type == "cpu"
