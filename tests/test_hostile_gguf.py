"""Hostile and cut GGUF files (security issue 36, item 1): the pack's own bounded header reader (`gguf_header`)
refuses, within a second and with flat memory (a 1 MiB read window), counts the file cannot hold (a 96-byte file
once froze ComfyUI's model lists), too many tensors, nesting, duplicates and foreign byte orders; names every cut
"incomplete file"; keeps a broken file from hiding its neighbours; refuses NaN or infinite block scales and dense
values by layer.

Every hostile file is built here byte by byte (`_Gguf`) or with the `gguf` package's own writer."""

from __future__ import annotations

import os
import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest
import torch

from h3_core.weights import gguf_file, gguf_header, sources
from h3_core.weights.errors import H3WeightsError, IncompleteFileError
from h3_core.weights.headers import read_file_header, read_header
from h3_core.weights.quant import ggml
from h3_core.weights.safetensors_io import load_tensors

UINT8, UINT32, FLOAT32, BOOL, STRING, ARRAY = 0, 4, 6, 7, 8, 9


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


class _Gguf:
    """A GGUF file written field by field, so any count, length or type can lie."""

    def __init__(self, n_tensors: int = 0, n_keys: int = 0, version: int = 3):
        self.data = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_keys)

    def kv(self, key: str, type_id: int, payload: bytes) -> _Gguf:
        self.data += _s(key) + struct.pack("<I", type_id) + payload
        return self

    def array(self, key: str, item_type: int, count: int, items: bytes = b"") -> _Gguf:
        return self.kv(key, ARRAY, struct.pack("<IQ", item_type, count) + items)

    def tensor(self, name: str, dims: tuple[int, ...], type_id: int = 0, offset: int = 0) -> _Gguf:
        self.data += _s(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) + struct.pack("<IQ", type_id, offset)
        return self

    def write(self, path, pad: int = 0) -> str:
        path.write_bytes(self.data + b"\0" * pad)
        return str(path)


