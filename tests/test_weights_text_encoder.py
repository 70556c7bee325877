"""The 50-layer Comfy text encoder as a Qwen3VLForConditionalGeneration diffusers accepts.

H3 conditions on the residual stream after decoder layer 50, before any final norm. These tests
prove the loaded Comfy file yields exactly that stream through diffusers' own reader.
"""

from __future__ import annotations

import pytest
import torch
from support import weights_support

from h3_core import weights
from h3_core.weights import qwen_h3


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def deep_and_truncated(tmp_path_factory):
    """A 51-layer tiny Qwen3-VL and the same model written to / read from a 50-layer Comfy file."""
    deep = weights_support.tiny_text_encoder(seed=0)  # 51 layers: the tiny config's (diffusers' minimum)
    path = tmp_path_factory.mktemp("te") / "qwen3vl_tiny_minimax_h3.safetensors"
    weights.save_comfy_text_encoder(deep, str(path))
    return deep, weights.load_text_encoder(path), path


def test_comfy_file_has_exactly_50_layers_and_no_norm_or_head(deep_and_truncated):
    _, _, path = deep_and_truncated
    det = weights.detect(path)
    assert (det.component, det.layout, det.key_format) == ("text_encoder", "comfyui", "legacy")
    names = det.header.tensors
    layers = {k.split(".")[2] for k in names if k.startswith("model.layers.")}
    assert layers == {str(i) for i in range(50)}
    assert "model.embed_tokens.weight" in names and "visual.deepstack_merger_list.0.norm.weight" in names
    assert not any(k.startswith(("model.norm", "lm_head", "model.language_model")) for k in names)


def test_hidden_state_50_equals_the_deeper_stack_bit_exactly_with_an_image(deep_and_truncated, monkeypatch):
    deep, truncated, _ = deep_and_truncated
    assert deep.config.text_config.num_hidden_layers == 51
    # The image must really flow through the vision tower and the DeepStack injection.
    calls = []
    original = type(truncated.model.language_model)._deepstack_process

    def counting(self, *args, **kwargs):
        calls.append(self is truncated.model.language_model)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(truncated.model.language_model), "_deepstack_process", counting)
    reference = weights_support.prompt_embeds(deep)  # diffusers' get_qwen3vl_prompt_embeds, hidden_states[50]
    ours = weights_support.prompt_embeds(truncated)
    assert calls.count(True) == 3  # three DeepStack mergers injected into the truncated stack
    assert ours.shape == reference.shape == (1, 11, 64)
    assert torch.equal(ours, reference)
    # ...and the image matters: other pixels give another stream.
    other = weights_support.prompt_embeds(truncated, seed=1)
    assert not torch.equal(other, ours)


def test_the_stream_is_pre_norm_and_the_arrangement_is_consistent(deep_and_truncated):
    deep, truncated, _ = deep_and_truncated
    ids, vision = weights_support.qwen_presentation()
    kwargs = dict(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        mm_token_type_ids=torch.tensor(weights_support.TokenTypes().create_mm_token_type_ids([ids])),
        use_cache=False,
        output_hidden_states=True,
        **vision,
    )
    with torch.no_grad():
        deep_out = deep.model(**kwargs)
        ours = truncated.model(**kwargs)
    # transformers replaces the last entry with the post-norm state; index 50 of 51 layers is pre-norm.
    assert len(deep_out.hidden_states) == 52 and len(ours.hidden_states) == 52
    assert not torch.equal(deep_out.hidden_states[50], deep.model.language_model.norm(deep_out.hidden_states[50]))
    assert torch.equal(ours.hidden_states[50], deep_out.hidden_states[50])
    assert torch.equal(ours.last_hidden_state, ours.hidden_states[50])  # identity norm, pass-through layer 51
    assert truncated.config.text_config.num_hidden_layers == 51
    assert qwen_h3.real_layer_count(truncated) == 50
    with pytest.raises(RuntimeError, match="no language-model head"):
        truncated(**{k: v for k, v in kwargs.items() if k != "output_hidden_states"})
    with pytest.raises(RuntimeError, match="save_comfy_text_encoder"):
        truncated.save_pretrained("unused")


def test_diffusers_refuses_a_plain_50_layer_stack():
    """Why the arrangement exists: diffusers' reader rejects `num_hidden_layers <= 50`."""
    plain = weights_support.tiny_text_encoder(seed=0, num_layers=50)
    with pytest.raises(ValueError, match="more than 50"):
        weights_support.prompt_embeds(plain)


def test_full_transformers_folder_loads_as_the_full_model(deep_and_truncated, tmp_path):
    deep, _, _ = deep_and_truncated
    deep.save_pretrained(tmp_path / "text_encoder", max_shard_size="20MB")
    loaded = weights.load_text_encoder(tmp_path / "text_encoder")
    assert weights.detect(tmp_path / "text_encoder").layout == "diffusers"
    assert weights_support.state_dicts_equal(deep, loaded)
    assert loaded.lm_head.weight is loaded.model.language_model.embed_tokens.weight  # tied again
    assert torch.equal(weights_support.prompt_embeds(loaded), weights_support.prompt_embeds(deep))


def test_a_comfy_file_with_fewer_than_50_layers_is_refused(deep_and_truncated, tmp_path):
    deep, _, _ = deep_and_truncated
    path = tmp_path / "qwen3vl_49.safetensors"
    weights.save_comfy_text_encoder(deep, str(path), num_layers=49)
    with pytest.raises(weights.H3WeightsError, match="after decoder layer 50"):
        weights.load_text_encoder(path)
    assert not weights.check(path).ok
