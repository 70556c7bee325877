"""detect / check on the tiny files, refusals, native partitions, and header-only speed."""

from __future__ import annotations

import json
import time

import pytest
import torch
from support import weights_support

from h3_core import weights
from h3_core.weights import safetensors_io, transformer_keys, video_vae_keys


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The four tiny components, their Comfy files in one models folder, and a native partition."""
    root = tmp_path_factory.mktemp("tiny_weights")
    models = {
        "transformer": weights_support.tiny_transformer(seed=0),
        "vae": weights_support.tiny_video_vae(seed=0),
        "audio_vae": weights_support.tiny_audio_vae(seed=0),
        "text_encoder": weights_support.tiny_text_encoder(seed=0),
    }
    comfy = root / "models"
    files = {
        "transformer": comfy / "minimax_h3_ref2va_tiny.safetensors",
        "vae": comfy / "minimax_h3_video_vae_tiny.safetensors",
        "audio_vae": comfy / "minimax_h3_audio_vae_tiny.safetensors",
        "text_encoder": comfy / "qwen3vl_tiny_minimax_h3.safetensors",
    }
    weights.save_comfy_transformer(models["transformer"], str(files["transformer"]))
    weights.save_comfy_video_vae(models["vae"], str(files["vae"]))
    weights.save_comfy_audio_vae(models["audio_vae"], str(files["audio_vae"]))
    weights.save_comfy_text_encoder(models["text_encoder"], str(files["text_encoder"]))

    native = root / "FL2VA"
    weights.save_native_transformer(models["transformer"], str(native))  # + model_index.json
    vae = models["vae"]
    safetensors_io.write_file(  # Comfy key names, latents in config.json, weights under source/
        str(native / "video_vae" / "source" / "model.safetensors"),
        video_vae_keys.from_diffusers(vae.state_dict(), dict(vae.config), with_latent_stats=False),
        {"format": "pt"},
    )
    (native / "video_vae" / "config.json").write_text(
        json.dumps({"source_path": "source", "source_safetensors_path": "model.safetensors",
                    "latents_mean": list(vae.config.latents_mean), "latents_std": list(vae.config.latents_std),
                    "decoder_num_attention_heads": 2, "decoder_attention_head_dim": 16, "norm_num_groups": 8})
    )
    audio = models["audio_vae"]
    safetensors_io.write_file(str(native / "audio_vae" / "model.safetensors"), audio.state_dict(), {"format": "pt"})
    (native / "audio_vae" / "config.json").write_text(
        json.dumps({"latent_channels": 32, "sample_rate": 32000, "latents_mean": list(audio.config.latents_mean),
                    "latents_std": list(audio.config.latents_std), "num_attention_heads": 2})
    )
    models["text_encoder"].save_pretrained(native / "text_encoder")
    return {"models": models, "files": files, "comfy": comfy, "native": native}


@pytest.mark.parametrize("component", ["transformer", "vae", "audio_vae", "text_encoder"])
def test_detect_comfy_files(tiny, component):
    det = weights.detect(tiny["files"][component])
    assert (det.component, det.layout) == (component, "comfyui")
    assert det.partition == ("ref2va" if component == "transformer" else None)
    assert det.num_tensors == len(det.header.tensors) > 0
    assert component in det.summary()


def test_check_models_folder_reports_every_file(tiny):
    report = weights.check(tiny["comfy"])
    assert report.ok, str(report)
    assert len(report.components) == 4
    text = str(report)
    assert text.count("0 missing, 0 unexpected") == 4 and "all components OK" in text


def test_native_partition_detects_checks_and_loads_bit_exactly(tiny):
    native, models = tiny["native"], tiny["models"]
    report = weights.check(native)
    assert report.ok, str(report)
    assert {c.detection.layout for c in report.components} == {"native"}
    dit = weights.load_transformer(native)
    assert weights.detect(native / "transformer").partition == "fl2va"
    assert weights_support.state_dicts_equal(dit, models["transformer"])
    vae = weights.load_video_vae(native)
    assert weights_support.state_dicts_equal(vae, models["vae"])
    assert list(vae.config.latents_std) == list(models["vae"].config.latents_std)
    audio = weights.load_audio_vae(native)
    assert weights_support.state_dicts_equal(audio, models["audio_vae"])  # weight_g / weight_v kept
    text = weights.load_text_encoder(native)
    assert weights_support.state_dicts_equal(text, models["text_encoder"])


def test_pipeline_root_with_two_partitions_needs_a_choice(tiny, tmp_path):
    model = tiny["models"]["transformer"]
    model.save_pretrained(tmp_path / "transformer")
    model.save_pretrained(tmp_path / "transformer_ref")
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(weights.H3WeightsError, match="partition='fl2va' or 'ref2va'"):
        weights.load_transformer(tmp_path)
    assert weights_support.state_dicts_equal(weights.load_transformer(tmp_path, partition="ref2va"), model)
    assert weights.detect(tmp_path / "transformer_ref").partition == "ref2va"


# --- refusals and broken files ------------------------------------------------------------------


def _tiny_dit_shapes(model) -> dict:
    comfy = transformer_keys.from_diffusers(model.state_dict(), dict(model.config), "comfy")
    return weights_support.shapes_of(comfy, weights_support.dit_dtype)


def test_pruned_dit_header_is_the_pruned_family(tiny, tmp_path):
    """A pruned ("AdaLN curve") DiT is the DiT's `pruned` key family: K-wide AdaLN projections, no time_embedder."""
    shapes = _tiny_dit_shapes(tiny["models"]["transformer"])
    for key in [k for k in shapes if k.startswith("time_embedder.")]:
        del shapes[key]
    shapes["adaln_t_table"] = (torch.float32, (1001, 8))
    for key in [k for k in shapes if "adaln_proj.linear.weight" in k]:
        shapes[key] = (torch.float16, (shapes[key][1][0], 8))
    path = tmp_path / "minimax_h3_fl2va_pruned_bf16.safetensors"
    weights_support.write_header_only(str(path), shapes)
    det = weights.detect(path)
    assert (det.component, det.partition, det.key_format, det.format) == ("transformer", "fl2va", "pruned", "dense")
    report = weights.check(path)
    assert report.ok and "adaln_t_table [1001, 8]" in str(report), str(report)
    shapes["adaln_t_table"] = (torch.float32, (1001, 4))  # AdaLN projections 8 wide: the shapes disagree
    weights_support.write_header_only(str(path), shapes)
    assert not weights.check(path).ok


