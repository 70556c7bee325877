"""Wire form 2: the header and the tensor storages unjoined, one buffer in and views out, one xxh3-128 seal,
memory-mapped files, and the ways a body or a file can lie about itself."""

import hashlib
import json
import tracemalloc

import numpy as np
import pytest
import safetensors.torch as st
import torch
from support.contract_cases import KINDS, _retamper, _st_header, expect_contract_error, make

from h3_core.contract import CHECKSUM_KEY, HEADER_KEY, ChecksumError, ContractError, H3Conditioning, wire
from h3_core.contract.wire import checksum_of


def _tensors(c):
    return [c.prompt_embeds, c.text_token_tags, *c.condition_latents, *c.audio_condition_latents]


def _error(data, fragment, kind=ContractError):
    return expect_contract_error(lambda raw: H3Conditioning.from_buffer(bytearray(raw)), data, fragment, kind)


def _relabel(data, edit_table, seal=False):
    """The same data under an edited safetensors tensor table (re-sealed to match when `seal`): a header that
    lies about offsets, dtypes or shapes, as another writer could produce."""
    header, start = _st_header(data)
    meta = header.pop("__metadata__")
    edit_table(header)
    if seal:
        meta[CHECKSUM_KEY] = checksum_of(meta[HEADER_KEY], header, data[start:])
    text = json.dumps({"__metadata__": meta, **header}).encode()
    return len(text).to_bytes(8, "little") + text + data[start:]


