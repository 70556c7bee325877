"""Community quantised files comfy-kitchen dequantises: mxfp8 (e4m3 codes, one E8M0 power-of-two scale per 32
values in cuBLAS' blocked layout). A tiny DiT whose block linears kitchen's quantiser wrote in mxfp8 loads with
its layers kept quantised (the fused qkv / fc1 block scales re-tiled with their rows) and computes exactly what a
dense model holding kitchen's dequantisation computes."""

import json

import pytest
import torch
import weights_support as support
from safetensors import safe_open

from h3_core import tiny, weights
from h3_core.tiny_pruned import block_linears
from h3_core.weights.quant import quantise_state_dict
from h3_core.weights.quant.linear import QuantLinear
from h3_core.weights.safetensors_io import write_file


@pytest.fixture(scope="module", autouse=True)
def _parity_threads(parity_threads):
    """Bitwise comparisons: the thread count is pinned (conftest.parity_threads)."""


def _read(path):
    with safe_open(str(path), framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, dict(handle.metadata() or {})


@pytest.fixture(scope="module")
def mxfp8_dit(tiny_dir, tmp_path_factory):
    """(mxfp8 twin, its dense reference): block linears in mxfp8 from the fp32 tiny DiT, the rest as stored."""
    from comfy_kitchen import tensor as kt

    tensors, metadata = _read(tiny_dir / "comfyui" / tiny.COMFY_FILES["transformer"])
    quantised = quantise_state_dict(tensors, "mxfp8", block_linears(tensors))
    out = tmp_path_factory.mktemp("mxfp8")
    twin, dense = out / "minimax_h3_tiny_fl2va_mxfp8.safetensors", out / "dense_fl2va.safetensors"
    write_file(str(twin), quantised, metadata)
    reference = {}
    for key, tensor in quantised.items():
        if key.endswith((".comfy_quant", ".weight_scale")):
            continue
        prefix = key.rpartition(".")[0]
        if f"{prefix}.comfy_quant" in quantised and key.endswith(".weight"):
            assert json.loads(quantised[f"{prefix}.comfy_quant"].numpy().tobytes()) == {"format": "mxfp8"}
            params = kt.TensorCoreMXFP8Layout.Params(scale=quantised[f"{prefix}.weight_scale"],
                                                     orig_dtype=torch.float32, orig_shape=tuple(tensor.shape))
            tensor = kt.TensorCoreMXFP8Layout.dequantize(tensor, params)
        reference[key] = tensor
    write_file(str(dense), reference, metadata)
    return twin, dense


def test_mxfp8_file_is_read_and_checked_from_its_markers(mxfp8_dit):
    twin, _ = mxfp8_dit
    header = weights.detect(str(twin)).header
    assert header.tensors["blocks.0.attn.qkv_proj.weight_scale"].dtype == "F8_E8M0"
    report = weights.check(str(twin))
    assert report.ok, str(report)
    assert "block linears mxfp8 (e4m3, E8M0 scale per 32) x8" in str(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_dit_forward_equals_the_dense_dequantised_model_bitwise(mxfp8_dit, dtype):
    twin, dense = mxfp8_dit
    quant = weights.load_transformer(twin, dtype=dtype)
    reference = weights.load_transformer(dense, dtype=dtype)
    to_k = quant.transformer_blocks[1].attn.to_k  # a third of the fused qkv, its block scales re-tiled
    assert isinstance(to_k, QuantLinear) and to_k.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(to_k.dense_weight(torch.float32), reference.transformer_blocks[1].attn.to_k.weight.float())
    for got, expected in zip(support.dit_forward(quant), support.dit_forward(reference), strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