@pytest.mark.parametrize("variant", ["int8_convrot", "fp8_scaled"])
def test_quantised_files_with_unreadable_markers_are_refused(tiny, tmp_path, variant):
    """Quantised files load (tests/test_quant_*.py); one whose .comfy_quant markers are not JSON (here: a
    header-only file, its markers zeros) is refused by name, before any weight is read."""
    shapes = _tiny_dit_shapes(tiny["models"]["transformer"])
    for key in [k for k in shapes if k.startswith("blocks.") and k.endswith(("qkv_proj.weight", "fc1.weight"))]:
        rows = shapes[key][1][0]
        shapes[key] = (torch.int8 if variant == "int8_convrot" else torch.float8_e4m3fn, shapes[key][1])
        shapes[key[: -len("weight")] + "weight_scale"] = (torch.float32, (rows,))
        shapes[key[: -len("weight")] + "comfy_quant"] = (torch.uint8, (32,))
    path = tmp_path / f"minimax_h3_fl2va_{variant}.safetensors"
    weights_support.write_header_only(str(path), shapes)
    with pytest.raises(weights.H3WeightsError, match="unreadable .comfy_quant marker") as excinfo:
        weights.detect(path)
    assert "blocks.0." in str(excinfo.value)
    assert not weights.check(path).ok


def test_broken_and_foreign_files_get_clear_errors(tiny, tmp_path):
    source = tiny["files"]["vae"]
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(source.read_bytes()[:-100])
    with pytest.raises(weights.IncompleteFileError, match="interrupted download"):
        weights.detect(truncated)
    foreign = tmp_path / "foreign.safetensors"
    weights_support.write_header_only(str(foreign), {"conv.weight": (torch.float32, (4, 4))})
    with pytest.raises(weights.UnrecognisedCheckpointError, match="not a MiniMax-H3 component"):
        weights.detect(foreign)
    pickled = tmp_path / "model.ckpt"
    pickled.write_bytes(b"not read")
    with pytest.raises(weights.UnrecognisedCheckpointError, match="never pickled"):
        weights.detect(pickled)
    with pytest.raises(weights.H3WeightsError, match="holds the H3 DiT, not the video VAE"):
        weights.load_video_vae(tiny["files"]["transformer"])


