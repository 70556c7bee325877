"""The quantised layer formats, one layer at a time: writer, header-only twin, QuantLinear, refusals, LoRA."""

import json

import pytest
import torch
from support import quant_support as qs
from support import weights_support

from h3_core import weights
from h3_core.safetensors_header import DTYPE_TAGS
from h3_core.weights.quant import kitchen, layouts, markers, quantise_state_dict
from h3_core.weights.quant.linear import QuantLinear, use_kitchen_matmul
from h3_core.weights.quant.writer import quantised_header

FORMATS = {  # file-level format -> per-layer options of the test layer
    "int8_convrot": {},
    "int8": {},
    "fp8_scaled": {"input_scale": 0.02},
    "w6a8": {},
    "nvfp4": {"pre_quant_scale": (torch.rand(128, generator=torch.Generator().manual_seed(9)) + 0.5).bfloat16()},
}


def _layer(fmt: str, seed: int = 0, shape=(64, 128)):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(*shape, generator=generator) * 0.05
    state = quantise_state_dict({"layer.weight": weight}, fmt, {"layer": FORMATS[fmt]})
    family = {k[len("layer."):]: v for k, v in state.items()}
    marker = markers.parse(family.pop("comfy_quant"), "layer")
    spec = layouts.describe("layer", marker, {k: (DTYPE_TAGS[v.dtype], tuple(v.shape)) for k, v in family.items()})
    return weight, state, family, spec


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_writer_and_header_twin_agree(fmt):
    weight, state, family, spec = _layer(fmt)
    stored, marker = quantised_header(fmt, tuple(weight.shape), FORMATS[fmt])
    assert {k: (DTYPE_TAGS[v.dtype], tuple(v.shape)) for k, v in family.items()} == stored
    assert markers.encode(marker).numpy().tobytes() == state["layer.comfy_quant"].numpy().tobytes()
    assert spec.shape == tuple(weight.shape)


def test_marker_bytes_are_core_s():
    marker = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    assert markers.encode(marker).numel() == 72  # what kitchen / ComfyUI core write
    assert markers.encode({"format": "float8_e4m3fn"}).numel() == 27
    nested = markers.encode({"format": "asym_w4a8_int8", "params": {"group_size": 32}})
    assert markers.parse(nested, "x") == {"format": "asym_w4a8_int8", "group_size": 32}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantisation_error_is_within_the_format_bound(fmt):
    weight, state, family, spec = _layer(fmt)
    error, bound = qs.error_and_bound(json.loads(state["layer.comfy_quant"].numpy().tobytes()), family, weight)
    assert error <= bound
    assert error < {"int8_convrot": 0.02, "int8": 0.005, "fp8_scaled": 0.07, "w6a8": 0.05, "nvfp4": 0.2}[fmt]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quant_linear_equals_linear_on_kitchens_dequantisation(fmt, dtype):
    weight, state, family, spec = _layer(fmt)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(dtype)
    module = QuantLinear(spec, family, bias)
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    marker = json.loads(state["layer.comfy_quant"].numpy().tobytes())
    dense = qs.kitchen_dequant(marker, family, dtype)
    scaled = x * family["pre_quant_scale"].to(dtype) if "pre_quant_scale" in family else x
    with torch.no_grad():
        assert torch.equal(module(x), torch.nn.functional.linear(scaled, dense, bias))
        assert torch.equal(module.dense_weight(dtype), dense)
    assert all(not p.requires_grad for p in module.parameters())
    assert [name for name, _ in module.named_parameters()][0] == "bias"  # diffusers' dtype probe reads it


@pytest.mark.parametrize("fmt", ["int8_convrot", "int8", "fp8_scaled", "w6a8"])
def test_kitchen_gemm_fast_path_runs_through_the_same_dispatch(fmt):
    """Kitchen's W8A8 int8 / fp8 GEMM (its eager reference on CPU): close to the weight-only result, not equal
    (the activation is quantised too). On CUDA the same call runs kitchen's kernels (bench/gpu_check)."""
    weight, state, family, spec = _layer(fmt)
    module = torch.nn.Sequential(QuantLinear(spec, family))
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = module(x)
        assert use_kitchen_matmul(module) == 0  # no CUDA here: stays weight-only
        assert use_kitchen_matmul(module, force=True) == 1
        fast = module(x)
    assert not torch.equal(fast, exact)
    assert ((fast - exact).abs().max() / exact.abs().max()).item() < 0.06


def test_nvfp4_has_no_fast_path():
    _, _, family, spec = _layer("nvfp4")
    assert use_kitchen_matmul(torch.nn.Sequential(QuantLinear(spec, family)), force=True) == 0


def test_rotation_groups_fit_tiny_widths():
    assert [kitchen.default_rotation(k) for k in (5376, 2688, 128, 64, 32, 48)] == [256, 64, 64, 64, 16, 16]
    with pytest.raises(weights.H3WeightsError, match="no ConvRot group"):
        kitchen.default_rotation(6)


