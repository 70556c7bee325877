"""Core's conditioning nodes on the pack's CONDITIONING, in a real ComfyUI: honoured with the effect shown, or
refused by the H3 Sampler with a message naming the node; an edited CONDITIONING is what samples and what
H3 Save Conditioning saves; Remote Encode and Load Conditioning outputs take the same path; Save / Load
Conditioning list, upload and name their files.
"""

from __future__ import annotations

import copy
import json
import os
import urllib.request
import uuid

import numpy as np
import pytest
import torch
from support.comfy_harness import comfy, comfy_factory  # noqa: F401  (session fixtures)
from support.comfy_pack import encoder_url, server  # noqa: F401  (module fixtures: pack server, encoder endpoint)

from h3_core import media
from h3_core.contract import H3Conditioning

TINY = "[embedded] tiny H3 (random weights, outputs are noise)"
PROMPT_A = "A red fox trots through fresh snow at dawn; wind in the pines, crunching steps."
PROMPT_B = "Waves break on black sand at night, foam glowing under the moon."


def base(ref2va: bool = False) -> dict:
    graph = {
        "1": {"class_type": "H3SplitTextEncoderLoader", "inputs": {"text_encoder": TINY}},
        "2": {"class_type": "H3SplitVideoVAELoader", "inputs": {"vae": TINY}},
        "3": {"class_type": "H3SplitAudioVAELoader", "inputs": {"audio_vae": TINY}},
        "4": {"class_type": "H3SplitDiTLoader", "inputs": {
            "dit": TINY, "partition": "ref2va (references)" if ref2va else "fl2va (t2va, first/last frame)",
            "weight_dtype": "default"}},
    }
    for node, prompt in (("10", PROMPT_A), ("11", PROMPT_B)):
        graph[node] = {"class_type": "H3SplitTextEncode", "inputs": {
            "text_encoder": ["1", 0], "prompt": prompt, "width": 0, "height": 0, "length": 124, "task": "t2va"}}
    return graph


def save(graph: dict, node: str, source: str, prefix: str) -> None:
    graph[node] = {"class_type": "H3SplitSaveConditioning",
                   "inputs": {"conditioning": [source, 0], "filename_prefix": f"h3/test_core/{prefix}"}}


def sample(graph: dict, node: str, source: str, prefix: str, seed: int = 5) -> None:
    """Sampler -> Decode -> SaveImage (frames as PNG)."""
    graph[node] = {"class_type": "H3SplitSampler", "inputs": {
        "dit": ["4", 0], "conditioning": [source, 0], "seed": seed, "steps": 3, "video_shift": 12.0,
        "audio_shift": 3.0}}
    graph[f"{node}d"] = {"class_type": "H3SplitDecode",
                         "inputs": {"latent": [node, 0], "vae": ["2", 0], "audio_vae": ["3", 0]}}
    graph[f"{node}s"] = {"class_type": "SaveImage",
                         "inputs": {"images": [f"{node}d", 1], "filename_prefix": f"h3test_core/{prefix}"}}


def saved(server, prefix: str) -> H3Conditioning:
    return H3Conditioning.load(sorted((server.output_dir / "h3" / "test_core").glob(f"{prefix}_*.safetensors"))[-1],
                               mmap=False)


def frames(result, prefix: str) -> np.ndarray:
    paths = sorted(p for p in result.files if p.name.startswith(prefix) and p.suffix == ".png")
    assert len(paths) == 124, prefix
    return np.stack([media.read_image(p) for p in paths])


def refused(server, graph: dict) -> dict:
    result = server.run_prompt(graph, timeout=600, check=False)
    assert result.status == "error", result.status
    return result.error


@pytest.fixture(scope="module")
def encoded(server):
    """The two t2va prompts as the local encode nodes save them, unedited."""
    graph = base()
    save(graph, "30", "10", "plain")
    save(graph, "31", "11", "other")
    server.run_prompt(graph, timeout=600)
    return saved(server, "plain"), saved(server, "other")


