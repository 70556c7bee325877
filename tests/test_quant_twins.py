"""The tiny twins of the published files: their structure, their quality vs fp32, bitwise forwards, memory."""

import json
import re
import shutil

import pytest
import torch
from support import quant_support as qs
from support import weights_support

from h3_core import weights
from h3_core.safetensors_header import DTYPE_TAGS
from h3_core.tiny import twins as tiny_twins
from h3_core.weights import release_headers
from h3_core.weights.quant.linear import Int8Embedding, QuantLinear


@pytest.fixture(scope="module", autouse=True)
def _parity_threads(parity_threads):
    """Bitwise comparisons: the thread count is pinned (conftest.parity_threads)."""


@pytest.fixture(scope="module")
def twins(tiny_dir, tmp_path_factory):
    """The twins of the tiny build (written next to its fp32 Comfy files; built here for an older tiny build)."""
    comfy = tiny_dir / "comfyui"
    wanted = [tiny_twins.twin_path(f, v) for f, variants in tiny_twins.TWIN_FILES.items() for v in variants]
    if all((comfy / rel).is_file() for rel in wanted):
        return comfy
    out = tmp_path_factory.mktemp("twins")
    for rel in tiny_twins.SOURCES.values():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(comfy / rel, out / rel)
    tiny_twins.write_twins(out)
    return out


def _path(twins, family, variant):
    return twins / tiny_twins.twin_path(family, variant)


def _generic(name: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", name)


RELEASE_OF = {  # twin -> the published file it stands for
    ("fl2va", "bf16"): "diffusion_models/minimax_h3_fl2va_bf16.safetensors",
    ("fl2va", "int8_convrot"): "diffusion_models/minimax_h3_fl2va_int8_convrot.safetensors",
    ("text_encoder", "bf16"): "text_encoders/qwen3vl_32b_minimax_h3_bf16.safetensors",
    ("text_encoder", "int8_convrot"): "text_encoders/qwen3vl_32b_minimax_h3_int8_convrot.safetensors",
    ("text_encoder", "nvfp4_awq"): "text_encoders/qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
    ("video_vae", "fp16"): "vae/minimax_h3_video_vae_fp16.safetensors",
    ("video_vae", "int8_convrot"): "vae/minimax_h3_video_vae_int8_convrot.safetensors",
}


@pytest.mark.parametrize("twin", sorted(RELEASE_OF))
def test_twins_have_the_published_names_dtypes_and_markers(twins, twin):
    """Same tensor names (indices aside), dtypes and marker formats as the release file; tiny rotation groups."""
    tensors, _ = qs.read(_path(twins, *twin))
    release, data = release_headers.release_header(RELEASE_OF[twin])
    mine = {(_generic(k), DTYPE_TAGS[v.dtype]) for k, v in tensors.items() if not k.startswith("visual.")}
    theirs = {(_generic(k), tag) for k, (tag, _) in release.items() if not k.startswith("visual.")}
    assert mine == theirs
    formats = {_generic(prefix): marker for prefix, (marker, _) in qs.layers_of(tensors).items()}
    published = {_generic(k[: -len(".comfy_quant")]): json.loads(v) for k, v in data.items()}
    assert set(formats) == set(published)
    for name, marker in formats.items():
        expected = dict(published[name])
        if "convrot_groupsize" in expected:  # the release's 256 does not divide tiny widths
            assert marker["convrot_groupsize"] in (16, 64)
            expected["convrot_groupsize"] = marker["convrot_groupsize"]
        assert marker == expected, name
    report = weights.check(_path(twins, *twin))
    assert report.ok, str(report)


def test_check_names_every_layer_family(twins):
    report = str(weights.check(_path(twins, "fl2va", "int8_convrot")))
    assert ("formats: DiT fl2va · AdaLN projections int8 row-wise x2 · block linears int8_convrot (group 64) x8"
            in report)
    report = str(weights.check(_path(twins, "text_encoder", "nvfp4_awq")))
    assert "embed_tokens int8 row-wise x1" in report
    assert "language linears nvfp4 (block 16, AWQ pre-scale) x100" in report


ERRORS = {}  # format -> (max relative error, its bound), filled by the next test, printed for the docs


@pytest.mark.parametrize("twin", [("fl2va", "int8_convrot"), ("text_encoder", "int8_convrot"),
                                  ("text_encoder", "nvfp4_awq"), ("video_vae", "int8_convrot")])
def test_twin_error_vs_fp32_is_within_each_format_bound(twins, twin):
    original, _ = qs.read(twins / tiny_twins.SOURCES[twin[0]])
    tensors, _ = qs.read(_path(twins, *twin))
    for prefix, (marker, family) in qs.layers_of(tensors).items():
        error, bound = qs.error_and_bound(marker, family, original[f"{prefix}.weight"])
        label = marker["format"] + (" convrot" if marker.get("convrot") else "")
        worst = ERRORS.get(label, (0.0, 0.0))
        ERRORS[label] = (max(worst[0], error), max(worst[1], bound))
    print("\nmax relative weight error vs fp32 (bound):",
          {k: (round(e, 4), round(b, 4)) for k, (e, b) in sorted(ERRORS.items())})
    assert ERRORS


def _dense_twin(twins, family, variant, tmp_path, dtype):
    reference = tmp_path / f"dense_{family}_{variant}.safetensors"
    prescales = qs.dense_reference(_path(twins, family, variant), reference, dtype)
    return reference, prescales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["fl2va", "ref2va"])
