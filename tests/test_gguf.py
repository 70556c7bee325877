"""GGUF DiT and text-encoder files (ComfyUI-GGUF's layout): detection from the file, refused GGML types, every
twin's dequantisation against the `gguf` package's numpy dequantiser (bitwise, float32), quantised layers kept
as stored bytes, and `encode --text-encoder X.gguf` + `generate --dit Y.gguf` writing a valid mp4.

Cost: an mp4 costs a CLI encode and a full tiny decode (a minute or more on a shared 2-core machine), so by
default two pairs run to an mp4 (a standard and a K-quant type, full and pruned DiT); every DiT and text-encoder
twin computes exactly what a dense model holding the numpy-dequantised weights computes (one forward each), and
H3_GGUF_MATRIX=full runs every DiT twin with the text encoder of its type to an mp4.
"""

import json
import os
import pathlib
import shutil

import av
import gguf
import numpy as np
import pytest
import torch

from h3_core import cli, tiny, weights
from h3_core.contract import H3Conditioning
from h3_core.tiny import gguf_twins as tiny_gguf
from h3_core.weights import gguf_file
from h3_core.weights.errors import UnsupportedCheckpointError
from h3_core.weights.headers import read_header
from h3_core.weights.quant import ggml
from h3_core.weights.quant.linear import QuantLinear

VAE = tiny.COMFY_FILES["vae"]
AUDIO_VAE = tiny.COMFY_FILES["audio_vae"]
BF16_DIT = "diffusion_models/minimax_h3_tiny_fl2va_bf16.safetensors"  # the bench's reference row
DIT_FAMILIES = ("fl2va", "ref2va", "fl2va_pruned")
TWINS = [(family, kind) for family in (*DIT_FAMILIES, "text_encoder") for kind in tiny_gguf.QUANT_TYPES]
MP4_PAIRS = [("fl2va", "Q5_1"), ("fl2va_pruned", "Q4_K")]
if os.environ.get("H3_GGUF_MATRIX") == "full":
    MP4_PAIRS = [(family, kind) for family in DIT_FAMILIES for kind in tiny_gguf.QUANT_TYPES]


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """A models folder holding the tiny fp32 sources, both VAEs and every GGUF twin (`tiny --twins gguf`)."""
    comfy = tiny_dir / "comfyui"
    if all((comfy / tiny_gguf.gguf_path(*twin)).is_file() for twin in TWINS) and all(
            (comfy / rel).is_file() for rel in tiny_gguf.split_paths()):
        return comfy
    out = tmp_path_factory.mktemp("gguf")
    for rel in {*tiny_gguf.SOURCES.values(), VAE, AUDIO_VAE, BF16_DIT}:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(comfy / rel, out / rel)
    tiny_gguf.write_gguf_twins(out)
    return out


def _path(models, family, kind) -> pathlib.Path:
    return models / tiny_gguf.gguf_path(family, kind)


@pytest.mark.parametrize("twin", TWINS, ids=["-".join(t) for t in TWINS])
def test_every_twin_dequantises_as_the_gguf_package_does_bitwise(models, twin):
    """Each block-quantised tensor, dequantised the way the loaded layers do it (diffusers' torch dequantiser),
    equals the `gguf` package's numpy dequantisation bit for bit in float32; and the file checks clean."""
    header = read_header([str(_path(models, *twin))])
    quantised = {name: info for name, info in header.tensors.items() if info.ggml_type not in ggml.DENSE_TYPES}
    assert quantised and {info.ggml_type for info in quantised.values()} <= {twin[1], "Q8_0"}
    for name, info in quantised.items():
        ours = ggml.dequantise(gguf_file.read_tensor(info), info.ggml_type, info.dense_shape, torch.float32)
        reference = torch.from_numpy(gguf_file.numpy_dequantise(info))
        assert ours.dtype == torch.float32 and torch.isfinite(ours).all(), name
        assert torch.equal(ours, reference), name
    report = weights.check(_path(models, *twin))
    assert report.ok, str(report)


