"""The 0.3.75 smoke set: the pack in ComfyUI 0.3.75 (`COMFY_0375`, `.comfyui/`), which every suite run still checks
while the rest of the ComfyUI tier runs in core 0.33 (the harness's DEFAULT_INSTALL).

One shared 0.3.75 server (the `comfy` fixture's configuration, named with install=COMFY_0375) for the module:

* every pack node registers, with a complete V1-shaped description;
* every shipped API workflow of workflows/api/ that 0.3.75 has the nodes for runs to its output (all but the
  core-sampler twins `*_core`, which need core 0.33's own H3 node);
* the committed templates render the same against 0.3.75's /object_info;
* every template loads from the template browser of 0.3.75's frontend (1.32.9) in one browser session
  (tests/ui/load_templates.mjs): with no missing node type but core 0.33's H3 node in the core-sampler templates;
* 1.32.9's schema alert on a dropped workflow is caught (what 1.49.6 does not raise).

Frontend 1.58.1 served by 0.3.75 is tests/test_templates_newest_frontend.py. With H3_COMFY=0.3.75 the whole tier
runs in 0.3.75 and this module repeats a part of it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.comfy_harness import (
    COMFY_0375,
    PACK_NAME,
    UI_DIR,
    ComfyServer,
    chromium_path,
    import_failures,
    shared_comfy,
    thread_env,
    ui_available,
    unavailable,
)
from support.comfy_pack import PACK_NODES, encoder_url  # noqa: F401  (module fixture: a real encoder endpoint)

from h3_core import media

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO / "workflows"
sys.path.insert(0, str(WORKFLOWS))
import build_workflows  # noqa: E402

API_NAMES = sorted(path.stem for path in (WORKFLOWS / "api").glob("*.json"))
CORE_033_ONLY = sorted(build_workflows.CORE_033_SCHEMAS)
TITLES = {graph.key: graph.title for graph in build_workflows.build_graphs()}


def api(name: str, endpoint: str | None = None) -> dict:
    graph = json.loads((WORKFLOWS / "api" / f"{name}.json").read_text())
    for node in graph.values():
        if node["class_type"] == "H3SplitRemoteEncode" and endpoint:
            node["inputs"]["endpoint"] = endpoint
    return graph


def declared_pack_nodes() -> set[str]:
    """The node ids the pack's sources declare (`node_id="H3Split..."`, `NODE_ID, DISPLAY_NAME = "H3Split...", ...`)."""
    pattern = re.compile(r'(?:node_id=|NODE_ID(?:, DISPLAY_NAME)? = )"(H3Split\w+)"')
    return {m for path in (REPO / "nodes").glob("*.py") for m in pattern.findall(path.read_text())}


def needs_core_033(name: str) -> bool:
    return any(node["class_type"] in build_workflows.CORE_033_SCHEMAS for node in api(name).values())


@pytest.fixture(scope="module")
def old(tiny_dir, tmp_path_factory) -> ComfyServer:
    """The session's 0.3.75 server with the tiny H3 (as the `comfy` fixture's) and the tiny H3 as the loaders'
    embedded-tiny choice."""
    env = {"H3_TINY_DIR": str(tiny_dir), **thread_env()}
    server = shared_comfy(tmp_path_factory.getbasetemp(), Path(tiny_dir) / "comfyui", env, install=COMFY_0375)
    server.add_model("minimax_h3", tiny_dir, "tiny")
    return server


def test_pack_nodes_register_in_0375(old):
    log = old.log_text()
    stats = old.get_json("/system_stats")
    assert stats["system"]["comfyui_version"] == COMFY_0375.version == "0.3.75"
    assert import_failures(log) == [] and "IMPORT FAILED" not in log, old.log_tail(200)
    nodes = old.pack_nodes()
    assert set(PACK_NODES) <= declared_pack_nodes() == set(nodes), sorted(set(nodes) ^ declared_pack_nodes())
    for name, entry in nodes.items():
        assert entry["name"] == name and "MiniMax H3" in entry["display_name"], name
        for key in ("input", "input_order", "output", "output_name", "display_name", "category"):
            assert key in entry, (name, key)
    print(f"\nComfyUI 0.3.75: up in {old.start_wall_s:.1f} s wall, {old.start_cpu_s:.1f} CPU-s")


