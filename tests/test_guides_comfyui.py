"""Guides in a real ComfyUI (issue 37): the pack's guide graph samples in core's own H3 nodes, and a guide that does
not fit the video is refused naming the node and the constraint.

The shipped `guides` and `continue` API workflows run to an mp4 in the pack's Sampler with every other shipped
workflow (`test_nodes_comfyui.py`, and the 0.3.75 smoke set); here the same encode chain feeds core 0.33's
UNETLoader -> ModelSamplingMiniMaxH3 -> KSampler (core reads the guides from `minimax_keyframes`, as it reads its own
Add Guide's). Runs on the suite's shared ComfyUI (`comfy`): no server of its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.comfy_harness import comfy  # noqa: F401  (session fixture)
from support.core033 import TINY_DITS

from h3_core import media

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflows"))
import build_workflows  # noqa: E402

STEPS = 3


def _graph(key: str) -> dict:
    return next(graph for graph in build_workflows.build_graphs(tiny=True) if graph.key == key).api()


def _id(graph: dict, class_type: str) -> str:
    return next(key for key, node in graph.items() if node["class_type"] == class_type)


def _core_stage_1(graph: dict) -> dict:
    """The graph's encode chain into core's sampler: the pack's DiT Loader and Sampler replaced by UNETLoader (the
    tiny Comfy-format fl2va DiT) -> MiniMaxH3SigmaShift -> KSampler on MiniMax H3 Empty Latent from Conditioning."""
    conditioning = [_id(graph, "H3SplitAudioVAEEncode"), 0]
    for class_type in ("H3SplitDiTLoader", "H3SplitSampler"):
        del graph[_id(graph, class_type)]
    graph["c1"] = {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_DITS["fl2va"], "weight_dtype": "default"}}
    graph["c2"] = {"class_type": "MiniMaxH3SigmaShift",
                   "inputs": {"model": ["c1", 0], "shift_video": 12.0, "shift_audio": 3.0}}
    graph["c3"] = {"class_type": "H3SplitEmptyLatentFromConditioning", "inputs": {"conditioning": conditioning}}
    graph["c4"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": conditioning}}
    graph["c5"] = {"class_type": "KSampler", "inputs": {
        "model": ["c2", 0], "seed": 0, "steps": STEPS, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": conditioning, "negative": ["c4", 0], "latent_image": ["c3", 0], "denoise": 1.0}}
    graph[_id(graph, "H3SplitDecode")]["inputs"]["latent"] = ["c5", 0]
    return graph


@pytest.mark.parametrize("key", ["guides", "continue"])
def test_the_pack_guides_sample_in_cores_own_nodes(comfy, key):  # noqa: F811
    if "MiniMaxH3SigmaShift" not in comfy.object_info():
        pytest.skip(f"ComfyUI {comfy.install.version if comfy.install else '0.3.75'} has no H3 of its own")
    result = comfy.run_prompt(_core_stage_1(_graph(key)), timeout=600)
    ran = {node["class_type"] for node in _core_stage_1(_graph(key)).values()}
    assert {"H3SplitGuide" if key == "guides" else "H3SplitContinueVideo", "KSampler", "UNETLoader"} <= ran
    mp4s = [path for path in result.files if path.suffix == ".mp4"]
    assert len(mp4s) == 1, result.files
    info = media.probe(mp4s[0])
    assert info["frames"] == 124 and info["channels"] == 2, info


def test_a_guide_past_the_end_is_refused_at_queue_time(comfy):  # noqa: F811
    graph = _graph("guides")
    guide = next(key for key, node in graph.items()
                 if node["class_type"] == "H3SplitGuide" and "image" in node["inputs"])
    graph[guide]["inputs"]["frame_idx"] = 200  # the video has 124 frames
    for node in graph.values():
        if node["class_type"] == "H3SplitSampler":
            node["inputs"]["steps"] = STEPS
    status, body = comfy.request("POST", "/prompt", {"prompt": graph})
    assert status == 400, (status, body)  # at queue time: no model loaded, nothing run
    encode = _id(graph, "H3SplitTextEncode")
    errors = body["node_errors"][encode]["errors"]
    assert any("MiniMax H3 Guide: frame_idx 200 is outside the video's 124 frames" in e["details"] for e in errors), \
        errors
