"""Release-size checkpoints of every published layout, as data-free header-only files.

Key names and shapes come from the meta-instantiated release models run through our writers'
converters (so nothing is copied by hand), are cross-checked against the published key lists
(docs/ARCHITECTURE.md §6), written as
sparse safetensors files (valid headers, no data on disk) in the Comfy, diffusers and native
containers, and then `check` must map every one onto its meta model with zero missing, zero
unexpected keys and equal shapes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from support import weights_support

from h3_core import configs, weights
from h3_core.weights import audio_vae_keys, text_encoder_keys, transformer_keys, video_vae_keys

GIB = 2**30


def _json(path, payload):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(payload, handle)


def _shards(folder, shapes, prefix, n=2):
    """Header-only shards + a standard index, splitting the sorted keys into n parts."""
    names = sorted(shapes)
    weight_map = {}
    for i in range(n):
        part = names[i::n]
        file_name = f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
        weights_support.write_header_only(os.path.join(folder, file_name), {k: shapes[k] for k in part})
        weight_map.update({k: file_name for k in part})
    _json(os.path.join(folder, f"{prefix}.safetensors.index.json"), {"metadata": {}, "weight_map": weight_map})


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    if not weights_support.sparse_files_supported(root):
        pytest.skip("this filesystem has no sparse files; release-size header fixtures would use real disk")
    dit = weights_support.release_meta_model("transformer")
    vae = weights_support.release_meta_model("vae")
    audio = weights_support.release_meta_model("audio_vae")
    te = weights_support.release_meta_model("text_encoder")
    dit_cfg, vae_cfg, audio_cfg = (configs.get(n, tiny=False) for n in ("transformer", "vae", "audio_vae"))
    te_cfg = te.config.to_dict()

    # Comfy-Org single files.
    comfy = root / "comfy"
    files = {
        "transformer": comfy / "minimax_h3_fl2va_bf16.safetensors",
        "vae": comfy / "minimax_h3_video_vae_fp16.safetensors",
        "audio_vae": comfy / "minimax_h3_audio_vae_fp32.safetensors",
        "text_encoder": comfy / "qwen3vl_32b_minimax_h3_bf16.safetensors",
    }
    comfy_shapes = {
        "transformer": weights_support.shapes_of(
            transformer_keys.from_diffusers(dit.state_dict(), dit_cfg, "comfy"), weights_support.dit_dtype
        ),
        "vae": weights_support.shapes_of(
            video_vae_keys.from_diffusers(vae.state_dict(), vae_cfg),
            lambda k, t: torch.float32 if k.startswith("latents_") else torch.float16,
        ),
        "audio_vae": weights_support.shapes_of(audio_vae_keys.from_diffusers(audio.state_dict(), audio_cfg)),
        "text_encoder": weights_support.shapes_of(
            text_encoder_keys.from_transformers(te.state_dict(), 50), lambda k, t: torch.bfloat16
        ),
    }
    sizes = {c: weights_support.write_header_only(str(files[c]), comfy_shapes[c]) for c in files}

    # diffusers pipeline root (sharded DiT, 64-layer transformers text encoder).
    droot = root / "MiniMax-H3-diffusers"
    _json(str(droot / "model_index.json"), {"_class_name": "MiniMaxH3Pipeline"})
    for folder, model, cfg, cls in (
        ("transformer", dit, dit_cfg, "MiniMaxH3Transformer3DModel"),
        ("transformer_ref", dit, dit_cfg, "MiniMaxH3Transformer3DModel"),
        ("vae", vae, vae_cfg, "AutoencoderKLMiniMaxH3"),
        ("audio_vae", audio, audio_cfg, "AutoencoderKLMiniMaxH3Audio"),
    ):
        _json(str(droot / folder / "config.json"), {"_class_name": cls, **cfg})
        _shards(str(droot / folder), weights_support.shapes_of(model.state_dict()), "diffusion_pytorch_model")
    _json(str(droot / "text_encoder" / "config.json"), te_cfg)
    te_shapes = weights_support.shapes_of(te.state_dict(), lambda k, t: torch.bfloat16)
    _shards(str(droot / "text_encoder"), te_shapes, "model", n=3)

    # Native MiniMaxAI partition.
    nroot = root / "FL2VA"
    _json(str(nroot / "model_index.json"), {"_minimax_h3": {"partition": "FL2VA", "tasks": ["t2va", "fl2va"]}})
    native_dit = weights_support.shapes_of(
        transformer_keys.from_diffusers(dit.state_dict(), dit_cfg, "native"), weights_support.dit_dtype
    )
    _shards(str(nroot / "transformer"), native_dit, "model", n=4)
    _json(
        str(nroot / "transformer" / "config.json"),
        {
            "token_refiner_num_layers": 2,
            "ffn_hidden_size": 14336,
            **{k: v for k, v in dit_cfg.items() if k not in ("num_refiner_layers", "ffn_dim")},
        },
    )
    native_vae = video_vae_keys.from_diffusers(vae.state_dict(), vae_cfg, with_latent_stats=False)
    vae_file = str(nroot / "video_vae" / "source" / "model.safetensors")
    weights_support.write_header_only(vae_file, weights_support.shapes_of(native_vae))
    _json(
        str(nroot / "video_vae" / "config.json"),
        {
            "auto_map": {"AutoModel": "vae.MiniMaxH3VAE"},
            "latent_channels": 24,
            "source_path": "source",
            "source_safetensors_path": "model.safetensors",
            "latents_mean": [0.1] * 24,
            "latents_std": [1.1] * 24,
        },
    )
    audio_shapes = weights_support.shapes_of(audio.state_dict())
    weights_support.write_header_only(str(nroot / "audio_vae" / "model.safetensors"), audio_shapes)
    _json(
        str(nroot / "audio_vae" / "config.json"),
        {"latent_channels": 32, "sample_rate": 32000, "latents_mean": [0.0] * 32, "latents_std": [1.0] * 32},
    )
    _json(
        str(nroot / "audio_vae" / "metadata.json"),
        {
            "metadata": {
                "kwargs": {
                    "encoder_dim": 64,
                    "encoder_rates": [2, 4, 4, 5, 5],
                    "latent_dim": 2048,
                    "decoder_dim": 1024,
                    "decoder_rates": [5, 5, 2, 2, 2, 2, 2],
                    "vae_latent_channels": 32,
                    "sample_rate": 32000,
                    "decoder_type": "bigvgan",
                    "attn_proj": True,
                }
            }
        },
    )
    legacy_te = {}
    for key, tensor in te.state_dict().items():  # the older HF Qwen-VL spelling, full 64 layers
        key = key.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        legacy_te[key] = tensor
    _json(str(nroot / "text_encoder" / "config.json"), te_cfg)
    legacy_shapes = weights_support.shapes_of(legacy_te, lambda k, t: torch.bfloat16)
    _shards(str(nroot / "text_encoder"), legacy_shapes, "model", n=3)
    return {"files": files, "sizes": sizes, "shapes": comfy_shapes, "diffusers": droot, "native": nroot}


def test_comfy_names_and_shapes_match_spec(release):
    """A few §5.1 key names with the release shapes they must have."""
    s = {c: {k: v[1] for k, v in shapes.items()} for c, shapes in release["shapes"].items()}
    dit = s["transformer"]
    assert dit["video_patch_proj.weight"] == (5376, 96)
    assert dit["audio_patch_proj.weight"] == (5376, 32)
    assert dit["condition_proj.weight"] == (5376, 5120)
    assert dit["time_embedder.proj_in.weight"] == (5376, 256)
    assert dit["time_embedder.proj_out.weight"] == (2688, 5376)
    assert dit["rope.inv_freq"] == (16,)
    assert dit["blocks.49.attn.qkv_proj.weight"] == (3 * 7168, 5376)
    assert dit["token_refiner.blocks.1.attn.qkv_proj.weight"] == (3 * 7168, 5376)
    assert dit["blocks.0.attn.q_norm.weight"] == (128,)
    assert dit["blocks.0.mlp.fc1.weight"] == (2 * 14336, 5376)
    assert dit["blocks.0.mlp.fc2.weight"] == (5376, 14336)
    assert dit["blocks.0.adaln_proj.linear.weight"] == (18 * 5376, 2688)
    assert dit["final_layer.adaln_proj.linear.weight"] == (2 * 5376, 2688)
    assert dit["final_layer.video_out.weight"] == (96, 5376)
    assert dit["final_layer.audio_out.weight"] == (32, 5376)
    assert "token_refiner.final_norm.weight" in dit and "blocks.50.norm1.weight" not in dit
    assert sum(1 for k in dit if k.endswith(".attn.qkv_proj.weight")) == 52
    assert release["sizes"]["transformer"] / 1e9 == pytest.approx(66.3, abs=0.3)  # published: 66.3 GB bf16
    vae = s["vae"]
    assert vae["encoder.down.5.block.0.conv1.weight"] == (1024, 512, 3, 3, 3)
    assert "decoder.transformer_blocks.0.scale1" in vae
    assert vae["decoder.x_embedder.weight"] == (2048, 24)
    assert vae["decoder.transformer_blocks.35.attn.to_qkv.weight"] == (3 * 2048, 2048)
    assert vae["decoder.transformer_blocks.0.ff.w1.weight"] == (2 * 8192, 2048)
    assert vae["decoder.proj_out.weight"] == (3 * 4 * 16 * 16, 2048)
    assert vae["decoder.mask_token"] == (1, 1, 2048) and vae["latents_mean"] == (24,)
    assert release["sizes"]["vae"] / 1e9 == pytest.approx(5.21, abs=0.05)  # published: fp16 file 5.21 GB
    audio = s["audio_vae"]
    assert "pre_block.attn.zero_k_bias" in audio and audio["pre_block.attn.qkv.weight"] == (6144, 2048)
    assert audio["dec_in_proj.weight"] == (2048, 32, 1) and audio["decoder.conv_pre.weight"] == (1024, 2048, 7)
    assert audio["decoder.conv_post.weight"] == (1, 8, 7) and "decoder.conv_post.bias" not in audio
    assert audio["latents_mean"] == (32,) and not any(k.endswith(("weight_g", "weight_v")) for k in audio)
    assert sum(1 for k in audio if k.startswith("decoder.resblocks.") and k.endswith("convs1.0.weight")) == 21
    assert release["sizes"]["audio_vae"] / 1e6 == pytest.approx(605, abs=5)  # published: 605 MB
    te = s["text_encoder"]
    assert te["model.embed_tokens.weight"] == (151936, 5120)
    assert te["model.layers.49.self_attn.q_proj.weight"] == (8192, 5120)
    assert te["model.layers.49.self_attn.k_proj.weight"] == (1024, 5120)
    assert te["model.layers.0.mlp.gate_proj.weight"] == (25600, 5120)
    assert "visual.deepstack_merger_list.0.norm.weight" in te and "model.layers.50.input_layernorm.weight" not in te
    assert not any(k.startswith(("model.norm", "lm_head")) for k in te)


@pytest.mark.parametrize("component", ["transformer", "vae", "audio_vae", "text_encoder"])
def test_release_comfy_file_maps_onto_the_meta_model(release, component):
    report = weights.check(release["files"][component])
    assert report.ok, str(report)
    (result,) = report.components
    assert (result.detection.component, result.detection.layout) == (component, "comfyui")
    assert result.missing == [] and result.unexpected == [] and result.mismatched == []
    # Comfy files state no config: shapes + release values must give the release config exactly.
    release_config = configs.get(component, tiny=False)
    if component == "text_encoder":
        release_config["text_config"]["num_hidden_layers"] = 50
    assert result.config == release_config
    if component == "transformer":
        assert result.detection.partition == "fl2va"


def test_release_diffusers_root_maps_onto_the_meta_models(release):
    report = weights.check(release["diffusers"])
    assert report.ok, str(report)
    found = {(c.detection.component, c.detection.partition) for c in report.components}
    assert found == {
        ("transformer", "fl2va"),
        ("transformer", "ref2va"),
        ("vae", None),
        ("audio_vae", None),
        ("text_encoder", None),
    }
    assert all(c.detection.layout == "diffusers" for c in report.components)
    te = next(c for c in report.components if c.detection.component == "text_encoder")
    assert "64 decoder layers, with final norm" in te.detection.notes


def test_release_native_partition_maps_onto_the_meta_models(release):
    report = weights.check(release["native"])
    assert report.ok, str(report)
    assert {c.detection.component for c in report.components} == {"transformer", "vae", "audio_vae", "text_encoder"}
    assert all(c.detection.layout == "native" for c in report.components)
    dit = next(c for c in report.components if c.detection.component == "transformer")
    assert dit.detection.partition == "fl2va" and len(dit.detection.files) == 4
    audio = next(c for c in report.components if c.detection.component == "audio_vae")
    assert audio.detection.key_format == "weight_norm"
