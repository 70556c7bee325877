"""Every node of every shipped template says which package it needs, as core's templates do: `cnr_id` / `ver` in its
properties (the pack's registry id and version from pyproject.toml for the pack's nodes, comfy-core for core's); and
the templates default to the files and Turbo LoRAs core's own H3 templates use. Reads the committed files only."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflows"))
import build_workflows  # noqa: E402

GRAPHS = build_workflows.build_graphs()
TEMPLATES = {graph.key: json.loads((REPO / build_workflows.TEMPLATES / f"{graph.title}.json").read_text())
             for graph in GRAPHS}
CORE_TEMPLATES = ("t2va_core", "fl2va_core", "ref2va_core")


def pyproject() -> tuple[str, str]:
    project = (REPO / "pyproject.toml").read_text().split("[project]", 1)[1].split("\n[", 1)[0]
    return (re.search(r'^name\s*=\s*"([^"]+)"', project, re.M).group(1),
            re.search(r'^version\s*=\s*"([^"]+)"', project, re.M).group(1))


def test_every_template_node_carries_cnr_id_and_ver():
    pack_id, version = pyproject()
    assert pack_id == "minimax-h3-split"
    for key, workflow in TEMPLATES.items():
        for node in workflow["nodes"]:
            props = node["properties"]
            if node["type"].startswith("H3Split"):
                assert (props.get("cnr_id"), props.get("ver")) == (pack_id, version), (key, node["type"])
            else:
                assert props.get("cnr_id") == "comfy-core" and re.fullmatch(r"\d+\.\d+\.\d+", props.get("ver", "")), (
                    key, node["type"], props)
        minimum = {n["properties"]["ver"] for n in workflow["nodes"] if n["properties"]["cnr_id"] == "comfy-core"}
        assert ("0.33.0" in minimum) == (key in CORE_TEMPLATES), (key, minimum)


def test_templates_default_to_cores_files_and_turbo_loras():
    turbo = {"fl2va": ("minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", 8),
             "ref2va": ("minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors", 4)}
    for key, workflow in TEMPLATES.items():
        names = {m["name"] for m in workflow["models"]}
        assert {"minimax_h3_video_vae_int8_convrot.safetensors", "minimax_h3_audio_vae_fp32.safetensors"} <= names
        dits = [m["name"] for m in workflow["models"] if m["directory"] == "diffusion_models"]
        assert len(dits) == 1 and "_pruned_" in dits[0], key
        partition = "ref2va" if "_ref2va_" in dits[0] else "fl2va"
        lora, forwards = turbo[partition]
        assert [m["name"] for m in workflow["models"] if m["directory"] == "loras"] == [lora], key
        by_type = {n["type"]: n for n in workflow["nodes"]}
        if key in CORE_TEMPLATES:  # core's KSampler counts DiT forwards
            assert by_type["LoraLoaderModelOnly"]["widgets_values"][:2] == [lora, 1.0]
            assert by_type["KSampler"]["widgets_values"][2:6] == [forwards, 1.0, "res_multistep", "simple"]
            assert "H3SplitTextEncoderLoader" not in by_type and "H3SplitRemoteEncode" in by_type
        else:  # the pack's Sampler counts noise levels: forwards + 1
            values = by_type["H3SplitSampler"]["widgets_values"]
            assert values[2] == forwards + 1 and lora in values, (key, values)
        if "H3SplitTextEncoderLoader" in by_type and key != "t2va_pruned_int8":
            assert "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors" in names, key


def test_api_twins_stay_tiny():
    """The API forms run the tiny H3 anywhere: no Turbo LoRA (the tiny has none), the core-sampler ones on core's
    UNETLoader with the tiny Comfy-format DiT."""
    for graph in GRAPHS:
        api = json.loads((REPO / "workflows" / "api" / f"{graph.key}.json").read_text())
        types = {node["class_type"] for node in api.values()}
        assert "LoraLoaderModelOnly" not in types, graph.key
        assert not any("lora" in node["inputs"] for node in api.values()), graph.key
        if graph.key in CORE_TEMPLATES:
            unet = next(node for node in api.values() if node["class_type"] == "UNETLoader")
            assert unet["inputs"]["unet_name"].startswith("minimax_h3_tiny_"), unet
            assert {"MiniMaxH3SigmaShift", "KSampler", "H3SplitEmptyLatentFromConditioning", "H3SplitRemoteEncode",
                    "H3SplitDecode"} <= types
            remote = next(node for node in api.values() if node["class_type"] == "H3SplitRemoteEncode")
            assert remote["inputs"]["endpoint"] == build_workflows.DEFAULT_ENDPOINT
