"""The pack's nodes and shipped workflows inside a real ComfyUI (CPU, loopback) and its real frontend: core 0.33 and
its frontend 1.49.6 (the harness's DEFAULT_INSTALL), or 0.3.75 and its frontend 1.32.9 with H3_COMFY=0.3.75 (where
the two differ, the test says which it expects of each). tests/test_comfy0375_smoke.py runs a part of this in 0.3.75
in every run.

One ComfyUI server and one H3 encoder server for the module; every graph runs the embedded tiny H3.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from support import warm_cli
from support.comfy_harness import (  # noqa: F401  (comfy: session fixture)
    COMFY_0375,
    PACK_NAME,
    ComfyError,
    comfy,
    progress_as_sent,
)
from support.comfy_pack import encoder_url, server  # noqa: F401  (module fixtures: pack server, encoder endpoint)

from h3_core import media
from h3_core.contract import H3Conditioning

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO / "workflows"
TEMPLATES = REPO / "example_workflows"
sys.path.insert(0, str(WORKFLOWS))
import build_workflows  # noqa: E402

NAMES = ["t2va", "t2i", "fl2va", "ref2va", "ref2va_remote", "t2va_pruned_int8", "fl2va_pruned_fp8_nvfp4", "guides",
         "continue"]
# Core 0.33's stage 1 on the pack's Remote Encode: listed everywhere, run in tests/test_core033_comfyui.py (0.3.75 lacks
# core's H3 node, which its frontend reports missing; 0.33's loads them with nothing missing).
CORE_NAMES = ["t2va_core", "fl2va_core", "ref2va_core"]
CORE_033_ONLY = sorted(build_workflows.CORE_033_SCHEMAS)
ALL_NAMES = NAMES + CORE_NAMES
VIDEO_NAMES = [name for name in NAMES if name != "t2i"]  # t2i saves a PNG (its first frame), not an mp4
# Each template's file name (its title in the template browser) by the API workflow's name.
TITLES = {graph.key: graph.title for graph in build_workflows.build_graphs()}
SCREENSHOTS = REPO / "docs" / "images"  # H3_UPDATE_SCREENSHOTS=1 rewrites the templates' screenshots there


def template(name: str) -> dict:
    return json.loads((TEMPLATES / f"{TITLES[name]}.json").read_text())
EXPECTED_CANVAS = {"t2va": (128, 64), "t2i": (128, 64), "fl2va": (96, 64), "ref2va": (128, 64),
                   "ref2va_remote": (128, 64), "t2va_pruned_int8": (128, 64), "fl2va_pruned_fp8_nvfp4": (96, 64),
                   "guides": (96, 64), "continue": (128, 64)}
# The real DiT and text encoder each template stands for (None: no text encoder, the endpoint encodes).
FL2VA_INT8, REF2VA_INT8, NVFP4 = ("minimax_h3_fl2va_pruned_int8_convrot.safetensors",
                                  "minimax_h3_ref2va_pruned_int8_convrot.safetensors",
                                  "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors")
EXPECTED_FILES = {  # the files core's own H3 templates use
    "t2va": (FL2VA_INT8, NVFP4),
    "t2i": (FL2VA_INT8, NVFP4),
    "fl2va": (FL2VA_INT8, NVFP4),
    "ref2va": (REF2VA_INT8, NVFP4),
    "ref2va_remote": (REF2VA_INT8, None),
    "t2va_core": (FL2VA_INT8, None),
    "fl2va_core": (FL2VA_INT8, None),
    "ref2va_core": (REF2VA_INT8, None),
    "guides": (FL2VA_INT8, NVFP4),
    "continue": (FL2VA_INT8, NVFP4),
    "t2va_pruned_int8": ("minimax_h3_fl2va_pruned_int8_convrot.safetensors",
                         "qwen3vl_32b_minimax_h3_int8_convrot.safetensors"),
    "fl2va_pruned_fp8_nvfp4": ("minimax_h3_fl2va_pruned_fp8_scaled.safetensors",
                               "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"),
}
# Core's folders (Load VAE: loaders, CLIP Text Encode: conditioning, KSampler: sampling, VAE Decode: latent).
PACK_NODES = {
    "H3SplitTextEncoderLoader": (["text_encoder"], ["MINIMAX_H3_TEXT_ENCODER"], "loaders"),
    "H3SplitVideoVAELoader": (["vae"], ["MINIMAX_H3_VIDEO_VAE"], "loaders"),
    "H3SplitAudioVAELoader": (["audio_vae"], ["MINIMAX_H3_AUDIO_VAE"], "loaders"),
    "H3SplitDiTLoader": (["dit", "partition"], ["MINIMAX_H3_DIT"], "loaders"),
    "H3SplitKeyframes": ([], ["MINIMAX_H3_MEDIA"], "conditioning"),
    "H3SplitReferences": ([], ["MINIMAX_H3_MEDIA"], "conditioning"),
    "H3SplitTextEncode": (["text_encoder", "prompt", "width", "height", "length"], ["CONDITIONING"], "conditioning"),
    "H3SplitVideoVAEEncode": (["conditioning", "vae"], ["CONDITIONING"], "conditioning"),
    "H3SplitAudioVAEEncode": (["conditioning", "audio_vae"], ["CONDITIONING"], "conditioning"),
    "H3SplitRemoteEncode": (["prompt", "width", "height", "length", "endpoint"], ["CONDITIONING"], "conditioning"),
    "H3SplitSampler": (["dit", "conditioning", "seed", "steps", "video_shift", "audio_shift"], ["LATENT"], "sampling"),
    "H3SplitDecode": (["latent", "vae", "audio_vae"], ["VIDEO", "IMAGE", "AUDIO", "IMAGE"], "latent"),
    "H3SplitSaveConditioning": (["conditioning", "filename_prefix"], [], "conditioning"),
    "H3SplitLoadConditioning": (["conditioning_file"], ["CONDITIONING"], "conditioning"),
    "H3SplitEmptyLatentFromConditioning": (["conditioning"], ["LATENT", "INT", "INT", "INT"], "latent"),
}


def api(name: str, endpoint: str | None = None) -> dict:
    graph = json.loads((WORKFLOWS / "api" / f"{name}.json").read_text())
    for node in graph.values():
        if node["class_type"] == "H3SplitRemoteEncode" and endpoint:
            node["inputs"]["endpoint"] = endpoint
    return graph


def node_of(graph: dict, class_type: str) -> dict:
    return next(node for node in graph.values() if node["class_type"] == class_type)


def id_of(graph: dict, class_type: str) -> str:
    return next(key for key, node in graph.items() if node["class_type"] == class_type)


# --- registration --------------------------------------------------------------------------------


def test_object_info_declares_every_node(server):
    info = server.object_info()
    for node_id, (inputs, outputs, category) in PACK_NODES.items():
        assert node_id in info, f"{node_id} missing from /object_info"
        entry = info[node_id]
        declared = {**entry["input"].get("required", {}), **entry["input"].get("optional", {})}
        assert set(inputs) <= set(declared), (node_id, sorted(declared))
        assert entry["output"] == outputs, node_id
        assert entry["category"] == f"{category}/MiniMax H3", node_id
        # Found by "MiniMax" and "H3" in the node search (frontend 1.32.9 searches the id and the display name);
        # loaders named as core's ("Load VAE").
        assert "MiniMax H3" in entry["display_name"], node_id
        assert entry["display_name"].startswith("Load ") == (category == "loaders"), node_id
    refs = info["H3SplitReferences"]["input"]["optional"]
    assert [k for k in refs if k.startswith("ref_image_")] == [f"ref_image_{i}" for i in range(1, 10)]
    assert refs["ref_video_1"][0] == "VIDEO" and refs["ref_audio_3"][0] == "AUDIO"
    assert "tooltip" in info["H3SplitTextEncode"]["input"]["required"]["length"][1]


LOADERS = ("H3SplitTextEncoderLoader", "H3SplitVideoVAELoader", "H3SplitAudioVAELoader", "H3SplitDiTLoader")


def test_every_loader_places_its_model_on_a_device_the_user_picks(server):
    """The appended `device` widget lists the devices torch sees ("default" first: ComfyUI's choice), every template
    loader carries it, and a graph placing every model explicitly runs (on this CPU machine: all on cpu)."""
    info = server.object_info()
    for loader in LOADERS:
        kind, options = info[loader]["input"]["optional"]["device"]
        choices = options.get("options", kind)  # V3 combos: ["COMBO", {"options": [...]}]
        assert choices[:2] == ["default", "cpu"] and options["default"] == "default", loader
        assert info[loader]["input_order"]["optional"][-1] == "device", loader  # appended, never inserted
    for name in NAMES:
        loaders = [node for node in template(name)["nodes"] if node["type"] in LOADERS]
        assert loaders and all(node["widgets_values"][-1] == "default" for node in loaders), name
    graph = api("t2va")
    for node in graph.values():
        if node["class_type"] in LOADERS:
            node["inputs"]["device"] = "cpu"
    result = server.run_prompt(graph, timeout=600)
    assert result.status == "success", result.types()
    bad = api("t2va")
    node_of(bad, "H3SplitDiTLoader")["inputs"]["device"] = "cuda:7"
    with pytest.raises(ComfyError, match="device"):  # a device this machine does not have: refused by name
        server.run_prompt(bad, timeout=120)


def test_workflows_are_generated_from_one_source(server):
    rendered = build_workflows.render_all(server.object_info())
    for name, content in rendered.items():
        path = REPO / name
        committed = path.read_bytes() if isinstance(content, bytes) else path.read_text()
        assert committed == content, f"{name} drifted: rerun workflows/build_workflows.py"
    # ComfyUI lists every *.json of a pack's workflows/ folder as a template too: a UI copy left there
    # would show each template twice.
    templates = [f"example_workflows/{TITLES[n]}.{ext}" for n in ALL_NAMES for ext in ("json", "jpg")]
    assert sorted(rendered) == sorted(templates + [f"workflows/api/{n}.json" for n in ALL_NAMES])
    assert sorted(p.name for p in WORKFLOWS.glob("*.json")) == []
    assert sorted(p.name for p in TEMPLATES.iterdir()) == sorted(n.split("/")[-1] for n in rendered if "example" in n)


HF = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main"


def test_templates_carry_the_model_list_the_frontend_reads():
    # The frontend's schema of a model entry: {name, url (a URL), directory, hash?, hash_type?}; its missing-model
    # dialog downloads only from allowed hosts and only *.safetensors, into models/<directory>/.
    for name in ALL_NAMES:
        workflow = template(name)
        assert workflow["extra"]["info"]["name"] == TITLES[name] and TITLES[name].startswith(f"MiniMax H3 {name} - ")
        assert str(uuid.UUID(workflow["id"])) == workflow["id"]  # the schema wants a UUID
        models = workflow["models"]
        expected_dit, expected_te = EXPECTED_FILES[name]
        assert [m["name"] for m in models if m["directory"] == "diffusion_models"] == [expected_dit]
        text_encoders = [m["name"] for m in models if m["directory"] == "text_encoders"]
        assert text_encoders == ([expected_te] if expected_te else [])
        for model in models:
            assert set(model) == {"name", "url", "directory"}
            assert model["url"] == f"{HF}/{model['directory']}/{model['name']}"
            assert model["directory"] in {"diffusion_models", "text_encoders", "vae", "loras"}
            assert model["name"].endswith(".safetensors")
        assert len([m for m in models if m["directory"] == "loras"]) == 1  # a Turbo LoRA, at its step count
        listing = [n for n in workflow["nodes"] if "models" in n["properties"]]
        per_node = sorted(m["name"] for n in listing for m in n["properties"]["models"])
        assert per_node == sorted(m["name"] for m in models)
        loaders = [n for n in workflow["nodes"] if n["type"] in build_workflows.LOADER_INPUT]
        assert {n["id"] for n in loaders} <= {n["id"] for n in listing}
        # Each node selects the published files it lists for download (never the embedded tiny H3): a loader's
        # first widget, the Sampler's `lora`.
        assert all(n["widgets_values"][0] == n["properties"]["models"][0]["name"] for n in loaders), name
        assert all(set(m["name"] for m in n["properties"]["models"]) <= set(n["widgets_values"]) for n in listing)
        thumbnail = (TEMPLATES / f"{TITLES[name]}.jpg").read_bytes()
        assert thumbnail[:3] == b"\xff\xd8\xff" and len(thumbnail) < 50_000  # a JPEG, small


def test_shipped_workflows_hold_no_secrets(server):
    # Secrets come from the environment: no node has a widget for one, and no workflow carries one.
    for node_id, entry in server.pack_nodes().items():
        names = {**entry["input"].get("required", {}), **entry["input"].get("optional", {})}
        assert not any(word in name.lower() for name in names for word in ("token", "secret", "password", "key")), (
            node_id
        )
    for path in (WORKFLOWS / "api").glob("*.json"):
        for node in json.loads(path.read_text()).values():
            for value in node["inputs"].values():
                assert not (isinstance(value, str) and "bearer " in value.lower()), path


# --- running the shipped workflows ---------------------------------------------------------------


@pytest.mark.parametrize("name", VIDEO_NAMES)
def test_api_workflow_runs_to_an_mp4(server, encoder_url, name):
    result = server.run_prompt(api(name, encoder_url), timeout=600)
    assert result.status == "success" and "execution_success" in result.types()
    progress = [m for m in result.of_type("progress") if m.get("max") == build_workflows.STEPS - 1]
    assert progress and progress[-1]["value"] == build_workflows.STEPS - 1  # the sampler's steps, live on the ws
    mp4 = next(path for path in result.files if path.suffix == ".mp4")
    info = media.probe(mp4)
    width, height = EXPECTED_CANVAS[name]
    assert (info["frames"] - 5) % 17 == 0 and info["frames"] == 124
    assert info["fps"] == 24.0 and (info["width"], info["height"]) == (width, height)
    assert info["sample_rate"] == 32000 and info["channels"] == 2


def test_t2i_workflow_saves_one_image(server):
    """Text to image, as ComfyUI core's: a 5-frame job (the shortest clip), Decode's `image` output (its first
    frame) to Save Image: one PNG on the canvas H3's rule picks, the first frame of the decoded clip."""
    graph = api("t2i")
    assert node_of(graph, "H3SplitTextEncode")["inputs"]["length"] == 5
    assert node_of(graph, "SaveImage")["inputs"]["images"] == [id_of(graph, "H3SplitDecode"), 3]
    result = server.run_prompt(graph, timeout=600)
    assert result.status == "success"
    pngs = [path for path in result.files if path.suffix == ".png"]
    assert len(pngs) == 1 and not [path for path in result.files if path.suffix == ".mp4"], result.files
    image = media.read_image(pngs[0])
    assert image.shape == (64, 128, 3) and image.std() > 0  # the tiny's noise, one 128x64 frame
    # ... the first of the clip's frames: the same graph saving Decode's `frames` gives it as its first image
    frames = api("t2i")
    node_of(frames, "SaveImage")["inputs"].update(images=[id_of(frames, "H3SplitDecode"), 1],
                                                 filename_prefix="h3/t2i_frames")
    saved = sorted(path for path in server.run_prompt(frames, timeout=600).files if path.suffix == ".png")
    assert len(saved) == 5 and np.array_equal(media.read_image(saved[0]), image)


def test_lengths_core_allows_run_with_a_warning(server):
    """Outside H3's trained 124-345 frames, as ComfyUI core allows (5..3592 on the 17k+5 grid): a 20 s (481-frame)
    and a 5-frame graph run, each with a warning in the log, not a refusal; beyond core's lengths: refused at queue
    time naming the bound."""
    for frames, seed in ((481, 4810), (5, 50)):
        graph = api("t2va")
        node_of(graph, "H3SplitTextEncode")["inputs"]["length"] = frames
        node_of(graph, "H3SplitSampler")["inputs"].update(seed=seed, steps=2)
        result = server.run_prompt(graph, timeout=900)
        assert result.status == "success"
        info = media.probe(next(path for path in result.files if path.suffix == ".mp4"))
        assert info["frames"] == frames and info["sample_rate"] == 32000
        warning = f"{frames} frames ({frames / 24:.2f} s) is outside H3's trained range of 5-15 s (124-345 frames)"
        assert warning in server.log_text()
    info = server.object_info()["H3SplitTextEncode"]["input"]["required"]["length"][1]
    assert (info["min"], info["max"], info["step"], info["default"]) == (5, 3592, 17, 124)
    assert "trained on 124" in info["tooltip"] and "warning" in info["tooltip"]
    bad = api("t2va")
    node_of(bad, "H3SplitTextEncode")["inputs"]["length"] = 3609
    status, body = server.post_prompt_expect_error(bad)
    assert status == 400 and "3592" in json.dumps(body)


def old_frontend(server) -> bool:
    """Whether the server is 0.3.75 (frontend 1.32.9), not core 0.33 (1.49.6)."""
    return server.install == COMFY_0375


def model_urls_fetched(report: dict) -> set[str]:
    """The model URLs the frontend tried to reach (1.49.6 checks each listed file's URL; the page stays on loopback,
    so each try is a console error, which the problems leave out as offline noise)."""
    return {m.split("Fetch API cannot load ", 1)[1].rstrip(".").split(". Refused")[0]
            for m in report.get("console_errors", []) if "Fetch API cannot load " in m}


def missing_models_dialog(report: dict) -> list[str]:
    """The "directory / file" lines of the frontend's missing-models dialog, if it opened."""
    dialogs = [d for d in report["dialogs"] if d.startswith("Missing Models")]
    return [line for d in dialogs for line in d.splitlines() if " / " in line]


@pytest.mark.parametrize("name", NAMES)
def test_ui_workflow_loads_in_the_real_frontend(server, encoder_url, name):
    """The template's graph with every loader on the embedded tiny H3 (built from the same source as the shipped
    template): it loads, each loader shows the tiny badge, and graphToPrompt's graph runs."""
    workflow = build_workflows.tiny_templates(server.object_info())[name]
    # dropped onto the canvas, one file after another into one page, as a user does
    report = server.load_workflow_ui(workflow, run=False, same_page=True)
    assert report["missing_types"] == [] and report["dangling_links"] == [], report
    # No alert, toast or page error (schema validation included), nothing unexpected on the console.
    assert report["problems"] == [] and report["returncode"] == 0, report["problems"]
    # The frontend read the model list: 1.32.9 offers exactly the real files (none is installed here); 1.49.6 looks only
    # for the files the graph selects, the tiny H3's, all installed: no dialog, no file's URL tried.
    if old_frontend(server):
        assert missing_models_dialog(report) == [f"{m['directory']} / {m['name']}" for m in workflow["models"]]
    else:
        assert missing_models_dialog(report) == [] and model_urls_fetched(report) == set(), report["console_errors"]
    assert report["node_count"] == len(workflow["nodes"])
    loaders = [node["id"] for node in workflow["nodes"] if node["type"] in LOADERS]
    assert sorted(int(k) for k in report["tiny_badges"]) == sorted(loaders)
    assert all("outputs are noise" in text for text in report["tiny_badges"].values())
    prompt = report["prompt"]
    assert {node["class_type"] for node in prompt.values()} == {
        node["type"] for node in workflow["nodes"] if node["type"] != build_workflows.NOTE
    }
    if name == "ref2va_remote":
        node_of(prompt, "H3SplitRemoteEncode")["inputs"]["endpoint"] = encoder_url
    # graphToPrompt's graph runs (with a fresh seed so nothing is served from cache): the frontend's form of the
    # prompt (every widget's value, defaults included; 1.49.6's SaveVideo as `format.codec` ...) is what a user
    # queues, not the shipped API workflow's, so it runs here too
    node_of(prompt, "H3SplitSampler")["inputs"]["seed"] = 11
    assert server.run_prompt(prompt, timeout=600).status == "success"


@pytest.mark.parametrize("name", ALL_NAMES)
def test_templates_are_listed_and_load_from_the_template_browser(server, name, tmp_path):
    """As the template browser loads it: no problem, no overlapping nodes, no tiny badge (the loaders select the
    published files), and a screenshot of the whole graph (docs/images/ with H3_UPDATE_SCREENSHOTS=1)."""
    shot = (SCREENSHOTS if os.environ.get("H3_UPDATE_SCREENSHOTS") else tmp_path) / f"template_{name}.png"
    report = server.load_workflow_ui(template=TITLES[name], screenshot=shot, same_page=True)  # one after another
    assert sorted(report["templates_listed"][PACK_NAME]) == sorted(TITLES.values())  # each once
    assert report["overlaps"] == [], [(b["id"], b["title"], b["y"], b["h"]) for b in report["boxes"]]
    assert report["tiny_badges"] == {}
    assert shot.stat().st_size > 10_000
    if shot.parent == SCREENSHOTS:
        small_png(shot)
    assert report["thumbnail"]["status"] == 200 and report["thumbnail"]["type"] == "image/jpeg"
    if name in CORE_NAMES and old_frontend(server):  # needs core 0.33+'s H3 node; everything else is in 0.3.75
        assert report["missing_types"] == CORE_033_ONLY and report["dangling_links"] == [], report
        return
    assert report["missing_types"] == [] and report["dangling_links"] == []
    assert report["node_count"] == report["expected_node_count"] > 0
    assert report["problems"] == [] and report["returncode"] == 0, report["problems"]
    nodes = template(name)["nodes"]
    if old_frontend(server):  # 1.32.9: nothing marked, the missing-models dialog lists every published file
        assert report["error_nodes"] == []
        assert len(missing_models_dialog(report)) == len(template(name)["models"])
    else:  # 1.49.6 marks exactly the nodes whose published file is not installed (combo values held to their lists)
        listing = {str(node["id"]) for node in nodes if "models" in node["properties"]}
        assert {str(node["id"]) for node in report["error_nodes"]} == listing, report["error_nodes"]
        assert model_urls_fetched(report) == {m["url"] for m in template(name)["models"]}


def small_png(path: Path, colours: int = 64) -> None:
    """A screenshot for the docs at a fraction of its size: the canvas's flat colours fit a small palette."""
    from PIL import Image

    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(colors=colours)
    palette.save(path, optimize=True)


def test_search_finds_the_pack_by_minimax_and_h3(server):
    """What a user types: the template browser's search and the canvas's node search (frontends 1.49.6 and 1.32.9)
    find the pack by "MiniMax" and "H3", and its Sampler and Decode by "sampler" and "vae decode"."""
    report = server.load_workflow_ui(search_templates=["H3", "MiniMax", "ref2va"],
                                     search_nodes=["H3", "MiniMax", "sampler", "vae decode"])
    assert report["returncode"] == 0, report.get("error")
    if old_frontend(server):
        assert sorted(report["template_search"]["H3"]) == sorted(TITLES.values())
    else:  # 0.33 ships core's own H3 templates (video_minimax_h3_*, ...), which 1.49.6 lists beside the pack's
        assert set(TITLES.values()) <= set(report["template_search"]["H3"])
    assert set(TITLES.values()) <= set(report["template_search"]["MiniMax"])
    assert {TITLES["ref2va"], TITLES["ref2va_remote"]} <= set(report["template_search"]["ref2va"])
    found = {query: [name.strip() for name in names] for query, names in report["node_search"].items()}
    names = {entry["display_name"] for entry in server.pack_nodes().values()}
    assert names <= set(found["H3"]) and names <= set(found["MiniMax"])
    assert "MiniMax H3 Sampler" in found["sampler"]
    assert "MiniMax H3 VAE Decode (video + audio)" in found["vae decode"]


def test_no_previews_unless_the_user_asks(server):
    # This server runs with ComfyUI's default `--preview-method none`: progress, but no preview pictures
    # (tests/test_previews_comfyui.py runs one with `auto`).
    graph = api("t2va")
    node_of(graph, "H3SplitSampler")["inputs"].update(seed=17, steps=4)
    sampler, decode = id_of(graph, "H3SplitSampler"), id_of(graph, "H3SplitDecode")
    result = server.run_prompt(graph, timeout=600)
    # ComfyUI's binary frames start with their event type: 3 is the progress-text line the pack's nodes send
    # (nodes/progress_text.py); every other type is a preview picture.
    assert [frame for frame in result.binary if int.from_bytes(frame[:4], "big") != 3] == []
    steps = [(m["value"], m["max"]) for m in result.of_type("progress") if m["node"] == sampler]
    assert progress_as_sent(steps, [(k, 3) for k in range(4)], server.install), steps  # 0.33 throttles a bar
    assert any(m["node"] == decode and m["max"] > 1 for m in result.of_type("progress"))  # decode tiles


def test_sampler_cache_widget_runs_and_shows_what_it_skipped(server):
    """The appended `cache` widget (h3_core/step_cache.py): every:2 on 4 DiT forwards of the 2-block tiny DiT runs the
    stack on forwards 0 and 2, and the node's progress text (ComfyUI's binary text channel) says so: each step's line
    keeps its count and adds what the cache skipped so far, the last line sums it up."""
    graph = api("t2va")
    node_of(graph, "H3SplitSampler")["inputs"].update(seed=17, steps=5, cache="every:2")
    sampler = id_of(graph, "H3SplitSampler")
    result = server.run_prompt(graph, timeout=600)
    assert result.status == "success"
    texts = [frame for frame in result.binary if sampler.encode() in frame and b"cache skipped" in frame]
    assert texts and re.search(rb"DiT forward 4/4, cache skipped \d+%$", texts[-2]), texts
    assert re.search(rb"done in [0-9.]+ s, cache skipped 50% of DiT blocks$", texts[-1]), texts
    assert [(m["value"], m["max"]) for m in result.of_type("progress") if m["node"] == sampler][-1] == (4, 4)
    bad = api("t2va")
    node_of(bad, "H3SplitSampler")["inputs"]["cache"] = "every:1"
    status, body = server.post_prompt_expect_error(bad)  # refused when queued, before any model loads
    assert status == 400 and "every:K needs an integer K >= 2" in json.dumps(body), body


def test_interrupt_stops_the_sampler_within_one_step(server):
    graph = api("t2va")
    node_of(graph, "H3SplitSampler")["inputs"].update(steps=200, seed=5)
    sampler = id_of(graph, "H3SplitSampler")
    seen = {}

    def on_message(message):
        data = message.get("data", {})
        if message.get("type") == "progress" and data.get("node") == sampler and data.get("max") == 199:
            seen.setdefault("at", data["value"])
            if data["value"] >= 2 and "sent" not in seen:
                seen["sent"] = data["value"]
                server.interrupt()

    result = server.run_prompt(graph, timeout=600, check=False, on_message=on_message)
    assert result.status == "interrupted", result.error
    steps = [m["value"] for m in result.of_type("progress") if m.get("node") == sampler and m.get("max") == 199]
    # The sampler stops at the next step boundary once ComfyUI's flag is set (counted in steps, without a clock:
    # tests/test_step_cache.py). Here the flag is set an HTTP round trip after a websocket message, while the tiny
    # DiT runs ~100 steps a second (CI saw 26 more steps go by on a busy machine): stopped far short of its 200.
    assert max(steps) < 199 - 50, (seen, steps)
    assert server.run_prompt(api("t2va"), timeout=600).status == "success"  # and the server keeps serving


# --- the nodes compute exactly what h3_core computes ---------------------------------------------


def test_local_nodes_equal_the_cli(server, tiny_dir, tmp_path):
    graph = api("fl2va")
    sampler = node_of(graph, "H3SplitSampler")
    sampler["inputs"].update(seed=21, steps=4)
    video_encode = id_of(graph, "H3SplitVideoVAEEncode")
    decode = id_of(graph, "H3SplitDecode")
    graph["90"] = {
        "class_type": "H3SplitSaveConditioning",
        "inputs": {"conditioning": [video_encode, 0], "filename_prefix": "h3test/fl2va_cond"},
    }
    graph["91"] = {"class_type": "SaveImage", "inputs": {"images": [decode, 1], "filename_prefix": "h3test/frame"}}
    result = server.run_prompt(graph, timeout=600)
    saved_cond = sorted((server.output_dir / "h3test").glob("fl2va_cond*.safetensors"))[-1]
    frames = sorted(p for p in result.files if p.suffix == ".png")

    inputs = WORKFLOWS / "inputs"
    cond_path, dump = tmp_path / "cond.safetensors", tmp_path / "dump.safetensors"
    run = lambda *args: warm_cli.run(
        args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "H3_THREADS": "2"},
    )
    prompt = node_of(graph, "H3SplitTextEncode")["inputs"]["prompt"]
    enc = run(
        "encode",
        "--models",
        str(tiny_dir),
        "--prompt",
        prompt,
        "--task",
        "fl2va",
        "--first-frame",
        str(inputs / build_workflows.EXAMPLE_MEDIA["first"]),
        "--last-frame",
        str(inputs / build_workflows.EXAMPLE_MEDIA["last"]),
        "--out",
        str(cond_path),
    )
    assert enc.returncode == 0, enc.stderr
    # The CLI prints each long phase: weights read (bytes), the text encode, the video VAE per clip (2 keyframes).
    assert "load [" in enc.stderr and "100% " in enc.stderr, enc.stderr
    assert "text: layer 51/51" in enc.stderr and "video_vae: clip 2/2" in enc.stderr, enc.stderr
    gen = run(
        "generate",
        "--models",
        str(tiny_dir),
        "--cond",
        str(cond_path),
        "--out",
        str(tmp_path / "o.mp4"),
        "--seed",
        "21",
        "--steps",
        "4",
        "--dump",
        str(dump),
    )
    assert gen.returncode == 0, gen.stderr
    assert "denoise: step 3/3" in gen.stderr and "load [" in gen.stderr, gen.stderr
    assert "decode_video: tile 0/" in gen.stderr and "decode_audio: clip 1/1" in gen.stderr, gen.stderr

    node_cond, cli_cond = H3Conditioning.load(saved_cond), H3Conditioning.load(cond_path)
    assert torch.equal(node_cond.prompt_embeds, cli_cond.prompt_embeds)
    assert all(torch.equal(a, b) for a, b in zip(node_cond.condition_latents, cli_cond.condition_latents))
    assert (node_cond.task, node_cond.width, node_cond.height, node_cond.keyframe_anchors) == (
        cli_cond.task,
        cli_cond.width,
        cli_cond.height,
        cli_cond.keyframe_anchors,
    )

    from safetensors.torch import load_file

    video = load_file(str(dump))["video"]  # float32 [F, H, W, 3]
    assert len(frames) == video.shape[0] == 124
    expected = np.clip(255.0 * video.numpy(), 0, 255).astype(np.uint8)  # SaveImage's quantisation
    got = np.stack([media.read_image(path) for path in frames])
    assert np.array_equal(got, expected)


