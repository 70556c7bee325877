"""The component-handler and weight-format registries: every handler round-trips tiny weights in
every key family it reads, and a format outside the registry is refused by name before any read."""

from __future__ import annotations

import pytest
import torch
from support import weights_support

from h3_core import weights
from h3_core.weights import audio_vae_keys, components, pruned, transformer_keys

BUILDERS = {
    "transformer": weights_support.tiny_transformer,
    "vae": weights_support.tiny_video_vae,
    "audio_vae": weights_support.tiny_audio_vae,
    "text_encoder": weights_support.tiny_text_encoder,
}


def _cases():
    for name, handler in weights.HANDLERS.items():
        for family in handler.families:
            layouts = [layout for layout, used in (("comfyui", family.comfy), ("native", family.native)) if used]
            for layout in layouts or ["diffusers"]:
                yield pytest.param(name, family.name, layout, id=f"{name}-{family.name}-{layout}")


def _config(model) -> dict:
    return model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)


@pytest.fixture(scope="module")
def models():
    return {name: build(seed=5) for name, build in BUILDERS.items()}


def test_registry_covers_every_slot_with_one_handler_each():
    assert set(BUILDERS) == set(weights.HANDLERS)
    assert set(weights.SLOTS) == {components.slot_of(name, p) for name in weights.HANDLERS for p in (None, "ref2va")}
    folders = [folder for handler in weights.HANDLERS.values() for folder in handler.folders]
    assert len(folders) == len(set(folders))  # a root's sub-folder names one component only
    assert all(name in handler.folders for name, handler in weights.HANDLERS.items())  # diffusers' folder name


@pytest.mark.parametrize("name, family, layout", list(_cases()))
def test_handler_round_trips_tiny_weights(models, name, family, layout):
    handler, model = weights.HANDLERS[name], models[name]
    assert isinstance(model, handler.model_type())
    state, config = model.state_dict(), _config(model)
    if family == pruned.PRUNED:  # the curve model's state: its table instead of the timestep MLP
        state = {k: v for k, v in state.items() if not k.startswith("time_embedder.")}
        state[pruned.MODEL_TABLE_KEY] = torch.rand(5, config["time_embed_dim"])
    written = handler.from_model(state, config, family, layout)

    # Detection: the written keys are recognised as this handler and this family, and nothing else.
    found, found_family = components.classify(written, "tiny")
    assert (found.name, found_family.name) == (name, family)
    # Config from shapes agrees with the model's own config wherever both speak.
    shapes = {key: tuple(tensor.shape) for key, tensor in written.items()}
    derived = handler.derive_config(shapes, family, config, "tiny")
    assert isinstance(derived, dict) and derived

    back, unexpected = handler.to_model(written, config, family, layout)
    assert unexpected == []
    expected = dict(state)
    if name == "audio_vae" and family == "folded":
        expected = audio_vae_keys.fold_weight_norm(state)
    if name == "text_encoder" and family == "legacy":  # the Comfy file keeps no final norm and no head
        expected = {k: v for k, v in state.items() if not k.startswith(("model.language_model.norm.", "lm_head."))}
    if name == "transformer" and family != "diffusers":
        assert transformer_keys.ROPE_KEY in written  # recomputed by the model: dropped on the way in
    assert weights_support.state_dicts_equal(back, expected)


def test_dense_files_report_their_format(tmp_path, models):
    path = tmp_path / "minimax_h3_video_vae_tiny.safetensors"
    weights.save_comfy_video_vae(models["vae"], str(path))
    det = weights.detect(path)
    assert (det.component, det.slot, det.format) == ("vae", "vae", "dense")
    assert "dense weights" in det.summary()
    assert sorted(fmt.name for fmt in weights.FORMATS if fmt.supported) == ["dense", "gguf", "quantised"]


def test_an_unknown_weight_format_is_refused_by_name_before_any_read(tmp_path, models, monkeypatch):
    model = models["transformer"]
    shapes = weights_support.shapes_of(transformer_keys.from_diffusers(model.state_dict(), dict(model.config), "comfy"))
    for key in [k for k in shapes if k.endswith("mlp.fc2.weight")]:
        shapes[key] = (torch.int16, shapes[key][1])
    path = tmp_path / "minimax_h3_fl2va_int16.safetensors"
    weights_support.write_header_only(str(path), shapes)

    def no_data(*args, **kwargs):
        raise AssertionError("a refused format must not read tensor data")

    monkeypatch.setattr(weights.loaders, "load_tensors", no_data)
    with pytest.raises(weights.UnsupportedCheckpointError, match="unknown weight format") as excinfo:
        weights.detect(path)
    message = str(excinfo.value)
    assert "I16" in message and "supported formats: dense" in message and "supported:" in message
    with pytest.raises(weights.UnsupportedCheckpointError, match="I16"):
        weights.load_transformer(path)
    report = weights.check(path)
    assert not report.ok and "unknown weight format" in str(report)


def test_refused_formats_are_named(tmp_path, models):
    model = models["transformer"]
    shapes = weights_support.shapes_of(transformer_keys.from_diffusers(model.state_dict(), dict(model.config), "comfy"))
    quantised = dict(shapes)  # fp8 codes without a .comfy_quant marker: no layer format to read them by
    quantised["blocks.0.mlp.fc1.weight"] = (torch.float8_e4m3fn, shapes["blocks.0.mlp.fc1.weight"][1])
    weights_support.write_header_only(str(tmp_path / "q.safetensors"), quantised)
    with pytest.raises(weights.UnsupportedCheckpointError, match="without a .comfy_quant marker"):
        weights.detect(tmp_path / "q.safetensors")
