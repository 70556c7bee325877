"""The loaders' lists (nodes/model_files.py, UX issue 38 item 7): one embedded tiny entry (the tiny H3's twins only
with H3_SHOW_TINY_TWINS=1, and still accepted by name), and each file of the loader's folder that no loader can load
named with its reason: a `⚠ NAME — reason` entry at the end of the list, refused with the whole reason at queue
time, logged once; readable files of other model families left out and named in the tooltip.

nodes/model_files.py is imported under a stand-in package whose `comfy_bridge` lists a temporary models folder (the
real one imports ComfyUI), with the h3_core every other test imports; the files are release-size headers over
sparse data (h3_core.weights.release_headers), so this runs in the fast tier. tests/test_queue_time_errors_comfyui.py
checks the same in a real ComfyUI (/object_info and POST /prompt).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types
from pathlib import Path

import pytest

import h3_core.models
import h3_core.weights
from h3_core.tiny import files as tiny_files
from h3_core.weights import release_headers

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "h3pack_loader_lists_under_test"
TINY_CHOICE, TINY_PREFIX = "[embedded] tiny H3 (noise)", "[embedded] tiny H3 / "
LEGACY_TINY = "[embedded] tiny H3 (random weights, outputs are noise)"  # saved by 0.2-0.4 workflows
LOADER_OF = {"text_encoder": "Load MiniMax H3 Text Encoder", "vae": "Load MiniMax H3 Video VAE",
             "audio_vae": "Load MiniMax H3 Audio VAE", "transformer": "Load MiniMax H3 DiT"}


def _bridge(models: Path) -> types.ModuleType:
    """comfy_bridge's listing and resolving, over `models` (its names, as nodes/comfy_bridge.py spells them)."""
    bridge = types.ModuleType(f"{PACKAGE}.nodes.comfy_bridge")
    bridge.PACK_FOLDER, bridge.TINY_CHOICE, bridge.TINY_FILE_PREFIX = "minimax_h3", TINY_CHOICE, TINY_PREFIX
    bridge.LEGACY_TINY_CHOICES = (LEGACY_TINY,)

    def model_choices(folder):
        names = sorted(p.name for p in (models / folder).iterdir())
        return [TINY_CHOICE, *(TINY_PREFIX + name for name in tiny_files.in_folder(folder)), *names]

    def resolve_model_path(folder, choice):
        if choice.startswith(TINY_PREFIX):
            if choice[len(TINY_PREFIX):] not in tiny_files.in_folder(folder):
                raise ValueError(f"{choice!r} is not one of the embedded tiny H3's files")
            return models / "tiny" / choice, False
        if "/" in choice or not choice.endswith((".safetensors", ".gguf")):
            raise ValueError(f"{choice[:200]!r} is not a .safetensors file in models/{folder}/")
        path = models / folder / choice
        if not path.exists():
            raise FileNotFoundError(path)
        return path, False

    bridge.model_choices, bridge.resolve_model_path = model_choices, resolve_model_path
    return bridge


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """models/vae and models/diffusion_models with good, cut, corrupt, misplaced and other-family files."""
    root = tmp_path_factory.mktemp("models")

    def release(rel: str, dest: Path) -> Path:
        tensors, data = release_headers.release_header(rel)
        release_headers.write_sparse(str(dest), tensors, data)
        return dest

    vae, dit = root / "vae", root / "diffusion_models"
    release("vae/minimax_h3_video_vae_fp16.safetensors", vae / "minimax_h3_video_vae_fp16.safetensors")
    cut = release("vae/minimax_h3_video_vae_fp16.safetensors", vae / "half_download.safetensors")
    os.truncate(cut, cut.stat().st_size // 2)
    (vae / "broken.safetensors").write_bytes(b"<html>404 Not Found</html>")
    release_headers.write_sparse(str(vae / "sdxl_vae.safetensors"), {"decoder.conv_in.weight": ("F32", (4, 4))})
    release("diffusion_models/minimax_h3_fl2va_bf16.safetensors", dit / "minimax_h3_fl2va_bf16.safetensors")
    release("vae/minimax_h3_video_vae_fp16.safetensors", dit / "my_video_vae.safetensors")  # the wrong folder
    return root


@pytest.fixture(scope="module")
def model_files(models):
    """nodes/model_files.py, its `..h3_core` the h3_core every other test imports, its bridge the stub above."""
    pack = types.ModuleType(PACKAGE)
    pack.__path__ = [str(ROOT)]
    nodes = types.ModuleType(f"{PACKAGE}.nodes")
    nodes.__path__ = [str(ROOT / "nodes")]
    bridge = _bridge(models)
    nodes.comfy_bridge = bridge
    added = {PACKAGE: pack, f"{PACKAGE}.nodes": nodes, f"{PACKAGE}.nodes.comfy_bridge": bridge,
             f"{PACKAGE}.h3_core": sys.modules["h3_core"], f"{PACKAGE}.h3_core.weights": h3_core.weights,
             f"{PACKAGE}.h3_core.models": h3_core.models}
    sys.modules.update(added)
    try:
        yield importlib.import_module(f"{PACKAGE}.nodes.model_files")
    finally:
        for name in [*added, f"{PACKAGE}.nodes.model_files"]:
            sys.modules.pop(name, None)


@pytest.fixture
def hidden_twins(monkeypatch):
    monkeypatch.delenv("H3_SHOW_TINY_TWINS", raising=False)


def test_one_tiny_entry_unless_the_twins_are_asked_for(model_files, hidden_twins, monkeypatch):
    for folder, component in (("vae", "vae"), ("diffusion_models", "transformer")):
        options = model_files.choices(folder, component)
        assert [name for name in options if name.startswith("[embedded]")] == [TINY_CHOICE], options
    monkeypatch.setenv("H3_SHOW_TINY_TWINS", "1")
    dits = model_files.choices("diffusion_models", "transformer")
    twins = [name for name in dits if name.startswith(TINY_PREFIX)]
    assert len(twins) == len(tiny_files.in_folder("diffusion_models")) == 20
    assert dits.index(TINY_CHOICE) < dits.index(twins[0])


def test_a_hidden_twin_is_still_accepted_by_name(model_files, hidden_twins):
    """Saved workflows (the shipped quantised API graphs) name twins: the list no longer shows them, queue time still
    takes them (ComfyUI leaves the list check to the loaders' validate_inputs) and resolving them is unchanged."""
    twin = TINY_PREFIX + "minimax_h3_tiny_fl2va_pruned_int8_convrot.safetensors"
    assert twin not in model_files.choices("diffusion_models", "transformer")
    assert model_files.problems("diffusion_models", "transformer", twin, LOADER_OF) is None
    # the old label too, without resolving it (that would build the tiny H3 on ComfyUI's event loop)
    assert model_files.is_tiny(LEGACY_TINY) and model_files.problems("vae", "vae", LEGACY_TINY, LOADER_OF) is None


def test_the_video_vae_list_names_each_unloadable_file_with_its_reason(model_files, hidden_twins):
    listed = model_files.listing("vae", "vae")
    assert listed.options == [
        "minimax_h3_video_vae_fp16.safetensors",
        TINY_CHOICE,
        "⚠ broken.safetensors — not readable: not a safetensors file (corrupt, or another format)",
        "⚠ half_download.safetensors — not readable: incomplete file (interrupted download?)",
    ]
    assert listed.not_h3 == ("sdxl_vae.safetensors",)  # another family's VAE: core's loaders list it
    note = listed.tooltip_note("vae")
    assert "Entries marked ⚠ are files in models/vae that cannot be loaded" in note
    assert "Not listed, not MiniMax H3 model files: sdxl_vae.safetensors." in note


def test_a_component_in_the_wrong_folder_is_named_with_where_it_goes(model_files, hidden_twins):
    options = model_files.choices("diffusion_models", "transformer")
    assert options == ["minimax_h3_fl2va_bf16.safetensors", TINY_CHOICE,
                       "⚠ my_video_vae.safetensors — holds the H3 video VAE: move it to models/vae/"]


def test_an_unloadable_entry_is_refused_with_the_whole_reason(model_files, hidden_twins):
    noted = next(name for name in model_files.choices("vae", "vae") if "half_download" in name)
    wrong = model_files.problems("vae", "vae", noted, LOADER_OF)
    assert wrong.startswith("half_download.safetensors is not an H3 model file this loader reads: ")
    assert "incomplete file - the header describes" in wrong and "(interrupted download?)" in wrong
    assert wrong == model_files.problems("vae", "vae", "half_download.safetensors", LOADER_OF)
    misplaced = next(name for name in model_files.choices("diffusion_models", "transformer") if name.startswith("⚠"))
    assert model_files.problems("diffusion_models", "transformer", misplaced, LOADER_OF) == (
        "my_video_vae.safetensors holds the H3 video VAE, not the DiT: move it to models/vae/ and load it with "
        "Load MiniMax H3 Video VAE")
    assert model_files.problems("vae", "vae", "⚠ ../../etc/passwd — x", LOADER_OF).startswith("'../../etc/passwd'")


def test_each_unloadable_file_is_logged_once(models, model_files, hidden_twins, caplog):
    fresh, pipe = models / "vae" / "fresh_cut.safetensors", models / "vae" / "pipe.safetensors"
    fresh.write_bytes((models / "vae" / "broken.safetensors").read_bytes()[:10])
    os.mkfifo(pipe)  # never opened: reading its header would block the list
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                video = model_files.choices("vae", "vae")
                model_files.choices("vae", "audio_vae")
                model_files.choices("diffusion_models", "transformer")
        assert "⚠ pipe.safetensors — not readable: not a regular file" in video
        lines = [record.getMessage() for record in caplog.records]
        about = [line for line in lines if "fresh_cut.safetensors is left out of the loader lists" in line]
        assert len(about) == 1 and "not a safetensors file (corrupted: header length" in about[0], lines
        assert len([line for line in lines if "pipe.safetensors is left out of the loader lists" in line]) == 1
        misplaced = [line for line in lines if "my_video_vae.safetensors is left out" in line]
        assert len(misplaced) <= 1  # once per process (an earlier test may have logged it)
    finally:
        fresh.unlink()
        pipe.unlink()


def test_a_text_encoders_vision_file_is_not_called_a_stranger(models, model_files, hidden_twins):
    """llama.cpp's `mmproj` file rides beside its GGUF text encoder: readable, no H3 component of its own, and not
    named in the tooltip as another family's file."""
    other = models / "vae" / "mmproj-qwen3vl.safetensors"
    release_headers.write_sparse(str(other), {"visual.blocks.0.attn.qkv.weight": ("F32", (4, 4))})
    try:
        assert model_files.listing("vae", "vae").not_h3 == ("sdxl_vae.safetensors",)
    finally:
        other.unlink()


def test_a_long_reason_is_cut_in_the_list_and_the_name_read_back(model_files):
    entry = model_files.note("a — b.safetensors", "not supported: " + "x" * 300)
    assert len(entry) < 150 and entry.endswith("…")
    assert model_files.noted_name(model_files.note("plain.safetensors", "why")) == "plain.safetensors"
    assert model_files.noted_name("plain.safetensors") is None