def _timed(call):
    """(exception raised, seconds, peak bytes traced) of one call that must fail."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(H3WeightsError) as caught:
            call()
        return caught.value, time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --- counts the file cannot hold ------------------------------------------------------------------------------

HUGE = 1 << 62


@pytest.mark.parametrize("case", ["uint8 array", "string array", "nested array", "string value", "key length",
                                  "tensor count", "metadata count"])
def test_a_count_the_file_cannot_hold_is_refused_at_once_with_flat_memory(tmp_path, case):
    """The 96-byte file that hung `/object_info` (one array claiming 2^62 items; the `gguf` reader allocated ~2 GB
    in 23 s) and its siblings: refused in well under a second, with < 1 MB allocated, naming what claimed too
    much and saying "incomplete file" (a cut file and a lying count look the same)."""
    built = {
        "uint8 array": lambda: _Gguf(0, 1).array("tokenizer.ggml.tokens", UINT8, HUGE),
        "string array": lambda: _Gguf(0, 1).array("tokenizer.ggml.tokens", STRING, HUGE),
        "nested array": lambda: _Gguf(0, 1).array("x", ARRAY, 2, struct.pack("<IQ", UINT8, HUGE)),
        "string value": lambda: _Gguf(0, 1).kv("general.name", STRING, struct.pack("<Q", HUGE)),
        "key length": lambda: _Gguf(0, 1),  # then the key's length
        "tensor count": lambda: _Gguf(HUGE, 0),
        "metadata count": lambda: _Gguf(0, HUGE),
    }[case]()
    if case == "key length":
        built.data += struct.pack("<Q", HUGE)
    path = built.write(tmp_path / "hostile.gguf", pad=max(0, 96 - len(built.data)))
    error, seconds, peak = _timed(lambda: read_file_header(path))
    assert seconds < 1.0 and peak < 2 << 20, (seconds, peak)  # the reader's window: 1 MiB
    if case in ("tensor count", "metadata count", "key length"):
        assert "more than the" in str(error) and str(HUGE) in str(error)
    else:
        assert isinstance(error, IncompleteFileError) and "incomplete file" in str(error)
        assert "(interrupted download?)" in str(error) and str(HUGE) in str(error)


def test_100000_tensor_entries_are_refused_before_any_is_read(tmp_path):
    """A directory of 100,000 real entries (2.6 MB; the `gguf` reader spent 83 s on it) stops at the count: more
    than `MAX_TENSORS` (8x the largest real file) is refused by that limit, fast."""
    n = 100_000
    built = _Gguf(n, 0)
    built.data += b"".join(_s(f"t{i}") + struct.pack("<IQIQ", 1, 32, 0, 128 * i) for i in range(n))
    path = built.write(tmp_path / "many.gguf", pad=128 * 4)
    error, seconds, peak = _timed(lambda: read_file_header(path))
    assert f"{n} tensor entries, more than the {gguf_header.MAX_TENSORS}" in str(error)
    assert seconds < 1.0 and peak < 2 << 20  # the reader's window: 1 MiB


def test_a_directory_at_the_tensor_cap_reads_in_bounded_time(tmp_path):
    """`MAX_TENSORS` entries (the most a file may hold) parse in a bounded time: what one hostile directory costs."""
    n = gguf_header.MAX_TENSORS
    built = _Gguf(n, 0)
    built.data += b"".join(_s(f"t{i}") + struct.pack("<IQIQ", 1, 32, 0, 128 * i) for i in range(n))
    path = built.write(tmp_path / "cap.gguf", pad=32 + 128 * n)
    start = time.process_time()
    found = gguf_header.parse(path)
    assert len(found.tensors) == n and time.process_time() - start < 2.0


@pytest.mark.parametrize("case", ["depth", "type", "item type", "duplicate key", "duplicate tensor", "big-endian",
                                  "version 1", "dims", "utf-8", "alignment", "walk", "header cap", "kept array"])
def test_malformed_headers_are_refused_by_name(tmp_path, case):
    nested = struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", UINT8, 0)
    built, match, pad = {
        "depth": (_Gguf(0, 1).array("x", ARRAY, 1, nested), "nested more than 2 deep", 0),
        "type": (_Gguf(0, 1).kv("x", 99, b"\0" * 8), "unknown GGUF value type 99", 0),
        "item type": (_Gguf(0, 1).array("x", 42, 1, b"\0" * 8), "unknown GGUF array item type 42", 0),
        "duplicate key": (_Gguf(0, 2).kv("a", UINT32, b"\0" * 4).kv("a", UINT32, b"\0" * 4), "'a' appears twice", 0),
        "duplicate tensor": (_Gguf(2, 0).tensor("w", (32,)).tensor("w", (32,)), "'w' appears twice", 128),
        "big-endian": (_Gguf(version=3 << 24), "big-endian", 0),
        "version 1": (_Gguf(version=1), "GGUF version 1", 0),
        "dims": (_Gguf(1, 0).tensor("w", (1, 1, 1, 1, 32)), "5 dimensions, more than GGML's 4", 128),
        "utf-8": (_Gguf(0, 1), "not UTF-8", 0),  # then a key of bytes that are no UTF-8
        "alignment": (_Gguf(0, 1).kv("general.alignment", UINT32, struct.pack("<I", 24)), "not a power of two", 0),
        # counts checked before the walk: each item of these is a zero-length string (8 zero bytes, see `pad`)
        "walk": (_Gguf(0, 1).array("tokenizer.ggml.merges", STRING, gguf_header.MAX_WALKED + 1),
                 f"more than {gguf_header.MAX_WALKED} strings", 8 * (gguf_header.MAX_WALKED + 1)),
        "header cap": (_Gguf(0, 1).array("x", UINT8, gguf_header.MAX_HEADER_BYTES), "larger than 64 MiB",
                       gguf_header.MAX_HEADER_BYTES),
        "kept array": (_Gguf(0, 1).array("comfy.gguf.orig_shape.w", UINT32, 5000), "more than the 4096 items",
                       4 * 5000),
    }[case]
    if case == "utf-8":
        built.data += _s(b"\xff\xfe") + struct.pack("<II", UINT32, 0)
    path = tmp_path / "bad.gguf"
    with open(path, "wb") as handle:  # sparse padding: the large cases cost no disk and no time
        handle.write(built.data)
        handle.truncate(len(built.data) + pad)
    start = time.perf_counter()
    with pytest.raises(H3WeightsError, match=match):
        read_file_header(str(path))
    assert time.perf_counter() - start < 1.0


# --- cut files ------------------------------------------------------------------------------------------------

def _realistic(path) -> str:
    """A small file with what real ones hold: strings, numbers, a tokenizer-like string array, a nested array, an
    original-shape array, and Q8_0 / F32 / F16 tensors."""
    writer = gguf.GGUFWriter(str(path), "qwen3vl")
    writer.add_string("general.name", "hostile test")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_array("qwen3vl.rope.dimension_sections", [24, 20, 20, 0])
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.add_float32("qwen3vl.rope.freq_base", 5e6)
    writer.add_bool("x.flag", True)
    writer.add_array("comfy.gguf.orig_shape.w8", [2, 64])
    rng = np.random.default_rng(0)
    w8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("w8", w8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("w32", rng.standard_normal((3, 8)).astype(np.float32))
    writer.add_tensor("w16", rng.standard_normal((4,)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_the_directory_equals_the_gguf_packages_and_skips_unkept_arrays(tmp_path):
    """Tensors (names, dimensions, types, absolute offsets) and every value equal `GGUFReader`'s where kept; arrays
    of other keys are stepped over, never held."""
    path = _realistic(tmp_path / "ok.gguf")
    reader = gguf.GGUFReader(path)
    everything = gguf_header.parse(path, ("tokenizer.", "qwen3vl.", "x.", "comfy.", "general."))
    assert [(t.name, t.dims, t.type_id, t.offset) for t in everything.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "x.nested")):
            assert everything.values[key] == field.contents(), key
    assert everything.values["x.nested"] == [[1, 2], [3]]  # `contents()` flattens nested arrays: [1, 2, 3]
    default = gguf_file.directory(path)
    assert "tokenizer.ggml.tokens" not in default.values and "x.nested" not in default.values
    assert default.values["qwen3vl.rope.dimension_sections"] == [24, 20, 20, 0]
    tensors, metadata = read_file_header(path)
    assert tensors["w8"].dense_shape == (2, 64) and metadata["general.name"] == "hostile test"


def test_a_file_cut_anywhere_says_incomplete_file(tmp_path):
    """Cut at every byte from the magic on (header, directory, tensor data): each says "incomplete file
    (interrupted download?)", never IndexError, RecursionError or numpy's reshape words (the `gguf` reader's)."""
    whole = (tmp_path / "whole.gguf")
    data = open(_realistic(whole), "rb").read()
    tensors, _ = read_file_header(str(whole))
    offsets = range(4, max(info.offset + info.nbytes for info in tensors.values()))  # the rest is alignment padding
    for cut in offsets:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(IncompleteFileError, match=r"incomplete file .*\(interrupted download\?\)"):
            read_file_header(str(path))
        path.unlink()


