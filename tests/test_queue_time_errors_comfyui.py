"""Mistakes the graph shows are refused by POST /prompt (queue time, no model loaded), once each, on the input
that causes them, in a real ComfyUI (core 0.33 by default; the frontend's error displays in 0.3.75's 1.32.9) on
loopback with the pack's shipped API workflows."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from support.comfy_harness import COMFY_0375, comfy, shared_comfy, thread_env  # noqa: F401  (comfy: session fixture)

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows" / "api"


@pytest.fixture(scope="module")
def server(comfy, tiny_dir):
    comfy.add_model("minimax_h3", tiny_dir, "tiny")  # the loaders' embedded-tiny choice, prebuilt
    return comfy


@pytest.fixture(scope="module")
def server_0375(tiny_dir, tmp_path_factory):
    """ComfyUI 0.3.75 (frontend 1.32.9) in the `comfy` fixture's configuration (the server of
    tests/test_comfy0375_smoke.py, where both run in one process), for what tests/ui/queue_errors.mjs reads of the
    frontend's error displays: 1.32.9's dialogs. Core 0.33's frontend (1.49.6) shows them elsewhere, which the script
    does not read yet."""
    env = {"H3_TINY_DIR": str(tiny_dir), **thread_env()}
    old = shared_comfy(tmp_path_factory.getbasetemp(), Path(tiny_dir) / "comfyui", env, install=COMFY_0375)
    old.add_model("minimax_h3", tiny_dir, "tiny")
    return old


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
    errors = refused(server, edited("t2va", "H3SplitTextEncode", length=3609), "H3SplitTextEncode")
    assert len(errors) == 1, errors
    name, details = errors[0]
    assert name == "length" and "5-3592 frames" in details and "got 3609 frames" in details


def test_each_problem_once_on_its_own_input(server):
    graph = edited("t2va", "H3SplitTextEncode", prompt="  ", width=640, height=0, length=130)
    errors = dict(refused(server, graph, "H3SplitTextEncode"))
    assert sorted(errors) == ["height", "length", "prompt"], errors
    assert "prompt is empty" in errors["prompt"]
    assert "set height too" in errors["height"]
    assert "17k+5" in errors["length"] and "nearest valid: 124 or 141" in errors["length"]


def test_off_grid_canvas_names_the_edge(server):
    errors = refused(server, edited("t2va", "H3SplitTextEncode", width=128, height=100), "H3SplitTextEncode")
    assert errors == [("height", "height - height must be a multiple of 32 px (VAE /16 x DiT patch 2), got 100; "
                                 "nearest valid: 96 or 128")]


def test_remote_encode_endpoint_problem_lands_on_endpoint(server):
    graph = edited("ref2va_remote", "H3SplitRemoteEncode", endpoint="ftp://example.invalid", length=124)
    errors = refused(server, graph, "H3SplitRemoteEncode")
    assert [name for name, _ in errors] == ["endpoint"], errors


def test_length_widget_stays_on_the_grid(server):
    spec = server.object_info("H3SplitTextEncode")["input"]["required"]["length"][1]
    assert (spec["min"], spec["max"], spec["step"]) == (5, 3592, 17)  # core's lengths; 124-345 trained (a warning)
    steps = (spec["max"] - spec["min"]) // spec["step"]
    assert all((spec["min"] + k * spec["step"]) % 17 == 5 for k in range(steps + 1))
    assert spec["min"] + steps * spec["step"] == spec["max"]


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


# --- loaders: lists by component, refusals from the header, the DiT partition the file says ------------------


def options(server, class_type: str, name: str) -> list[str]:
    spec = server.object_info(class_type)["input"]["required"][name]
    return spec[1]["options"] if spec[0] == "COMBO" else spec[0]


def user_files(listed: list[str]) -> list[str]:
    return [name for name in listed if not name.startswith(("[embedded]", "minimax_h3/", "⚠ "))]


def test_vae_loaders_list_only_their_component_user_files_first(server):
    video = options(server, "H3SplitVideoVAELoader", "vae")
    audio = options(server, "H3SplitAudioVAELoader", "audio_vae")
    assert user_files(video) and user_files(audio)
    assert all("video_vae" in name for name in user_files(video)), video
    assert all("audio_vae" in name for name in user_files(audio)), audio
    for listed in (video, audio):  # the user's files before the embedded tiny entries
        firsts = [i for i, name in enumerate(listed) if name.startswith("[embedded]")]
        assert firsts and min(firsts) > max(listed.index(name) for name in user_files(listed))
    assert not any("audio_vae" in name for name in video) and not any("video_vae" in name for name in audio)


def test_a_file_of_another_component_is_refused_at_queue_time(server):
    audio_file = user_files(options(server, "H3SplitAudioVAELoader", "audio_vae"))[0]
    errors = refused(server, edited("t2va", "H3SplitVideoVAELoader", vae=audio_file), "H3SplitVideoVAELoader")
    loader = server.object_info("H3SplitAudioVAELoader")["display_name"]  # named as the user sees it
    assert errors == [("vae", f"vae - {audio_file} holds the H3 audio VAE, not the video VAE: load it with {loader}")]


def test_a_missing_model_file_is_refused_at_queue_time(server):
    errors = refused(server, edited("t2va", "H3SplitDiTLoader", dit="minimax_h3_fl2va_bf16.safetensors"),
                     "H3SplitDiTLoader")
    assert len(errors) == 1 and errors[0][0] == "dit", errors
    assert "minimax_h3_fl2va_bf16.safetensors is not in models/diffusion_models/: download it there" in errors[0][1]


def test_the_dit_file_says_its_partition(server):
    """A saved workflow whose partition widget contradicts its DiT file runs on the partition the file says."""
    dits = user_files(options(server, "H3SplitDiTLoader", "dit"))
    fl2va = next(name for name in dits if "fl2va" in name and "pruned" not in name and "fp32" in name)
    graph = edited("t2va", "H3SplitDiTLoader", dit=fl2va, partition="ref2va (references)")
    assert server.run_prompt(graph, timeout=600).status == "success"


TINY_CHOICE = "[embedded] tiny H3 (noise)"
LOADER_INPUTS = {"H3SplitTextEncoderLoader": "text_encoder", "H3SplitVideoVAELoader": "vae",
                 "H3SplitAudioVAELoader": "audio_vae", "H3SplitDiTLoader": "dit"}


@pytest.fixture
def bad_files(server, tiny_dir, tmp_path):
    """A half-downloaded video VAE in models/vae and an audio VAE in models/diffusion_models, removed afterwards (the
    session's server is shared with other modules)."""
    vae = Path(tiny_dir) / "comfyui" / "vae" / "minimax_h3_tiny_video_vae_fp32.safetensors"
    cut = tmp_path / "h3test_half.safetensors"
    cut.write_bytes(vae.read_bytes()[:vae.stat().st_size // 2])
    added = [server.add_model("vae", cut),
             server.add_model("diffusion_models", Path(tiny_dir) / "comfyui" / "vae" /
                              "minimax_h3_tiny_audio_vae_fp32.safetensors", "h3test_audio_vae_here.safetensors")]
    yield
    for path in added:
        path.unlink()


def test_each_loader_lists_one_tiny_entry(server):
    """The tiny H3's twins (quantised, pruned, GGUF copies) are listed only with H3_SHOW_TINY_TWINS=1; the shipped
    quantised API graphs that name them still queue and run (test_each_queue_time_rule_rings_on_its_input's DiT file
    rule, and tests/test_nodes_comfyui.py's pruned graphs)."""
    for class_type, name in LOADER_INPUTS.items():
        listed = options(server, class_type, name)
        assert [entry for entry in listed if entry.startswith("[embedded]")] == [TINY_CHOICE], (class_type, listed)


def test_a_hidden_twin_still_queues(server):
    """Accepted at queue time though not listed: another input's refusal is the prompt's only error."""
    twin = "[embedded] tiny H3 / minimax_h3_tiny_fl2va_pruned_int8_convrot.safetensors"
    assert twin not in options(server, "H3SplitDiTLoader", "dit")
    graph = edited("t2va", "H3SplitDiTLoader", dit=twin)
    graph[key_of(graph, "H3SplitVideoVAELoader")]["inputs"]["device"] = "cuda:77"
    status, body = server.post_prompt_expect_error(graph)
    assert status == 400 and set(body["node_errors"]) == {key_of(graph, "H3SplitVideoVAELoader")}, body


def test_unloadable_files_are_named_with_their_reason_in_the_list_and_at_queue_time(server, bad_files):
    """Issue 38 item 7: a user's corrupt or misplaced file no longer vanishes. The loader of its folder lists it last,
    marked with the reason; picking it is refused when queued with the whole reason; the console says it once."""
    cut = "⚠ h3test_half.safetensors — not readable: incomplete file (interrupted download?)"
    misplaced = "⚠ h3test_audio_vae_here.safetensors — holds the H3 audio VAE: move it to models/vae/"
    for _ in range(2):  # the second list from the header cache: nothing logged again
        video, audio = options(server, "H3SplitVideoVAELoader", "vae"), options(server, "H3SplitAudioVAELoader",
                                                                                    "audio_vae")
        dits = options(server, "H3SplitDiTLoader", "dit")
        assert video[-1] == cut and audio[-1] == cut, (video, audio)
        # Core 0.33's environment pins comfy-kitchen 0.2.31: the tiny's w6a8 twins (>= 0.2.40) are marked there too.
        dits = [name for name in dits if not re.search(r"w6a8.* needs comfy-kitchen >= [0-9.]+, and [0-9.]+ is", name)]
        assert dits[-1] == misplaced and cut not in dits, dits
    tooltip = server.object_info("H3SplitVideoVAELoader")["input"]["required"]["vae"][1]["tooltip"]
    assert "Entries marked ⚠ are files in models/vae that cannot be loaded" in tooltip
    errors = refused(server, edited("t2va", "H3SplitVideoVAELoader", vae=cut), "H3SplitVideoVAELoader")
    assert len(errors) == 1 and errors[0][0] == "vae", errors
    assert errors[0][1].startswith("vae - h3test_half.safetensors is not an H3 model file this loader reads: ")
    assert "incomplete file - the header describes" in errors[0][1], errors
    errors = refused(server, edited("t2va", "H3SplitDiTLoader", dit=misplaced), "H3SplitDiTLoader")
    loader = server.object_info("H3SplitAudioVAELoader")["display_name"]
    assert errors == [("dit", f"dit - h3test_audio_vae_here.safetensors holds the H3 audio VAE, not the DiT: move it "
                              f"to models/vae/ and load it with {loader}")]
    log = server.log_text()
    assert log.count("h3test_half.safetensors is left out of the loader lists") == 1, log[-3000:]
    assert log.count("h3test_audio_vae_here.safetensors is left out of the loader lists") == 1, log[-3000:]


# --- progress that says what happens ---------------------------------------------------------------------------


def progress_texts(result, node: str) -> list[str]:
    """The progress-text lines ComfyUI sent for `node` (binary ws frames of type 3: node id length, id, text)."""
    import struct

    texts = []
    for frame in result.binary:
        if len(frame) < 8 or struct.unpack(">I", frame[:4])[0] != 3:
            continue
        length = struct.unpack(">I", frame[4:8])[0]
        if frame[8:8 + length].decode() == node:
            texts.append(frame[8 + length:].decode())
    return texts


def test_progress_text_says_what_each_node_does(server):
    graph = api("t2va")
    sampler, decode = key_of(graph, "H3SplitSampler"), key_of(graph, "H3SplitDecode")
    graph[sampler]["inputs"].update(steps=4, seed=11)  # 4 noise levels: 3 DiT forwards
    # a prompt no other test sends: ComfyUI's cache would skip a Text Encode another test already ran
    graph[key_of(graph, "H3SplitTextEncode")]["inputs"]["prompt"] = "A heron lifts off a misty lake; wingbeats, frogs."
    result = server.run_prompt(graph, timeout=600)
    forwards = [text for text in progress_texts(result, sampler) if text.startswith("DiT forward")]
    assert forwards[-3:] == ["DiT forward 1/3", "DiT forward 2/3", "DiT forward 3/3"], forwards
    ticks = [m for m in result.of_type("progress") if m.get("node") == sampler]
    assert ticks and max(m["max"] for m in ticks) == 3 and ticks[-1]["value"] == 3
    decoding = progress_texts(result, decode)
    assert any(text.startswith("decoding video: tile") for text in decoding), decoding
    assert any(text.startswith("decoding audio") for text in decoding), decoding
    text_encode = progress_texts(result, key_of(graph, "H3SplitTextEncode"))
    assert any(text.startswith("text encoder: layer") for text in text_encode), text_encode
    # each ends in a one-line summary, not its last step (UX review 4: "decoding audio (one pass) - 45 s" stayed)
    assert re.fullmatch(r"done: 3 DiT forwards in [0-9.]+ s", progress_texts(result, sampler)[-1])
    assert re.fullmatch(r"decoded in [0-9.]+ s", decoding[-1]) and re.fullmatch(r"encoded in [0-9.]+ s",
                                                                                 text_encode[-1])


# --- what the real frontend shows -------------------------------------------------------------------------------


def test_the_frontend_shows_a_bad_length_once_on_length(server_0375, tmp_path):
    """Run from the real frontend (1.32.9) with length 130 (off the 17k+5 grid): one error, on `length`, and the
    dialog says it once."""
    import os
    import subprocess

    server = server_0375

    from support.comfy_harness import chromium_path, ui_available

    ok, reason = ui_available()
    if not ok:
        pytest.skip(reason)
    fixtures = Path(__file__).resolve().parent / "fixtures" / "workflows" / "ui"
    workflow = json.loads((fixtures / "t2va.json").read_text())
    text_encode = next(node for node in workflow["nodes"] if node["type"] == "H3SplitTextEncode")
    widgets = [spec for spec in server.object_info("H3SplitTextEncode")["input_order"]["required"]
               if spec not in ("text_encoder",)]
    text_encode["widgets_values"][widgets.index("length")] = 130
    path = tmp_path / "t2va_length_130.json"
    path.write_text(json.dumps(workflow))
    ui = Path(__file__).resolve().parent / "ui"
    env = {**os.environ, "COMFY_URL": server.url, "CHROMIUM_PATH": chromium_path() or ""}
    done = subprocess.run(["node", str(ui / "queue_errors.mjs"), str(path)], cwd=ui, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-3000:]
    report = json.loads(lines[-1])
    node = report["node_errors"][str(text_encode["id"])]
    assert node["inputs"] == ["length"], node
    shown = "\n".join(report["dialogs"])
    assert shown.count("got 130; nearest valid: 124 or 141") == 1, shown


def run_in_frontend(server, workflow: dict, path: Path, *flags: str) -> dict:
    """tests/ui/queue_errors.mjs on `workflow` (saved at `path`): what the real frontend shows once it is queued."""
    import os
    import subprocess

    from support.comfy_harness import chromium_path, ui_available

    ok, reason = ui_available()
    if not ok:
        pytest.skip(reason)
    path.write_text(json.dumps(workflow))
    ui = Path(__file__).resolve().parent / "ui"
    env = {**os.environ, "COMFY_URL": server.url, "CHROMIUM_PATH": chromium_path() or ""}
    done = subprocess.run(["node", str(ui / "queue_errors.mjs"), str(path), *flags], cwd=ui, env=env,
                          capture_output=True, text=True, timeout=660)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1])


def test_a_run_time_error_dialog_is_titled_with_the_display_name(server_0375, tmp_path):
    """A pack node that fails at run time (References, on a 1 s reference audio) titles the frontend's error dialog
    with its display name (web/error_titles.js); the report keeps the pack's exception type, and what the server
    sends API clients (/history) keeps the class id."""
    import numpy as np

    server = server_0375

    from h3_core import media

    short = server.input_dir / "h3test_ui_1s.wav"
    tone = np.stack([np.sin(np.arange(32000) / 32000 * 2 * np.pi * 330)] * 2).astype(np.float32) * 0.2
    short.write_bytes(media.encode_wav_bytes(tone, 32000, sample_format="s16"))
    fixtures = Path(__file__).resolve().parent / "fixtures" / "workflows" / "ui"
    workflow = json.loads((fixtures / "ref2va.json").read_text())
    next(node for node in workflow["nodes"] if node["type"] == "LoadAudio")["widgets_values"][0] = short.name
    report = run_in_frontend(server, workflow, tmp_path / "ref2va_short_audio.json", "--run-error", "600",
                             "--show-report")
    display_name = server.object_info("H3SplitReferences")["display_name"]
    assert report["execution_error"], report
    assert report["execution_error"]["node_type"] == display_name  # as the page's listeners see it
    assert report["history_error"]["node_type"] == display_name  # and its history (the queue panel's report)
    assert report["dialog_titles"] == [display_name], report["dialogs"]
    shown = next(dialog for dialog in report["dialogs"] if "Show Report" in dialog)
    assert "H3SplitReferences" not in shown
    assert "reference audio 1 must be 2-15 s long, got 1.00 s" in shown
    assert f"**Node Type:** {display_name}" in report["report"], report["report"]
    assert "**Exception Type:** minimax_h3.h3_core.rules.H3InputError" in report["report"], report["report"]
    error = dict(server.history(report["prompt_id"])["status"]["messages"])["execution_error"]
    assert error["node_type"] == "H3SplitReferences"  # API clients keep the class id


# --- every queue-time rule, each with a graph that rings it (issue 38) --------------------------------------------
#
# One row per rule: the workflow it edits, the edit, then where POST /prompt puts the refusal (node class, input) and
# a fragment of the sentence. The rules across nodes (the task against the media, the DiT partition against the task,
# `gpus` against the DiT's heads) read the graph (nodes/graph_checks.py) and the DiT file's header only; a 400 means
# nothing was queued, so nothing was loaded.

DROP = object()  # an edit value: remove that input (disconnect it)
TINY_FILE = "[embedded] tiny H3 / minimax_h3_tiny_{}_fp32.safetensors"  # the tiny DiT's files (2 attention heads)


def _user_file(folder_option: tuple[str, str], token: str):
    def pick(server):
        return next(name for name in user_files(options(server, *folder_option)) if token in name)

    return pick


RULES = [
    # rule, workflow, {class_type: {input: value (or a function of the server, or DROP)}}, (class, input), fragment
    ("length on the 17k+5 grid", "t2va", {"H3SplitTextEncode": {"length": 130}}, ("H3SplitTextEncode", "length"),
     "17k+5"),
    ("prompt not empty", "t2va", {"H3SplitTextEncode": {"prompt": "  "}}, ("H3SplitTextEncode", "prompt"),
     "the prompt is empty"),
    ("width and height both set or both 0", "t2va", {"H3SplitTextEncode": {"width": 640, "height": 0}},
     ("H3SplitTextEncode", "height"), "set height too"),
    ("canvas on the 32 px grid", "t2va", {"H3SplitTextEncode": {"width": 128, "height": 100}},
     ("H3SplitTextEncode", "height"), "height must be a multiple of 32 px"),
    ("loader file of its own component", "t2va",
     {"H3SplitVideoVAELoader": {"vae": _user_file(("H3SplitAudioVAELoader", "audio_vae"), "audio_vae")}},
     ("H3SplitVideoVAELoader", "vae"), "holds the H3 audio VAE, not the video VAE"),
    ("model file present", "t2va", {"H3SplitDiTLoader": {"dit": "minimax_h3_fl2va_bf16.safetensors"}},
     ("H3SplitDiTLoader", "dit"), "is not in models/diffusion_models/: download it there"),
    ("loader device on this machine", "t2va", {"H3SplitDiTLoader": {"device": "cuda:77"}},
     ("H3SplitDiTLoader", "device"), "device must be one of"),
    ("sampler steps in range", "t2va", {"H3SplitSampler": {"steps": 1}}, ("H3SplitSampler", "steps"),
     "steps must be at least 2"),
    ("cache a known form", "t2va", {"H3SplitSampler": {"cache": "turbo"}}, ("H3SplitSampler", "cache"),
     "cache must be off, quality, balanced, fast, every:K (an integer K >= 2)"),
    ("cache every:K with K >= 2", "t2va", {"H3SplitSampler": {"cache": "every:1"}}, ("H3SplitSampler", "cache"),
     "every:K needs an integer K >= 2, got 'every:1'"),
    ("cache presets need cache-dit", "t2va", {"H3SplitSampler": {"cache": "fast"}}, ("H3SplitSampler", "cache"),
     "cache fast needs cache-dit, which is not installed"),
    ("gpus divides the DiT's attention heads", "t2va", {"H3SplitSampler": {"gpus": 3}}, ("H3SplitSampler", "gpus"),
     "gpus 3: the DiT's 2 attention heads do not divide into 3 ranks"),
    ("DiT file partition matches the task", "t2va", {"H3SplitDiTLoader": {"dit": TINY_FILE.format("ref2va")}},
     ("H3SplitSampler", "dit"), "this t2va conditioning needs the FL2VA DiT partition; the loaded DiT is the Ref2VA "
     "DiT partition (in Load MiniMax H3 DiT, pick a DiT file of the other partition"),
    ("DiT folder partition widget matches the task", "ref2va",
     {"H3SplitDiTLoader": {"partition": "fl2va (t2va, first/last frame)"}}, ("H3SplitSampler", "dit"),
     "this ref2va conditioning needs the Ref2VA DiT partition; the loaded DiT is the FL2VA DiT partition"),
    ("fl2va has keyframes connected", "fl2va", {"H3SplitTextEncode": {"media": DROP}}, ("H3SplitTextEncode", "task"),
     "fl2va needs 1 or 2 keyframes (first and/or last frame) or a guide, got 0 keyframes: connect MiniMax H3 "
     "Keyframes"),
    ("fl2va takes no references", "ref2va", {"H3SplitTextEncode": {"task": "fl2va"}}, ("H3SplitTextEncode", "task"),
     "fl2va takes first/last keyframes and guides only; references need task ref2va: set task to ref2va or auto"),
    ("t2va takes no media", "fl2va", {"H3SplitTextEncode": {"task": "t2va"}}, ("H3SplitTextEncode", "task"),
     "t2va takes a prompt only"),
    ("ref2va has references connected", "t2va", {"H3SplitTextEncode": {"task": "ref2va"}},
     ("H3SplitTextEncode", "task"), "ref2va needs at least one image or video reference"),
    ("remote endpoint a URL the token policy allows", "ref2va_remote",
     {"H3SplitRemoteEncode": {"endpoint": "ftp://example.invalid"}}, ("H3SplitRemoteEncode", "endpoint"), "ftp"),
    ("remote encode: fl2va has keyframes connected", "ref2va_remote",
     {"H3SplitRemoteEncode": {"task": "fl2va"}}, ("H3SplitRemoteEncode", "task"), "fl2va takes first/last keyframes "
     "and guides only"),
]


def ruled(server, name: str, edits: dict) -> dict:
    graph = copy.deepcopy(api(name))
    for class_type, inputs in edits.items():
        node = graph[key_of(graph, class_type)]["inputs"]
        for input_name, value in inputs.items():
            if value is DROP:
                node.pop(input_name, None)
            else:
                node[input_name] = value(server) if callable(value) else value
    return graph


def cache_dit_in_server(server) -> bool:
    tooltip = server.object_info("H3SplitSampler")["input"]["optional"]["cache"][1]["tooltip"]
    return "not installed in this ComfyUI" not in tooltip


@pytest.mark.parametrize("rule, name, edits, where, fragment", RULES, ids=[row[0] for row in RULES])
def test_each_queue_time_rule_rings_on_its_input(server, rule, name, edits, where, fragment):
    import time

    if rule == "cache presets need cache-dit" and cache_dit_in_server(server):
        pytest.skip("cache-dit is installed beside this ComfyUI (requirements-dev.txt); "
                    "tests/test_queue_time_rules.py checks that sentence with cache-dit hidden")
    graph = ruled(server, name, edits)
    started = time.perf_counter()
    status, body = server.post_prompt_expect_error(graph)
    seconds = time.perf_counter() - started
    assert status == 400, body
    class_type, input_name = where
    blamed = {body["node_errors"][key]["class_type"] for key in body["node_errors"]}
    assert blamed == {class_type}, body["node_errors"]  # refused once, by the node the rule belongs to
    errors = [(error["extra_info"].get("input_name"), error["details"])
              for error in body["node_errors"][key_of(graph, class_type)]["errors"]]
    assert [input for input, _ in errors] == [input_name], errors
    assert fragment in errors[0][1], errors
    print(f"\n[queue-time rule] {rule}: refused in {seconds * 1000:.0f} ms: {errors[0][1]}")


ACCEPTED_CACHE = ["off", "every:2", "every:3", "every:4", "every:5", "every:12", " Every:2 ",
                  "quality", "balanced", "fast", "Fast", "dbcache:threshold=0.2,warmup=2"]


@pytest.mark.parametrize("value", ACCEPTED_CACHE)
def test_every_cache_value_a_saved_workflow_may_hold_is_accepted(server, value):
    """The Sampler refuses none of them (another node's error keeps the prompt from running)."""
    if value.strip().lower() in ("quality", "balanced", "fast") or value.startswith("dbcache"):
        if not cache_dit_in_server(server):
            pytest.skip("cache-dit is not installed beside this ComfyUI: the presets are refused (rule above)")
    graph = ruled(server, "t2va", {"H3SplitSampler": {"cache": value, "gpus": 2},
                                   "H3SplitVideoVAELoader": {"device": "cuda:77"}})
    status, body = server.post_prompt_expect_error(graph)
    assert status == 400 and set(body["node_errors"]) == {key_of(graph, "H3SplitVideoVAELoader")}, body


def test_graph_rules_see_only_their_own_prompt(server):
    """Two graphs posted at once: each refusal names its own graph's values (the graph rides in the request)."""
    from concurrent.futures import ThreadPoolExecutor

    graphs = [ruled(server, "t2va", {"H3SplitSampler": {"gpus": gpus}}) for gpus in (3, 5, 7, 9)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(server.post_prompt_expect_error, graphs))
    for graph, (status, body) in zip(graphs, answers):
        gpus = graph[key_of(graph, "H3SplitSampler")]["inputs"]["gpus"]
        details = body["node_errors"][key_of(graph, "H3SplitSampler")]["errors"][0]["details"]
        assert status == 400 and f"gpus {gpus}:" in details, body
