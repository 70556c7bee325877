"""GGUF text encoders in llama.cpp's names (convert_hf_to_gguf.py: `blk.N.attn_q`, `token_embd`, and the `mmproj`
vision file `v.blk.N.*`, `v.patch_embd` in two temporal halves, `mm.0`/`mm.2`, `v.deepstack.L.*`): the names
agree with the `gguf` package's own tensor map, the loaded pair equals the Comfy-named pair bit for bit, `encode`
works with it, and what cannot be mapped is refused by name."""

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from h3_core import cli, tiny, weights
from h3_core.contract import H3Conditioning
from h3_core.tiny import gguf_twins as tiny_gguf
from h3_core.weights import gguf_file, gguf_llama_names
from h3_core.weights.errors import UnsupportedCheckpointError
from h3_core.weights.headers import read_header
from h3_core.weights.safetensors_io import load_tensors


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """A models folder with the tiny text encoder's Comfy-named and llama.cpp-named GGUF pairs and both VAEs."""
    comfy = tiny_dir / "comfyui"
    if all((comfy / rel).is_file() for rel in (*tiny_gguf.split_paths(), *tiny_gguf.llamacpp_paths())):
        return comfy
    out = tmp_path_factory.mktemp("gguf_llamacpp")
    for rel in {*tiny_gguf.SOURCES.values(), tiny.COMFY_FILES["vae"], tiny.COMFY_FILES["audio_vae"]}:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(comfy / rel, out / rel)
    tiny_gguf.write_gguf_twins(out, types=(tiny_gguf.SPLIT_TYPE,))
    return out


def _pairs(models):
    return ([models / rel for rel in tiny_gguf.llamacpp_paths()], [models / rel for rel in tiny_gguf.split_paths()])


def test_twin_names_are_the_gguf_packages_own(models):
    """Every tensor of the twin is named as the `gguf` package's tensor map names the transformers tensor (the
    names llama.cpp's converter looks up), except the converter's own Qwen3-VL cases (patch halves, merger,
    DeepStack), checked against its code's rules."""
    llama, comfy = _pairs(models)
    comfy_names = sorted(read_header([str(p) for p in comfy]).tensors)
    blocks = 1 + max(int(n.split(".")[2]) for n in comfy_names if n.startswith("model.layers."))
    text_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3VL, blocks)
    vision_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, blocks)
    raw = {t.name for p in llama for t in gguf.GGUFReader(str(p)).tensors}
    deepstack = gguf_llama_names.deepstack_layers(raw)
    custom = {"visual.patch_embed.proj": "v.patch_embd", "visual.merger.norm": "v.post_ln",
              "visual.merger.linear_fc1": "mm.0", "visual.merger.linear_fc2": "mm.2"}
    checked = 0
    for name in comfy_names:
        ours = gguf_llama_names.llama_name(name, deepstack)
        assert ours in raw, name
        stem, kind = name.rsplit(".", 1)
        if name.startswith("model."):
            assert text_map.get_name(stem) + f".{kind}" == ours, name
            checked += 1
        elif name.startswith("visual.blocks.") or name == "visual.pos_embed.weight":
            assert vision_map.get_name(stem) + f".{kind}" == ours, name
            checked += 1
        elif name.startswith("visual.deepstack_merger_list."):
            index = int(name.split(".")[2])
            generic = vision_map.get_name("model." + stem)  # the map numbers mergers 0..n-1; the converter uses L
            assert generic.replace(f".{index}.", f".{deepstack[index]}.") + f".{kind}" == ours, name
        else:
            assert ours == f"{custom[stem]}.{kind}", name
    assert checked > 100 and "v.patch_embd.weight.1" in raw
    assert gguf.GGUFReader(str(llama[1])).fields["general.architecture"].contents() == "clip"


def test_loaded_llamacpp_pair_equals_the_comfy_named_pair_bitwise(models):
    """The same stored bytes under the Comfy names (the patch kernel, dense in llama.cpp's file, is the Comfy file's
    numpy dequantisation); the loaded encoders hold equal weights and encode equal prompt embeddings."""
    from support import weights_support

    llama, comfy = _pairs(models)
    ours, theirs = read_header([str(p) for p in llama]), read_header([str(p) for p in comfy])
    assert set(ours.tensors) == set(theirs.tensors)
    mine, reference = load_tensors(ours), load_tensors(theirs)
    patch = gguf_llama_names.PATCH
    for name in reference:
        if name == patch:
            assert torch.equal(mine[name], torch.from_numpy(gguf_file.numpy_dequantise(theirs.tensors[name])))
        else:
            assert mine[name].dtype == reference[name].dtype and torch.equal(mine[name], reference[name]), name
    det = weights.detect(str(llama[0]))
    assert det.component == "text_encoder" and set(det.files) == {str(p) for p in llama}
    assert weights.check(llama[0]).ok
    assert [d.path for d in weights.scan(str(llama[0].parent))] == [str(llama[0])]
    with pytest.raises(weights.H3WeightsError):
        weights.detect(str(llama[1]))  # a vision file alone is no component
    a, b = weights.load_text_encoder(llama[0]), weights.load_text_encoder(comfy[0])
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert torch.equal(weights_support.prompt_embeds(a), weights_support.prompt_embeds(b))