def test_conditioning_file_round_trip_through_nodes(server, tmp_path):
    graph = api("t2va")
    text = id_of(graph, "H3SplitTextEncode")
    graph["90"] = {
        "class_type": "H3SplitSaveConditioning",
        "inputs": {"conditioning": [text, 0], "filename_prefix": "h3test/t2va_cond"},
    }
    server.run_prompt(
        {
            k: v
            for k, v in graph.items()
            if v["class_type"] in ("H3SplitTextEncoderLoader", "H3SplitTextEncode", "H3SplitSaveConditioning")
        },
        timeout=600,
    )
    saved = sorted((server.output_dir / "h3test").glob("t2va_cond*.safetensors"))[-1]
    target = server.input_dir / "h3test_cond.safetensors"
    target.write_bytes(saved.read_bytes())
    loaded = copy.deepcopy(graph)
    for key in [
        k
        for k, v in loaded.items()
        if v["class_type"] in ("H3SplitTextEncoderLoader", "H3SplitTextEncode", "H3SplitSaveConditioning")
    ]:
        del loaded[key]
    loaded["80"] = {"class_type": "H3SplitLoadConditioning", "inputs": {"conditioning_file": target.name}}
    node_of(loaded, "H3SplitSampler")["inputs"]["conditioning"] = ["80", 0]
    result = server.run_prompt(loaded, timeout=600)
    assert result.status == "success" and any(p.suffix == ".mp4" for p in result.files)