@pytest.mark.parametrize("family", ["fl2va", "text_encoder"])
def test_loaded_layers_stay_quantised_and_compute_with_the_numpy_weights(models, family):
    """Loaded at bf16, a Q4_0 twin holds its quantised layers as the file's bytes (about 0.28x bf16 there); each
    layer's weight is the numpy dequantisation (rows reordered as the converter reorders them)."""
    path = _path(models, family, "Q4_0")
    header = read_header([str(path)])
    model = (weights.load_text_encoder if family == "text_encoder" else weights.load_transformer)(
        path, dtype=torch.bfloat16)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert layers and all(m.weight.dtype == torch.uint8 for m in layers.values())
    stored = sum(m.weight.numel() for m in layers.values())
    dense = sum(m.in_features * m.out_features * 2 for m in layers.values())
    assert stored / dense == pytest.approx(18 / 32 / 2)  # Q4_0: 18 bytes per 32 values vs 2 bytes a value
    if family == "fl2va":
        pairs = {"transformer_blocks.0.attn.to_out.0": "blocks.0.attn.out_proj.weight",
                 "transformer_blocks.1.ff.net.2": "blocks.1.mlp.fc2.weight"}
    else:
        pairs = {"model.language_model.layers.3.mlp.down_proj": "model.layers.3.mlp.down_proj.weight"}
    for module, key in pairs.items():
        expected = torch.from_numpy(gguf_file.numpy_dequantise(header.tensors[key]))
        assert torch.equal(layers[module].dense_weight(torch.float32), expected)
        x = torch.randn(3, layers[module].in_features, dtype=torch.bfloat16)
        got = layers[module](x)
        want = torch.nn.functional.linear(x, expected.to(torch.bfloat16), None if layers[module].bias is None
                                          else layers[module].bias.to(torch.bfloat16))
        assert torch.equal(got, want)


def _dense_reference(path, out) -> pathlib.Path:
    """The GGUF file as a dense float32 safetensors file: every tensor dequantised by the `gguf` package (numpy)."""
    from h3_core.weights.safetensors_io import write_file

    header = read_header([str(path)])
    write_file(str(out), {name: torch.from_numpy(gguf_file.numpy_dequantise(info).copy())
                          for name, info in header.tensors.items()}, header.metadata)
    return out


DIT_TWINS = [twin for twin in TWINS if twin[0] != "text_encoder"]


@pytest.mark.parametrize("twin", DIT_TWINS, ids=["-".join(t) for t in DIT_TWINS])
def test_dit_twin_forward_equals_the_numpy_dequantised_dense_model_bitwise(models, tmp_path, twin, parity_threads):
    from support import weights_support

    quant = weights.load_transformer(_path(models, *twin))
    dense = weights.load_transformer(_dense_reference(_path(models, *twin), tmp_path / "dense.safetensors"))
    assert isinstance(quant.transformer_blocks[0].attn.to_out[0], QuantLinear)
    for got, expected in zip(weights_support.dit_forward(quant), weights_support.dit_forward(dense), strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, expected)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_K"])
def test_text_encoder_twin_equals_the_numpy_dequantised_dense_model_bitwise(models, tmp_path, kind, parity_threads):
    from support import weights_support

    path = _path(models, "text_encoder", kind)
    quant = weights.load_text_encoder(path)
    dense = weights.load_text_encoder(_dense_reference(path, tmp_path / "te.safetensors"))
    got, expected = weights_support.prompt_embeds(quant), weights_support.prompt_embeds(dense)
    assert torch.isfinite(got).all() and torch.equal(got, expected)


def test_format_is_read_from_the_file_not_its_name(models, tmp_path):
    renamed = tmp_path / "minimax_h3_fl2va_bf16.safetensors"  # a misleading name: still GGUF
    shutil.copy(_path(models, "fl2va", "Q5_1"), renamed)
    det = weights.detect(str(renamed))
    assert (det.component, det.partition, det.format) == ("transformer", "fl2va", "gguf")
    assert {spec.label for spec in det.quant.layers.values()} == {"GGUF Q5_1"}
    fake = tmp_path / "minimax_h3_fl2va_Q4_K.gguf"  # a .gguf name on safetensors bytes: the bytes decide
    shutil.copy(models / tiny_gguf.SOURCES["fl2va"], fake)
    assert weights.detect(str(fake)).format == "dense"


