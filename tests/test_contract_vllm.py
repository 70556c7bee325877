"""vLLM-Omni's unified stage-0 payload <-> `H3Conditioning`."""


import pytest
import torch
from support.contract_cases import KINDS, D, _randn, _tags, make

from h3_core.contract import (
    ContractError,
    H3Conditioning,
    H3Reference,
    patchify_video_latent,
)

# --- vLLM-Omni unified stage-0 payload ------------------------------------------------------------


@pytest.mark.parametrize("prompt_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_vllm_round_trip(kind, prompt_dtype):
    c = make(kind, prompt_dtype=prompt_dtype)
    payload = c.to_vllm()
    assert set(payload) == {"hidden_states", "embed", "meta", "kv_metadata"}
    assert payload["hidden_states"]["output"].dtype == prompt_dtype
    assert H3Conditioning.from_vllm(payload, metadata=c.metadata) == c
    assert H3Conditioning.from_vllm(c.to_vllm(include_pack_metadata=True)) == c


def test_vllm_payload_layout_ref2va():
    c = make("ref2va_video", prompt_dtype=torch.bfloat16)
    p = c.to_vllm()
    assert p["hidden_states"]["output"].shape == (66, 64) and p["hidden_states"]["output"].is_contiguous()
    assert torch.equal(p["meta"]["token_role_ids"], c.text_token_tags)
    layout = p["kv_metadata"]["minimax_h3_encoder_layout"]
    assert layout.dtype == torch.int64
    assert layout.tolist() == [
        1, 2, 3, 64, 64, 124, 37, 207, 2, 2, 3, 0, 0, 0, 0,  # header: schema 1, v2, ref2va, no edit rows
        1, 4, 6, 7, 4, 4,  # visual (T, h, w) in packed order
        120, 120,  # audio lengths in packed order
        1, 0, 0, 4, 6,  # image (no latent_t, as vLLM's encoder emits it)
        4, 120, 0, 0, 0,  # standalone audio
        3, 120, 7, 4, 4,  # video_audio
    ]
    emb = p["embed"]["embedding"]
    assert emb.dtype == torch.float32 and emb.shape == (1 * 2 * 3 + 7 * 2 * 2, 96)
    assert torch.equal(emb[:6], patchify_video_latent(c.condition_latents[0]))
    assert torch.equal(p["embed"]["speech_feat"], torch.cat(c.audio_condition_latents))


def test_vllm_payload_layout_fl2va_and_t2va():
    p = make("fl2va_both").to_vllm()
    assert p["kv_metadata"]["minimax_h3_encoder_layout"].tolist() == [
        1, 2, 2, 64, 64, 124, 37, 207, 2, 0, 0, 2, 0, 0, 0, 1, 4, 4, 1, 4, 4, 0, -1]
    assert p["embed"]["speech_feat"].dtype == torch.float32 and p["embed"]["speech_feat"].shape == (0,)
    p = make("t2va").to_vllm()
    assert p["kv_metadata"]["minimax_h3_encoder_layout"].tolist() == [
        1, 2, 1, 64, 64, 124, 37, 207, 0, 0, 0, 0, 0, 0, 0]
    for slot in ("embedding", "speech_feat"):
        assert p["embed"][slot].dtype == torch.float32 and p["embed"][slot].shape == (0,)


def _vllm_native_ref2va():
    """A payload as vLLM-Omni's encoder stage emits it (images, videos, standalone audio; tags [L, 1])."""
    image = _randn(1, 24, 1, 4, 6, seed=80)
    video = _randn(1, 24, 7, 2, 4, seed=81)
    sound, voice = _randn(200, 32, seed=82), _randn(160, 32, seed=83)
    layout = [1, 2, 3, 64, 64, 124, 37, 207, 2, 2, 3, 0, 0, 0, 0,
              1, 4, 6, 7, 2, 4, 100, 80,
              1, 0, 0, 4, 6, 3, 100, 7, 2, 4, 4, 80, 0, 0, 0]
    return {
        "hidden_states": {"output": _randn(50, D, seed=84, dtype=torch.bfloat16)},
        "embed": {"embedding": torch.cat([patchify_video_latent(image), patchify_video_latent(video)]),
                  "speech_feat": torch.cat([sound, voice])},
        "meta": {"token_role_ids": _tags(50, 9).reshape(50, 1)},
        "kv_metadata": {"minimax_h3_encoder_layout": torch.tensor(layout, dtype=torch.int64)},
    }


def test_vllm_native_round_trip():
    payload = _vllm_native_ref2va()
    c = H3Conditioning.from_vllm(payload)
    assert c.references == (H3Reference("image", False), H3Reference("video", True), H3Reference("audio", True))
    assert c.prompt_embeds.dtype == torch.bfloat16 and c.prompt_embeds.shape == (1, 50, D)
    back = c.to_vllm()
    assert torch.equal(back["hidden_states"]["output"], payload["hidden_states"]["output"])
    assert torch.equal(back["meta"]["token_role_ids"], payload["meta"]["token_role_ids"].reshape(-1))
    for slot in ("embedding", "speech_feat"):
        assert torch.equal(back["embed"][slot], payload["embed"][slot])
    assert torch.equal(back["kv_metadata"]["minimax_h3_encoder_layout"],
                       payload["kv_metadata"]["minimax_h3_encoder_layout"])


def test_vllm_v1_header_accepted():
    p = make("fl2va").to_vllm()
    layout = p["kv_metadata"]["minimax_h3_encoder_layout"].tolist()
    p["kv_metadata"]["minimax_h3_encoder_layout"] = torch.tensor([1, 1] + layout[2:12] + layout[15:])
    assert H3Conditioning.from_vllm(p) == make("fl2va")


def _vllm_error(payload, fragment):
    with pytest.raises(ContractError) as info:
        H3Conditioning.from_vllm(payload)
    assert fragment in str(info.value), str(info.value)
    return info.value


def _with_layout(payload, edit):
    values = payload["kv_metadata"]["minimax_h3_encoder_layout"].tolist()
    edit(values)
    payload["kv_metadata"]["minimax_h3_encoder_layout"] = torch.tensor(values, dtype=torch.int64)
    return payload


def test_vllm_malformed_payloads():
    def set_at(index, value):
        return lambda v: v.__setitem__(index, value)

    _vllm_error(_with_layout(_vllm_native_ref2va(), set_at(0, 2)), "unsupported wire schema 2:2")
    _vllm_error(_with_layout(_vllm_native_ref2va(), set_at(1, 3)), "unsupported wire schema 1:3")
    _vllm_error(_with_layout(_vllm_native_ref2va(), set_at(12, 96)), "latent-mask editing")
    _vllm_error(_with_layout(_vllm_native_ref2va(), lambda v: v.append(0)), "the header's counts imply")
    _vllm_error(_with_layout(_vllm_native_ref2va(), set_at(2, 7)), "unknown task code 7")
    _vllm_error(_with_layout(_vllm_native_ref2va(), set_at(6, 38)), "disagree with num_frames")
    _vllm_error(_with_layout(_vllm_native_ref2va(), set_at(26, 8)), "does not match visual shape")
    _vllm_error(_with_layout(_vllm_native_ref2va(), set_at(23, 9)), "unknown kind code 9")
    _vllm_error(_with_layout(_vllm_native_ref2va(), set_at(29, 99)), "ref_audio_t=99 does not match")
    _vllm_error(_with_layout(_vllm_native_ref2va(), lambda v: v.__delitem__(slice(4, None))), "header truncated")
    _vllm_error(_with_layout(_vllm_native_ref2va(), lambda v: v.__delitem__(slice(1, None))), "header truncated")

    p = _vllm_native_ref2va()
    p["embed"]["embedding"] = p["embed"]["embedding"][:-1]
    _vllm_error(p, "embed.embedding: must be fp32")
    p = _vllm_native_ref2va()
    p["embed"]["speech_feat"] = p["embed"]["speech_feat"].double()
    _vllm_error(p, "embed.speech_feat: must be fp32")
    p = make("t2va").to_vllm()
    p["embed"]["embedding"] = torch.empty(0, dtype=torch.float64)
    _vllm_error(p, "empty slot must be fp32 [0]")
    p = make("fl2va").to_vllm()
    _with_layout(p, lambda v: v.__setitem__(-1, 5))
    _vllm_error(p, "keyframe frame index must be 0 (first) or -1 (last), got 5")
    p = _vllm_native_ref2va()
    del p["kv_metadata"]
    _vllm_error(p, "missing or not a tensor")
    p = _vllm_native_ref2va()
    p["kv_metadata"]["minimax_h3_encoder_layout"] = p["kv_metadata"]["minimax_h3_encoder_layout"].float()
    _vllm_error(p, "1-D integer tensor")
    p = _vllm_native_ref2va()
    p["meta"]["token_role_ids"] = p["meta"]["token_role_ids"][:-1]
    err = _vllm_error(p, "text_token_tags")
    assert err.field == "text_token_tags"