def test_honoured_core_nodes_are_what_save_conditioning_saves(server, encoded):
    plain, other = encoded
    graph = base()
    graph["20"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["10", 0]}}
    graph["21"] = {"class_type": "ConditioningAverage", "inputs": {
        "conditioning_to": ["10", 0], "conditioning_from": ["11", 0], "conditioning_to_strength": 0.25}}
    graph["22"] = {"class_type": "ConditioningSetTimestepRange",
                   "inputs": {"conditioning": ["10", 0], "start": 0.0, "end": 1.0}}
    for node, source, prefix in (("32", "20", "zero"), ("33", "21", "avg"), ("34", "22", "range")):
        save(graph, node, source, prefix)
    result = server.run_prompt(graph, timeout=600)

    zero = saved(server, "zero")
    assert torch.count_nonzero(zero.prompt_embeds) == 0 and zero.prompt_embeds.shape == plain.prompt_embeds.shape
    assert zero == H3Conditioning(**{**plain.__dict__, "prompt_embeds": torch.zeros_like(plain.prompt_embeds)})
    # core's arithmetic: `to` * s + `from` (cut or zero-padded to `to`'s length) * (1 - s)
    t0 = other.prompt_embeds[:, : plain.prompt_embeds.shape[1]]
    t0 = torch.cat([t0, torch.zeros(1, plain.prompt_embeds.shape[1] - t0.shape[1], t0.shape[2])], dim=1)
    avg = saved(server, "avg")
    assert torch.equal(avg.prompt_embeds, torch.mul(plain.prompt_embeds, 0.25) + torch.mul(t0, 0.75))
    assert torch.equal(avg.text_token_tags, plain.text_token_tags) and avg.task == plain.task
    assert saved(server, "range") == plain
    # the node shows where the file went, by the name H3 Load Conditioning lists it under
    text = result.outputs["32"]["text"][0]
    assert text.startswith("saved h3/test_core/zero_") and "'h3/test_core/zero_" in text and "[output]'" in text


@pytest.mark.parametrize("node", ["ConditioningCombine", "ConditioningConcat", "ConditioningSetTimestepRange"])
def test_meaningless_core_nodes_are_refused_by_the_sampler(server, node):
    graph = base()
    if node == "ConditioningCombine":
        graph["20"] = {"class_type": node, "inputs": {"conditioning_1": ["10", 0], "conditioning_2": ["11", 0]}}
        said = "holds 2 prompts (ConditioningCombine"
    elif node == "ConditioningConcat":
        graph["20"] = {"class_type": node, "inputs": {"conditioning_to": ["10", 0], "conditioning_from": ["11", 0]}}
        said = "ConditioningConcat appended"
    else:
        graph["20"] = {"class_type": node, "inputs": {"conditioning": ["10", 0], "start": 0.5, "end": 1.0}}
        said = "ConditioningSetTimestepRange limited this H3 conditioning to 0.5-1 of the schedule"
    sample(graph, "40", "20", "refused")
    error = refused(server, graph)
    assert error["node_id"] == "40" and error["node_type"] == "H3SplitSampler", error
    assert said in error["exception_message"] and ("H3 Text Encode" in error["exception_message"]
                                                   or "remove" in error["exception_message"])


def test_averaging_conditionings_of_other_references_is_refused(server):
    graph = base(ref2va=True)
    for node, image in (("5", "h3_example_reference_image.png"), ("6", "h3_example_first_frame.png")):
        graph[node] = {"class_type": "LoadImage", "inputs": {"image": image}}
        graph[f"{node}r"] = {"class_type": "H3SplitReferences", "inputs": {"ref_image_1": [node, 0]}}
    for text, media_node in (("10", "5r"), ("11", "6r")):
        graph[text]["inputs"].update(task="ref2va", media=[media_node, 0], prompt="<Picture 1> spins slowly.")
        graph[f"{text}v"] = {"class_type": "H3SplitVideoVAEEncode", "inputs": {"conditioning": [text, 0],
                                                                              "vae": ["2", 0]}}
    graph["20"] = {"class_type": "ConditioningAverage", "inputs": {
        "conditioning_to": ["10v", 0], "conditioning_from": ["11v", 0], "conditioning_to_strength": 0.5}}
    sample(graph, "40", "20", "refused_refs")
    error = refused(server, graph)
    assert error["node_id"] == "40", error
    assert "ConditioningAverage mixed this H3 conditioning with one encoded from other media" in (
        error["exception_message"])


def test_a_core_node_between_encode_nodes_is_refused_there(server):
    """Encode parts travel only between the pack's encode nodes: an edit before they are complete is refused."""
    graph = base(ref2va=True)
    graph["5"] = {"class_type": "LoadImage", "inputs": {"image": "h3_example_reference_image.png"}}
    graph["5r"] = {"class_type": "H3SplitReferences", "inputs": {"ref_image_1": ["5", 0]}}
    graph["10"]["inputs"].update(task="ref2va", media=["5r", 0], prompt="<Picture 1> spins slowly.")
    graph["20"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["10", 0]}}
    graph["21"] = {"class_type": "H3SplitVideoVAEEncode", "inputs": {"conditioning": ["20", 0], "vae": ["2", 0]}}
    save(graph, "30", "21", "between")
    del graph["11"]
    error = refused(server, graph)
    assert error["node_id"] == "21", error
    assert "another node changed this conditioning before its encode parts were complete" in (
        error["exception_message"])