def test_int8_dit_twin_forward_equals_the_dense_dequantised_model_bitwise(twins, tmp_path, family, dtype):
    path = _path(twins, family, "int8_convrot")
    quant = weights.load_transformer(path, dtype=dtype)
    reference, _ = _dense_twin(twins, family, "int8_convrot", tmp_path, dtype)
    dense = weights.load_transformer(reference, dtype=dtype)
    assert isinstance(quant.transformer_blocks[1].attn.to_k, QuantLinear)
    assert isinstance(quant.transformer_blocks[0].adaln_proj.linear, QuantLinear)
    assert quant.transformer_blocks[0].attn.to_q.weight.dtype == torch.int8  # stays quantised in memory
    for got, expected in zip(weights_support.dit_forward(quant), weights_support.dit_forward(dense), strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def _te_rename(prefix: str) -> str:
    return prefix.replace("model.layers.", "model.language_model.layers.").replace(
        "model.embed_tokens", "model.language_model.embed_tokens")


@pytest.mark.parametrize("variant, dtype", [("int8_convrot", torch.float32), ("nvfp4_awq", torch.float32),
                                            ("nvfp4_awq", torch.bfloat16)])
def test_text_encoder_twins_equal_the_dense_dequantised_model_bitwise(twins, tmp_path, variant, dtype):
    quant = weights.load_text_encoder(_path(twins, "text_encoder", variant), dtype=dtype)
    reference, prescales = _dense_twin(twins, "text_encoder", variant, tmp_path, dtype)
    dense = weights.load_text_encoder(reference, dtype=dtype)
    handles = qs.prescale_inputs(dense, prescales, _te_rename)
    embed = quant.model.language_model.embed_tokens
    assert isinstance(embed, Int8Embedding) == (variant == "nvfp4_awq")
    with torch.no_grad():
        got, expected = weights_support.prompt_embeds(quant), weights_support.prompt_embeds(dense)
    for handle in handles:
        handle.remove()
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_video_vae_twin_is_dequantised_at_load_and_decodes_bitwise(twins, tmp_path):
    quant = weights.load_video_vae(_path(twins, "video_vae", "int8_convrot"))
    reference, _ = _dense_twin(twins, "video_vae", "int8_convrot", tmp_path, torch.float32)
    dense = weights.load_video_vae(reference)
    assert not any(isinstance(m, QuantLinear) for m in quant.modules())  # small: dense after load
    assert weights_support.state_dicts_equal(quant, dense)


def _parameter_bytes(model, only=None) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if only is None or only(name))


def test_int8_dit_stays_quantised_in_memory(twins):
    """Loaded at bf16, the int8 twin's quantised layers hold <= 0.55 x their bytes in the bf16 twin (1 byte a
    weight + one fp32 scale a row vs 2 bytes). The whole tiny model cannot show the release ratio (0.51, see
    test_quant_release): at tiny widths the quantised linears are a minority of its parameters."""
    int8 = weights.load_transformer(_path(twins, "fl2va", "int8_convrot"), dtype=torch.bfloat16)
    bf16 = weights.load_transformer(_path(twins, "fl2va", "bf16"), dtype=torch.bfloat16)
    quantised = {name for name, module in int8.named_modules() if isinstance(module, QuantLinear)}

    def in_quantised(name):
        return name.rpartition(".")[0] in quantised and not name.endswith(".bias")

    ratio = _parameter_bytes(int8, in_quantised) / _parameter_bytes(bf16, in_quantised)
    whole = _parameter_bytes(int8) / _parameter_bytes(bf16)
    print(f"\nint8/bf16 bytes after load: quantised layers {ratio:.3f}, whole tiny DiT {whole:.3f}")
    assert ratio <= 0.55 and whole < 1.0