# --- refusals ------------------------------------------------------------------------------------


def _dit_file(tmp_path, models, edit):
    """The tiny DiT as a Comfy file whose fc2 layers are int8_convrot, edited by `edit(tensors)`."""
    model = models
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    state = weights.transformer_keys.from_diffusers(model.state_dict(), config, "comfy", inv_freq=model.rope.inv_freq)
    fc2 = [k for k in state if k.endswith("mlp.fc2.weight") and k.startswith("blocks.")]
    tensors = quantise_state_dict(state, "int8_convrot", fc2)
    edit(tensors)
    path = tmp_path / "minimax_h3_fl2va_int8_convrot.safetensors"  # the name says nothing the loader believes
    weights.safetensors_io.write_file(str(path), tensors, weights.config_merge.config_metadata("transformer", config))
    return path


@pytest.fixture(scope="module")
def dit():
    return weights_support.tiny_transformer(0)


@pytest.mark.parametrize("marker, named", [
    ({"format": "svdquant_w4a4"}, "'svdquant_w4a4' (known to ComfyUI, not implemented here"),
    ({"format": "convrot_w4a4"}, "'convrot_w4a4' (known to ComfyUI, not implemented here"),
    ({"format": "int3_magic"}, "'int3_magic' (unknown"),
])
def test_unknown_formats_are_refused_by_name_before_any_weight(tmp_path, dit, monkeypatch, marker, named):
    def edit(tensors):
        tensors["blocks.1.mlp.fc2.comfy_quant"] = markers.encode(marker)

    path = _dit_file(tmp_path, dit, edit)
    from h3_core.weights.quant import plan

    read = []
    original = plan._read_markers

    def spy(header, keys):
        read.append(set(keys))
        return original(header, keys)

    def no_data(*args, **kwargs):
        raise AssertionError("a refused format must not read tensor data")

    monkeypatch.setattr(plan, "_read_markers", spy)
    monkeypatch.setattr(weights.safetensors_io, "load_tensors", no_data)
    monkeypatch.setattr(weights.loaders, "load_tensors", no_data)
    with pytest.raises(weights.UnsupportedCheckpointError, match="is not supported") as excinfo:
        weights.load_transformer(path)
    message = str(excinfo.value)
    assert named in message and "supported layer formats: int8_tensorwise" in message and "nvfp4" in message
    assert read and all(name.endswith(".comfy_quant") for names in read for name in names)  # markers only
    assert not weights.check(path).ok


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update({"blocks.0.mlp.fc2.weight_scale": torch.ones(3)}), "weight_scale must be F32"),
    (lambda t: t.update({"blocks.0.mlp.fc2.comfy_quant": markers.encode(
        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 48})}), "power of 4"),
    (lambda t: t.update({"blocks.0.mlp.fc2.comfy_quant": torch.zeros(40, dtype=torch.uint8)}), "unreadable"),
    (lambda t: t.update({"blocks.0.mlp.fc1.weight_scale": torch.ones(1)}), "of no marked layer"),
    (lambda t: t.update({"blocks.0.mlp.fc1.weight": t["blocks.0.mlp.fc1.weight"].to(torch.float8_e4m3fn)}),
     "without a .comfy_quant marker"),
    (lambda t: t.update({"blocks.0.mlp.fc2.input_scale": torch.ones(())}), "unexpected tensors"),
])
def test_malformed_quantised_layers_are_refused(tmp_path, dit, edit, match):
    path = _dit_file(tmp_path, dit, edit)
    with pytest.raises(weights.H3WeightsError, match=match):
        weights.detect(path)


def test_w4a8_correction_tensors_are_refused_by_name(tmp_path, dit):
    """4-bit W4A8 layers load (tests/test_community_formats.py); a variant with tensors this package does not read
    (`weight_correction`) is refused naming them."""
    def edit(tensors):
        tensors["blocks.0.mlp.fc2.weight"] = torch.zeros(64, 64, dtype=torch.int8)  # K/2 bytes: 4-bit codes
        tensors["blocks.0.mlp.fc2.weight_s_rel"] = torch.zeros(64, 8, dtype=torch.float8_e4m3fn)
        tensors["blocks.0.mlp.fc2.weight_s_channel"] = torch.ones(64)
        tensors["blocks.0.mlp.fc2.weight_correction"] = torch.ones(64)
        del tensors["blocks.0.mlp.fc2.weight_scale"]
        tensors["blocks.0.mlp.fc2.comfy_quant"] = markers.encode({"format": "asym_w4a8_int8", "group_size": 16,
                                                                  "convrot_groupsize": 64})

    with pytest.raises(weights.H3WeightsError, match="unexpected tensors .*weight_correction"):
        weights.detect(_dit_file(tmp_path, dit, edit))


