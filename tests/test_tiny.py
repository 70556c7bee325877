"""The embedded tiny H3: deterministic, loadable by diffusers itself, same weights in every layout."""

import json
from pathlib import Path

import pytest
import torch
from support import tiny_bytes, warm_cli

from h3_core import facts, tiny
from h3_core.models import ModelSource

REPO = Path(__file__).resolve().parents[1]


def test_same_seed_same_bytes_other_seed_other_weights(tiny_dir, tmp_path):
    again = tiny.build(tmp_path / "again", seed=0)
    first = json.loads((tiny_dir / "tiny.json").read_text())
    second = json.loads((again / "tiny.json").read_text())
    assert first["files"] == second["files"]  # sha256 of every file, byte for byte
    assert len(first["files"]) >= 25
    other = tiny.build_models(seed=1)["transformer"].state_dict()
    base = tiny.build_models(seed=0)["transformer"].state_dict()
    assert any(not torch.equal(other[key], base[key]) for key in base)


def test_layout_on_disk(tiny_dir):
    root = tiny_dir / "diffusers"
    for sub in ("transformer", "transformer_ref", "vae", "audio_vae", "text_encoder", "tokenizer", "processor",
                "scheduler", "audio_scheduler"):
        assert (root / sub).is_dir(), sub
    index = json.loads((root / "modular_model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline" and index["_blocks_class_name"] == "MiniMaxH3Blocks"
    assert "/" not in index["transformer"][2]["pretrained_model_name_or_path"]  # relocatable: no absolute path
    for rel in tiny.COMFY_FILES.values():
        assert (tiny_dir / "comfyui" / rel).is_file(), rel
    for partition in ("FL2VA", "Ref2VA"):
        assert (tiny_dir / "native" / partition / "model_index.json").is_file()


def test_faithful_shapes(tiny_dir):
    te_config = json.loads((tiny_dir / "diffusers" / "text_encoder" / "config.json").read_text())
    assert te_config["text_config"]["num_hidden_layers"] > facts.TEXT_ENCODER_LAYER  # diffusers taps layer 50
    dit = json.loads((tiny_dir / "diffusers" / "transformer" / "config.json").read_text())
    assert dit["text_dim"] == te_config["text_config"]["hidden_size"]
    assert dit["in_channels"] == 24 and dit["audio_in_channels"] == 32 and dit["patch_size"] == [1, 2, 2]


def test_diffusers_monolithic_pipeline_loads_and_runs_t2va(tiny_dir):
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(tiny_dir / "diffusers"), workflow="t2va")
    pipe.load_components(dtype=torch.float32)
    assert type(pipe).__name__ == "MiniMaxH3ModularPipeline"
    state = pipe(prompt="a fox", height=64, width=64, num_frames=124, num_inference_steps=2,
                 generator=torch.Generator("cpu").manual_seed(0), output_type="pt")
    assert tuple(state.get("videos").shape) == (1, 124, 3, 64, 64)
    assert tuple(state.get("audio").shape) == (1, 2, 207 * 800)


@pytest.mark.parametrize("component", ["transformer", "transformer_ref", "vae", "audio_vae", "text_encoder"])
@pytest.mark.parametrize("layout", ["comfyui", "native"])
def test_single_files_hold_the_same_weights(tiny_dir, component, layout):
    reference = ModelSource.from_path(tiny_dir, layout="diffusers").load(component)
    source = ModelSource.from_path(tiny_dir, layout=layout)
    if component not in source.paths:
        pytest.skip(f"the {layout} layout has no {component} file")
    loaded = source.load(component)
    expected = reference.state_dict()
    got = loaded.state_dict()
    if component == "text_encoder":  # the Comfy file keeps layers 0..49 only, no final norm, no lm_head
        expected = {k: v for k, v in expected.items() if k in got}
    if component == "audio_vae":  # weight norm is folded in the Comfy-named files
        return _same_audio_decode(reference, loaded)
    assert set(got) >= set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def _same_audio_decode(reference, loaded):
    latents = torch.randn(2, 32, 12, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reference.decode(latents).sample, loaded.decode(latents).sample)


def test_cli_builds(tmp_path):
    out = tmp_path / "cli-tiny"
    result = warm_cli.run(["tiny", "--out", str(out), "--seed", "3"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert json.loads((out / "tiny.json").read_text())["seed"] == 3


def test_legacy_comfyui_folders_load_through_models(tiny_dir, tmp_path):
    """A ComfyUI models folder from before the renames (unet/ for the DiT, clip/ for the text
    encoder) is what `check` accepts, so `--models` (ModelSource) accepts it too."""
    import os

    from h3_core import weights

    models = tmp_path / "ComfyUI" / "models"
    legacy = {"diffusion_models": "unet", "text_encoders": "clip", "vae": "vae"}
    for rel in tiny.COMFY_FILES.values():
        folder, name = rel.split("/")
        (models / legacy[folder]).mkdir(parents=True, exist_ok=True)
        os.symlink(tiny_dir / "comfyui" / rel, models / legacy[folder] / name)
    (models / "unet" / "not_h3.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert weights.check(models).components and all(
        c.ok for c in weights.check(models).components if "not_h3" not in c.path
    )
    source = ModelSource.from_path(models)
    assert source.layout == "comfyui" and set(source.paths) == set(weights.SLOTS)
    assert source.paths["transformer_ref"].parent.name == "unet" and source.paths["text_encoder"].parent.name == "clip"
    assert "not_h3.safetensors" in "".join(source.problems)  # skipped, and said why
    reference = ModelSource.from_path(tiny_dir, layout="comfyui")
    assert {slot: path.name for slot, path in source.paths.items()} == {
        slot: path.name for slot, path in reference.paths.items()
    }
    for slot in ("transformer_ref", "text_encoder"):
        got, expected = source.load(slot).state_dict(), reference.load(slot).state_dict()
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected), slot


def test_links_into_the_build_run_at_the_tiny_settings_and_a_copy_at_the_release(tiny_dir, tmp_path):
    """Tiny weights reached through links (a ComfyUI models folder, a loader's pick) run at the tiny's pipeline
    settings and Qwen processor, as the build itself does; a copy outside any build is taken as real weights."""
    import os
    import shutil

    from h3_core import configs

    models = tmp_path / "models"
    for rel in tiny.COMFY_FILES.values():
        (models / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(tiny_dir / "comfyui" / rel, models / rel)
    tiny_rule, release_rule = configs.get("pipeline", tiny=True), configs.get("pipeline", tiny=False)
    folder = ModelSource.from_path(models)
    assert folder.tiny and folder.pipeline_config == tiny_rule
    linked = models / tiny.COMFY_FILES["text_encoder"]
    picked = ModelSource.for_file("text_encoder", linked)
    assert picked.tiny and picked.pipeline_config == tiny_rule
    copy = tmp_path / "elsewhere" / linked.name
    copy.parent.mkdir()
    shutil.copyfile(linked, copy)
    alone = ModelSource.for_file("text_encoder", copy)
    assert not alone.tiny and alone.pipeline_config == release_rule


def test_the_build_is_the_committed_bytes_and_names_any_file_that_moved(tiny_dir):
    # The fingerprint in docs/PROTOCOL.md and every cache key derive from these bytes; they depend only on the pack,
    # the lock and the seed (no library version is stamped into the build: tiny.json records them instead).
    manifest = json.loads((tiny_dir / "tiny.json").read_text())
    want = tiny_bytes.expected()
    moved = tiny_bytes.differences(manifest, want)
    assert not moved, (
        "the tiny build's bytes moved (the model fingerprint with them):\n  " + "\n  ".join(moved)
        + "\nlibraries that differ from the committed build: " + (", ".join(tiny_bytes.libraries(manifest, want))
                                                                  or "none")
        + "\nif the pack changed the build, refresh: .venv/bin/python -m tests.support.tiny_bytes --write")
    texts = [path.read_text() for path in tiny_dir.rglob("*.json") if path.name != "tiny.json"]
    assert not [text for text in texts if '"_diffusers_version"' in text or '"transformers_version"' in text]
    assert set(manifest["built_with"]) >= {"torch", "diffusers", "transformers"}


def test_differences_name_changed_missing_and_new_files():
    want = {"files": {"a": "1", "b": "2", "c": "3"}, "built_with": {"torch": "2.14.1"}}
    got = {"files": {"a": "1", "b": "9", "d": "4"}, "built_with": {"torch": "2.15.0"}}
    assert tiny_bytes.differences(got, want) == ["changed: b", "missing: c", "new: d"]
    assert tiny_bytes.libraries(got, want) == ["torch 2.14.1 -> 2.15.0"]
