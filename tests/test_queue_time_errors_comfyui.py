"""Mistakes the graph shows are refused by POST /prompt (queue time, no model loaded), once each, on the input
that causes them, in a real ComfyUI 0.3.75 on loopback with the pack's shipped API workflows."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from comfy_harness import comfy  # noqa: F401  (session fixture)

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows" / "api"


@pytest.fixture(scope="module")
def server(comfy, tiny_dir):
    comfy.add_model("minimax_h3", tiny_dir, "tiny")  # the loaders' embedded-tiny choice, prebuilt
    return comfy


def api(name: str) -> dict:
    return json.loads((WORKFLOWS / f"{name}.json").read_text())


def key_of(graph: dict, class_type: str) -> str:
    return next(key for key, node in graph.items() if node["class_type"] == class_type)


def refused(server, graph: dict, class_type: str) -> list[tuple[str, str]]:
    """POST /prompt, expecting a 400; the (input_name, details) of the errors on the node of `class_type`."""
    status, body = server.post_prompt_expect_error(graph)
    assert status == 400, body
    node = body["node_errors"][key_of(graph, class_type)]
    return [(error["extra_info"].get("input_name"), error["details"]) for error in node["errors"]]


def edited(name: str, class_type: str, **inputs) -> dict:
    graph = copy.deepcopy(api(name))
    graph[key_of(graph, class_type)]["inputs"].update(inputs)
    return graph


def test_a_bad_length_is_one_error_on_length(server):
    errors = refused(server, edited("t2va", "H3SplitTextEncode", length=107), "H3SplitTextEncode")
    assert len(errors) == 1, errors
    name, details = errors[0]
    assert name == "length" and "124-345 frames" in details and "got 107 frames" in details


def test_each_problem_once_on_its_own_input(server):
    graph = edited("t2va", "H3SplitTextEncode", prompt="  ", width=640, height=0, length=130)
    errors = dict(refused(server, graph, "H3SplitTextEncode"))
    assert sorted(errors) == ["height", "length", "prompt"], errors
    assert "prompt is empty" in errors["prompt"]
    assert "set height too" in errors["height"]
    assert "17k+5" in errors["length"] and "nearest valid: 124 or 141" in errors["length"]


def test_off_grid_canvas_names_the_edge(server):
    errors = refused(server, edited("t2va", "H3SplitTextEncode", width=128, height=100), "H3SplitTextEncode")
    assert errors == [("height", "height - must be a multiple of 32 px (VAE /16 x DiT patch 2), got 100; "
                                 "nearest valid: 96 or 128")]


def test_remote_encode_endpoint_problem_lands_on_endpoint(server):
    graph = edited("ref2va_remote", "H3SplitRemoteEncode", endpoint="ftp://example.invalid", length=124)
    errors = refused(server, graph, "H3SplitRemoteEncode")
    assert [name for name, _ in errors] == ["endpoint"], errors


def test_length_widget_stays_on_the_grid(server):
    spec = server.object_info("H3SplitTextEncode")["input"]["required"]["length"][1]
    assert (spec["min"], spec["max"], spec["step"]) == (124, 345, 17)
    assert all((spec["min"] + k * spec["step"]) % 17 == 5 for k in range(14))


def test_a_short_reference_audio_is_the_references_nodes_error(server):
    """Known only once the media is decoded (run time), but blamed on the node that brought it, with a type that
    reads as the pack's (no file-system path in ComfyUI's report)."""
    import numpy as np

    from h3_core import media

    short = server.input_dir / "h3test_1s.wav"
    tone = np.stack([np.sin(np.arange(32000) / 32000 * 2 * np.pi * 220)] * 2).astype(np.float32) * 0.2
    short.write_bytes(media.encode_wav_bytes(tone, 32000, sample_format="s16"))
    graph = api("ref2va")
    graph[key_of(graph, "LoadAudio")]["inputs"]["audio"] = short.name
    result = server.run_prompt(graph, timeout=600, check=False)
    assert result.status == "error"
    assert result.error["node_type"] == "H3SplitReferences", result.error
    assert "reference audio 1 must be 2-15 s long, got 1.00 s" in result.error["exception_message"]
    assert "ref_audio_1" in result.error["exception_message"]
    assert result.error["exception_type"] == "minimax_h3.h3_core.rules.H3InputError"
