"""ComfyUI core's H3 CONDITIONING <-> `H3Conditioning`."""


import pytest
import torch
from support.contract_cases import KINDS, D, _randn, _tags, make

from h3_core import contract as hc
from h3_core.contract import (
    ContractError,
    H3Conditioning,
    H3Reference,
    audio_latent_to_rows,
)

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
    assert set(make("t2va").to_comfy()[0][1]) == {"minimax_token_tags", hc.COMFY_PACK_KEY, "pooled_output"}


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
        for da, db in zip(ea[key], eb[key], strict=False):
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
    core[0][1]["minimax_keyframes"][1]["resolved_frame_index"] = 122  # a guide at 122 of 124 frames, but a clip
    core[0][1]["minimax_keyframes"][1]["latent"] = _randn(1, 24, 2, 4, 4)  # of 5 frames would end past the video
    _core_error(core, "does not fit in the video's 124 frames", "guides[0]", **canvas)

    core = _core_native_fl2va()
    core[0][1]["minimax_keyframes"][0]["audio_latent"] = _randn(1, 32, 2, 300)  # more than the 207 left at frame 0
    _core_error(core, "more than the 207 the output leaves", "guides[0]", **canvas)

    core = _core_native_fl2va()
    core[0][1]["minimax_keyframes"][0].pop("latent")
    _core_error(core, "neither a video latent nor an audio latent", "minimax_keyframes[0]", **canvas)

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


def _two_faults(fault):
    """A core-native fl2va CONDITIONING (first and last keyframe) with one of the faults below applied."""
    core = _core_native_fl2va()
    extras = core[0][1]
    fault(core, extras)
    return core


# A CONDITIONING with two faults gets the error of the one read first: decode reads the entry, the keys the
# contract cannot hold, the pack key, keyframes-or-references, task, canvas, metadata, each keyframe, each
# reference, then the tensors. Each case pins one step of that order (the first field named wins).
_FAULT_ORDER = [
    ("conditioning", lambda core, x: (core.append(core[0]), x.pop("minimax_token_tags"))),
    ("minimax_token_tags", lambda core, x: (x.pop("minimax_token_tags"), x.update(minimax_audio_cond_noise_aug=1))),
    ("minimax_audio_cond_noise_aug", lambda core, x: x.update(minimax_audio_cond_noise_aug=1,
                                                              minimax_h3_pack={"format": "other"})),
    (hc.COMFY_PACK_KEY, lambda core, x: x.update(minimax_h3_pack={"format": hc.FORMAT_ID, "version": 9},
                                                 minimax_refs=_core_native_ref2va()[0][1]["minimax_refs"])),
    ("minimax_keyframes", lambda core, x: x.update(minimax_refs=_core_native_ref2va()[0][1]["minimax_refs"],
                                                   minimax_h3_pack={**_PACK, "task": "t2va"})),
    ("task", lambda core, x: x.update(minimax_h3_pack={**_PACK, "task": "t2va", "height": 32})),
    ("height", lambda core, x: x.update(minimax_h3_pack={**_PACK, "height": 32, "metadata": {"a": "b"}})),
    ("metadata", lambda core, x: (x.update(minimax_h3_pack={**_PACK, "metadata": {"a": "b"}}),
                                  x["minimax_keyframes"][0].update(resolved_frame_index="60"))),
    ("minimax_keyframes[0]", lambda core, x: (x["minimax_keyframes"][0].update(resolved_frame_index="60"),
                                              x["minimax_keyframes"][1].update(latent=None))),
    ("minimax_keyframes[1]['latent']", lambda core, x: (x["minimax_keyframes"][1].update(latent="x"),
                                                        core[0].__setitem__(0, "not a tensor"))),
    ("cross_attn", lambda core, x: (core[0].__setitem__(0, "not a tensor"), x.update(minimax_token_tags=1))),
]
_PACK = {"format": hc.FORMAT_ID, "version": 1, "task": "fl2va", "height": 64, "width": 64, "num_frames": 124,
         "metadata": {}}


@pytest.mark.parametrize("field_name, fault", _FAULT_ORDER, ids=[name for name, _ in _FAULT_ORDER])
def test_core_reader_order_decides_which_fault_is_named(field_name, fault):
    canvas = dict(height=64, width=64, num_frames=124, metadata={"src": "comfy"})
    if field_name in ("task", "height", "metadata"):
        canvas = dict(task="fl2va", height=64, metadata={"src": "comfy"})  # faults: conflicts with the pack key
    with pytest.raises(ContractError) as info:
        H3Conditioning.from_comfy(_two_faults(fault), **canvas)
    assert info.value.field == field_name, str(info.value)


def test_core_reference_faults_are_named_in_reference_order():
    core = _core_native_ref2va()
    refs = core[0][1]["minimax_refs"]
    refs[1]["ref_audio_t"] = 99  # audio mismatch on the second reference
    refs[2]["latent_w"] = 8  # and a shape mismatch on the third
    _core_error(core, "ref_audio_t=99 does not match", "minimax_refs[1]", height=64, width=64, num_frames=124)
    refs[1]["latent_h"] = 9  # the second's visual latent is read before its audio
    _core_error(core, "latent_h=9 does not match", "minimax_refs[1]", height=64, width=64, num_frames=124)


# A hostile CONDITIONING puts a multi-element tensor where core holds a list or an int: `or`, `==` and `!=` on it
# are no bools, so each place is checked by type first and refused as a ContractError naming it (not a RuntimeError).
_TENSOR = torch.zeros(3)
_TENSOR_PLACES = [
    ("minimax_keyframes", lambda c: c[0][1].__setitem__("minimax_keyframes", _TENSOR), "fl2va"),
    ("minimax_refs", lambda c: c[0][1].__setitem__("minimax_refs", _TENSOR), "ref2va"),
    ("minimax_keyframes[0]", lambda c: c[0][1]["minimax_keyframes"][0].__setitem__("resolved_frame_index", _TENSOR),
     "fl2va"),
    ("minimax_refs[0]", lambda c: c[0][1]["minimax_refs"][0].__setitem__("latent_h", _TENSOR), "ref2va"),
    ("minimax_refs[1]", lambda c: c[0][1]["minimax_refs"][1].__setitem__("ref_audio_t", _TENSOR), "ref2va"),
    ("minimax_refs[0]", lambda c: c[0][1]["minimax_refs"][0].__setitem__("ref_audio_t", _TENSOR), "ref2va"),
]


@pytest.mark.parametrize("field_name, plant, task", _TENSOR_PLACES, ids=[f"{n}-{i}" for i, (n, _, _) in
                                                                         enumerate(_TENSOR_PLACES)])
def test_a_tensor_where_a_list_or_int_belongs_is_refused_by_name(field_name, plant, task):
    core = _core_native_fl2va() if task == "fl2va" else _core_native_ref2va()
    plant(core)
    with pytest.raises(ContractError) as info:
        H3Conditioning.from_comfy(core, height=64, width=64, num_frames=124)
    assert info.value.field == field_name, str(info.value)


def test_a_tensor_in_the_pack_key_is_refused_by_name():
    core = make("t2va").to_comfy()
    core[0][1]["minimax_h3_pack"]["height"] = _TENSOR
    with pytest.raises(ContractError) as info:
        H3Conditioning.from_comfy(core, height=64)
    assert info.value.field == "height" and "plain value" in str(info.value)
