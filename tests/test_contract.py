"""Tests for h3_core.contract: the encoder -> diffusion conditioning contract.

Shapes follow shared/h3/STAGE_SPLIT.md (64x64 canvas, 124 frames, text width D=64): t2va (1,24,64);
fl2va (1,36,64) + one (1,24,1,4,4) keyframe; ref2va (1,43,64) + a (1,24,1,4,6) image + a (240,32) audio;
ref2va+video adds a (1,24,7,4,4) video reference with a soundtrack. (The probe's soundtrack was 0.92 s = 37
latents, under the contract's 80-latent floor, so the soundtrack here is 3 s like the audio reference.)
"""

import ast
import dataclasses
import hashlib
import json
import pathlib
import pickle
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import safetensors.torch as st  # noqa: E402

from h3_core import contract as hc  # noqa: E402
from h3_core.contract import (  # noqa: E402
    ContractError,
    H3Conditioning,
    H3Reference,
    audio_latent_to_rows,
    audio_rows_to_latent,
    patchify_video_latent,
    unpatchify_video_rows,
)

H = W = 64
NF = 124
D = 64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _tags(length, zeros=0, start=3):
    tags = torch.ones(length, dtype=torch.int64)
    tags[start:start + zeros] = 0
    return tags


def _kwargs(kind, prompt_dtype=torch.float32):
    """Constructor kwargs for one of the STAGE_SPLIT probe requests."""
    if kind == "t2va":
        return dict(task="t2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 24, D, seed=1, dtype=prompt_dtype), text_token_tags=_tags(24))
    if kind == "fl2va":
        return dict(task="fl2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 36, D, seed=2, dtype=prompt_dtype), text_token_tags=_tags(36, 6),
                    condition_latents=[_randn(1, 24, 1, 4, 4, seed=3)], keyframe_anchors=("first",))
    if kind == "fl2va_both":
        return dict(task="fl2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 48, D, seed=4, dtype=prompt_dtype), text_token_tags=_tags(48, 12),
                    condition_latents=[_randn(1, 24, 1, 4, 4, seed=5), _randn(1, 24, 1, 4, 4, seed=6)],
                    keyframe_anchors=("first", "last"))
    if kind == "fl2va_last":
        return dict(task="fl2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 36, D, seed=7, dtype=prompt_dtype), text_token_tags=_tags(36, 6),
                    condition_latents=[_randn(1, 24, 1, 4, 4, seed=8)], keyframe_anchors=("last",))
    if kind == "ref2va":
        return dict(task="ref2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 43, D, seed=9, dtype=prompt_dtype), text_token_tags=_tags(43, 8),
                    condition_latents=[_randn(1, 24, 1, 4, 6, seed=10)],
                    audio_condition_latents=[_randn(240, 32, seed=11)],
                    references=[H3Reference("image", False), H3Reference("audio", True)],
                    metadata={"model": "tiny-minimax-h3", "pack": "0.1"})
    if kind == "ref2va_video":
        return dict(task="ref2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 66, D, seed=12, dtype=prompt_dtype), text_token_tags=_tags(66, 14),
                    condition_latents=[_randn(1, 24, 1, 4, 6, seed=13), _randn(1, 24, 7, 4, 4, seed=14)],
                    audio_condition_latents=[_randn(240, 32, seed=15), _randn(240, 32, seed=16)],
                    references=[("image", False), ("audio", True), ("video", True)])
    if kind == "ref2va_silent_video":
        return dict(task="ref2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 40, D, seed=17, dtype=prompt_dtype), text_token_tags=_tags(40, 10),
                    condition_latents=[_randn(1, 24, 2, 6, 4, seed=18)], references=[{"kind": "video",
                                                                                      "has_audio": False}])
    raise KeyError(kind)


KINDS = ["t2va", "fl2va", "fl2va_both", "fl2va_last", "ref2va", "ref2va_video", "ref2va_silent_video"]


def make(kind="t2va", prompt_dtype=torch.float32, **changes):
    kwargs = _kwargs(kind, prompt_dtype)
    kwargs.update(changes)
    return H3Conditioning(**kwargs)


# --- construction happy paths -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_construct_each_task(kind):
    c = make(kind)
    assert c.task == kind.split("_")[0]
    assert isinstance(c.condition_latents, tuple) and isinstance(c.references, tuple)
    assert all(isinstance(r, H3Reference) for r in c.references)
    assert "H3Conditioning(" in repr(c)


def test_derived_properties():
    c = make("t2va")
    assert (c.latent_t, c.audio_t, c.latent_height, c.latent_width) == (37, 207, 4, 4)
    assert c.duration_s == pytest.approx(124 / 24)
    assert (c.text_len, c.text_dim, c.latent_channels) == (24, 64, None)
    assert make("fl2va").latent_channels == 24
    for frames, lat, aud in ((209, 62, 348), (345, 102, 575), (141, 42, 235)):
        c = make("t2va", num_frames=frames)
        assert (c.latent_t, c.audio_t) == (lat, aud)
    assert (hc.MIN_NUM_FRAMES, hc.MAX_NUM_FRAMES) == (124, 360)


def test_prompt_dtype_kept_not_cast():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        c = make("ref2va", prompt_dtype=dtype)
        assert c.prompt_embeds.dtype == dtype


def test_frozen_and_readonly_metadata():
    c = make("ref2va")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.task = "t2va"
    with pytest.raises(TypeError):
        c.metadata["x"] = "y"
    with pytest.raises(TypeError):
        hash(c)


def test_equality_is_bit_exact():
    a, b = make("ref2va_video"), make("ref2va_video")
    assert a == b
    lat = b.condition_latents[1].clone()
    lat.view(torch.int32)[0, 0, 0, 0, 0] ^= 1  # one ulp
    assert a != dataclasses.replace(b, condition_latents=(b.condition_latents[0], lat))
    assert a != dataclasses.replace(b, metadata={"k": "v"})
    zero = make("t2va", prompt_embeds=torch.zeros(1, 24, D))
    assert zero != make("t2va", prompt_embeds=-torch.zeros(1, 24, D))  # -0.0 differs bitwise


def test_separate_audio_budgets_accept_600_each():
    # 600 latents of embedded soundtrack AND 600 of standalone audio: separate budgets, so valid.
    video = _randn(1, 24, 7, 4, 4, seed=30)
    c = make("ref2va", condition_latents=[video, video],
             audio_condition_latents=[_randn(600, 32, seed=s) for s in range(4)],
             references=[("video", True), ("video", True), ("audio", True), ("audio", True)])
    assert len(c.audio_condition_latents) == 4


def test_reference_limits_accept_maximum():
    refs = [("image", False)] * 9 + [("video", False)] * 2 + [("audio", True)]
    lat_i, lat_v = _randn(1, 24, 1, 2, 2, seed=31), _randn(1, 24, 2, 2, 2, seed=32)
    c = make("ref2va", references=refs, condition_latents=[lat_i] * 9 + [lat_v] * 2,
             audio_condition_latents=[_randn(160, 32, seed=33)])
    assert len(c.references) == 12


def test_check_compatible():
    c = make("ref2va")
    c.check_compatible(text_dim=64, latent_channels=24, audio_channels=32)
    with pytest.raises(ContractError, match=r"prompt_embeds: width D=64 does not match the model's text_dim 5120"):
        c.check_compatible(text_dim=5120)
    with pytest.raises(ContractError, match=r"condition_latents\[0\]: C=24 .* latent channels 16"):
        c.check_compatible(latent_channels=16)
    with pytest.raises(ContractError, match="audio channels 16"):
        c.check_compatible(audio_channels=16)
    make("t2va").check_compatible(latent_channels=16)  # nothing to check


# --- one test per validation rule -----------------------------------------------------------------

_VIDEO = _randn(1, 24, 7, 4, 4, seed=40)
_IMAGE = _randn(1, 24, 1, 4, 6, seed=41)
_ROWS = _randn(240, 32, seed=42)
_KF = _randn(1, 24, 1, 4, 4, seed=43)
_BAD_TAGS = _tags(24)
_BAD_TAGS[2] = 2

VIOLATIONS = [
    # (id, kind, changes, field, fragment of the message)
    ("task", "t2va", dict(task="i2va"), "task", "must be one of"),
    ("height_multiple", "t2va", dict(height=48), "height", "multiple of 32"),
    ("width_multiple", "t2va", dict(width=100), "width", "multiple of 32"),
    ("height_type", "t2va", dict(height=64.0), "height", "positive int"),
    ("height_bool", "t2va", dict(height=True), "height", "positive int"),
    ("num_frames_form", "t2va", dict(num_frames=125), "num_frames", "17n+5"),
    ("num_frames_too_short", "t2va", dict(num_frames=107), "num_frames", "[124, 360]"),
    ("num_frames_too_long", "t2va", dict(num_frames=362), "num_frames", "[124, 360]"),
    ("prompt_type", "t2va", dict(prompt_embeds=[[0.0]]), "prompt_embeds", "torch.Tensor"),
    ("prompt_rank", "t2va", dict(prompt_embeds=_randn(24, D)), "prompt_embeds", "[1, L, D]"),
    ("prompt_batch", "t2va", dict(prompt_embeds=_randn(2, 24, D)), "prompt_embeds", "[1, L, D]"),
    ("prompt_dtype", "t2va", dict(prompt_embeds=_randn(1, 24, D).double()), "prompt_embeds", "dtype"),
    ("tags_dtype", "t2va", dict(text_token_tags=_tags(24).int()), "text_token_tags", "int64"),
    ("tags_length", "t2va", dict(text_token_tags=_tags(23)), "text_token_tags", "[L] = [24]"),
    ("tags_values", "t2va", dict(text_token_tags=_BAD_TAGS), "text_token_tags", "0 (vision block) or 1"),
    ("latent_dtype", "fl2va", dict(condition_latents=[_KF.bfloat16()]), "condition_latents[0]", "float32"),
    ("latent_rank", "fl2va", dict(condition_latents=[_KF[:, :, 0]]), "condition_latents[0]", "[1, C, T, h, w]"),
    ("latent_type", "fl2va", dict(condition_latents=[_KF.numpy()]), "condition_latents[0]", "torch.Tensor"),
    ("latent_odd_w", "ref2va", dict(condition_latents=[_randn(1, 24, 1, 4, 5)]), "condition_latents[0]", "even"),
    ("latent_channels_differ", "ref2va_video",
     dict(condition_latents=[_IMAGE, _randn(1, 16, 7, 4, 4)]), "condition_latents[1]", "differs"),
    ("audio_dtype", "ref2va", dict(audio_condition_latents=[_ROWS.double()]), "audio_condition_latents[0]",
     "float32"),
    ("audio_width", "ref2va", dict(audio_condition_latents=[_randn(240, 16)]), "audio_condition_latents[0]",
     "[2*T, 32]"),
    ("audio_rows_odd", "ref2va", dict(audio_condition_latents=[_randn(241, 32)]), "audio_condition_latents[0]",
     "even"),
    ("audio_too_short", "ref2va", dict(audio_condition_latents=[_randn(158, 32)]), "audio_condition_latents[0]",
     "80-600 latents"),
    ("audio_too_long", "ref2va", dict(audio_condition_latents=[_randn(1202, 32)]), "audio_condition_latents[0]",
     "80-600 latents"),
    ("anchor_value", "fl2va", dict(keyframe_anchors=("middle",)), "keyframe_anchors", "'first' or 'last'"),
    ("t2va_latents", "t2va", dict(condition_latents=[_KF]), "condition_latents", "t2va carries text only"),
    ("t2va_audio", "t2va", dict(audio_condition_latents=[_ROWS]), "audio_condition_latents", "t2va carries"),
    ("t2va_anchors", "t2va", dict(keyframe_anchors=("first",)), "keyframe_anchors", "t2va carries"),
    ("t2va_references", "t2va", dict(references=[("image", False)]), "references", "t2va carries"),
    ("fl2va_no_keyframe", "fl2va", dict(condition_latents=[], keyframe_anchors=()), "condition_latents",
     "1-2 keyframe"),
    ("fl2va_three_keyframes", "fl2va", dict(condition_latents=[_KF] * 3, keyframe_anchors=("first", "last")),
     "condition_latents", "1-2 keyframe"),
    ("fl2va_anchor_order", "fl2va", dict(condition_latents=[_KF] * 2, keyframe_anchors=("last", "first")),
     "keyframe_anchors", "must be one of"),
    ("fl2va_anchor_count", "fl2va", dict(condition_latents=[_KF] * 2, keyframe_anchors=("first",)),
     "keyframe_anchors", "one anchor per keyframe"),
    ("fl2va_keyframe_size", "fl2va", dict(condition_latents=[_randn(1, 24, 1, 4, 6)]), "condition_latents[0]",
     "[1, C, 1, H/16, W/16]"),
    ("fl2va_keyframe_frames", "fl2va", dict(condition_latents=[_randn(1, 24, 2, 4, 4)]), "condition_latents[0]",
     "[1, C, 1, H/16, W/16]"),
    ("fl2va_audio", "fl2va", dict(audio_condition_latents=[_ROWS]), "audio_condition_latents", "fl2va carries"),
    ("fl2va_references", "fl2va", dict(references=[("image", False)]), "references", "fl2va carries"),
    ("ref2va_anchors", "ref2va", dict(keyframe_anchors=("first",)), "keyframe_anchors", "ref2va carries no"),
    ("ref2va_no_reference", "ref2va", dict(references=[], condition_latents=[], audio_condition_latents=[]),
     "references", "at least one image or video"),
    ("ref2va_audio_only", "ref2va", dict(references=[("audio", True)], condition_latents=[]), "references",
     "at least one image or video"),
    ("ref2va_ten_images", "ref2va", dict(references=[("image", False)] * 10, condition_latents=[],
                                         audio_condition_latents=[]), "references", "at most 9 image"),
    ("ref2va_four_videos", "ref2va", dict(references=[("video", False)] * 4, condition_latents=[],
                                          audio_condition_latents=[]), "references", "at most 3 video"),
    ("ref2va_four_audios", "ref2va", dict(references=[("image", False)] + [("audio", True)] * 4),
     "references", "at most 3 audio"),
    ("ref2va_thirteen", "ref2va", dict(references=[("image", False)] * 9 + [("video", False)] * 3
                                       + [("audio", True)]), "references", "at most 12 references in total"),
    ("ref2va_latent_count", "ref2va", dict(condition_latents=[]), "condition_latents", "one latent per image/video"),
    ("ref2va_image_frames", "ref2va", dict(condition_latents=[_randn(1, 24, 2, 4, 6)]), "condition_latents[0]",
     "T=1"),
    ("ref2va_video_frames", "ref2va_silent_video", dict(condition_latents=[_randn(1, 24, 6, 4, 4)]),
     "condition_latents[0]", "5n+2"),
    ("ref2va_audio_count", "ref2va", dict(audio_condition_latents=[]), "audio_condition_latents",
     "one audio condition per reference with audio"),
    ("ref2va_embedded_budget", "ref2va", dict(references=[("video", True)] * 2, condition_latents=[_VIDEO] * 2,
                                              audio_condition_latents=[_randn(640, 32)] * 2),
     "audio_condition_latents", "embedded video soundtracks total 640"),
    ("ref2va_standalone_budget", "ref2va", dict(references=[("image", False), ("audio", True), ("audio", True)],
                                                audio_condition_latents=[_randn(640, 32)] * 2),
     "audio_condition_latents", "standalone audio references total 640"),
    ("ref_image_with_audio", "ref2va", dict(references=[("image", True)]), "references", "cannot have audio"),
    ("ref_audio_without_audio", "ref2va", dict(references=[("audio", False)]), "references", "has_audio=True"),
    ("ref_kind", "ref2va", dict(references=[("text", False)]), "references", "kind must be one of"),
    ("ref_has_audio_type", "ref2va", dict(references=[("video", 1)]), "references", "must be a bool"),
    ("ref_entry", "ref2va", dict(references=["image"]), "references", "each entry must be"),
    ("metadata_values", "t2va", dict(metadata={"a": 1}), "metadata", "str to str"),
    ("metadata_type", "t2va", dict(metadata=[("a", "b")]), "metadata", "mapping"),
    ("latents_not_sequence", "fl2va", dict(condition_latents=_KF), "condition_latents", "must be a sequence"),
]


@pytest.mark.parametrize("kind,changes,field_name,fragment", [v[1:] for v in VIOLATIONS],
                         ids=[v[0] for v in VIOLATIONS])
def test_validation_rule(kind, changes, field_name, fragment):
    with pytest.raises(ContractError) as info:
        make(kind, **changes)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field_name
    message = str(info.value)
    assert message.startswith(f"{field_name}: "), message
    assert fragment in message, message


# --- serialisation ------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_bytes_round_trip_bit_exact(kind, prompt_dtype):
    c = make(kind, prompt_dtype=prompt_dtype)
    back = H3Conditioning.from_bytes(c.to_bytes())
    assert back == c
    assert back.prompt_embeds.dtype == prompt_dtype
    assert back.to_bytes() == c.to_bytes()


def test_file_round_trip(tmp_path):
    c = make("ref2va_video", prompt_dtype=torch.bfloat16)
    path = tmp_path / "cond.safetensors"
    c.save(path)
    assert H3Conditioning.load(path) == c
    assert H3Conditioning.load(str(path)) == c
    assert [p.name for p in tmp_path.iterdir()] == ["cond.safetensors"]  # no temp file left behind


def test_loaded_tensors_own_their_memory():
    c = make("fl2va")
    data = bytearray(c.to_bytes())
    back = H3Conditioning.from_bytes(data)
    data[-64:] = bytes(64)  # the caller's buffer is not shared
    assert back == c
    back.condition_latents[0].add_(1.0)  # writable, no warnings
    assert back != c


def test_bytes_are_safetensors_with_one_header_key():
    c = make("ref2va_video")
    data = c.to_bytes()
    tensors = st.load(data)
    assert sorted(tensors) == ["audio_condition_latents.0", "audio_condition_latents.1", "condition_latents.0",
                               "condition_latents.1", "prompt_embeds", "text_token_tags"]
    assert torch.equal(tensors["condition_latents.1"], c.condition_latents[1])
    header = _st_metadata(data)
    assert list(header) == [hc.HEADER_KEY]
    meta = json.loads(header[hc.HEADER_KEY])
    assert meta["format"] == "minimax-h3-conditioning" and meta["version"] == 1
    assert meta["tensor_count"] == 6
    assert meta["references"] == [{"kind": "image", "has_audio": False}, {"kind": "audio", "has_audio": True},
                                  {"kind": "video", "has_audio": True}]


def test_fingerprint():
    c = make("ref2va")
    assert c.fingerprint() == hashlib.sha256(c.to_bytes()).hexdigest()
    assert c.fingerprint() == make("ref2va").fingerprint()
    assert c.fingerprint() != dataclasses.replace(c, metadata={"model": "other"}).fingerprint()
    tags = c.text_token_tags.clone()
    tags[0] = 0
    assert c.fingerprint() != dataclasses.replace(c, text_token_tags=tags).fingerprint()


def test_shared_storage_tensors_serialise():
    kf = _randn(1, 24, 1, 4, 4, seed=50)
    c = make("fl2va_both", condition_latents=[kf, kf])  # the same tensor twice
    assert H3Conditioning.from_bytes(c.to_bytes()) == c


def _st_metadata(data):
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])["__metadata__"]


