"""The safetensors wire form: round trips, and every way a payload can be broken or hostile."""

import dataclasses
import hashlib
import json

import pytest
import safetensors.torch as st
import torch
from support.contract_cases import KINDS, _randn, _retamper, _st_metadata, expect_contract_error, make

from h3_core import contract as hc
from h3_core.contract import (
    ContractError,
    H3Conditioning,
)

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


def test_bytes_are_safetensors_with_a_header_and_a_checksum():
    c = make("ref2va_video")
    data = c.to_bytes()
    tensors = st.load(data)
    assert sorted(tensors) == ["audio_condition_latents.0", "audio_condition_latents.1", "condition_latents.0",
                               "condition_latents.1", "prompt_embeds", "text_token_tags"]
    assert torch.equal(tensors["condition_latents.1"], c.condition_latents[1])
    header = _st_metadata(data)
    assert sorted(header) == [hc.CHECKSUM_KEY, hc.HEADER_KEY]
    assert header[hc.CHECKSUM_KEY].startswith("xxh3-128:") and len(header[hc.CHECKSUM_KEY]) == 9 + 32
    meta = json.loads(header[hc.HEADER_KEY])
    assert meta["format"] == "minimax-h3-conditioning" and meta["version"] == hc.WIRE_VERSION == 2
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


def _payload_error(data, fragment):
    return expect_contract_error(H3Conditioning.from_bytes, data, fragment)


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
    err = _payload_error(bytes(data), "xxh3-128 checksum mismatch")
    assert isinstance(err, hc.ChecksumError)


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
    err = _payload_error(_retamper(data, lambda h: h.update(version=4)), "unsupported version 4")
    assert "reads versions 1, 2, 3 (writes 2, and 3 on the wire for a client that asks)" in str(err)


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


# --- form 3: the checksum after the data (answers to a client that asks) ----------------------------------------


def test_form_3_round_trips_whole_and_as_it_arrives_and_converts_to_form_2():
    from h3_core.contract import wire

    cond = make("ref2va")
    streamed = wire.encode(cond, wire.STREAM_VERSION)
    data = streamed.tobytes()
    assert streamed.version == 3 and streamed.checksum is None and len(streamed) == len(data)
    assert b"".join(bytes(piece) for piece in streamed.pieces(1000)) == data  # hashed piece by piece as sent
    assert data[-wire.TRAILER_BYTES:].hex() == wire.encode(cond, 3).tobytes()[-16:].hex()  # deterministic
    assert hc.H3Conditioning.from_buffer(bytearray(data)) == cond
    receiving = wire.Receiving.new(len(data))
    for start in range(0, len(data), 777):  # pieces that cut the header, the tensors and the digest anywhere
        end = min(start + 777, len(data))
        receiving.buf[start:end] = memoryview(data)[start:end]
        receiving.advance(end)
    assert receiving.checked_plan() is not None
    assert hc.H3Conditioning.from_buffer(receiving.buf, receiving) == cond
    assert streamed.form(2).tobytes() == cond.to_bytes() and cond.to_wire().form(3).tobytes() == data
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    assert header["__metadata__"][hc.CHECKSUM_KEY] == "xxh3-128:trailing"
    assert json.loads(header["__metadata__"][hc.HEADER_KEY])["version"] == 3


def test_form_3_tampering_and_a_missing_digest_are_refused_by_name(tmp_path):
    from h3_core.contract import ChecksumError, wire

    cond = make("t2va")
    data = wire.encode(cond, wire.STREAM_VERSION).tobytes()
    for where in (-1, -wire.TRAILER_BYTES - 1, 40):  # the digest, the last data byte, the header's JSON
        bad = bytearray(data)
        bad[where] ^= 0x01
        with pytest.raises(ContractError) as info:
            hc.H3Conditioning.from_bytes(bytes(bad))
        assert where == 40 or isinstance(info.value, ChecksumError)
    _payload_error(data[:-wire.TRAILER_BYTES], "truncated: tensors need")
    # each form's checksum where the other keeps it: refused as a corrupted header, not retried as a bad digest
    form2 = cond.to_bytes()
    _payload_error(_retamper(form2, lambda h: h.update(version=3)), "form 3's 'minimax_h3_checksum' must be")
    marked = st.save(st.load(form2), metadata={hc.HEADER_KEY: _st_metadata(form2)[hc.HEADER_KEY],
                                               hc.CHECKSUM_KEY: wire.TRAILING_CHECKSUM})
    _payload_error(marked, "'minimax_h3_checksum' must be an xxh3-128 checksum")
    path = tmp_path / "answer.safetensors"
    path.write_bytes(data)  # an answer's body saved as it came: files hold form 2
    with pytest.raises(ContractError, match="is in wire form 3 .* a conditioning file is form 2"):
        hc.H3Conditioning.load(path)