def test_a_prompt_edit_does_not_re_encode_unchanged_references(server):
    """ComfyUI re-runs the VAE encode nodes after a prompt edit (their input conditioning changed); the nodes then
    find every reference's part in the pack's component cache: no VAE clip is encoded, the latents are the same."""
    graph = api("ref2va")
    encoders = ("H3SplitTextEncoderLoader", "H3SplitVideoVAELoader", "H3SplitAudioVAELoader", "LoadImage",
                "LoadVideo", "LoadAudio", "H3SplitReferences", "H3SplitTextEncode", "H3SplitVideoVAEEncode",
                "H3SplitAudioVAEEncode")
    graph = {key: node for key, node in graph.items() if node["class_type"] in encoders}
    video, audio = id_of(graph, "H3SplitVideoVAEEncode"), id_of(graph, "H3SplitAudioVAEEncode")
    image = f"h3test_prompt_edit_{uuid.uuid4().hex}.png"  # pixels no earlier test encoded: the first run must
    from PIL import Image

    Image.fromarray(np.random.default_rng(7).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(
        server.input_dir / image)
    node_of(graph, "LoadImage")["inputs"]["image"] = image
    graph["90"] = {"class_type": "H3SplitSaveConditioning",
                   "inputs": {"conditioning": [audio, 0], "filename_prefix": "h3test/prompt_edit"}}
    saved, progress = [], []
    for prompt in (f"<Picture 1> first {uuid.uuid4().hex}", f"<Picture 1> edited {uuid.uuid4().hex}"):
        node_of(graph, "H3SplitTextEncode")["inputs"]["prompt"] = prompt
        result = server.run_prompt(graph, timeout=600)
        saved.append(H3Conditioning.load(sorted((server.output_dir / "h3test").glob("prompt_edit*.safetensors"))[-1]))
        assert {video, audio} <= set(result.executed_nodes())  # ComfyUI's own cache re-runs them after the edit ...
        progress.append([d for d in result.of_type("progress") if d.get("node") == video])
    assert progress[0] and not progress[1]  # ... but the edit encodes no VAE clip (the first run did: the new image)
    first, edited = saved
    assert not torch.equal(first.prompt_embeds, edited.prompt_embeds)
    assert all(torch.equal(a, b) for a, b in zip(first.condition_latents, edited.condition_latents))
    assert all(torch.equal(a, b) for a, b in zip(first.audio_condition_latents, edited.audio_condition_latents))
    assert len(first.condition_latents) == 2 and len(first.audio_condition_latents) == 2


# --- bad input fails early, names the constraint, and the server keeps serving -------------------


def _error_text(result) -> str:
    return json.dumps(result.error or {})


def test_bad_inputs_fail_before_heavy_work(server, tmp_path):
    graph = api("t2va")
    text = node_of(graph, "H3SplitTextEncode")

    bad = copy.deepcopy(graph)
    node_of(bad, "H3SplitTextEncode")["inputs"]["length"] = 23
    status, body = server.post_prompt_expect_error(bad)
    assert status == 400 and "17k+5" in json.dumps(body)

    bad = copy.deepcopy(graph)
    node_of(bad, "H3SplitTextEncode")["inputs"].update(width=100, height=64)
    status, body = server.post_prompt_expect_error(bad)
    assert status == 400 and "multiple of 32" in json.dumps(body)

    bad = copy.deepcopy(graph)
    del node_of(bad, "H3SplitTextEncode")["inputs"]["text_encoder"]  # a text-only graph with no text encoder
    status, body = server.post_prompt_expect_error(bad)
    assert status == 400 and "text_encoder" in json.dumps(body)

    # an 18 s reference audio: refused by the rules before any encoder runs
    long_audio = server.input_dir / "h3test_18s.wav"
    tone = np.stack([np.sin(np.arange(18 * 32000) / 32000 * 2 * np.pi * 220)] * 2).astype(np.float32) * 0.2
    long_audio.write_bytes(media.encode_wav_bytes(tone, 32000, sample_format="s16"))
    bad = api("ref2va")
    node_of(bad, "LoadAudio")["inputs"]["audio"] = long_audio.name
    result = server.run_prompt(bad, timeout=600, check=False)
    assert result.status == "error" and "reference audio 1 must be 2-15 s long, got 18.00 s" in _error_text(result)
    assert id_of(bad, "H3SplitSampler") not in result.executed_nodes()

    # ten reference images (two chained References nodes)
    bad = api("ref2va")
    refs = id_of(bad, "H3SplitReferences")
    image = id_of(bad, "LoadImage")
    bad["95"] = {
        "class_type": "H3SplitReferences",
        "inputs": {"media": [refs, 0], **{f"ref_image_{i}": [image, 0] for i in range(1, 10)}},
    }
    node_of(bad, "H3SplitTextEncode")["inputs"]["media"] = ["95", 0]
    status, body = server.post_prompt_expect_error(bad)  # the graph fixes the count: refused when queued
    assert status == 400 and "at most 9 image references, got 10" in json.dumps(body), body

    # a ref2va graph without its video VAE encoder: the sampler names the missing node
    bad = api("ref2va")
    node_of(bad, "H3SplitAudioVAEEncode")["inputs"]["conditioning"] = [id_of(bad, "H3SplitTextEncode"), 0]
    del bad[id_of(bad, "H3SplitVideoVAEEncode")]
    result = server.run_prompt(bad, timeout=600, check=False)
    assert result.status == "error" and "H3 Video VAE Encode" in _error_text(result)

    assert text  # the good graph still runs on the same server
    good = api("t2va")
    node_of(good, "H3SplitSampler")["inputs"]["seed"] = 99
    assert server.run_prompt(good, timeout=600).status == "success"


def test_remote_graph_gives_the_local_graphs_video(server, encoder_url):
    """Remote Encode -> Sampler -> Decode makes the same mp4 content as the local encode chain."""
    decoded = {}
    for name in ("ref2va", "ref2va_remote"):
        graph = api(name, encoder_url)
        node_of(graph, "H3SplitSampler")["inputs"].update(seed=31)
        node_of(graph, "SaveVideo")["inputs"]["filename_prefix"] = f"h3test/same_{name}"
        mp4 = next(p for p in server.run_prompt(graph, timeout=600).files if p.suffix == ".mp4")
        decoded[name] = media.read_video(mp4)
    local, remote = decoded["ref2va"], decoded["ref2va_remote"]
    assert local.frames.shape == remote.frames.shape and np.array_equal(local.frames, remote.frames)
    assert np.array_equal(local.audio, remote.audio)