def _retamper(data, edit_header=None, edit_tensors=None):
    """Re-serialise a payload with an edited contract header and/or tensor dict."""
    header = json.loads(_st_metadata(data)[hc.HEADER_KEY])
    tensors = {k: v.clone() for k, v in st.load(data).items()}
    if edit_header:
        edit_header(header)
    if edit_tensors:
        edit_tensors(tensors)
    return st.save(tensors, metadata={hc.HEADER_KEY: json.dumps(header)})


def _payload_error(data, fragment):
    with pytest.raises(ContractError) as info:
        H3Conditioning.from_bytes(data)
    assert info.value.field == "payload"
    assert fragment in str(info.value), str(info.value)
    return info.value


@pytest.mark.parametrize("cut", [0, 5, 8, 40, -1, -100, -4000])
def test_truncated_bytes(cut):
    data = make("ref2va_video").to_bytes()
    n = int.from_bytes(data[:8], "little")
    end = cut if cut >= 0 else len(data) + cut
    if 8 < end < 8 + n:
        fragment = "truncated: header claims"
    elif end >= 8 + n:
        fragment = "truncated: tensors need"
    else:
        fragment = "truncated"
    _payload_error(data[:end], fragment)


def test_corrupted_tensor_data_fails_checksum():
    data = bytearray(make("ref2va").to_bytes())
    data[-10] ^= 0x01
    _payload_error(bytes(data), "checksum mismatch")


