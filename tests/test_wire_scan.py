"""The reader's one pass (`wire._Scan`): the checksum and the finiteness test of every float tensor, piece by piece
while a payload arrives (`Receiving`) or in `from_buffer`, give the same answers as a checksum pass followed by
`check_finite` on each tensor (`verify` + `build` without a scan): the same error, message and field, the checksum's
before any value's, the first tensor in the contract's order, the first element in it."""

from __future__ import annotations

import math

import pytest
import torch
from support.contract_cases import _retamper, make

from h3_core import safetensors_header as sth
from h3_core.contract import ChecksumError, ContractError, H3Conditioning, wire


def _reference(data: bytes):
    """The two-pass reading: the checksum over the data, then `check_finite` per tensor in `build`."""
    buf = bytearray(data)
    parsed = sth.read_header(memoryview(buf), wire.MAX_HEADER_BYTES, max_tensors=wire.MAX_TENSORS)
    checked = wire.plan(parsed, len(buf) - parsed.data_start)
    wire.verify(checked, memoryview(buf)[parsed.data_start:])
    return wire.build(H3Conditioning, checked, buf, parsed.data_start)


def _arriving(data: bytes, piece: int):
    buf = wire.new_buffer(len(data))
    receiving = wire.Receiving(buf)
    for start in range(0, len(data), piece):
        end = min(start + piece, len(data))
        buf[start:end] = memoryview(data)[start:end]
        receiving.advance(end)
    return H3Conditioning.from_buffer(buf, receiving)


READERS = {
    "from_buffer": lambda data: H3Conditioning.from_buffer(bytearray(data)),
    "arriving by 1 byte": lambda data: _arriving(data, 1),
    "arriving by 97 bytes": lambda data: _arriving(data, 97),
    "arriving by 4093 bytes": lambda data: _arriving(data, 4093),
}


def _outcome(read, data: bytes):
    try:
        return read(data)
    except ContractError as error:
        return type(error), str(error), error.field


def _poisoned(kind: str, dtype: torch.dtype, spots: dict[str, tuple[int, float]], seal: bool = True) -> bytes:
    def poison(tensors):
        for name, (index, value) in spots.items():
            flat = tensors[name].reshape(-1)
            flat[index if index >= 0 else flat.numel() + index] = value

    return _retamper(make(kind, prompt_dtype=dtype).to_bytes(), edit_tensors=poison, seal=seal)


CASES = {
    "first prompt element nan": ("t2va", {"prompt_embeds": (0, math.nan)}),
    "last prompt element inf": ("t2va", {"prompt_embeds": (-1, math.inf)}),
    "mid prompt -inf": ("t2va", {"prompt_embeds": (1000, -math.inf)}),
    "two in one tensor: the first": ("t2va", {"prompt_embeds": (1200, math.inf)}),
    "a latent": ("ref2va_video", {"condition_latents.1": (17, math.nan)}),
    "latent and prompt: contract order": ("ref2va", {"condition_latents.0": (3, math.nan),
                                                     "prompt_embeds": (-5, math.inf)}),
    "an audio latent": ("ref2va_video", {"audio_condition_latents.1": (-1, -math.inf)}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_pass_refuses_like_two(case, dtype):
    kind, spots = CASES[case]
    data = _poisoned(kind, dtype, spots)
    expected = _outcome(_reference, data)
    assert isinstance(expected, tuple) and "must be finite" in expected[1], expected
    for name, read in READERS.items():
        assert _outcome(read, data) == expected, name


def test_a_checksum_mismatch_is_reported_before_a_nan():
    data = bytearray(_poisoned("t2va", torch.bfloat16, {"prompt_embeds": (5, math.nan)}))
    data[-1] ^= 0x01
    for read in READERS.values():
        with pytest.raises(ChecksumError, match="checksum mismatch"):
            read(bytes(data))


@pytest.mark.parametrize("kind", ["t2va", "fl2va", "ref2va", "ref2va_video"])
def test_a_clean_payload_is_read_in_one_pass(kind, monkeypatch):
    """`from_buffer` on a whole buffer: the checksum and the finiteness test in one pass. Arriving (`Receiving`):
    the checksum piece by piece as the bytes land, then one finiteness pass per float tensor (the test per piece in
    the receiving thread measured slower end to end)."""
    c = make(kind, prompt_dtype=torch.bfloat16)
    data = c.to_bytes()
    tested = []

    def second_pass(*args):
        raise AssertionError("a second pass over the data")

    monkeypatch.setattr(wire, "verify", second_pass)
    monkeypatch.setattr(wire, "check_finite", second_pass)
    assert READERS["from_buffer"](data) == c
    monkeypatch.setattr(wire, "check_finite", lambda name, t: tested.append(name))
    floats = 1 + len(c.condition_latents) + len(c.audio_condition_latents)
    for name, read in READERS.items():
        tested.clear()
        if name != "from_buffer":
            assert read(data) == c, name
            assert len(tested) == len(set(tested)) == floats, (name, tested)

