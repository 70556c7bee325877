"""What is particular to ComfyUI core 0.33 (issue 39), a real server on CPU: core 0.33.0 at commit 783545f6, which has
its own H3 (comfy/ldm/minimax/, comfy_extras/nodes_minimax_h3.py), set up by scripts/setup_comfyui.sh in
`.comfyui-0.33/` with core's own pins (comfy-kitchen 0.2.31 included) first on the server's path.

Core 0.33 is the ComfyUI of the whole ComfyUI tier (comfy_harness.DEFAULT_INSTALL; issue 39.1): the shipped API
workflows, the templates in 0.33's frontend (1.49.6) and their rendering against 0.33's /object_info are checked by
tests/test_nodes_comfyui.py there, on the same shared server this module uses (`core033`). Here, only what involves
core's own H3:

* the pack's requirements keep every pin of core 0.33's, and core 0.33's environment already meets them;
* every pack node registers beside core's H3 nodes;
* the pack's stage 0 feeds core's own stage 1: the CONDITIONING of the pack's Text Encode (t2va), of Load
  Conditioning, and of the full fl2va and ref2va encode chains samples in core's nodes (UNETLoader on the tiny
  Comfy-format DiT -> ModelSamplingMiniMaxH3 -> KSampler / SamplerCustomAdvanced, on the latent of MiniMax H3 Empty
  Latent from Conditioning or core's EmptyMiniMaxH3LatentAV), and core's LATENT decodes with MiniMax H3 VAE Decode.
  Core's own VAELoader cannot load the tiny VAE files (core fixes the VAE widths to the release's: a size mismatch),
  so the tests decode with the pack's Decode;
* a conditioning core's sampler would take and mean nothing by (still missing an encoder: core would sample it
  without its references) is refused by name;
* the core-sampler templates (t2va_core, fl2va_core, ref2va_core: the pack's Remote Encode, core's UNETLoader ->
  ModelSamplingMiniMaxH3 -> KSampler, the pack's Decode) run as their tiny API twins against a real encoder endpoint;
  build_workflows' copy of core's H3 node (which renders them against 0.3.75) is 0.33's declaration, and its copy of
  SaveVideo is the form 0.33's frontend reads; their tiny variants load in 0.33's frontend as dropped files.

Whether core's and the pack's stage 1 agree numerically is not checked here.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from support.comfy_harness import (
    CORE033_SITE,
    CORE_033,
    PACK_NAME,
    UI_DIR,
    ComfyError,
    chromium_path,
    import_failures,
    ui_available,
    unavailable,
)
from support.comfy_pack import PACK_NODES, encoder_url  # noqa: F401  (module fixture: a real encoder endpoint)
from support.core033 import (
    CORE_H3_NODES,
    TINY_DITS,
    conflicts,
    core033,  # noqa: F401  (module fixture: the 0.33 server)
    core033_requirements_text,
    pack_import_seconds,
    parse_requirements,
)

from h3_core import media

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO / "workflows" / "api"
sys.path.insert(0, str(REPO / "workflows"))
import build_workflows  # noqa: E402

TINY = "[embedded] tiny H3 (noise)"
PROMPT = "A red fox trots through fresh snow at dawn; wind in the pines, crunching steps."
STEPS = 3
CANVAS = (128, 64)  # the tiny H3's canvas for the shipped workflows' inputs (width, height)
# The core-sampler templates (build_workflows) and the canvas of their tiny twins' output.
CORE_TEMPLATES = {"t2va_core": CANVAS, "fl2va_core": (96, 64), "ref2va_core": CANVAS}


def api(name: str, endpoint: str | None = None) -> dict:
    graph = json.loads((WORKFLOWS / f"{name}.json").read_text())
    for node in graph.values():
        if node["class_type"] == "H3SplitRemoteEncode" and endpoint:
            node["inputs"]["endpoint"] = endpoint
    return graph


def id_of(graph: dict, class_type: str) -> str:
    return next(key for key, node in graph.items() if node["class_type"] == class_type)


def assert_mp4(path: Path, canvas=CANVAS) -> None:
    info = media.probe(path)
    assert info["frames"] == 124 and info["fps"] == 24.0 and (info["width"], info["height"]) == canvas, info
    assert info["sample_rate"] == 32000 and info["channels"] == 2, info


def core_sampling(graph: dict, conditioning: list, partition: str, *, prefix: str, seed: int = 0,
                  latent: str = "pack", guider: str = "ksampler") -> None:
    """Sample `conditioning` in core's own nodes and decode with the pack's: UNETLoader (the tiny Comfy-format DiT
    of `partition`) -> ModelSamplingMiniMaxH3 -> KSampler (cfg 1, no CFG as H3) or BasicGuider +
    SamplerCustomAdvanced, on the latent of MiniMax H3 Empty Latent from Conditioning (`latent="pack"`) or core's
    EmptyMiniMaxH3LatentAV at the tiny canvas (`"core"`) -> MiniMax H3 VAE Decode -> SaveVideo. The pack's video /
    audio VAE loaders must be nodes "v" and "a"."""
    graph["c1"] = {"class_type": "UNETLoader",
                   "inputs": {"unet_name": TINY_DITS[partition], "weight_dtype": "default"}}
    graph["c2"] = {"class_type": "MiniMaxH3SigmaShift",
                   "inputs": {"model": ["c1", 0], "shift_video": 12.0, "shift_audio": 3.0}}
    if latent == "pack":
        graph["c3"] = {"class_type": "H3SplitEmptyLatentFromConditioning", "inputs": {"conditioning": conditioning}}
    else:
        graph["c3"] = {"class_type": "EmptyMiniMaxH3LatentAV",
                       "inputs": {"width": CANVAS[0], "height": CANVAS[1], "length": 124}}
    if guider == "ksampler":
        graph["c4"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": conditioning}}
        graph["c5"] = {"class_type": "KSampler", "inputs": {
            "model": ["c2", 0], "seed": seed, "steps": STEPS, "cfg": 1.0, "sampler_name": "euler",
            "scheduler": "simple", "positive": conditioning, "negative": ["c4", 0], "latent_image": ["c3", 0],
            "denoise": 1.0}}
    else:
        graph["c4"] = {"class_type": "BasicGuider", "inputs": {"model": ["c2", 0], "conditioning": conditioning}}
        graph["c6"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}}
        graph["c7"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}}
        graph["c8"] = {"class_type": "BasicScheduler",
                       "inputs": {"model": ["c2", 0], "scheduler": "simple", "steps": STEPS, "denoise": 1.0}}
        graph["c5"] = {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["c6", 0], "guider": ["c4", 0], "sampler": ["c7", 0], "sigmas": ["c8", 0],
            "latent_image": ["c3", 0]}}
    graph["c9"] = {"class_type": "H3SplitDecode", "inputs": {"latent": ["c5", 0], "vae": ["v", 0],
                                                              "audio_vae": ["a", 0]}}
    graph["c10"] = {"class_type": "SaveVideo", "inputs": {"video": ["c9", 0], "filename_prefix": f"h3core/{prefix}",
                                                           "format": "mp4", "codec": "h264"}}


def vae_loaders() -> dict:
    return {"v": {"class_type": "H3SplitVideoVAELoader", "inputs": {"vae": TINY}},
            "a": {"class_type": "H3SplitAudioVAELoader", "inputs": {"audio_vae": TINY}}}


def only_mp4(result) -> Path:
    mp4s = [path for path in result.files if path.suffix == ".mp4"]
    assert len(mp4s) == 1, result.files
    return mp4s[0]


# --- requirements -----------------------------------------------------------------------------------------------


def test_the_pack_requirements_keep_core_033_pins():
    """`pip install -r requirements.txt` inside ComfyUI 0.33 moves none of core's pinned packages (comfy-kitchen
    0.2.31 above all) and asks nothing core's ranges exclude; pyproject's dependencies likewise."""
    text = core033_requirements_text()
    if text is None:
        unavailable(f"core 0.33's requirements.txt is in neither {CORE_033.dir} nor the archive in ../shared")
    core = parse_requirements(text)
    assert "comfy-kitchen" in core and "torch" in core  # the file read is core's
    pack = parse_requirements((REPO / "requirements.txt").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert conflicts(pack, core) == []
    assert conflicts(parse_requirements("\n".join(project["dependencies"])), core) == []
    # The check sees a moved pin (the pack's previous range) and a range with no common version.
    assert conflicts(parse_requirements("comfy-kitchen>=0.2.40,<0.3"), core)
    assert conflicts(parse_requirements("av<15"), core)


def test_core_033_environment_already_meets_the_pack_requirements():
    """In the environment the 0.33 server runs in (the venv with core's pins first on the path), every requirement
    of the pack is met as installed: installing the pack there changes nothing."""
    ok, reason = CORE_033.available()
    if not ok:
        unavailable(reason)
    script = (
        "import importlib.metadata as md, json, sys\n"
        "from packaging.requirements import Requirement\n"
        "bad = {}\n"
        "for line in open(sys.argv[1]):\n"
        "    line = line.split('#', 1)[0].strip()\n"
        "    if not line: continue\n"
        "    req = Requirement(line)\n"
        "    try: have = md.version(req.name)\n"
        "    except md.PackageNotFoundError: have = None\n"
        "    if have is None or not req.specifier.contains(have, prereleases=True): bad[req.name] = have\n"
        "print(json.dumps({'bad': bad, 'kitchen': md.version('comfy-kitchen')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(REPO / "requirements.txt")], capture_output=True,
                         text=True, env={"PYTHONPATH": str(CORE033_SITE), "PATH": "/usr/bin:/bin"}, check=True)
    report = json.loads(out.stdout)
    assert report == {"bad": {}, "kitchen": "0.2.31"}, report


# --- the server ---------------------------------------------------------------------------------------------------


def test_pack_nodes_register_beside_core_h3_nodes(core033):
    server = core033.server
    log = server.log_text()
    assert CORE_033.version == "0.33.0" and (CORE_033.dir / "comfy_extras" / "nodes_minimax_h3.py").is_file()
    assert "ComfyUI version: 0.33.0" in log and "comfy-kitchen version: 0.2.31" in log
    assert import_failures(log) == [] and "IMPORT FAILED" not in log
    info = server.object_info()
    module = f"custom_nodes.{PACK_NAME}"
    for node in PACK_NODES:
        assert str(info[node]["python_module"]).startswith(module), node
    for node in CORE_H3_NODES:
        assert info[node]["python_module"] == "comfy_extras.nodes_minimax_h3", node
    assert set(PACK_NODES) <= set(server.pack_nodes())  # nodes added later register too (each H3Split*)
    assert all(node.startswith("H3Split") for node in server.pack_nodes())
    latent = info["H3SplitEmptyLatentFromConditioning"]
    assert latent["category"] == "latent/MiniMax H3" and latent["output"] == ["LATENT", "INT", "INT", "INT"]
    seconds = pack_import_seconds(log)
    assert seconds is not None and seconds < 60, seconds
    print(f"\nComfyUI 0.33: up in {core033.start_wall_s:.1f} s wall, {core033.start_cpu_s:.1f} CPU-s; "
          f"the pack's import: {seconds} s (ComfyUI's import-times table)")


# --- the pack's stage 0 into core's stage 1 ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def t2va_in_core(core033):
    """Text Encode (t2va) -> Save Conditioning, and -> core's KSampler twice: on the pack's latent from the
    conditioning and on core's EmptyMiniMaxH3LatentAV; both decoded by the pack's Decode."""
    graph = {
        "t": {"class_type": "H3SplitTextEncoderLoader", "inputs": {"text_encoder": TINY}},
        "e": {"class_type": "H3SplitTextEncode", "inputs": {
            "text_encoder": ["t", 0], "prompt": PROMPT, "width": 0, "height": 0, "length": 124, "task": "t2va"}},
        "s": {"class_type": "H3SplitSaveConditioning",
              "inputs": {"conditioning": ["e", 0], "filename_prefix": "h3/core033/t2va"}},
        **vae_loaders(),
    }
    core_sampling(graph, ["e", 0], "fl2va", prefix="t2va_pack_latent")
    second = {}
    core_sampling(second, ["e", 0], "fl2va", prefix="t2va_core_latent", latent="core")
    graph.update({f"{k}b": _renamed(v, "b") for k, v in second.items()})
    return core033.server.run_prompt(graph, timeout=600)


def _renamed(node: dict, suffix: str) -> dict:
    """A node of a second core_sampling branch: links to other c* nodes renamed, the rest shared."""
    node = copy.deepcopy(node)
    for key, value in node["inputs"].items():
        if isinstance(value, list) and isinstance(value[0], str) and value[0].startswith("c"):
            node["inputs"][key] = [value[0] + suffix, value[1]]
    return node


def test_text_encode_conditioning_samples_in_cores_nodes(t2va_in_core):
    result = t2va_in_core
    assert result.status == "success"
    mp4s = sorted(path for path in result.files if path.suffix == ".mp4")
    assert [p.name.split("_0")[0] for p in mp4s] == ["t2va_core_latent", "t2va_pack_latent"], mp4s
    for path in mp4s:
        assert_mp4(path)
    ran = {result.history["prompt"][2][node]["class_type"] for node in result.executed_nodes()}
    assert {"UNETLoader", "MiniMaxH3SigmaShift", "KSampler", "EmptyMiniMaxH3LatentAV",
            "H3SplitEmptyLatentFromConditioning", "H3SplitDecode"} <= ran


def test_load_conditioning_samples_in_cores_nodes(core033, t2va_in_core):
    """The conditioning file Save Conditioning wrote, loaded by Load Conditioning, samples in core's nodes through
    BasicGuider + SamplerCustomAdvanced."""
    saved = sorted((core033.server.output_dir / "h3" / "core033").glob("t2va_*.safetensors"))
    assert saved, list(core033.server.output_dir.rglob("*"))
    choice = f"h3/core033/{saved[-1].name} [output]"
    options = core033.server.object_info("H3SplitLoadConditioning")["input"]["required"]["conditioning_file"]
    listed = options[1]["options"] if len(options) > 1 and "options" in options[1] else options[0]
    assert choice in listed, listed
    graph = {"l": {"class_type": "H3SplitLoadConditioning", "inputs": {"conditioning_file": choice}},
             **vae_loaders()}
    core_sampling(graph, ["l", 0], "fl2va", prefix="t2va_loaded", guider="custom")
    result = core033.server.run_prompt(graph, timeout=600)
    assert_mp4(only_mp4(result))


def without_stage_1(name: str, *drop: str) -> dict:
    """A shipped graph without its DiT Loader, Sampler, Decode and SaveVideo (and `drop`), its VAE loaders renamed
    "v" and "a" for core_sampling."""
    graph = api(name)
    for class_type in ("H3SplitDiTLoader", "H3SplitSampler", "H3SplitDecode", "SaveVideo", *drop):
        del graph[id_of(graph, class_type)]
    for class_type, new in (("H3SplitVideoVAELoader", "v"), ("H3SplitAudioVAELoader", "a")):
        old = id_of(graph, class_type)
        graph[new] = graph.pop(old)
        for node in graph.values():
            for key, value in node["inputs"].items():
                if isinstance(value, list) and value[:1] == [old]:
                    node["inputs"][key] = [new, value[1]]
    return graph


def test_ref2va_encode_chain_samples_in_cores_nodes(core033):
    """The shipped ref2va graph's encode chain (image, video with soundtrack, audio references) with core's sampler
    in place of the pack's: core reads the references from the conditioning (`minimax_refs`)."""
    graph = without_stage_1("ref2va")
    core_sampling(graph, [id_of(graph, "H3SplitAudioVAEEncode"), 0], "ref2va", prefix="ref2va")
    result = core033.server.run_prompt(graph, timeout=600)
    assert_mp4(only_mp4(result))


def test_fl2va_encode_chain_samples_in_cores_nodes(core033):
    """The shipped fl2va graph's encode chain (first and last frame) with core's sampler: core reads the keyframes
    from the conditioning (`minimax_keyframes`), on the latent of the conditioning's 96x64 canvas."""
    graph = without_stage_1("fl2va")
    core_sampling(graph, [id_of(graph, "H3SplitVideoVAEEncode"), 0], "fl2va", prefix="fl2va", guider="custom")
    result = core033.server.run_prompt(graph, timeout=600)
    assert_mp4(only_mp4(result), canvas=(96, 64))


def test_a_conditioning_still_missing_its_encoders_is_refused_by_name(core033):
    """ref2va Text Encode straight into core's sampler: core would ignore the pack's parts and sample without the
    references; MiniMax H3 Empty Latent from Conditioning refuses it, naming the missing encode nodes (or, where the
    pack's queue-time graph rules see it first, POST /prompt does)."""
    graph = without_stage_1("ref2va", "H3SplitVideoVAEEncode", "H3SplitAudioVAEEncode")
    core_sampling(graph, [id_of(graph, "H3SplitTextEncode"), 0], "ref2va", prefix="refused")
    try:
        result = core033.server.run_prompt(graph, timeout=600, check=False)
    except ComfyError as refused:  # refused at queue time: nothing ran
        message = str(refused)
        assert "POST /prompt -> 400" in message, message
    else:
        assert result.status == "error", result.types()
        assert result.error["node_type"] == "H3SplitEmptyLatentFromConditioning", result.error
        message = result.error["exception_message"]
        ran = {result.history["prompt"][2][node]["class_type"] for node in result.executed_nodes()}
        assert "KSampler" not in ran
    assert "Video VAE Encode" in message and "Audio VAE Encode" in message, message


# --- the core-sampler templates: the pack's Remote Encode, core's stage 1 -------------------------------------------

@pytest.mark.parametrize("name", sorted(CORE_TEMPLATES))
def test_core_sampler_api_twin_runs_to_an_mp4(core033, encoder_url, name):
    """The template's tiny API twin (workflows/api/): Remote Encode on a real encoder endpoint -> core's UNETLoader
    (the tiny Comfy-format DiT) -> ModelSamplingMiniMaxH3 -> KSampler -> MiniMax H3 VAE Decode -> SaveVideo."""
    graph = api(name, encoder_url)
    graph[id_of(graph, "KSampler")]["inputs"]["steps"] = STEPS
    result = core033.server.run_prompt(graph, timeout=600)
    assert result.status == "success" and "execution_success" in result.types()
    ran = {result.history["prompt"][2][node]["class_type"] for node in result.executed_nodes()}
    assert {"H3SplitRemoteEncode", "UNETLoader", "MiniMaxH3SigmaShift", "KSampler",
            "H3SplitEmptyLatentFromConditioning", "H3SplitDecode"} <= ran, ran
    assert_mp4(only_mp4(result), canvas=CORE_TEMPLATES[name])


def test_build_workflows_copies_of_core_033_nodes_are_its_declarations(core033):
    """build_workflows' copy of core's H3 node (the core-sampler templates render with it against 0.3.75, which lacks
    the node) is 0.33's declaration; its copies of SaveVideo and SaveImage (the forms every template writes: 0.3.75's)
    name inputs 0.33 still takes: SaveVideo's `format` 0.33 declares a dynamic combo, and both have an output there
    (its frontend reads the written forms: the templates load in tests/test_nodes_comfyui.py)."""
    info = core033.server.object_info()
    for class_type, copied in build_workflows.CORE_033_SCHEMAS.items():
        live = info[class_type]
        assert live["input_order"] == copied["input_order"], class_type
        assert (live["output"], live["output_name"]) == (copied["output"], copied["output_name"]), class_type
        for section, inputs in copied["input"].items():
            for name, (kind, options) in inputs.items():
                live_kind, *live_options = live["input"][section][name]
                assert live_kind == kind, (class_type, name)
                assert {k: (live_options or [{}])[0].get(k) for k in options} == options, (class_type, name)
    save = info["SaveVideo"]
    written = build_workflows.WRITTEN_SCHEMAS["SaveVideo"]
    assert save["input"]["required"]["format"][0] == "COMFY_DYNAMICCOMBO_V3"  # still 0.33's form
    assert save["input_order"]["required"][:3] == written["input_order"]["required"][:3]
    image = build_workflows.WRITTEN_SCHEMAS["SaveImage"]  # 0.33 adds an output to chain to each; same inputs
    assert info["SaveImage"]["input_order"]["required"] == image["input_order"]["required"]
    assert (save["output"], info["SaveImage"]["output"]) == (["VIDEO"], ["IMAGE"])
    assert written["output"] == image["output"] == []


def test_core_sampler_tiny_variants_load_in_core_033_frontend(core033, tmp_path):
    """Core 0.33's own frontend (the comfyui-frontend-package its requirements pin), served by the 0.33 server: each
    core-sampler template's tiny variant, as a dropped file, loads with no missing node type, no dangling link, no
    problem (one browser session, tests/ui/load_templates.mjs; the templates themselves load from the template
    browser in tests/test_nodes_comfyui.py)."""
    ok, reason = ui_available()
    if not ok:
        unavailable(reason)
    server = core033.server
    tiny = build_workflows.tiny_templates(server.object_info())
    argv = ["node", str(UI_DIR / "load_templates.mjs")]
    for name in sorted(CORE_TEMPLATES):
        path = tmp_path / f"tiny_{name}.json"
        path.write_text(json.dumps(tiny[name]))
        argv.append(str(path))
    env = {**os.environ, "COMFY_URL": server.url, "CHROMIUM_PATH": chromium_path() or ""}
    done = subprocess.run(argv, cwd=UI_DIR, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"load_templates.mjs exited {done.returncode}\n{done.stderr[-3000:]}\n{server.log_tail()}"
    report = json.loads(lines[-1])
    assert "error" not in report, report["error"]
    print(f"\nComfyUI 0.33's frontend: {report['frontend_version']}")
    for name in sorted(CORE_TEMPLATES):
        load = report["loads"][f"tiny_{name}.json"]
        assert load["missing_types"] == [] and load["dangling_links"] == [], (name, load)
        assert load["node_count"] == load["expected_node_count"] > 0, (name, load)
        assert load["overlaps"] == [], (name, load["boxes"])
        assert load["problems"] == [] and load["error_nodes"] == [], (name, load)