def test_corrupted_header_bytes():
    data = bytearray(make("t2va").to_bytes())
    data[8] = ord("[")  # header no longer a JSON object
    err = _payload_error(bytes(data), "corrupted")
    assert "safetensors" in str(err)
    data = bytearray(make("t2va").to_bytes())
    data[9:20] = b"\xff" * 11  # not UTF-8
    _payload_error(bytes(data), "not valid JSON")


def test_garbage_and_wrong_types():
    _payload_error(b"definitely not a safetensors payload", "corrupted")
    _payload_error((2**40).to_bytes(8, "little") + b"{}", "exceeds")
    with pytest.raises(ContractError, match="expected bytes"):
        H3Conditioning.from_bytes("text")


def test_wrong_format():
    plain = st.save({"x": torch.zeros(2)})
    _payload_error(plain, "wrong format")
    data = make("t2va").to_bytes()
    _payload_error(_retamper(data, lambda h: h.update(format="other-conditioning")), "wrong format")


def test_unknown_version():
    data = make("fl2va").to_bytes()
    err = _payload_error(_retamper(data, lambda h: h.update(version=2)), "unsupported version 2")
    assert "reads version 1" in str(err)


def test_extra_and_missing_tensors():
    data = make("ref2va").to_bytes()
    bad = _retamper(data, edit_tensors=lambda t: t.update(extra=torch.zeros(3)))
    _payload_error(bad, "unexpected ['extra']")
    bad = _retamper(data, edit_tensors=lambda t: t.pop("condition_latents.0"))
    _payload_error(bad, "missing ['condition_latents.0']")


