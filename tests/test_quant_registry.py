"""The layer-format registry: one class per quantised layer format, and everything asks it.

Each registered format's quantiser, its header-only twin, its validation and its dequantisation agree on one layer;
the suffix and dtype sets the file-format detection uses are the registry's; a format registered from outside the
package (one class + `register`) is written, detected, loaded as a QuantLinear and computed with, with no other edit.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
import torch

from h3_core import weights
from h3_core.safetensors_header import DTYPE_TAGS
from h3_core.weights import formats
from h3_core.weights.quant import LayerFormat, LayerSpec, layouts, markers, quantise_state_dict
from h3_core.weights.quant.layer_format import want
from h3_core.weights.quant.linear import QuantLinear
from h3_core.weights.quant.writer import quantised_header

WEIGHTS = pathlib.Path(__file__).resolve().parents[1] / "h3_core" / "weights"
# Per quantisation name: options of the test layer (every registered format at least once).
CASES = {
    "int8_convrot": {},
    "fp8_scaled": {"input_scale": 0.02},
    "w6a8": {},
    "w4a8": {},
    "nvfp4_awq": {"pre_quant_scale": torch.full((128,), 1.25)},
    "mxfp8": {},
    "gguf": {"ggml_type": "Q8_0"},
}


def _header(tensors: dict) -> dict:
    return {k: (DTYPE_TAGS[v.dtype], tuple(v.shape)) for k, v in tensors.items()}


def test_every_registered_format_has_a_case():
    named = {layouts.file_formats()[name][0].name for name in CASES}
    assert named == set(layouts.supported_formats())


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantise_header_twin_describe_and_dequantise_agree(name):
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 0.05
    state = quantise_state_dict({"layer.weight": weight}, name, {"layer": CASES[name]})
    family = {k[len("layer."):]: v for k, v in state.items()}
    marker = markers.parse(family.pop("comfy_quant"), "layer")
    stored, header_marker = quantised_header(name, (64, 128), CASES[name])
    assert _header(family) == stored and marker == header_marker
    spec = layouts.describe("layer", marker, _header(family))
    assert spec.shape == (64, 128) and spec.layer_format is layouts.layer_format(marker["format"])
    module = QuantLinear(spec, family)
    assert [n for n, _ in module.named_parameters()] == [s for s in spec.layer_format.stored_order() if s in family]
    dense = module.dense_weight(torch.float32)
    assert dense.shape == (64, 128)
    stored_weight = weight / CASES[name]["pre_quant_scale"] if "pre_quant_scale" in CASES[name] else weight
    assert (dense - stored_weight).abs().max() < 0.25 * stored_weight.abs().max()


def test_gguf_quantiser_is_the_gguf_package_s():
    """The GGUF class's quantiser writes the `gguf` package's blocks; reading them back is its dequantiser's."""
    import gguf

    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    stored, marker = layouts.layer_format("gguf").quantise(weight, {"ggml_type": "Q8_0"})
    expected = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(stored["weight"].numpy(), expected) and marker == {"format": "gguf", "ggml_type": "Q8_0"}
    spec = layouts.describe("layer", marker, _header(stored))
    reference = gguf.quants.dequantize(expected, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(spec.layer_format.dequantise(spec, stored, torch.float32).numpy(), reference)
    with pytest.raises(weights.H3WeightsError, match="cannot quantise to Q4_K"):
        layouts.layer_format("gguf").quantise(torch.zeros(2, 256), {"ggml_type": "Q4_K"})


def test_one_suffix_list_and_one_dtype_set():
    """Detection's "quantised" evidence is the registry's: every registered side tensor counts, and the storage
    dtypes are one set."""
    for fmt in layouts.supported_formats():
        assert set(layouts.layer_format(fmt).side_tensors) <= set(layouts.side_suffixes())
    header = weights.headers.Header(tensors={"a.weight": weights.tensor_info.TensorInfo("F32", (4, 4), "x"),
                                             "a.weight_s_channel": weights.tensor_info.TensorInfo("F32", (4,), "x")},
                                    metadata={}, files=("x",))
    assert formats.detect_format(header, "x").name == "quantised"


def _names_a_format(node: ast.Compare, names: set) -> bool:
    return any(isinstance(n, ast.Constant) and n.value in names
               for side in (node.left, *node.comparators) for n in ast.walk(side))


def _tests_a_layer_format(node: ast.Compare) -> bool:
    """`fmt == INT8`, `self.fmt in (NVFP4, GGUF)`, `spec.format == ...`: a layer's format against a named constant."""
    sides = (node.left, *node.comparators)
    layer = [side for side in sides if isinstance(side, ast.Name) and side.id == "fmt"
             or isinstance(side, ast.Attribute) and side.attr in ("fmt", "format") and isinstance(side.value, ast.Name)
             and side.value.id in ("self", "spec", "module")]
    constant = [n for side in sides for n in ast.walk(side)
                if isinstance(n, ast.Name) and n.id.isupper() or isinstance(n, ast.Attribute) and n.attr.isupper()]
    return bool(layer and constant)


def test_no_module_outside_the_format_classes_branches_on_a_format_name():
    """The if-chains are gone: no comparison in `h3_core/weights` (the format classes aside) tests a layer's format
    (`spec.format`, `module.fmt`) or tests a value against a registered format's marker name ("gguf" aside: it is
    also the container's name)."""
    names = {fmt for fmt in layouts.supported_formats() if fmt != "gguf"}
    found = []
    for path in WEIGHTS.rglob("*.py"):
        if path.parent.name == "formats" and path.parent.parent.name == "quant":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and (_names_a_format(node, names) or _tests_a_layer_format(node)):
                found.append(f"{path.name}:{node.lineno}")
    assert not found


class _Int16Rows(LayerFormat):
    """A format defined outside the package: int16 codes with one float32 scale per row (absmax / 32767)."""

    name = "test_int16_rows"
    side_tensors = ("weight_scale",)
    required = frozenset({"weight_scale"})

    def check(self, where, marker, tensors):
        dtype, shape = tensors["weight"]
        want(dtype == "I16" and len(shape) == 2, where, f"weight must be I16 2-D, got {dtype}")
        want(tensors["weight_scale"] == ("F32", (shape[0], 1)), where, "weight_scale must be F32 [N, 1]")
        return LayerSpec(self, tuple(shape), marker, tensors)

    def label(self, spec):
        return "int16 row-wise"

    def dequantise(self, spec, stored, dtype):
        return (stored["weight"].to(torch.float32) * stored["weight_scale"]).to(dtype)

    def quantise(self, weight, options):
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 32767
        return {"weight": torch.round(weight / scale).to(torch.int16), "weight_scale": scale}, {"format": self.name}


def test_a_new_format_is_one_class_and_a_registration(monkeypatch, tmp_path):
    monkeypatch.setattr(layouts, "_REGISTRY", dict(layouts._REGISTRY))  # registered for this test only
    layouts.register(_Int16Rows)
    with pytest.raises(ValueError, match="already registered"):
        layouts.register(_Int16Rows)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    state = quantise_state_dict(model.state_dict(), "test_int16_rows", ["0"])
    spec = layouts.describe("0", markers.parse(state["0.comfy_quant"], "0"),
                            _header({k[2:]: v for k, v in state.items() if k != "0.comfy_quant"}))
    assert spec.label == "int16 row-wise"
    from h3_core.weights.quant import route

    converted, mismatched = route.install(model, state)
    assert not mismatched and isinstance(model[0], QuantLinear)
    model.load_state_dict(converted, assign=True)
    x = torch.randn(3, 16)
    dense = state["0.weight"].to(torch.float32) * state["0.weight_scale"]
    assert torch.equal(model(x), torch.nn.functional.linear(x, dense, state["0.bias"]))
