"""Community quantised files comfy-kitchen dequantises: mxfp8 (e4m3 codes, one E8M0 power-of-two scale per 32
values in cuBLAS' blocked layout) and 4-bit W4A8 (`asym_w4a8_int8` at 4 bits with its Lloyd-Max codebook). A tiny
DiT whose block linears kitchen's quantisers wrote in each loads with its layers kept quantised (mxfp8's fused qkv /
fc1 block scales re-tiled with their rows) and computes exactly what a dense model holding kitchen's
dequantisation computes."""

import json

import pytest
import torch
from safetensors import safe_open
from support import weights_support

from h3_core import tiny, weights
from h3_core.tiny.pruned import block_linears
from h3_core.weights.quant import quantise_state_dict
from h3_core.weights.quant.linear import QuantLinear
from h3_core.weights.safetensors_io import write_file


@pytest.fixture(scope="module", autouse=True)
def _parity_threads(parity_threads):
    """Bitwise comparisons: the thread count is pinned (conftest.parity_threads)."""


def _read(path):
    with safe_open(str(path), framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, dict(handle.metadata() or {})


def _kitchen_dense(marker: dict, family: dict, shape, dtype) -> torch.Tensor:
    """Kitchen's own dequantisation of one layer (its layouts called here directly, not through h3_core)."""
    from comfy_kitchen import tensor as kt

    if marker["format"] == "mxfp8":
        params = kt.TensorCoreMXFP8Layout.Params(scale=family["weight_scale"], orig_dtype=dtype,
                                                 orig_shape=tuple(shape))
        return kt.TensorCoreMXFP8Layout.dequantize(family["weight"], params)
    return kt.dequantize_w4a8_int8_weight(family["weight"], family["weight_s_rel"], family["weight_s_channel"],
                                          codebook=family.get("weight_codebook"), group_size=marker["group_size"],
                                          convrot_groupsize=marker["convrot_groupsize"], output_dtype=dtype)


FORMATS = ("mxfp8", "w4a8")
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def twins(tiny_dir, tmp_path_factory):
    """(format, dtype) -> (twin, its dense reference in dtype): block linears quantised by kitchen from the fp32
    tiny DiT; the reference holds kitchen's dequantisation in that dtype (what the quantised layers compute with)."""
    tensors, metadata = _read(tiny_dir / "comfyui" / tiny.COMFY_FILES["transformer"])
    out = tmp_path_factory.mktemp("community")
    made = {}
    for fmt in FORMATS:
        quantised = quantise_state_dict(tensors, fmt, block_linears(tensors))
        twin = out / f"minimax_h3_tiny_fl2va_{fmt}.safetensors"
        write_file(str(twin), quantised, metadata)
        families: dict = {}
        for key, tensor in quantised.items():
            prefix, _, suffix = key.rpartition(".")
            families.setdefault(prefix, {})[suffix] = tensor
        for dtype in DTYPES:
            reference = {}
            for prefix, family in families.items():
                if "comfy_quant" not in family:
                    reference.update({f"{prefix}.{suffix}": t for suffix, t in family.items()})
                    continue
                marker = json.loads(family["comfy_quant"].numpy().tobytes())
                shape = tensors[f"{prefix}.weight"].shape
                reference[f"{prefix}.weight"] = _kitchen_dense(marker, family, shape, dtype)
            dense = out / f"dense_fl2va_{fmt}_{str(dtype)[6:]}.safetensors"
            write_file(str(dense), reference, metadata)
            made[fmt, dtype] = (twin, dense)
    return made


LABELS = {"mxfp8": "block linears mxfp8 (e4m3, E8M0 scale per 32) x8",
          "w4a8": "block linears w4a8 (4-bit, group 16, ConvRot 64, codebook) x8"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_is_read_and_checked_from_its_markers(twins, fmt):
    report = weights.check(str(twins[fmt, torch.float32][0]))
    assert report.ok, str(report)
    assert LABELS[fmt] in str(report)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dit_forward_equals_the_dense_dequantised_model_bitwise(twins, fmt, dtype):
    twin, dense = twins[fmt, dtype]
    quant = weights.load_transformer(twin, dtype=dtype)
    reference = weights.load_transformer(dense, dtype=dtype)
    to_k = quant.transformer_blocks[1].attn.to_k  # a third of the fused qkv (mxfp8: its block scales re-tiled)
    assert isinstance(to_k, QuantLinear) and to_k.weight.dtype in (torch.float8_e4m3fn, torch.int8)
    assert torch.equal(to_k.dense_weight(dtype), reference.transformer_blocks[1].attn.to_k.weight)
    for got, expected in zip(weights_support.dit_forward(quant), weights_support.dit_forward(reference), strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