def test_inconsistent_header():
    data = make("ref2va").to_bytes()
    _payload_error(_retamper(data, lambda h: h.update(tensor_count=7)), "tensor_count 7")
    _payload_error(_retamper(data, lambda h: h.pop("metadata")), "missing fields ['metadata']")
    _payload_error(_retamper(data, lambda h: h.update(colour="blue")), "unknown fields ['colour']")
    _payload_error(_retamper(data, lambda h: h.update(num_condition_latents=-1)), "non-negative")

    def wrong_dtype(t):
        t["text_token_tags"] = t["text_token_tags"].int()
    _payload_error(_retamper(data, edit_tensors=wrong_dtype), "dtype 'I32'")


def test_validation_on_receipt():
    data = make("fl2va").to_bytes()
    with pytest.raises(ContractError, match=r"^num_frames: must be an int of the form 17n\+5"):
        H3Conditioning.from_bytes(_retamper(data, lambda h: h.update(num_frames=125)))
    with pytest.raises(ContractError, match="^condition_latents: t2va carries text only"):
        H3Conditioning.from_bytes(_retamper(data, lambda h: h.update(task="t2va", keyframe_anchors=[])))
    with pytest.raises(ContractError, match="^references: each entry"):
        H3Conditioning.from_bytes(_retamper(data, lambda h: h.update(task="ref2va", keyframe_anchors=[],
                                                                     references=["image"])))