def test_check_lists_missing_unexpected_and_misshaped_keys(tiny, tmp_path):
    shapes = _tiny_dit_shapes(tiny["models"]["transformer"])
    del shapes["blocks.1.mlp.fc2.weight"]
    shapes["blocks.0.attn.to_gate_compress.weight"] = (torch.bfloat16, (64, 64))  # a FastH3 VSA gate
    shapes["final_layer.video_out.weight"] = (torch.float32, (192, 64))  # a PDD head bank
    path = tmp_path / "minimax_h3_fl2va_modified.safetensors"
    config = json.dumps(dict(tiny["models"]["transformer"].config))
    weights_support.write_header_only(str(path), shapes, {"h3.config": config})
    (result,) = weights.check(path).components
    assert result.missing == ["transformer_blocks.1.ff.net.2.weight"]
    assert result.unexpected == ["blocks.0.attn.to_gate_compress.weight"]
    assert result.mismatched == [("proj_out.weight", (192, 64), (96, 64))]
    with pytest.raises(weights.KeyMismatchError, match="1 missing"):
        weights.load_transformer(path)


def test_a_rope_table_diffusers_would_ignore_is_refused(tiny, tmp_path):
    model = tiny["models"]["transformer"]
    tensors = transformer_keys.from_diffusers(model.state_dict(), dict(model.config), "comfy")
    tensors["rope.inv_freq"] = tensors["rope.inv_freq"] * 1.5
    path = tmp_path / "minimax_h3_fl2va_rope.safetensors"
    meta = {"format": "pt", "h3.config": json.dumps(dict(model.config))}
    safetensors_io.write_file(str(path), tensors, meta)
    with pytest.raises(weights.H3WeightsError, match="rope.inv_freq"):
        weights.load_transformer(path)


# --- (d) header-only speed -----------------------------------------------------------------------


def test_check_of_a_66_gb_file_reads_only_the_header(tmp_path, monkeypatch):
    if not weights_support.sparse_files_supported(tmp_path):
        pytest.skip("no sparse files on this filesystem")
    from h3_core.weights import transformer_keys as tk

    model = weights_support.release_meta_model("transformer")
    comfy_sd = tk.from_diffusers(model.state_dict(), dict(model.config), "comfy")
    shapes = weights_support.shapes_of(comfy_sd, weights_support.dit_dtype)
    path = tmp_path / "minimax_h3_fl2va_bf16.safetensors"
    size = weights_support.write_header_only(str(path), shapes)
    assert size > 66e9

    def no_data(*args, **kwargs):
        raise AssertionError("check must not read tensor data")

    import safetensors
    import safetensors.torch

    from h3_core.weights import loaders

    monkeypatch.setattr(safetensors, "safe_open", no_data)
    monkeypatch.setattr(safetensors.torch, "load_file", no_data)
    monkeypatch.setattr(safetensors_io, "safe_open", no_data)
    monkeypatch.setattr(safetensors_io, "load_tensors", no_data)
    monkeypatch.setattr(loaders, "load_tensors", no_data)
    monkeypatch.setattr(torch, "load", no_data)
    start = time.perf_counter()
    det = weights.detect(path)
    detect_seconds = time.perf_counter() - start
    report = weights.check(path)
    check_seconds = time.perf_counter() - start - detect_seconds
    assert report.ok, str(report)
    assert det.total_bytes > 60 * 2**30
    # Typically ~0.05 s / ~0.3 s on two CPU cores; generous bounds for a loaded CI box.
    assert detect_seconds < 5 and check_seconds < 20, (detect_seconds, check_seconds)
    print(f"\n66 GB DiT header: detect {detect_seconds:.3f}s, check {check_seconds:.3f}s")


def test_comfyui_models_folder_and_two_partition_folder(tiny, tmp_path):
    import shutil

    models = tmp_path / "ComfyUI" / "models"
    for sub, component in (("diffusion_models", "transformer"), ("text_encoders", "text_encoder"),
                           ("vae", "vae"), ("vae", "audio_vae")):
        (models / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy(tiny["files"][component], models / sub)
    report = weights.check(models)
    assert report.ok and len(report.components) == 4, str(report)
    # vae/ holds both VAEs: each loader picks its own file by its header.
    assert weights_support.state_dicts_equal(weights.load_video_vae(models), tiny["models"]["vae"])
    assert weights.load_text_encoder(models).config.text_config.num_hidden_layers == 51

    both = tmp_path / "native"
    weights.save_native_transformer(weights_support.tiny_transformer(seed=7), str(both / "FL2VA"))
    weights.save_native_transformer(tiny["models"]["transformer"], str(both / "Ref2VA"))
    assert weights.check(both).ok
    with pytest.raises(weights.H3WeightsError, match="several DiTs"):
        weights.load_transformer(both)
    loaded = weights.load_transformer(both, partition="ref2va")
    assert weights_support.state_dicts_equal(loaded, tiny["models"]["transformer"])
    with pytest.raises(weights.H3WeightsError, match="not ref2va"):
        weights.load_transformer(both / "FL2VA", partition="ref2va")
