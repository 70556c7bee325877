"""Tiny round trips through every published layout, bit-exact in weights and in outputs."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from support import weights_support

from h3_core import weights
from h3_core.weights import audio_vae_keys, transformer_keys, video_vae_keys


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # Any hub access would be a bug: make it fail loudly instead of downloading.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# --- DiT ----------------------------------------------------------------------------------------


def test_transformer_comfy_round_trip_is_bit_exact(tmp_path):
    model = weights_support.tiny_transformer(seed=0)
    path = tmp_path / "minimax_h3_fl2va_tiny.safetensors"
    weights.save_comfy_transformer(model, str(path))
    loaded = weights.load_transformer(path)
    assert weights_support.state_dicts_equal(model, loaded)
    for a, b in zip(weights_support.dit_forward(model), weights_support.dit_forward(loaded)):
        assert torch.equal(a, b)


def test_transformer_native_round_trip_is_bit_exact(tmp_path):
    model = weights_support.tiny_transformer(seed=1)
    root = tmp_path / "Ref2VA"
    files = weights.save_native_transformer(model, str(root), max_shard_bytes=256 * 1024)
    assert len(files) > 1  # exercises the shard index
    det = weights.detect(root / "transformer")
    assert (det.layout, det.partition) == ("native", "ref2va")
    index = json.loads((root / "model_index.json").read_text())
    assert index["_minimax_h3"]["partition"] == "Ref2VA" and index["_minimax_h3"]["tasks"] == ["ref2va"]
    loaded = weights.load_transformer(root)
    assert weights_support.state_dicts_equal(model, loaded)
    for a, b in zip(weights_support.dit_forward(model), weights_support.dit_forward(loaded)):
        assert torch.equal(a, b)


def test_transformer_qkv_layouts_match_diffusers_own_converter():
    """Our reference->diffusers DiT conversion equals diffusers' single-file converter for both the
    stacked (Comfy) and interleaved (native) QKV row orders."""
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    model = weights_support.tiny_transformer(seed=2)
    config = dict(model.config)
    for naming, qkv_layout in (("comfy", "stacked"), ("native", "interleaved")):
        reference = transformer_keys.from_diffusers(model.state_dict(), config, naming)
        ours, unexpected = transformer_keys.to_diffusers(reference, config, naming)
        theirs = convert_minimax_h3_transformer_checkpoint_to_diffusers(
            dict(reference), config=config, qkv_layout=qkv_layout
        )
        assert unexpected == []
        assert weights_support.state_dicts_equal(ours, theirs)
        assert weights_support.state_dicts_equal(ours, model.state_dict())
    comfy = transformer_keys.from_diffusers(model.state_dict(), config, "comfy")
    native = transformer_keys.from_diffusers(model.state_dict(), config, "native")
    qkv = "blocks.0.attn.qkv_proj.weight"
    assert not torch.equal(comfy[qkv], native[qkv])  # the two layouts really differ


def test_comfy_dit_goes_through_diffusers_single_file_loader_offline(tmp_path, monkeypatch):
    from diffusers import MiniMaxH3Transformer3DModel

    calls = []
    original = MiniMaxH3Transformer3DModel.from_single_file.__func__

    def spy(cls, path, **kwargs):
        calls.append((path, kwargs))
        assert os.path.isfile(os.path.join(kwargs["config"], "config.json"))  # a local config folder
        return original(cls, path, **kwargs)

    monkeypatch.setattr(MiniMaxH3Transformer3DModel, "from_single_file", classmethod(spy))
    model = weights_support.tiny_transformer(seed=4)
    path = tmp_path / "minimax_h3_fl2va_tiny.safetensors"
    weights.save_comfy_transformer(model, str(path))
    assert weights_support.state_dicts_equal(weights.load_transformer(path), model)
    ((called_path, kwargs),) = calls
    assert called_path == str(path) and kwargs["local_files_only"] is True


def _diffusers_reference(component, model, folder, dtype):
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel
    from transformers import Qwen3VLForConditionalGeneration

    model.save_pretrained(folder)
    if component == "text_encoder":
        return Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=dtype, local_files_only=True)
    cls = {
        "transformer": MiniMaxH3Transformer3DModel,
        "video_vae": AutoencoderKLMiniMaxH3,
        "audio_vae": AutoencoderKLMiniMaxH3Audio,
    }
    return cls[component].from_pretrained(folder, torch_dtype=dtype, local_files_only=True)


@pytest.mark.parametrize(
    "component, build, save, load",
    [
        ("transformer", weights_support.tiny_transformer, weights.save_comfy_transformer, weights.load_transformer),
        ("video_vae", weights_support.tiny_video_vae, weights.save_comfy_video_vae, weights.load_video_vae),
        ("audio_vae", weights_support.tiny_audio_vae, weights.save_comfy_audio_vae, weights.load_audio_vae),
        ("text_encoder", weights_support.tiny_text_encoder, weights.save_comfy_text_encoder, weights.load_text_encoder),
    ],
    ids=["transformer", "video_vae", "audio_vae", "text_encoder"],
)
def test_bf16_loading_matches_from_pretrained(tmp_path, component, build, save, load):
    """dtype=bf16 gives the dtypes (fp32 islands included) and values from_pretrained gives."""
    model = build(seed=3)
    reference = _diffusers_reference(component, model, tmp_path / "folder", torch.bfloat16).state_dict()
    save(model, str(tmp_path / "comfy.safetensors"))
    for path in (tmp_path / "folder", tmp_path / "comfy.safetensors"):
        loaded = load(path, dtype=torch.bfloat16).state_dict()
        if component == "audio_vae" and path.name.endswith(".safetensors"):
            reference_cmp = audio_vae_keys.fold_weight_norm(_fp32(model.state_dict()))
            assert all(loaded[k].dtype == torch.float32 for k in loaded)  # the audio VAE stays fp32
            assert weights_support.state_dicts_equal(loaded, reference_cmp)
            continue
        common = set(loaded) & set(reference)
        assert common == set(loaded), sorted(set(loaded) - set(reference))[:3]
        assert {k: loaded[k].dtype for k in common} == {k: reference[k].dtype for k in common}, path
        assert all(torch.equal(loaded[k], reference[k]) for k in common), path
        if component == "transformer":
            assert (
                loaded["proj_in.weight"].dtype == torch.float32
                and loaded["context_embedder.weight"].dtype == torch.bfloat16
            )


def _fp32(state):
    return {k: v.float() for k, v in state.items()}


# --- video VAE ----------------------------------------------------------------------------------


def test_video_vae_comfy_round_trip_is_bit_exact(tmp_path):
    vae = weights_support.tiny_video_vae(seed=0)
    path = tmp_path / "minimax_h3_video_vae_tiny.safetensors"
    weights.save_comfy_video_vae(vae, str(path))
    loaded = weights.load_video_vae(path)
    assert weights_support.state_dicts_equal(vae, loaded)
    assert list(loaded.config.latents_mean) == list(vae.config.latents_mean)
    assert list(loaded.config.latents_std) == list(vae.config.latents_std)
    latent = torch.randn(1, 24, 7, 2, 2, generator=torch.Generator().manual_seed(0))  # 22 frames
    with torch.no_grad():
        assert torch.equal(vae.decode(latent).sample, loaded.decode(latent).sample)


def test_video_vae_fused_layouts_mean_what_comfyui_computes():
    """Comfy's decoder views `to_qkv` output as [.., heads, 3 * head_dim] and chunks it, and
    computes `silu(gate) * value` from `ff.w1 = [gate; value]`; our file must mean the same."""
    vae = weights_support.tiny_video_vae(seed=1)
    config = dict(vae.config)
    comfy = video_vae_keys.from_diffusers(vae.state_dict(), config)
    block = vae.decoder.transformer_blocks[0]
    heads, head_dim = config["decoder_num_attention_heads"], config["decoder_attention_head_dim"]
    x = torch.randn(1, 5, heads * head_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        qkv = torch.nn.functional.linear(
            x,
            comfy["decoder.transformer_blocks.0.attn.to_qkv.weight"],
            comfy["decoder.transformer_blocks.0.attn.to_qkv.bias"],
        )
        q, k, v = qkv.view(1, 5, heads, 3 * head_dim).chunk(3, dim=-1)
        assert torch.allclose(q.flatten(2), block.attn.to_q(x), atol=1e-6, rtol=0)
        assert torch.allclose(k.flatten(2), block.attn.to_k(x), atol=1e-6, rtol=0)
        assert torch.allclose(v.flatten(2), block.attn.to_v(x), atol=1e-6, rtol=0)
        hidden = torch.nn.functional.linear(
            x, comfy["decoder.transformer_blocks.0.ff.w1.weight"], comfy["decoder.transformer_blocks.0.ff.w1.bias"]
        )
        gate, value = hidden.chunk(2, dim=-1)
        assert torch.allclose(torch.nn.functional.silu(gate) * value, block.ff.net[0](x), atol=1e-6, rtol=0)
    assert torch.count_nonzero(comfy["decoder.mask_token"]) == 0


# --- audio VAE ----------------------------------------------------------------------------------


def test_audio_vae_folded_file_is_bit_exact_with_the_weight_normed_model(tmp_path):
    vae = weights_support.tiny_audio_vae(seed=0)
    path = tmp_path / "minimax_h3_audio_vae_tiny.safetensors"
    weights.save_comfy_audio_vae(vae, str(path))
    assert weights.detect(path).key_format == "folded"
    loaded = weights.load_audio_vae(path)
    # Folded weights equal what the weight-norm hook computes, and the forward is bit-exact.
    folded = audio_vae_keys.fold_weight_norm(vae.state_dict())
    assert weights_support.state_dicts_equal(folded, loaded)
    assert list(loaded.config.latents_mean) == list(vae.config.latents_mean)
    latent = torch.randn(2, 32, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(vae.decode(latent).sample, loaded.decode(latent).sample)
        # and the encoder path too (posterior mean)
        audio = torch.rand(2, 1, 1600, generator=torch.Generator().manual_seed(1)) * 2 - 1
        assert torch.equal(vae.encode(audio).latent_dist.mode(), loaded.encode(audio).latent_dist.mode())


def test_audio_vae_diffusers_folder_keeps_weight_norm(tmp_path):
    vae = weights_support.tiny_audio_vae(seed=1)
    vae.save_pretrained(tmp_path / "audio_vae")
    loaded = weights.load_audio_vae(tmp_path / "audio_vae")
    assert weights_support.state_dicts_equal(vae, loaded)
    assert any(k.endswith("weight_g") for k in loaded.state_dict())


# --- text encoder (the layer-50 proof lives in test_weights_text_encoder.py) -----------------------


def test_text_encoder_comfy_round_trip_keeps_every_written_tensor(tmp_path):
    model = weights_support.tiny_text_encoder(seed=0)
    path = tmp_path / "qwen3vl_tiny_minimax_h3.safetensors"
    weights.save_comfy_text_encoder(model, str(path))
    loaded = weights.load_text_encoder(path)
    original, back = model.state_dict(), loaded.state_dict()
    dropped = {"lm_head.weight", "model.language_model.norm.weight"}  # the file has no head, no final norm
    kept = {k for k in original if k not in dropped and not k.startswith("model.language_model.layers.50.")}
    assert set(back) == kept
    assert all(torch.equal(original[k], back[k]) for k in back)
    assert torch.equal(weights_support.prompt_embeds(model), weights_support.prompt_embeds(loaded))


# --- writers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, save, load",
    [
        (weights_support.tiny_transformer, weights.save_comfy_transformer, weights.load_transformer),
        (weights_support.tiny_video_vae, weights.save_comfy_video_vae, weights.load_video_vae),
        (weights_support.tiny_audio_vae, weights.save_comfy_audio_vae, weights.load_audio_vae),
        (weights_support.tiny_text_encoder, weights.save_comfy_text_encoder, weights.load_text_encoder),
    ],
    ids=["transformer", "video_vae", "audio_vae", "text_encoder"],
)
def test_comfy_writers_are_deterministic_and_idempotent(tmp_path, build, save, load):
    first, second, again = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    save(build(seed=5), str(first))
    save(build(seed=5), str(second))
    assert _digest(first) == _digest(second)
    save(load(first), str(again))  # load -> write reproduces the very same bytes
    assert _digest(first) == _digest(again)