def test_only_the_core_sampler_twins_need_core_033():
    assert API_NAMES and sorted(name for name in API_NAMES if needs_core_033(name)) == sorted(
        name for name in API_NAMES if name.endswith("_core"))


@pytest.mark.parametrize("name", [name for name in API_NAMES if not name.endswith("_core")])
def test_shipped_api_workflow_runs_to_its_output(old, request, name):
    graph = api(name)
    if any(node["class_type"] == "H3SplitRemoteEncode" for node in graph.values()):
        graph = api(name, request.getfixturevalue("encoder_url"))
    result = old.run_prompt(graph, timeout=600)
    assert result.status == "success" and "execution_success" in result.types()
    saves = {node["class_type"] for node in graph.values() if node["class_type"] in ("SaveVideo", "SaveImage")}
    assert saves, name
    if "SaveVideo" in saves:
        (mp4,) = [path for path in result.files if path.suffix == ".mp4"]
        info = media.probe(mp4)
        assert info["frames"] == 124 and info["fps"] == 24.0 and info["sample_rate"] == 32000, info
    else:  # t2i: one PNG
        assert [path.suffix for path in result.files] == [".png"], result.files


def test_templates_render_the_same_against_0375(old):
    rendered = build_workflows.render_all(old.object_info())
    for name, content in rendered.items():
        committed = (REPO / name).read_bytes() if isinstance(content, bytes) else (REPO / name).read_text()
        assert committed == content, f"{name} renders differently against 0.3.75"


def test_templates_load_in_0375_frontend(old):
    """Every template from 0.3.75's template browser (frontend 1.32.9), one browser session: listed once each,
    nothing missing but core 0.33's H3 node (in the core-sampler templates), no dangling link, no overlap."""
    ok, reason = ui_available()
    if not ok:
        unavailable(reason)
    argv = ["node", str(UI_DIR / "load_templates.mjs")]
    for name in sorted(TITLES):
        argv += ["--template", f"{PACK_NAME}/{TITLES[name]}"]
    env = {**os.environ, "COMFY_URL": old.url, "CHROMIUM_PATH": chromium_path() or ""}
    done = subprocess.run(argv, cwd=UI_DIR, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"load_templates.mjs exited {done.returncode}\n{done.stderr[-3000:]}\n{old.log_tail()}"
    report = json.loads(lines[-1])
    assert "error" not in report, report["error"]
    assert report["frontend_version"] == "1.32.9", report["frontend_version"]
    assert sorted(report["templates_listed"][PACK_NAME]) == sorted(TITLES.values())
    for name in sorted(TITLES):
        load = report["loads"][f"{PACK_NAME}/{TITLES[name]}"]
        core = name.endswith("_core")
        assert load["missing_types"] == (CORE_033_ONLY if core else []), (name, load)
        assert load["dangling_links"] == [] and load["overlaps"] == [], (name, load)
        assert load["node_count"] == load["expected_node_count"] > 0, (name, load)
        if not core:
            assert load["problems"] == [], (name, load["problems"])


def test_frontend_test_fails_on_a_workflow_alert(old):
    """The frontend checks catch an alert: 1.32.9 validates a dropped workflow against its zod schema, and a top-level
    id that is not a UUID (the old files) raises the schema alert (1.49.6 raises none for it)."""
    workflow = json.loads((REPO / build_workflows.TEMPLATES / f"{TITLES['t2va']}.json").read_text())
    workflow["id"] = "minimax-h3-split-t2va"
    report = old.load_workflow_ui(workflow)
    assert report["returncode"] == 4 and not report["ok"]
    assert any("Invalid workflow against zod schema" in p and "Invalid uuid" in p for p in report["problems"])