def test_an_edited_conditioning_is_what_samples(server, encoded):
    """ZeroOut -> Sampler equals sampling a contract whose only change is zero prompt embeddings, loaded from a
    file; the unedited conditioning samples something else."""
    plain, _ = encoded
    direct = H3Conditioning(**{**plain.__dict__, "prompt_embeds": torch.zeros_like(plain.prompt_embeds)})
    direct.save(server.input_dir / "h3test_zeroed_directly.safetensors")
    graph = base()
    graph["20"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["10", 0]}}
    sample(graph, "40", "20", "edited")
    graph["21"] = {"class_type": "H3SplitLoadConditioning",
                   "inputs": {"conditioning_file": "h3test_zeroed_directly.safetensors"}}
    sample(graph, "41", "21", "direct")
    sample(graph, "42", "10", "unedited")
    result = server.run_prompt(graph, timeout=900)
    edited, direct_frames, unedited = (frames(result, p) for p in ("edited", "direct", "unedited"))
    assert np.array_equal(edited, direct_frames)
    assert not np.array_equal(edited, unedited)


def test_remote_and_loaded_conditionings_take_the_same_path(server, encoder_url, encoded):
    """Remote Encode's and Load Conditioning's CONDITIONING go through core nodes and the Sampler's reading alike;
    the pack's own saved files are listed from output/h3/ without a copy."""
    plain, _ = encoded
    listed = server.object_info("H3SplitLoadConditioning")["input"]["required"]["conditioning_file"]
    options = listed[1]["options"] if isinstance(listed[1], dict) and "options" in listed[1] else listed[0]
    name = next(o for o in options if o.startswith("h3/test_core/plain_") and o.endswith(" [output]"))
    assert listed[1].get("file_upload") is True  # V3's upload widget (frontends that know it draw it)
    graph = base()
    graph["12"] = {"class_type": "H3SplitRemoteEncode", "inputs": {
        "prompt": PROMPT_A, "width": 0, "height": 0, "length": 124, "endpoint": encoder_url, "task": "t2va"}}
    graph["13"] = {"class_type": "H3SplitLoadConditioning", "inputs": {"conditioning_file": name}}
    for node, source, prefix in (("20", "12", "remote_zero"), ("21", "13", "loaded_zero")):
        graph[node] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": [source, 0]}}
        save(graph, f"3{node[1]}", node, prefix)
    del graph["10"], graph["11"]
    server.run_prompt(graph, timeout=600)
    zeroed = H3Conditioning(**{**plain.__dict__, "prompt_embeds": torch.zeros_like(plain.prompt_embeds)})
    assert saved(server, "loaded_zero") == zeroed
    remote = saved(server, "remote_zero")
    assert torch.count_nonzero(remote.prompt_embeds) == 0
    assert torch.equal(remote.text_token_tags, plain.text_token_tags)


