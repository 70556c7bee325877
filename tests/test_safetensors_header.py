"""The one safetensors header parser (`h3_core.safetensors_header`): bytes, files and paths alike."""

import io

import pytest
import safetensors.torch as st
import torch

from h3_core import safetensors_header as sh


def _file():
    return st.save({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, metadata={"k": "v"})


def test_bytes_file_and_path_agree(tmp_path):
    data = _file()
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    parsed = [sh.read_header(data), sh.read_header(io.BytesIO(data)), sh.read_header(path), sh.read_header(str(path))]
    assert all(p == parsed[0] for p in parsed)
    head = parsed[0]
    assert head.metadata == {"k": "v"}
    assert {n: (e.dtype, e.shape, e.torch_dtype) for n, e in head.tensors.items()} == {
        "a": ("F32", (2, 3), torch.float32), "b": ("BF16", (4,), torch.bfloat16)}
    assert head.data_start + head.data_end == len(data)


def test_one_dtype_table_covers_both_directions():
    assert all(sh.DTYPE_TAGS[dtype] == tag for tag, dtype in sh.DTYPES.items())
    # the torch-free sizes the parser checks spans with are torch's own
    assert {tag: dtype.itemsize for tag, dtype in sh.DTYPES.items()} == sh.ITEMSIZES


def test_parsing_imports_no_torch():
    """The media sandbox's decoder host reads result headers with this module and must stay torch-free."""
    import subprocess
    import sys

    code = ("import sys; from h3_core import safetensors_header as sh; "
            "sh.read_header(b'\\x02' + bytes(7) + b'{}'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_unknown_dtype_tags_are_kept_by_name():
    raw = b'{"w":{"dtype":"F4_PACKED","shape":[3],"data_offsets":[0,2]}}'
    entry = sh.parse_header(raw).tensors["w"]
    assert (entry.dtype, entry.torch_dtype, entry.nbytes) == ("F4_PACKED", None, 2)


@pytest.mark.parametrize("raw,fragment", [
    (b"[]", "not a JSON object"),
    (b'{"w":{"dtype":"F32","shape":[2]}}', "corrupted tensor table entry"),
    (b'{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', "corrupted tensor table entry"),
    (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}', "corrupted tensor table entry"),
    (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', "spans 4 bytes, its shape needs 8"),
    (b'{"__metadata__":[1]}', "__metadata__ is not a JSON object"),
    (b"{" * 20 + b"}" * 20, "nests 20 deep"),
    (b"\xff{}", "not UTF-8"),
])
def test_malformed_headers(raw, fragment):
    with pytest.raises(sh.HeaderError, match=fragment.replace("[", r"\[")):
        sh.parse_header(raw)


def test_length_prefix_cap_and_truncation():
    with pytest.raises(sh.HeaderError, match=f"exceeds the {sh.MAX_HEADER_BYTES}-byte limit"):
        sh.read_header((sh.MAX_HEADER_BYTES + 1).to_bytes(8, "little"))
    with pytest.raises(sh.HeaderError, match="truncated: header claims 50"):
        sh.read_header((50).to_bytes(8, "little") + b"{}")
    with pytest.raises(sh.HeaderError, match="truncated: header claims 50"):
        sh.read_header(io.BytesIO((50).to_bytes(8, "little") + b"{}"), size=10)
    with pytest.raises(sh.HeaderError, match="shorter than the 8-byte"):
        sh.read_header(b"abc")