# --- patchify / audio row helpers ---------------------------------------------------------------


def test_patchify_order_and_inverse():
    lat = _randn(1, 3, 2, 4, 6, seed=60)
    rows = patchify_video_latent(lat)
    assert rows.shape == (2 * 2 * 3, 12) and rows.is_contiguous()
    for t in range(2):
        for i in range(2):
            for j in range(3):
                r = (t * 2 + i) * 3 + j
                for c in range(3):
                    for p in range(2):
                        for q in range(2):
                            assert rows[r, c * 4 + p * 2 + q] == lat[0, c, t, 2 * i + p, 2 * j + q]
    assert torch.equal(unpatchify_video_rows(rows, 2, 4, 6, 3), lat)
    # same as einsum("nctrhpwq->nthwcrpq") used by ComfyUI / vLLM-Omni
    ref = torch.einsum("nctrhpwq->nthwcrpq", lat.reshape(1, 3, 2, 1, 2, 2, 3, 2)).reshape(-1, 12)
    assert torch.equal(rows, ref)
    with pytest.raises(ContractError, match="not divisible"):
        patchify_video_latent(_randn(1, 3, 1, 3, 4))
    with pytest.raises(ContractError, match="expected shape"):
        unpatchify_video_rows(rows, 2, 4, 4, 3)