def test_the_directory_is_read_once_per_file_version(tmp_path):
    """Listing, projector pairing and the header read share one parse (cached by path, size and mtime); a file
    rewritten in place is parsed again, and a bad file's error is cached too."""
    path = _realistic(tmp_path / "once.gguf")
    assert gguf_file.directory(path) is gguf_file.directory(path)
    bad = _Gguf(0, 1).array("t", UINT8, HUGE).write(tmp_path / "bad.gguf", pad=64)
    for _ in range(2):
        with pytest.raises(IncompleteFileError):
            gguf_file.directory(bad)
    before = gguf_file.directory(path)
    data = open(path, "rb").read()
    open(path, "wb").write(data + b"\0" * 32)
    assert gguf_file.directory(path) is not before


# --- a broken neighbour ---------------------------------------------------------------------------------------

def _write(path, arch: str, tensors: dict, **strings) -> str:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in strings.items():
        writer.add_string(key.replace("__", "."), value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_broken_neighbour_does_not_hide_a_llamacpp_text_encoder(tmp_path):
    """A cut or hostile `.gguf` beside a llama.cpp text encoder and its projector: the encoder still pairs with its
    projector and lists; the broken file is refused on its own, by its own name (it named itself in the
    encoder's error before)."""
    row = np.zeros((4, 32), dtype=np.float32)
    text = _write(tmp_path / "qwen3vl.gguf", "qwen3vl", {"token_embd.weight": row, "blk.0.attn_q.weight": row})
    mmproj = _write(tmp_path / "mmproj.gguf", "clip", {"v.blk.0.attn_qkv.weight": row},
                    clip__projector_type="qwen3vl_merger")
    _Gguf(0, 1).array("tokenizer.ggml.tokens", STRING, HUGE).write(tmp_path / "broken.gguf", pad=64)
    cut = open(text, "rb").read()
    (tmp_path / "cut.gguf").write_bytes(cut[:len(cut) // 2])
    assert gguf_file.projector_for(text) == [mmproj]
    assert [p.rsplit("/", 1)[1] for p in sources.loose_files(str(tmp_path))] == ["broken.gguf", "cut.gguf",
                                                                                "qwen3vl.gguf"]
    assert read_header(sources.component_source(text).files).tensors  # the pair reads
    with pytest.raises(IncompleteFileError, match="broken.gguf"):
        sources.component_source(str(tmp_path / "broken.gguf"))


# --- NaN and infinity -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ggml.quantised_types())
def test_every_fp16_scale_of_a_block_is_tested(kind):
    """`HALF_FIELDS` against the `gguf` package's numpy dequantiser: with every other byte 0xFF (any fp16 there
    would be NaN) and the listed scales 1.0 the block dequantises finite, so no float field is missed; a NaN or
    an infinity in any listed scale makes its values non-finite and `non_finite` says so."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert set(ggml.HALF_FIELDS) == set(ggml.quantised_types())
    clean = np.full((3, size), 0xFF, dtype=np.uint8)
    for offset in ggml.HALF_FIELDS[kind]:
        clean[:, offset:offset + 2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    with np.errstate(all="ignore"):
        assert np.isfinite(gguf.quants.dequantize(clean, qtype)).all()
        assert not ggml.non_finite(clean, kind)
        for offset in ggml.HALF_FIELDS[kind]:
            for bad in (np.float16("nan"), np.float16("inf"), np.float16("-inf")):
                blocks = clean.copy()
                blocks[1, offset:offset + 2] = np.frombuffer(bad.tobytes(), np.uint8)
                assert not np.isfinite(gguf.quants.dequantize(blocks, qtype)).all()
                assert ggml.non_finite(blocks, kind), (kind, offset, bad)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_non_finite_dense_values_are_found(dtype):
    values = np.linspace(-3e4, 3e4, 5000).astype(dtype)
    assert not ggml.non_finite(values.view(np.uint8), "F32" if dtype == np.float32 else "F16")
    for bad in (np.nan, np.inf, -np.inf):
        poked = values.copy()
        poked[4321] = bad
        assert ggml.non_finite(poked.view(np.uint8), "F32" if dtype == np.float32 else "F16")
    bf16 = (np.arange(10, dtype=np.uint16) | 0x3F00)
    assert not ggml.non_finite(bf16.view(np.uint8), "BF16")
    bf16[3] = 0x7FC0  # bf16 NaN
    assert ggml.non_finite(bf16.view(np.uint8), "BF16")


def test_a_nan_block_scale_or_dense_value_is_refused_by_name_when_read(tmp_path):
    """Reading a GGUF tensor (what a load does) refuses a NaN Q8_0 scale or an infinite F32 value, naming the
    tensor; the clean tensors beside it read."""
    path = _realistic(tmp_path / "nan.gguf")
    tensors, _ = read_file_header(path)
    data = bytearray(open(path, "rb").read())
    data[tensors["w8"].offset + 34:tensors["w8"].offset + 36] = np.float16("nan").tobytes()  # block 1's d
    data[tensors["w32"].offset + 8:tensors["w32"].offset + 12] = np.float32("inf").tobytes()
    open(path, "wb").write(data)
    header = read_header([path])
    assert load_tensors(header, {"w16"})["w16"].shape == (4,)
    with pytest.raises(H3WeightsError, match=r"w8 \(Q8_0\) holds NaN or infinite block scales"):
        load_tensors(header, {"w8"})
    with pytest.raises(H3WeightsError, match=r"w32 \(F32\) holds NaN or infinite values"):
        load_tensors(header, {"w32"})


# --- mapped reads (design issue 40 item 3) ------------------------------------------------------------------------

def _mapped_from(path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of `path` (/proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == os.path.realpath(path):
                ranges.append(tuple(int(x, 16) for x in fields[0].split("-")))
    return ranges


def test_tensors_are_mapped_privately_and_equal_the_gguf_packages(tmp_path):
    """Every tensor read is a view of a private (copy-on-write) mapping of its range of the file, equal to the
    `gguf` package's reading; a write to it never reaches the file. A start its dtype cannot be viewed at (a hostile
    alignment) is read into a buffer instead, with the same bytes."""
    import dataclasses

    path = _realistic(tmp_path / "mapped.gguf")
    tensors, _ = read_file_header(path)
    reference = {t.name: np.asarray(t.data).reshape(-1).view(np.uint8) for t in gguf.GGUFReader(path).tensors}
    before = open(path, "rb").read()
    held = {name: gguf_file.read_tensor(info) for name, info in tensors.items()}
    ranges = _mapped_from(path)
    for name, read in held.items():
        assert any(start <= read.data_ptr() < end for start, end in ranges), name
        raw = read.reshape(-1).view(torch.uint8)
        assert np.array_equal(raw.numpy(), reference[name]), name
        raw[0] ^= 0xFF
    assert open(path, "rb").read() == before
    info = tensors["w32"]
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(b"\0" + before[info.offset:info.offset + info.nbytes])
    shifted = gguf_file.read_tensor(dataclasses.replace(info, file=str(odd), offset=1))
    assert not _mapped_from(odd) and torch.equal(shifted, gguf_file.read_tensor(info))


def test_a_file_cut_after_its_header_was_read_says_incomplete_file_when_mapped(tmp_path):
    """A file cut between its header read and the tensor read (a download still being written, a copy interrupted):
    the mapping is refused with "incomplete file", never a mapping past its end (that would be a SIGBUS later)."""
    path = _realistic(tmp_path / "cut.gguf")
    tensors, _ = read_file_header(path)
    info = max(tensors.values(), key=lambda i: i.offset)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:info.offset + info.nbytes // 2])
    with pytest.raises(IncompleteFileError, match=r"interrupted download\?"):
        gguf_file.read_tensor(info)
    with pytest.raises(IncompleteFileError, match=r"interrupted download\?"):  # cut between the check and the map
        gguf_file._mapped(info)