def _write_gguf(path, tensors: dict) -> None:
    writer = gguf.GGUFWriter(str(path), "minimax_h3")
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_shape=array.shape if qtype is not None else None, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["Q8_K", "IQ2_XXS", "TQ1_0", "I8"])
def test_types_no_dequantiser_knows_are_refused_by_name(tmp_path, kind):
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros((4, 256 // block * size), dtype=np.uint8) if kind != "I8" else np.zeros((4, 256), np.int8)
    path = tmp_path / "dit.gguf"
    _write_gguf(path, {"blocks.0.mlp.fc2.weight": (data, qtype if kind != "I8" else None),
                       "blocks.0.attn.norm.weight": (np.ones(8, np.float32), None)})
    with pytest.raises(UnsupportedCheckpointError, match=rf"GGML tensor type {kind} x1 .*supported: GGUF F32/F16/BF16 "
                                                         r"and .*Q4_K"):
        weights.detect(str(path))


def test_tiny_twins_gguf_step_writes_them_into_a_build(models, tmp_path):
    """`python -m h3_core tiny --out DIR --twins gguf` on an existing build adds the GGUF twins only."""
    build = tmp_path / "tiny"
    for rel in set(tiny_gguf.SOURCES.values()):
        (build / "comfyui" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(models / rel, build / "comfyui" / rel)
    (build / "tiny.json").write_text("{}")
    assert cli.main(["tiny", "--out", str(build), "--twins", "gguf"]) == 0
    for twin in TWINS:
        assert (build / "comfyui" / tiny_gguf.gguf_path(*twin)).read_bytes() == _path(models, *twin).read_bytes()


def _check_mp4(path, frames: int, width: int, height: int) -> None:
    with av.open(str(path)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, video.width, video.height) == ("h264", width, height)
        assert audio.codec_context.name == "aac" and audio.channels == 2
        assert sum(1 for _ in container.decode(video=0)) == frames


@pytest.mark.parametrize("family, kind", MP4_PAIRS, ids=["-".join(p) for p in MP4_PAIRS])
def test_encode_and_generate_with_gguf_files_write_a_valid_mp4(models, tmp_path, family, kind):
    common = ["--vae", str(models / VAE), "--audio-vae", str(models / AUDIO_VAE)]
    cond, out = tmp_path / "cond.safetensors", tmp_path / "out.mp4"
    encode = ["encode", "--text-encoder", str(_path(models, "text_encoder", kind)), *common, "--width", "32",
              "--height", "32", "--out", str(cond)]
    if family.startswith("ref2va"):
        image = pathlib.Path(__file__).resolve().parents[1] / "workflows" / "inputs" / "h3_example_reference_image.png"
        encode += ["--prompt", "<Picture 1> waves.", "--ref-image", str(image)]
    else:
        encode += ["--prompt", "A red fox in the snow."]
    assert cli.main(encode) == 0
    assert cli.main(["generate", "--dit", str(_path(models, family, kind)), *common, "--cond", str(cond),
                     "--steps", "2", "--out", str(out)]) == 0
    saved = H3Conditioning.load(cond)
    _check_mp4(out, saved.num_frames, saved.width, saved.height)


def test_plan_counts_the_stored_blocks(models):
    """The planner sizes a GGUF file from its header: quantised layers at their stored bytes."""
    from h3_core.planning import planner

    path = _path(models, "fl2va", "Q4_0")
    header = read_header([str(path)])
    plan = planner.plan_file(path, width=64, height=64, frames=124, device="cuda")
    assert plan.stored_bytes == header.total_bytes
    quantised = sum(info.nbytes for info in header.tensors.values() if info.ggml_type == "Q4_0")
    assert quantised and plan.device_bytes < planner.plan_file(models / tiny_gguf.SOURCES["fl2va"], width=64,
                                                               height=64, frames=124, device="cuda").device_bytes


def test_gguf_dit_and_text_encoder_stream_block_by_block_bitwise(tiny_dir, models, parity_threads):
    """`--offload block` on GGUF files: the stored bytes stream with their blocks; results equal the resident run."""
    from h3_core.diffusion import DiffusionStage, SamplingOptions
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource
    from h3_core.testing import CASES, STEPS

    source = ModelSource.from_path(tiny_dir, layout="comfyui")
    source.paths["text_encoder"] = _path(models, "text_encoder", "Q6_K")
    source.paths["transformer"] = _path(models, "fl2va_pruned", "Q4_K")
    request, _, seed = CASES["t2va-64x64-seed0"]
    prepared = EncoderStage(source, components=("text",)).prepare(request)
    resident_te = EncoderStage(source, components=("text",))
    streamed_te = EncoderStage(source, components=("text",), offload="block")
    assert torch.equal(streamed_te.encode_text(prepared)[0], resident_te.encode_text(prepared)[0])
    cond = resident_te.encode(request)
    options = SamplingOptions(steps=STEPS, seed=seed)
    expected = DiffusionStage(source).sample(cond, options)
    stage = DiffusionStage(source, offload="block")
    streamed = stage.sample(cond, options)
    assert torch.equal(streamed.video, expected.video) and torch.equal(streamed.audio, expected.audio)
    block = stage.transformer("t2va").transformer_blocks[0]
    assert any(isinstance(m, QuantLinear) and m.fmt == "gguf" for m in block.modules())


def test_q4_k_layers_hold_well_under_0_35_of_bf16(models):
    """Loaded at bf16, every Q4_K layer holds 144 bytes per 256 weights: 0.28x its bf16 size (bench/gguf_quality.py
    reports every type, and the release-size files)."""
    from bench import gguf_quality

    model = weights.load_transformer(_path(models, "fl2va", "Q4_K"), dtype=torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.spec.marker["ggml_type"] == "Q4_K"]
    assert layers
    ratio = sum(m.weight.numel() for m in layers) / sum(m.in_features * m.out_features * 2 for m in layers)
    assert ratio == 144 / 512 < 0.35
    release, bf16 = gguf_quality.release_bytes("Q4_K")
    assert release / bf16 < 0.35


def test_bench_command_runs_as_documented(models, tmp_path):
    """`python bench/gguf_quality.py --models TINY/comfyui --out FILE` (docs/REAL_WEIGHTS.md): every row finite, the
    standard types' errors ordered by their bits, Q4_K's release-size DiT under 0.35x bf16."""
    from bench import gguf_quality

    out = tmp_path / "gguf_quality.json"
    assert gguf_quality.main(["--models", str(models), "--out", str(out)]) == 0
    rows = {row["type"]: row for row in json.loads(out.read_text())}
    assert all(row.get("finite", True) for row in rows.values())
    assert rows["Q8_0"]["weight_error"] < rows["Q5_1"]["weight_error"] < rows["Q4_0"]["weight_error"] < 0.2
    assert rows["Q4_K"]["quantised_vs_bf16"] < 0.35 and rows["Q4_K"]["release_vs_bf16"] < 0.35


def test_text_encoder_with_a_separate_vision_projector_file(models):
    """A text-encoder GGUF without its tower takes the projector GGUF beside it (told by their tensors, not their
    names): the pair loads and encodes (image included) exactly as the single file of the same type does."""
    from support import weights_support

    language, projector = (models / rel for rel in tiny_gguf.split_paths())
    det = weights.detect(str(language))
    assert det.component == "text_encoder" and set(det.files) == {str(language), str(projector)}
    found = weights.scan(str(language.parent))  # the projector is part of the encoder, not a broken component
    assert [d.path for d in found] == [str(language)]
    with pytest.raises(weights.H3WeightsError):
        weights.detect(str(projector))  # a projector alone is no component
    split = weights.load_text_encoder(language)
    single = weights.load_text_encoder(_path(models, "text_encoder", tiny_gguf.SPLIT_TYPE))
    assert torch.equal(weights_support.prompt_embeds(split), weights_support.prompt_embeds(single))


@pytest.mark.parametrize("kind", ggml.quantised_types())
def test_every_accepted_type_dequantises_as_the_gguf_package_does(kind):
    """Every GGML type read (diffusers' dequantisers) on random block bytes: the same float32 bits as the `gguf`
    package's numpy dequantiser, NaN / inf positions included (random F16 scale bytes make some)."""
    block, size = ggml.block_sizes(kind)
    raw = np.random.default_rng(7).integers(0, 256, size=(4, 2 * size), dtype=np.uint8)
    ours = ggml.dequantise(torch.from_numpy(raw), kind, (4, 2 * block), torch.float32)
    reference = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32)
    torch.testing.assert_close(ours, torch.from_numpy(reference.reshape(4, 2 * block)), rtol=0, atol=0,
                               equal_nan=True)


# --- one load reads each file once, and maps it (design issue 40 item 3) -------------------------------------------

def _counting(monkeypatch):
    """Counters on the steps one load must take once per file: detection, the directory parse, its description as
    `TensorInfo`s; and on the per-layer ones (layer descriptions, marker parses, installs). Caches emptied first."""
    import collections
    import sys

    from h3_core.weights import gguf_header, loaders
    from h3_core.weights.quant import layouts, markers, plan, route

    detect_module = sys.modules["h3_core.weights.detect"]
    monkeypatch.setattr(gguf_header, "_CACHE", type(gguf_header._CACHE)())
    monkeypatch.setattr(gguf_file, "_HEADERS", type(gguf_file._HEADERS)())
    monkeypatch.setattr(plan, "_OPTIONS", {})
    counts = collections.Counter()

    def counted(owner, name, key=lambda *args: None):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            counts[(name, key(*args))] += 1
            return original(*args, **kwargs)
        return wrapper

    detect = counted(detect_module, "detect", lambda path: os.path.basename(path))
    for owner in (detect_module, loaders, weights):
        monkeypatch.setattr(owner, "detect", detect)
    monkeypatch.setattr(gguf_header, "parse", counted(gguf_header, "parse", lambda p, *_: os.path.basename(p)))
    monkeypatch.setattr(gguf_file, "_describe", counted(gguf_file, "_describe", lambda d, p: os.path.basename(p)))
    for owner, name in ((layouts, "describe"), (markers, "parse"), (route, "install")):
        monkeypatch.setattr(owner, name, counted(owner, name))
    return counts


def _file_mappings() -> dict:
    """{path: [(start, end)]} of the file mappings of this process (/proc/self/maps)."""
    found: dict = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.setdefault(fields[5].strip(), []).append((start, end))
    return found


def test_one_load_of_a_gguf_dit_reads_the_file_once_and_maps_its_tensors(models, monkeypatch):
    """`ModelSource.for_file` + `load` (what the DiT Loader does) detects the file once, parses its GGUF directory
    once and describes it once, never parses the markers its plan made, describes each quantised layer once in the
    plan and once where it is installed; and the loaded quantised layers hold views of the file's pages (a private
    mapping: written, a page is copied, never the file), equal to the `gguf` package's own (mapped) reading."""
    from h3_core.models import ModelSource

    path = _path(models, "fl2va", "Q8_0")
    counts = _counting(monkeypatch)
    source = ModelSource.for_file("transformer", path)
    model = source.load("transformer")
    name = path.name
    assert counts[("detect", name)] == 1
    assert counts[("parse", name)] == 1 and counts[("_describe", name)] == 1
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    plan = source.detections["transformer"].quant
    assert counts[("describe", None)] == len(plan.layers) + len(layers)  # was 48 for 14 layers (2 detections)
    assert counts[("parse", None)] == 0  # was 36: the plan's own markers' options are remembered, never parsed
    assert counts[("install", None)] == 2  # the check's, and the load's (drops the markers, installs nothing)

    mapped = _file_mappings().get(os.path.realpath(path), [])
    reference = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    weight = layers["transformer_blocks.0.attn.to_out.0"].weight
    assert any(start <= weight.data_ptr() < end for start, end in mapped), "not a view of the file"
    assert np.array_equal(weight.numpy().reshape(-1), np.asarray(reference["blocks.0.attn.out_proj.weight"].data)
                          .reshape(-1))
    before = path.read_bytes()
    weight.data[0, 0] ^= 0xFF  # a write lands in a private copy of its page (mode "c"), not in the file
    assert path.read_bytes() == before
    weight.data[0, 0] ^= 0xFF


def test_a_detection_is_reused_only_while_its_file_is_unchanged(models, tmp_path, monkeypatch):
    """The detection a source carries is the load's while the file is the one detected; rewritten in place since,
    or with the slot pointed at another file, the load detects again. A mapped load still notices its file
    rewritten in place (`file_identity`) and refuses it by name."""
    from h3_core.models import ModelSource
    from h3_core.weights import file_identity
    from h3_core.weights.errors import H3WeightsError

    path = tmp_path / "minimax_h3_fl2va_Q8_0.gguf"
    shutil.copy(_path(models, "fl2va", "Q8_0"), path)
    counts = _counting(monkeypatch)
    source = ModelSource.for_file("transformer", path)
    with open(path, "ab") as handle:  # same inode, longer: GGUF ignores bytes after its data
        handle.write(b"\0" * 64)
    model = source.load("transformer")
    assert counts[("detect", path.name)] == 2
    file_identity.check_unchanged(model, "DiT")
    with open(path, "ab") as handle:  # appended, never truncated: a cut mapped page would be a SIGBUS
        handle.write(b"\0" * 64)
    with pytest.raises(H3WeightsError, match="rewritten in place"):
        file_identity.check_unchanged(model, "DiT")
    other = ModelSource.for_file("transformer", path)
    other.paths["transformer"] = _path(models, "ref2va", "Q8_0")
    other.load("transformer")
    assert counts[("detect", _path(models, "ref2va", "Q8_0").name)] == 1
