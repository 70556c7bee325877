"""Hostile payloads and paths: the wire codec refuses them with a ContractError, in bounded time and memory,
and its messages never repeat the payload's bytes."""

import json
import os
import threading
import tracemalloc

import pytest
import safetensors.torch as st
import torch
from support.contract_cases import _retamper, _st_metadata, expect_contract_error, make

from h3_core.contract import HEADER_KEY, ContractError, H3Conditioning, wire


def _load_error(path, fragment):
    return expect_contract_error(H3Conditioning.load, path, fragment)


def _bytes_error(data, fragment):
    return expect_contract_error(H3Conditioning.from_bytes, data, fragment)


# --- load: what is not a regular file ----------------------------------------------------------------


def test_load_refuses_a_directory(tmp_path):
    _load_error(tmp_path, "not a regular file")


def test_load_refuses_a_device():
    _load_error(os.devnull, "not a regular file")


def test_load_refuses_a_missing_file(tmp_path):
    _load_error(tmp_path / "absent.safetensors", "cannot read")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_load_refuses_a_fifo_without_hanging(tmp_path):
    fifo = tmp_path / "cond.safetensors"
    os.mkfifo(fifo)
    outcome = []

    def load():
        try:
            H3Conditioning.load(fifo)
        except Exception as error:  # noqa: BLE001 - the test inspects whatever came out
            outcome.append(error)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # blocked in open(): release it by opening the other end, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("H3Conditioning.load blocked on a FIFO")
    assert len(outcome) == 1 and isinstance(outcome[0], ContractError), outcome
    assert "not a regular file" in str(outcome[0])


# --- load: the header is checked before the data is read ---------------------------------------------


def test_load_checks_the_header_before_reading_the_data(tmp_path):
    """A file whose header is wrong is refused after reading 8 + N bytes: the 64 MiB behind it is never
    read into memory (the previous code allocated the whole file first)."""
    plain = st.save({"x": torch.zeros(2)})  # a safetensors file, but no contract header
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(plain)
        f.truncate(len(plain) + 64 * 1024 * 1024)  # sparse: costs no disk
    tracemalloc.start()
    try:
        _load_error(path, "wrong format")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024, f"load allocated {peak} bytes for a file it refuses from its header"


def test_load_refuses_a_header_longer_than_the_file(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes((40_000).to_bytes(8, "little") + b"{}")
    tracemalloc.start()
    try:
        _load_error(path, "truncated: header claims 40000 bytes")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024


def test_load_round_trip_still_exact(tmp_path):
    c = make("ref2va_video")
    c.save(tmp_path / "c.safetensors")
    back = H3Conditioning.load(tmp_path / "c.safetensors")
    assert back == c
    back.condition_latents[0].add_(1.0)  # the loaded tensors are writable and own their memory
    assert back != c


# --- counts from the header are bounded before anything is built from them ----------------------------


@pytest.mark.parametrize("count", [10**6, 10**8])
def test_huge_condition_counts_refused_up_front(count):
    data = make("t2va").to_bytes()
    for key in ("num_condition_latents", "num_audio_condition_latents"):
        hostile = _retamper(data, lambda h, key=key: h.update({key: count, "tensor_count": count + 2}))
        err = _bytes_error(hostile, "at most")
        assert len(str(err)) < 300


def test_huge_reference_list_refused_up_front():
    data = make("t2va").to_bytes()
    hostile = _retamper(data, lambda h: h.update(references=[["image", False]] * 1_000))
    err = _bytes_error(hostile, "references must be a list of at most 12 entries")
    assert len(str(err)) < 300


def test_long_name_lists_are_truncated():
    data = make("t2va").to_bytes()
    extra = {f"leak_{i:04d}": torch.zeros(1) for i in range(15)}  # 17 tensors: within the 20 a header may list
    err = _bytes_error(_retamper(data, edit_tensors=lambda t: t.update(extra)), "and 5 more")
    assert "leak_0014" not in str(err) and len(str(err)) < 800


# --- messages never repeat payload bytes --------------------------------------------------------------


def test_messages_do_not_echo_payload_bytes():
    data = make("t2va").to_bytes()
    secret = "S3CRET" * 2000
    err = _bytes_error(_retamper(data, lambda h: h.update(format=secret)), "wrong format")
    assert "S3CRET" * 10 not in str(err) and len(str(err)) < 300
    err = _bytes_error(_retamper(data, lambda h: h.update(version=secret)), "unsupported version")
    assert "S3CRET" * 10 not in str(err) and len(str(err)) < 300
    broken = bytearray(data)
    broken[9:20] = b"\xff" * 11  # not UTF-8
    err = _bytes_error(bytes(broken), "not valid JSON")
    assert "xff" not in str(err).lower()
    prefix = (2**40 + 0x41).to_bytes(8, "little")
    err = _bytes_error(prefix + b"{}", "exceeds")
    cap = wire.MAX_HEADER_BYTES
    assert str(err) == f"payload: corrupted: header length {2**40 + 0x41} exceeds the {cap}-byte limit"


# --- deep JSON nesting is a ContractError, not a RecursionError ---------------------------------------


def test_deeply_nested_safetensors_header():
    raw = b"[" * 20_000 + b"]" * 20_000  # within the conditioning header cap, so the depth check is what refuses
    err = _bytes_error(len(raw).to_bytes(8, "little") + raw, "nests")
    assert "20000 deep" in str(err)


def test_deeply_nested_contract_header():
    data = make("t2va").to_bytes()
    header = json.loads(_st_metadata(data)[HEADER_KEY])
    deep = json.dumps(header)[:-1] + ',"x":' + "[" * 15_000 + "]" * 15_000 + "}"
    tensors = st.load(data)
    _bytes_error(st.save(tensors, metadata={HEADER_KEY: deep}), "nests")


def test_brackets_inside_strings_do_not_count_as_nesting():
    c = make("t2va", metadata={"note": "[" * 1000 + "{" * 1000})
    assert H3Conditioning.from_bytes(c.to_bytes()) == c


def test_a_model_file_picked_as_a_conditioning_is_named_as_such(tmp_path):
    # What users pick by mistake in Load Conditioning (a LoRA or a model): a well-formed safetensors file whose header
    # alone is larger than any conditioning's. The message says what it is, not only the header's size.
    from safetensors.torch import save_file

    path = tmp_path / "some_lora.safetensors"
    save_file({f"lora_unet_block_{i}.lora_down.weight": torch.zeros(1) for i in range(2000)}, str(path))
    with pytest.raises(ContractError, match="is not an H3 conditioning file: its safetensors header alone is") as info:
        H3Conditioning.load(path)
    assert "a model, LoRA or other weights file?" in str(info.value) and "Save Conditioning" in str(info.value)