def test_encode_with_a_llamacpp_text_encoder(models, tmp_path):
    """`encode --text-encoder X.gguf` (llama.cpp names, its mmproj beside it) writes the conditioning the Comfy-named
    pair writes, bit for bit."""
    vaes = (str(models / tiny.COMFY_FILES[kind]) for kind in ("vae", "audio_vae"))
    common = ["--vae", next(vaes), "--audio-vae", next(vaes),
              "--width", "32", "--height", "32", "--prompt", "A red fox in the snow."]
    saved = []
    for pair, out in zip(_pairs(models), ("llama.safetensors", "comfy.safetensors")):
        assert cli.main(["encode", "--text-encoder", str(pair[0]), *common, "--out", str(tmp_path / out)]) == 0
        saved.append(H3Conditioning.load(tmp_path / out))
    assert torch.equal(saved[0].prompt_embeds, saved[1].prompt_embeds)


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


def test_a_complete_models_head_and_final_norm_map_to_the_legacy_names():
    """A complete llama.cpp model also holds `output_norm` and `output`: the legacy names of a full stack."""
    names = gguf_llama_names.comfy_names(["token_embd.weight", "output_norm.weight", "output.weight"], "x.gguf")
    assert names == {"token_embd.weight": ("model.embed_tokens.weight", 0),
                     "output_norm.weight": ("model.norm.weight", 0), "output.weight": ("lm_head.weight", 0)}


def test_what_cannot_be_mapped_is_refused_by_name(tmp_path):
    """An unknown llama.cpp tensor (a MoE expert stack), another architecture, another projector type, and a
    patch kernel with one half: each refused with the tensor or architecture named, before any weight is read."""
    row = np.zeros((4, 32), dtype=np.float32)
    moe = _write(tmp_path / "moe.gguf", "qwen3vl", {"blk.0.attn_q.weight": row, "blk.0.ffn_gate_exps.weight": row})
    with pytest.raises(UnsupportedCheckpointError, match="blk.0.ffn_gate_exps.weight"):
        read_header([moe])
    llama = _write(tmp_path / "llama.gguf", "llama", {"token_embd.weight": row, "blk.0.attn_q.weight": row})
    with pytest.raises(UnsupportedCheckpointError, match="architecture 'llama'"):
        read_header([llama])
    other = _write(tmp_path / "mmproj.gguf", "clip", {"v.blk.0.attn_qkv.weight": row},
                   clip__projector_type="qwen2.5vl_merger")
    with pytest.raises(UnsupportedCheckpointError, match="qwen2.5vl_merger"):
        read_header([other])
    half = _write(tmp_path / "half.gguf", "clip", {"v.patch_embd.weight": np.zeros((4, 3, 2, 2), np.float32)},
                  clip__projector_type="qwen3vl_merger")
    with pytest.raises(weights.H3WeightsError, match="visual.patch_embed.proj.weight needs llama.cpp parts"):
        read_header([half])


def test_the_plain_tiny_build_writes_the_default_gguf_twins_and_loaders_offer_them(tiny_dir):
    """`python -m h3_core tiny` writes the Q8_0 and Q4_K twins (both pairs included); the loaders' embedded tiny
    choices are exactly its GGUF files but the vision-projector ones."""
    from h3_core.tiny import files as tiny_files

    built = {name.split("/", 1)[1] for name in json.loads((tiny_dir / "tiny.json").read_text())["files"]
             if name.startswith("comfyui/") and name.endswith(".gguf")}
    projectors = {rel for rel in built if gguf_file.is_projector(str(tiny_dir / "comfyui" / rel))}
    assert projectors == {tiny_gguf.split_paths()[1], tiny_gguf.llamacpp_paths()[1]}
    listed = {rel for rel in tiny_files.comfy_files() if rel.endswith(".gguf")}
    assert listed == built - projectors == set(tiny_gguf.default_files())
    assert all(any(rel.endswith(f"_{kind}.gguf") for kind in tiny_gguf.DEFAULT_TYPES) for rel in listed)


def test_one_load_of_a_llamacpp_pair_reads_each_file_once(models, monkeypatch):
    """The text-encoder loader's `for_file` + `load` of a llama.cpp pair detects once, and parses and describes each
    of the two files' GGUF directories once (projector pairing, the pair's header and the load share them)."""
    import collections
    import os
    import sys

    from h3_core import weights
    from h3_core.models import ModelSource
    from h3_core.weights import gguf_file, gguf_header, loaders

    language, projector = _pairs(models)[0]
    detect_module = sys.modules["h3_core.weights.detect"]
    monkeypatch.setattr(gguf_header, "_CACHE", type(gguf_header._CACHE)())
    monkeypatch.setattr(gguf_file, "_HEADERS", type(gguf_file._HEADERS)())
    counts = collections.Counter()
    detect, parse, describe = detect_module.detect, gguf_header.parse, gguf_file._describe

    def counted_detect(path):
        counts["detect"] += 1
        return detect(path)

    def counted_parse(path, *args):
        counts[("parse", os.path.basename(path))] += 1
        return parse(path, *args)

    def counted_describe(found, path):
        counts[("describe", os.path.basename(path))] += 1
        return describe(found, path)

    for owner in (detect_module, loaders, weights):
        monkeypatch.setattr(owner, "detect", counted_detect)
    monkeypatch.setattr(gguf_header, "parse", counted_parse)
    monkeypatch.setattr(gguf_file, "_describe", counted_describe)
    ModelSource.for_file("text_encoder", language).load("text_encoder")
    assert counts["detect"] == 1
    for path in (language, projector):
        assert counts[("parse", path.name)] == 1 and counts[("describe", path.name)] == 1, path.name