def test_an_uploaded_file_is_listed_and_loads(server, encoded, tmp_path):
    plain, _ = encoded
    path = tmp_path / "uploaded_cond.safetensors"
    plain.save(path)
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"h3test_uploaded.safetensors\""
            f"\r\nContent-Type: application/octet-stream\r\n\r\n").encode() + path.read_bytes() + (
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"type\"\r\n\r\ninput\r\n--{boundary}--\r\n"
    ).encode()
    request = urllib.request.Request(f"{server.url}/upload/image", data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
    assert answer["name"] == "h3test_uploaded.safetensors" and answer["type"] == "input"
    spec = server.object_info("H3SplitLoadConditioning")["input"]["required"]["conditioning_file"]
    options = spec[1]["options"] if isinstance(spec[1], dict) and "options" in spec[1] else spec[0]
    assert "h3test_uploaded.safetensors" in options
    graph = {"13": {"class_type": "H3SplitLoadConditioning",
                    "inputs": {"conditioning_file": "h3test_uploaded.safetensors"}}}
    save(graph, "30", "13", "uploaded")
    server.run_prompt(graph, timeout=300)
    assert saved(server, "uploaded") == plain


def test_empty_state_names_where_files_come_from(comfy_factory):
    """A fresh ComfyUI with no conditioning anywhere: the choice says where files come from, never undefined."""
    fresh = comfy_factory(env={"H3_TEST_FRESH": "1"})
    spec = fresh.object_info("H3SplitLoadConditioning")["input"]["required"]["conditioning_file"]
    options = spec[1]["options"] if isinstance(spec[1], dict) and "options" in spec[1] else spec[0]
    assert len(options) == 1 and "output/h3/" in options[0] and "upload" in options[0]
    status, body = fresh.post_prompt_expect_error(
        {"1": {"class_type": "H3SplitLoadConditioning", "inputs": {"conditioning_file": options[0]}},
         "2": {"class_type": "H3SplitSaveConditioning", "inputs": {"conditioning": ["1", 0],
                                                                    "filename_prefix": "h3/x"}}})
    assert status == 400 and "no file chosen" in json.dumps(body)


def test_save_and_load_nodes_in_the_real_frontend(server, encoded):
    """The canvas helpers load without a problem: Load Conditioning gets its upload button."""
    workflow = copy.deepcopy(UI_WORKFLOW)
    report = server.load_workflow_ui(workflow)
    assert report["problems"] == [] and report["returncode"] == 0, report["problems"]
    widgets = {int(k): v for k, v in report["widgets"].items()}
    assert [w["name"] for w in widgets[2]][-1] == "upload" and widgets[2][-1]["type"] == "button"
    assert "upload" not in report["prompt"]["2"]["inputs"]  # display-only: not part of the prompt


UI_WORKFLOW = {
    "last_node_id": 2, "last_link_id": 1, "version": 0.4, "links": [[1, 2, 0, 1, 0, "CONDITIONING"]],
    "groups": [], "config": {}, "extra": {},
    "nodes": [
        {"id": 1, "type": "H3SplitSaveConditioning", "pos": [400, 100], "size": [300, 80], "flags": {}, "order": 1,
         "mode": 0, "inputs": [{"name": "conditioning", "type": "CONDITIONING", "link": 1}], "outputs": [],
         "properties": {}, "widgets_values": ["h3/conditioning"]},
        {"id": 2, "type": "H3SplitLoadConditioning", "pos": [50, 100], "size": [300, 80], "flags": {}, "order": 0,
         "mode": 0, "inputs": [], "outputs": [{"name": "CONDITIONING", "type": "CONDITIONING", "links": [1]}],
         "properties": {}, "widgets_values": ["h3test_zeroed_directly.safetensors"]},
    ],
}


def test_graph_memory_bench_runs(tiny_dir):
    """bench/graph_memory.py in its small size and on this tree alone, so it cannot rot: a real ComfyUI runs the
    graph and its memory is read after the run and after /free (the base ref's arm is the same `measure` on a `git
    archive` of main, a second ComfyUI start and run: the figures come from the full run)."""
    from bench import graph_memory

    result = graph_memory.run(tiny_dir, base_ref=None, small=True)
    assert set(result["results"]) == {"this tree"} and result["held_ratio"] is None
    figures = result["results"]["this tree"]
    assert figures["rss_after_run"] > 0 and figures["rss_after_free"] > 0
    assert result["normalised_media_bytes"] == 124 * 256 * 128 * 3 + 2 * 96000 * 4


def test_a_saved_file_is_listed_by_load_nodes_at_once_and_its_message_shows_whole(server, tmp_path):
    """In the frontend: Save Conditioning's whole message shows in a box on the node (a one-line widget cut it), and
    Load Conditioning nodes list the new file as soon as Save wrote it, the one already on the canvas and one added
    after, without Refresh Node Definitions (tests/ui/save_load.mjs)."""
    import subprocess

    from support.comfy_harness import UI_DIR, chromium_path, ui_available

    ok, why = ui_available()
    if not ok:
        pytest.skip(why)
    prefix = f"ui_{uuid.uuid4().hex[:8]}"
    graph = {"1": base()["1"], "10": base()["10"]}
    save(graph, "30", "10", prefix)
    (tmp_path / "graph.json").write_text(json.dumps(graph))
    done = subprocess.run(["node", str(UI_DIR / "save_load.mjs"), str(tmp_path / "graph.json")], cwd=UI_DIR,
                          env={**os.environ, "COMFY_URL": server.url, "CHROMIUM_PATH": chromium_path()},
                          capture_output=True, text=True, timeout=600)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["exit_code"] == 0 and report["status"] == "success", (report, done.stderr[-2000:])
    listed = f"h3/test_core/{prefix}_00001_.safetensors [output]"
    assert listed not in report["before"]
    assert listed in report["existing"] and listed in report["added"], report
    assert report["saved_widget"] == "TEXTAREA", report
    text = report["saved_text"]
    assert text.startswith(f"saved h3/test_core/{prefix}_00001_.safetensors") and text.endswith(f"{listed!r}"), text