def test_audio_rows_are_channel_major():
    latent = _randn(1, 32, 2, 5, seed=61)  # ComfyUI layout [1, A, 2, T]
    rows = audio_latent_to_rows(latent)
    assert rows.shape == (10, 32)
    assert torch.equal(rows[:5], latent[0, :, 0, :].T)  # channel 0, frames 0..4
    assert torch.equal(rows[5:], latent[0, :, 1, :].T)  # then channel 1
    assert torch.equal(audio_rows_to_latent(rows), latent)
    with pytest.raises(ContractError):
        audio_latent_to_rows(_randn(1, 32, 1, 5))
    with pytest.raises(ContractError):
        audio_rows_to_latent(_randn(9, 32))


# --- ComfyUI core CONDITIONING ------------------------------------------------------------------


@pytest.mark.parametrize("prompt_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_comfy_round_trip(kind, prompt_dtype):
    c = make(kind, prompt_dtype=prompt_dtype)
    core = c.to_comfy()
    assert isinstance(core, list) and len(core) == 1 and core[0][0] is c.prompt_embeds
    assert H3Conditioning.from_comfy(core) == c


def test_comfy_form_matches_core():
    c = make("ref2va_video")
    (cross, extras), = c.to_comfy()
    assert extras["minimax_token_tags"] is c.text_token_tags
    assert "minimax_keyframes" not in extras
    image, audio, video = extras["minimax_refs"]
    assert set(image) == {"kind", "picture_index", "latent_h", "latent_w", "latent"}
    assert (image["kind"], image["picture_index"], image["latent_h"], image["latent_w"]) == ("image", 0, 4, 6)
    assert set(audio) == {"kind", "ref_audio_t", "audio_latent"}
    assert audio["kind"] == "audio" and audio["ref_audio_t"] == 120 and audio["audio_latent"].shape == (1, 32, 2, 120)
    assert torch.equal(audio["audio_latent"][0, :, 1, :].T, c.audio_condition_latents[0][120:])
    assert set(video) == {"kind", "latent_t", "latent_h", "latent_w", "ref_audio_t", "latent", "audio_latent"}
    assert (video["kind"], video["latent_t"], video["ref_audio_t"]) == ("video_audio", 7, 120)
    assert video["latent"] is c.condition_latents[1]
    pack = extras[hc.COMFY_PACK_KEY]
    assert pack == {"format": hc.FORMAT_ID, "version": 1, "task": "ref2va", "height": 64, "width": 64,
                    "num_frames": 124, "metadata": {}}

    silent = make("ref2va_silent_video").to_comfy()[0][1]["minimax_refs"][0]
    assert (silent["kind"], silent["ref_audio_t"], silent["audio_latent"]) == ("video", 0, None)

    kf = make("fl2va_both").to_comfy()[0][1]["minimax_keyframes"]
    assert [k["resolved_frame_index"] for k in kf] == [0, 123]
    assert make("fl2va_last").to_comfy()[0][1]["minimax_keyframes"][0]["resolved_frame_index"] == 123
    assert set(make("t2va").to_comfy()[0][1]) == {"minimax_token_tags", hc.COMFY_PACK_KEY}


def _core_native_fl2va():
    """A CONDITIONING as core's MiniMaxH3ImageToVideo builds it (first + last frame), without our pack key."""
    cross = _randn(1, 48, D, seed=70)
    tags = _tags(48, 12)
    kfs = [{"resolved_frame_index": 0, "latent": _randn(1, 24, 1, 4, 4, seed=71)},
           {"resolved_frame_index": 123, "latent": _randn(1, 24, 1, 4, 4, seed=72)}]
    return [[cross, {"pooled_output": None, "minimax_token_tags": tags, "minimax_keyframes": kfs}]]


def _core_native_ref2va():
    """As core's MiniMaxH3ReferenceToVideo builds it: images, then videos (+soundtrack), then audios."""
    cross = _randn(1, 66, D, seed=73)
    refs = [
        {"kind": "image", "picture_index": 0, "latent_h": 4, "latent_w": 6, "latent": _randn(1, 24, 1, 4, 6, seed=74)},
        {"kind": "video_audio", "latent_t": 7, "latent_h": 4, "latent_w": 4, "ref_audio_t": 100,
         "latent": _randn(1, 24, 7, 4, 4, seed=75), "audio_latent": _randn(1, 32, 2, 100, seed=76)},
        {"kind": "video", "latent_t": 2, "latent_h": 2, "latent_w": 4, "ref_audio_t": 0,
         "latent": _randn(1, 24, 2, 2, 4, seed=77), "audio_latent": None},
        {"kind": "audio", "ref_audio_t": 120, "audio_latent": _randn(1, 32, 2, 120, seed=78)},
    ]
    return [[cross, {"pooled_output": None, "minimax_token_tags": _tags(66, 14), "minimax_refs": refs}]]


def _assert_core_equal(a, b):
    """Compare two core CONDITIONINGs on the keys core's extra_conds reads."""
    (ca, ea), = a
    (cb, eb), = b
    assert torch.equal(ca, cb) and ca.dtype == cb.dtype
    for key in ("minimax_token_tags", "minimax_keyframes", "minimax_refs"):
        assert (key in ea) == (key in eb)
        if key not in ea:
            continue
        if key == "minimax_token_tags":
            assert torch.equal(ea[key], eb[key])
            continue
        assert len(ea[key]) == len(eb[key])
        for da, db in zip(ea[key], eb[key]):
            assert set(da) == set(db)
            for k in da:
                if isinstance(da[k], torch.Tensor):
                    assert torch.equal(da[k], db[k]) and da[k].dtype == db[k].dtype, k
                else:
                    assert da[k] == db[k], k


@pytest.mark.parametrize("build,task", [(_core_native_fl2va, "fl2va"), (_core_native_ref2va, "ref2va")])
def test_core_native_round_trip(build, task):
    core = build()
    c = H3Conditioning.from_comfy(core, height=64, width=64, num_frames=124, metadata={"src": "comfy"})
    assert c.task == task
    if task == "fl2va":
        assert c.keyframe_anchors == ("first", "last")
    else:
        assert c.references == (H3Reference("image", False), H3Reference("video", True),
                                H3Reference("video", False), H3Reference("audio", True))
        assert torch.equal(c.audio_condition_latents[0], audio_latent_to_rows(core[0][1]["minimax_refs"][1]
                                                                                ["audio_latent"]))
    _assert_core_equal(c.to_comfy(), core)
    assert H3Conditioning.from_comfy(c.to_comfy()) == c


def test_core_t2va_native():
    core = [[_randn(1, 24, D), {"pooled_output": None, "minimax_token_tags": _tags(24)}]]
    c = H3Conditioning.from_comfy(core, height=64, width=64, num_frames=124)
    assert c.task == "t2va"


def test_core_fp16_latents_upcast_exactly():
    core = _core_native_fl2va()
    half = [dict(kf, latent=kf["latent"].half()) for kf in core[0][1]["minimax_keyframes"]]
    core[0][1]["minimax_keyframes"] = half
    c = H3Conditioning.from_comfy(core, height=64, width=64, num_frames=124)
    assert c.condition_latents[0].dtype == torch.float32
    assert torch.equal(c.condition_latents[0].half(), half[0]["latent"])


def _core_error(core, fragment, field_name=None, **kwargs):
    with pytest.raises(ContractError) as info:
        H3Conditioning.from_comfy(core, **kwargs)
    assert fragment in str(info.value), str(info.value)
    if field_name:
        assert info.value.field == field_name
    return info.value


def test_core_unrepresentable_and_malformed():
    canvas = dict(height=64, width=64, num_frames=124)
    _core_error(_core_native_fl2va(), "not carried by core", "height")

    core = _core_native_fl2va()
    core[0][1]["minimax_keyframes"][1]["resolved_frame_index"] = 60  # AddGuide interior frame
    _core_error(core, "0 (first) or num_frames-1 = 123", "minimax_keyframes[1]", **canvas)

    core = _core_native_fl2va()
    core[0][1]["minimax_keyframes"][0]["audio_latent"] = _randn(1, 32, 2, 100)
    _core_error(core, "audio keyframes", "minimax_keyframes[0]", **canvas)

    core = _core_native_fl2va()
    core[0][1]["minimax_visual_cond_noise_aug"] = 0.99
    _core_error(core, "not representable", "minimax_visual_cond_noise_aug", **canvas)

    core = _core_native_fl2va()
    core[0][1]["minimax_refs"] = _core_native_ref2va()[0][1]["minimax_refs"]
    _core_error(core, "together with references", **canvas)

    core = _core_native_ref2va()
    core[0][1]["minimax_refs"][0]["latent_w"] = 8
    _core_error(core, "latent_w=8 does not match", "minimax_refs[0]", **canvas)

    core = _core_native_ref2va()
    core[0][1]["minimax_refs"][1]["ref_audio_t"] = 99
    _core_error(core, "ref_audio_t=99 does not match", "minimax_refs[1]", **canvas)

    core = _core_native_ref2va()
    core[0][1]["minimax_refs"][2]["audio_latent"] = _randn(1, 32, 2, 100)
    _core_error(core, "must carry no audio", "minimax_refs[2]", **canvas)

    core = _core_native_ref2va()
    core[0][1]["minimax_refs"][0]["kind"] = "sketch"
    _core_error(core, "kind must be", "minimax_refs[0]", **canvas)

    core = _core_native_ref2va()
    del core[0][1]["minimax_token_tags"]
    _core_error(core, "missing", "minimax_token_tags", **canvas)

    _core_error(_core_native_fl2va() * 2, "exactly one", "conditioning", **canvas)
    _core_error([[_randn(1, 24, D)]], "[cross_attn tensor, extras dict]", "conditioning", **canvas)


def test_core_pack_key_conflicts_and_versions():
    core = make("fl2va").to_comfy()
    _core_error(core, "conflicts with minimax_h3_pack", "height", height=128)
    assert H3Conditioning.from_comfy(core, height=64) == make("fl2va")  # agreeing value is fine
    core[0][1][hc.COMFY_PACK_KEY] = dict(core[0][1][hc.COMFY_PACK_KEY], version=9)
    _core_error(core, "unsupported version 9", hc.COMFY_PACK_KEY)


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


# --- hygiene ------------------------------------------------------------------------------------

_CONTRACT_SOURCE = pathlib.Path(hc.__file__).read_text()


def _imported_modules(source):
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_module_never_imports_pickle_or_comfy():
    roots = {name.split(".")[0] for name in _imported_modules(_CONTRACT_SOURCE)}
    assert not roots & {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
    assert not roots & {"comfy", "comfy_api", "comfy_extras", "folder_paths", "nodes", "diffusers", "vllm",
                        "vllm_omni"}
    tree = ast.parse(_CONTRACT_SOURCE)
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not {"torch.load", "torch.save", "pickle.load", "pickle.loads"} & calls


def test_round_trips_never_unpickle(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    c = make("ref2va_video", prompt_dtype=torch.bfloat16)
    assert H3Conditioning.from_bytes(c.to_bytes()) == c
    c.save(tmp_path / "c.safetensors")
    assert H3Conditioning.load(tmp_path / "c.safetensors") == c
