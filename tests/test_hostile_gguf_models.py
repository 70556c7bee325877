"""Hostile GGUF files beside and inside the tiny H3's real GGUF twins (security issue 36, item 1): a broken
neighbour does not hide a llama.cpp text encoder from `detect` / `scan`, and a NaN block scale or an infinite dense
value is refused by `check` (the command) and by a load, naming the layer, before anything runs."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest

from h3_core import cli, weights
from h3_core.tiny import gguf_twins as tiny_gguf
from h3_core.weights.errors import IncompleteFileError
from h3_core.weights.headers import read_header


def test_a_broken_neighbour_does_not_hide_the_tiny_llamacpp_text_encoder(tiny_dir, tmp_path):
    """The tiny llama.cpp pair with a 96-byte hostile `.gguf` (an array claiming 2^62 items) and a cut copy of the
    projector beside it: the encoder still detects with its projector and checks clean; `scan` reports each broken
    file on its own, by its own name."""
    for rel in tiny_gguf.llamacpp_paths():
        shutil.copy(tiny_dir / "comfyui" / rel, tmp_path)
    text, mmproj = (tmp_path / rel.rsplit("/", 1)[1] for rel in tiny_gguf.llamacpp_paths())
    hostile = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 21) + b"tokenizer.ggml.tokens"
    (tmp_path / "broken.gguf").write_bytes((hostile + struct.pack("<IIQ", 9, 0, 1 << 62)).ljust(96, b"\0"))
    data = mmproj.read_bytes()
    (tmp_path / "cut-mmproj.gguf").write_bytes(data[:len(data) // 3])
    det = weights.detect(str(text))
    assert det.component == "text_encoder" and det.files == (str(text), str(mmproj))
    results = {r.path: r for r in weights.scan(str(tmp_path))}
    assert not isinstance(results[str(text)], Exception)
    for name in ("broken.gguf", "cut-mmproj.gguf"):
        error = results[str(tmp_path / name)]
        assert isinstance(error, IncompleteFileError) and name in str(error) and "incomplete file" in str(error)
    assert weights.check(str(text)).ok


def _poke(path, name: str, offset_in_tensor: int, value: bytes) -> None:
    info = read_header([str(path)]).tensors[name]
    with open(path, "r+b") as handle:
        handle.seek(info.offset + offset_in_tensor)
        handle.write(value)


@pytest.mark.parametrize("kind", ["Q8_0 scale", "Q4_K dmin", "F32 value"])
def test_non_finite_gguf_scales_and_values_are_refused_by_check_and_load(tiny_dir, tmp_path, kind, capsys):
    """A NaN Q8_0 block scale (`d`), an infinite Q4_K `dmin`, a NaN in a dense F32 tensor: `python -m h3_core
    check` fails naming the layer (it passed before and the job ran to the mp4 encoder), and so does a load."""
    ggml_type = "Q4_K" if kind.startswith("Q4_K") else "Q8_0"
    path = tmp_path / f"dit_{ggml_type}.gguf"
    shutil.copy(tiny_dir / "comfyui" / tiny_gguf.gguf_path("fl2va", ggml_type), path)
    tensors = read_header([str(path)]).tensors
    if kind == "F32 value":
        name = sorted(n for n, i in tensors.items() if i.ggml_type == "F32" and i.nbytes >= 8)[0]
        _poke(path, name, 4, np.float32("nan").tobytes())
    else:
        name = sorted(n for n, i in tensors.items() if i.ggml_type == ggml_type)[0]
        block = 34 if ggml_type == "Q8_0" else 144  # poke the second block: not only the first is tested
        _poke(path, name, block + (2 if kind.endswith("dmin") else 0), np.float16("inf").tobytes())
    report = weights.check(str(path))
    assert not report.ok and name in str(report) and "NaN or infinite" in str(report)
    assert cli.main(["check", str(path)]) != 0 and name in capsys.readouterr().out
    with pytest.raises(weights.H3WeightsError, match="holds NaN or infinite"):
        weights.load_transformer(str(path))
