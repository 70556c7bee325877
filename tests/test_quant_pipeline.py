"""The quantised and re-typed twins in the pipeline: `encode` with every text-encoder twin gives a contract,
`generate` with every DiT twin samples, and writes a valid mp4 with the quantised ones."""

import os
import shutil

import pytest
import torch

from h3_core import configs, media, weights
from h3_core.contract import H3Conditioning
from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.request import EncodeRequest
from h3_core.testing import image
from h3_core.tiny import twins as tiny_twins
from h3_core.weights.quant.linear import QuantLinear

AUDIO_VAE = "vae/minimax_h3_tiny_audio_vae_fp32.safetensors"


@pytest.fixture(scope="module")
def comfy(tiny_dir, tmp_path_factory):
    comfy = tiny_dir / "comfyui"
    wanted = [tiny_twins.twin_path(f, v) for f, variants in tiny_twins.TWIN_FILES.items() for v in variants]
    if all((comfy / rel).is_file() for rel in wanted):
        return comfy
    out = tmp_path_factory.mktemp("twins")
    for rel in [*tiny_twins.SOURCES.values(), AUDIO_VAE]:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(comfy / rel, out / rel)
    tiny_twins.write_twins(out)
    return out


def _models(root, comfy, files) -> ModelSource:
    """A ComfyUI models folder holding exactly `files` (links into the tiny build): tiny weights, so the folder runs
    at the tiny's canvas rule and Qwen processor (ModelSource follows the links to the build's tiny.json)."""
    for rel in [*files, AUDIO_VAE]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(comfy / rel, root / rel)
    source = ModelSource.from_path(root)
    assert source.tiny and source.pipeline_config == configs.get("pipeline", tiny=True)
    return source


REQUESTS = {
    "t2va": EncodeRequest(prompt="A red fox in the snow.", width=64, height=64, num_frames=124),
    "ref2va": EncodeRequest(prompt="<Picture 1> walks in.", ref_images=[image(3, 64, 96)], width=64, height=64,
                            num_frames=124),
}


@pytest.fixture(scope="module")
def conds(comfy, tmp_path_factory):
    """t2va conditionings from each text-encoder twin, and one ref2va (its image through the int8 VAE twin)."""
    files = [tiny_twins.twin_path("text_encoder", "bf16"), tiny_twins.twin_path("video_vae", "int8_convrot")]
    base = EncoderStage(_models(tmp_path_factory.mktemp("encoder"), comfy, files))
    out = {"ref2va": base.encode(REQUESTS["ref2va"])}
    for variant in tiny_twins.TWIN_FILES["text_encoder"]:
        modules = {"text_encoder": weights.load_text_encoder(comfy / tiny_twins.twin_path("text_encoder", variant)),
                   "tokenizer": base.tokenizer, "processor": base.processor}
        out[variant] = EncoderStage(modules=modules, pipeline_config=base.pipeline_config).encode(REQUESTS["t2va"])
    return out


@pytest.mark.parametrize("variant", tiny_twins.TWIN_FILES["text_encoder"])
def test_encode_with_every_text_encoder_twin_gives_a_contract(conds, tmp_path, variant):
    cond = conds[variant]
    assert cond.task == "t2va" and torch.isfinite(cond.prompt_embeds).all()
    cond.save(tmp_path / "cond.safetensors")
    assert torch.equal(H3Conditioning.load(tmp_path / "cond.safetensors").prompt_embeds, cond.prompt_embeds)
    if variant != "bf16":  # quantised encoders give other embeddings than the bf16 one
        assert not torch.equal(cond.prompt_embeds, conds["bf16"].prompt_embeds)
    assert conds["ref2va"].task == "ref2va"


@pytest.fixture(scope="module")
def decoders(comfy):
    return {"vae": weights.load_video_vae(comfy / tiny_twins.twin_path("video_vae", "fp16")),
            "audio_vae": weights.load_audio_vae(comfy / AUDIO_VAE)}


@pytest.mark.parametrize("variant", tiny_twins.TWIN_FILES["fl2va"])
def test_generate_with_every_dit_twin(comfy, conds, decoders, tmp_path, variant):
    """Both partitions of each DiT twin sample; the quantised ones also decode to a valid mp4 (a tiny decode of
    124 frames dominates this module's time; the bf16 twins are dense files on the path every fp32 test takes)."""
    modules = {"transformer": weights.load_transformer(comfy / tiny_twins.twin_path("fl2va", variant)),
               "transformer_ref": weights.load_transformer(comfy / tiny_twins.twin_path("ref2va", variant)),
               **decoders}
    stage = DiffusionStage(modules=modules, pipeline_config=configs.get("pipeline", tiny=True))
    for task, cond in (("t2va", conds["nvfp4_awq"]), ("ref2va", conds["ref2va"])):
        quantised = any(isinstance(m, QuantLinear) for m in stage.transformer(task).modules())
        assert quantised == (variant == "int8_convrot")
        if not quantised:
            latents = stage.sample(cond, SamplingOptions(steps=2, seed=0))
            assert torch.isfinite(latents.video).all() and torch.isfinite(latents.audio).all()
            continue
        _, decoded = stage.generate(cond, SamplingOptions(steps=2, seed=0))
        path = media.write_mp4(tmp_path / f"{task}.mp4", decoded.video, decoded.audio, fps=decoded.fps,
                               sample_rate=decoded.sample_rate)
        probe = media.probe(path)
        assert (probe["width"], probe["height"], probe["frames"], probe["channels"]) == (64, 64, 124, 2)