# --- LoRA on quantised layers --------------------------------------------------------------------


def test_lora_on_quant_linear_is_a_branch_beside_the_codes(dit, tmp_path):
    """LoRA on the int8 DiT equals LoRA on the dense DiT holding kitchen's dequantised weights; removed exactly."""
    from safetensors.torch import save_file

    from h3_core.lora import LoRA

    path = _dit_file(tmp_path, dit, lambda t: None)
    quant = weights.load_transformer(path)
    reference_path = tmp_path / "dense.safetensors"
    qs.dense_reference(path, reference_path, torch.float32)
    dense = weights.load_transformer(reference_path)
    g = torch.Generator().manual_seed(5)
    lora_file = tmp_path / "lora.safetensors"
    tensors = {}
    for block in range(dit.config.num_layers):
        base = f"diffusion_model.blocks.{block}.mlp.fc2"
        tensors[f"{base}.lora_A.weight"] = torch.randn(4, dit.config.ffn_dim, generator=g) * 0.1
        tensors[f"{base}.lora_B.weight"] = torch.randn(dit.config.hidden_size, 4, generator=g) * 0.1
    save_file(tensors, str(lora_file))
    lora = LoRA.load(lora_file)
    codes = {k: v.clone() for k, v in quant.state_dict().items()}
    before = weights_support.dit_forward(quant)
    assert all(torch.equal(a, b) for a, b in zip(before, weights_support.dit_forward(dense), strict=True))
    with lora.applied(quant, 0.8), lora.applied(dense, 0.8):
        with_lora = weights_support.dit_forward(quant)
        assert all(torch.equal(a, b) for a, b in zip(with_lora, weights_support.dit_forward(dense), strict=True))
    assert not torch.equal(with_lora[0], before[0])
    assert all(torch.equal(a, b) for a, b in zip(weights_support.dit_forward(quant), before, strict=True))
    assert all(torch.equal(v, quant.state_dict()[k]) for k, v in codes.items())  # never re-quantised
    assert isinstance(quant.transformer_blocks[0].ff.net[2], QuantLinear)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_scales_are_reported_by_layer(tmp_path, dit, value):
    """A NaN or infinite scale once passed `check` and failed `generate` only at the very end."""
    layer = "blocks.0.mlp.fc2"

    def edit(tensors):
        scale = tensors[f"{layer}.weight_scale"].clone()
        scale.view(-1)[0] = value
        tensors[f"{layer}.weight_scale"] = scale

    path = _dit_file(tmp_path, dit, edit)
    report = weights.check(str(path))
    assert not report.ok and f"{layer}.weight_scale" in str(report) and "NaN or infinite" in str(report), report
    with pytest.raises(weights.H3WeightsError, match=f"{layer}.weight_scale"):
        weights.load_transformer(path)
    assert weights.check(str(_dit_file(tmp_path, dit, lambda t: None))).ok


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16,
                                   torch.float32])
def test_scale_finiteness_by_dtype(dtype):
    """fp8 block scales are tested on their bits (fast at release size); the result equals torch.isfinite's."""
    from h3_core.weights.check import _finite

    for values in ([1.0, 2.0, 0.5, -3.0], [1.0, float("nan"), 0.5], [1.0, float("inf"), 0.5]):
        t = torch.tensor(values).to(dtype)
        assert _finite(t.view(torch.uint8).numpy().tobytes(), dtype) == bool(torch.isfinite(t.float()).all())


def test_mxfp8_block_scale_nan_is_found_on_its_bits():
    from h3_core.weights.check import _finite

    e8m0 = torch.float8_e8m0fnu
    assert _finite(bytes([0x7F, 0x80, 0x00]), e8m0) and not _finite(bytes([0x7F, 0xFF]), e8m0)


def test_a_w6a8_layer_is_refused_by_name_where_comfy_kitchen_lacks_six_bits(monkeypatch):
    # ComfyUI core 0.33 pins comfy-kitchen 0.2.31, whose asym_w4a8 layout has no 6-bit codes: there a w6a8 layer is
    # refused naming the version it needs, at check time, instead of kitchen's divisibility error mid-run.
    from h3_core.weights.errors import H3WeightsError
    from h3_core.weights.quant import kitchen

    monkeypatch.setattr(kitchen, "installed_version", lambda: (0, 2, 31))
    with pytest.raises(H3WeightsError, match=r"w6a8 \(6-bit\) layer needs comfy-kitchen >= 0\.2\.40, and 0\.2\.31"):
        kitchen.require_six_bit("blocks.0.attn.qkv_proj")
    monkeypatch.setattr(kitchen, "installed_version", lambda: (0, 2, 40))
    kitchen.require_six_bit("blocks.0.attn.qkv_proj")  # the lock's version: accepted