# --- round trips ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_bitwise_with_views_of_the_buffer(kind, prompt_dtype):
    c = make(kind, prompt_dtype=prompt_dtype)
    buf = bytearray(c.to_wire().tobytes())
    back = H3Conditioning.from_buffer(buf)
    assert back == c  # bitwise: tensors compared as raw bits, scalars and metadata exactly
    base = np.frombuffer(buf, np.uint8).ctypes.data
    for got, want in zip(_tensors(back), _tensors(c), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        if got.numel():
            assert base <= got.data_ptr() < base + len(buf), "a tensor was copied out of the received buffer"
            assert got.data_ptr() % got.element_size() == 0
    back.prompt_embeds.add_(1)  # writable views of the buffer the caller handed over
    assert back != c


def test_encoded_pieces_are_the_tensor_storages():
    c = make("ref2va_video", prompt_dtype=torch.bfloat16)
    encoded = c.to_wire()
    addresses = {np.frombuffer(view, np.uint8).ctypes.data for view in encoded.views}
    assert addresses == {t.data_ptr() for t in _tensors(c) if t.numel()}  # sent from where they live, no copy
    joined = encoded.tobytes()
    assert joined == c.to_bytes() and len(joined) == len(encoded) == encoded.nbytes
    header, start = _st_header(joined)
    assert start % 8 == 0
    for name, info in header.items():
        if name != "__metadata__":
            assert info["data_offsets"][0] % torch.empty(0, dtype=wire.WIRE_DTYPES[info["dtype"]]).element_size() == 0
    assert header["__metadata__"][CHECKSUM_KEY] == encoded.checksum
    assert sorted(st.load(joined)) == sorted(header.keys() - {"__metadata__"})  # still plain safetensors


def test_fingerprint_is_sha256_of_the_bytes_without_joining():
    c = make("ref2va")
    assert c.fingerprint() == hashlib.sha256(c.to_bytes()).hexdigest()


def test_from_buffer_takes_only_a_bytearray():
    with pytest.raises(ContractError, match="expected a bytearray"):
        H3Conditioning.from_buffer(make("t2va").to_bytes())


# --- hostile bodies ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 7, 8, 60, -1, -33, -4000])
def test_truncated_bodies(cut):
    data = make("ref2va_video").to_bytes()
    _error(data[:cut], "truncated")


def test_wrong_length_bodies():
    data = make("ref2va").to_bytes()
    _error(data + b"\0" * 16, "corrupted: tensors need")
    _error(data[:-16], "truncated: tensors need")


@pytest.mark.parametrize("where", ["data_first", "data_last", "metadata_value", "shape_digit", "checksum"])
def test_bit_flips_fail_the_checksum(where):
    c = make("ref2va", metadata={"model": "tiny-minimax-h3", "note": "abcdef"})
    data = bytearray(c.to_bytes())
    header, start = _st_header(bytes(data))
    text = bytes(data[8:start])
    spot = {
        "data_first": start,
        "data_last": len(data) - 1,
        "metadata_value": 8 + text.index(b"abcdef"),
        "shape_digit": 8 + text.index(b'"shape":[240,32]') + len(b'"shape":[240,3'),  # "2" -> "3": 32 -> 33 wide
        "checksum": 8 + text.index(header["__metadata__"][CHECKSUM_KEY].encode()) + 20,
    }[where]
    data[spot] ^= 0x01
    err = _error(bytes(data), "corrupted", kind=ContractError)
    if where in ("data_first", "data_last", "metadata_value", "checksum"):
        assert isinstance(err, ChecksumError) and "xxh3-128 checksum mismatch" in str(err)
    else:  # a shape that no longer matches its byte span is refused by the header parser, before the checksum
        assert "spans" in str(err)


def test_offsets_are_checked_against_the_buffer_before_any_view(monkeypatch):
    data = make("ref2va").to_bytes()

    def viewed(*args, **kwargs):
        raise AssertionError("a tensor was viewed out of a body whose header lies")

    monkeypatch.setattr(wire.torch, "frombuffer", viewed)

    def past_the_end(table):  # the last tensor one row longer than the data holds
        last = max(table.values(), key=lambda info: info["data_offsets"][1])
        assert last["dtype"] == "F32"
        last["data_offsets"][1] += last["shape"][-1] * 4
        last["shape"][-2] += 1

    def overlap(table):
        first = min(table.values(), key=lambda info: info["data_offsets"][0])
        second = min((i for i in table.values() if i is not first), key=lambda info: info["data_offsets"][0])
        size = second["data_offsets"][1] - second["data_offsets"][0]
        second["data_offsets"] = [second["data_offsets"][0] - 4, second["data_offsets"][0] - 4 + size]

    def huge(table):
        table["prompt_embeds"]["shape"] = [1, 2**40, 64]
        table["prompt_embeds"]["data_offsets"] = [0, 2**40 * 64 * 4]

    for edit, fragment in ((past_the_end, "tensors need"), (overlap, "expected"), (huge, "starts at byte")):
        for seal in (False, True):  # sealed or not, the lie is refused before the checksum or any view
            _error(_relabel(data, edit, seal=seal), fragment)


def test_dtype_and_shape_lies():
    data = make("ref2va").to_bytes()

    def f32_as_bf16(table):  # same shape, half the bytes: refused by the span check
        table["audio_condition_latents.0"]["dtype"] = "BF16"
    _error(_relabel(data, f32_as_bf16), "spans")

    def f32_as_i32(table):  # same width, not a dtype the contract uses
        table["audio_condition_latents.0"]["dtype"] = "I32"
    _error(_relabel(data, f32_as_i32, seal=True), "not one the contract uses")

    def transposed(table):  # same bytes, other shape: the seal catches it ...
        table["audio_condition_latents.0"]["shape"] = [32, 240]
    _error(_relabel(data, transposed), "checksum mismatch", kind=ChecksumError)
    # ... and resealed, the contract's own validation does (audio latents are (T, 32))
    with pytest.raises(ContractError, match=r"^audio_condition_latents\[0\]"):
        H3Conditioning.from_buffer(bytearray(_relabel(data, transposed, seal=True)))


def test_checksum_key_must_be_present_and_well_formed():
    data = make("t2va").to_bytes()
    _error(_retamper(data, seal=False), f"{CHECKSUM_KEY!r} must be an xxh3-128 checksum")
    other = make("fl2va").to_bytes()
    swapped = _relabel(data, lambda table: None)  # same payload, re-serialised header
    assert H3Conditioning.from_buffer(bytearray(swapped)) == make("t2va")
    header, start = _st_header(data)
    header["__metadata__"][CHECKSUM_KEY] = _st_header(other)[0]["__metadata__"][CHECKSUM_KEY]
    text = json.dumps(header).encode()
    _error(len(text).to_bytes(8, "little") + text + data[start:], "checksum mismatch", kind=ChecksumError)


# --- files: read into memory (never mapped), version 1 ----------------------------------------------------


@pytest.mark.parametrize("kind", ["t2va", "fl2va", "ref2va", "ref2va_video"])
def test_load_equals_what_was_saved(kind, tmp_path):
    c = make(kind, prompt_dtype=torch.bfloat16)
    path = tmp_path / "c.safetensors"
    c.save(path)
    assert path.read_bytes() == c.to_bytes()
    back = H3Conditioning.load(path)
    assert back == c
    for a, b in zip(_tensors(back), _tensors(c), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape


def test_loaded_tensors_are_private_and_writable(tmp_path):
    c = make("ref2va")
    path = tmp_path / "c.safetensors"
    c.save(path)
    before = path.read_bytes()
    back = H3Conditioning.load(path)
    back.audio_condition_latents[0].mul_(2)  # the tensors own their memory: the file is untouched
    assert path.read_bytes() == before and H3Conditioning.load(path) == c


def test_mmap_is_refused(tmp_path):
    """A conditioning file is never memory-mapped: asking for it is an error, not a silent mapping."""
    c = make("t2va")
    c.save(tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="never memory-maps"):
        H3Conditioning.load(tmp_path / "c.safetensors", mmap=True)
    assert H3Conditioning.load(tmp_path / "c.safetensors", mmap=False) == c


def test_load_reads_the_data_once(tmp_path):
    """One buffer of the data's size, which the tensors then own: no second copy, no temporary of the file."""
    c = make("t2va", prompt_embeds=torch.randn(1, 4096, 1024), text_token_tags=torch.ones(4096, dtype=torch.int64))
    path = tmp_path / "big.safetensors"
    c.save(path)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        back = H3Conditioning.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert back == c
    assert peak < size + 2 * 1024 * 1024, f"load allocated {peak} bytes for a {size}-byte file"


def test_corrupted_and_truncated_files(tmp_path):
    data = bytearray(make("ref2va").to_bytes())
    path = tmp_path / "c.safetensors"
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        H3Conditioning.load(path)
    path.write_bytes(make("ref2va").to_bytes()[:-100])
    with pytest.raises(ContractError, match="truncated: tensors need"):
        H3Conditioning.load(path)


def _version_1(c) -> bytes:
    """A payload as the previous release wrote it: a sha256 per tensor in the contract header, no seal."""
    tensors = {"prompt_embeds": c.prompt_embeds, "text_token_tags": c.text_token_tags}
    tensors.update({f"condition_latents.{i}": t for i, t in enumerate(c.condition_latents)})
    tensors.update({f"audio_condition_latents.{i}": t for i, t in enumerate(c.audio_condition_latents)})
    header = {**wire.identity_fields(c), "version": 1, "keyframe_anchors": list(c.keyframe_anchors),
              "references": [{"kind": r.kind, "has_audio": r.has_audio} for r in c.references],
              "metadata": dict(c.metadata), "num_condition_latents": len(c.condition_latents),
              "num_audio_condition_latents": len(c.audio_condition_latents), "tensor_count": len(tensors),
              "sha256": {n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                         for n, t in tensors.items()}}
    return st.save(tensors, metadata={HEADER_KEY: json.dumps(header, sort_keys=True)})


def test_version_1_files_still_load(tmp_path):
    c = make("ref2va_video", prompt_dtype=torch.bfloat16)
    path = tmp_path / "old.safetensors"
    path.write_bytes(_version_1(c))
    assert H3Conditioning.load(path) == c
    data = bytearray(_version_1(c))
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="checksum mismatch for tensor"):
        H3Conditioning.load(path)


# --- the checksum taken while the payload arrives ------------------------------------------------------------


def _arrive(data: bytes, piece: int = 97) -> tuple[bytearray, wire.Receiving]:
    """Fill a buffer front to back in odd-sized pieces, as a socket would, telling a `Receiving` after each."""
    buf = bytearray(len(data))
    receiving = wire.Receiving(buf)
    for start in range(0, len(data), piece):
        end = min(start + piece, len(data))
        buf[start:end] = data[start:end]
        receiving.advance(end)
    return buf, receiving


@pytest.mark.parametrize("kind", ["t2va", "fl2va", "ref2va"])
def test_receiving_checks_the_seal_on_arrival(kind, monkeypatch):
    c = make(kind)
    buf, receiving = _arrive(c.to_bytes())
    assert receiving.checked_plan() is not None

    def second_pass(*args):
        raise AssertionError("the checksum was computed twice")

    monkeypatch.setattr(wire, "verify", second_pass)
    assert H3Conditioning.from_buffer(buf, receiving) == c


def test_receiving_a_corrupted_or_lying_payload():
    data = bytearray(make("ref2va").to_bytes())
    data[-1] ^= 0x80
    buf, receiving = _arrive(bytes(data))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        H3Conditioning.from_buffer(buf, receiving)
    lying = _relabel(make("ref2va").to_bytes(), lambda table: table["prompt_embeds"]["data_offsets"].reverse())
    buf, receiving = _arrive(lying)
    assert receiving.checked_plan() is None  # stopped at the header; from_buffer runs (and reports) every check
    with pytest.raises(ContractError, match="corrupted tensor table entry"):
        H3Conditioning.from_buffer(buf, receiving)
    buf, receiving = _arrive(make("t2va").to_bytes())
    other = bytearray(buf)
    assert H3Conditioning.from_buffer(other, receiving) == make("t2va")  # a receipt for another buffer is ignored
    data = make("t2va").to_bytes()
    partial = bytearray(len(data))
    receiving = wire.Receiving(partial)
    partial[:len(data) // 2] = data[:len(data) // 2]
    receiving.advance(len(data) // 2)
    assert receiving.plan is not None and receiving.checked_plan() is None  # never covered the whole payload
