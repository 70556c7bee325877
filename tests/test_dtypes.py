"""The one dtype rule (h3_core.dtypes) and loading without upcasts or copies."""

import os

import pytest
import torch

from h3_core import dtypes, weights
from h3_core.devices import DeviceError, Placement, parse_device


def test_rule_cpu_fp32_cuda_bf16_vaes_official():
    for component in ("transformer", "transformer_ref", "text_encoder", "vae", "audio_vae"):
        assert dtypes.compute_dtype(component, "cpu") == torch.float32
    assert dtypes.compute_dtype("transformer", "cuda") == torch.bfloat16
    assert dtypes.compute_dtype("text_encoder", torch.device("cuda", 1)) == torch.bfloat16
    assert dtypes.compute_dtype("vae", "cuda") == torch.float32  # encoder fp32; decode under fp16 autocast
    assert dtypes.compute_dtype("audio_vae", "cuda") == torch.float32


def test_override_and_refusals():
    assert dtypes.compute_dtype("transformer", "cpu", "bf16") == torch.bfloat16
    assert dtypes.compute_dtype("text_encoder", "cuda", "float32") == torch.float32
    assert dtypes.compute_dtype("transformer", "cuda", "auto") == torch.bfloat16
    assert dtypes.compute_dtype("dit", "cuda", torch.float16) == torch.float16
    with pytest.raises(ValueError, match="float32 only"):
        dtypes.compute_dtype("audio_vae", "cuda", "bf16")
    with pytest.raises(ValueError, match="unknown dtype"):
        dtypes.compute_dtype("transformer", "cpu", "int4")
    with pytest.raises(ValueError, match="unknown H3 component"):
        dtypes.compute_dtype("unet", "cpu")
    # the autocast context is a no-op off CUDA (CPU runs stay bit-exact)
    with dtypes.vae_decode_autocast("cpu"):
        assert not torch.is_autocast_enabled()


def test_placement_flags():
    assert Placement().dtype_of("transformer") == torch.float32
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="cpu, cuda or cuda:N"):
        parse_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA"):
            parse_device("cuda:0")
    with pytest.raises(ValueError, match="offload must be"):
        Placement(offload="disk")


def _write_bf16_text_encoder(path):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from weights_support import tiny_text_encoder

    model = tiny_text_encoder(seed=3).to(torch.bfloat16)
    weights.save_comfy_text_encoder(model, str(path))
    return model


def test_bf16_text_encoder_stays_bf16_without_a_copy(tmp_path):
    path = tmp_path / "te_bf16.safetensors"
    _write_bf16_text_encoder(path)
    size = os.path.getsize(path)
    model = weights.load_text_encoder(str(path), dtype=torch.bfloat16)
    params = list(model.parameters())
    assert params and {p.dtype for p in params} == {torch.bfloat16}
    # every parameter is a view into the file's memory map: no float32 (or any) copy was made
    assert {p.untyped_storage().nbytes() for p in params} == {size}
    # a CPU float32 run widens them (the only upcast the rule allows)
    wide = weights.load_text_encoder(str(path), dtype=torch.float32)
    assert {p.dtype for p in wide.parameters()} == {torch.float32}
