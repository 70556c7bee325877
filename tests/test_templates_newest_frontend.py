"""The shipped templates in the newest ComfyUI frontend, served by ComfyUI 0.3.75 (with tests/test_comfy0375_smoke.py,
the 0.3.75 smoke set every run keeps while the rest of the ComfyUI tier runs in core 0.33).

The frontend is a separate PyPI package (comfyui-frontend-package); ComfyUI serves another one with
`--front-end-root`. scripts/setup_comfyui.sh installs the newest one checked here beside ComfyUI, never into the
venv (0.3.75 pins 1.32.9): `pip install --no-deps --target <H3_COMFY_DIR>/frontend-1.58.1
comfyui-frontend-package==1.58.1`. H3_FRONTEND_ROOT (another frontend's static/) overrides that folder.

One server start and one browser session load every template of example_workflows/ (as the template browser does)
and its tiny-H3 variant (as a dropped file), one after another (tests/ui/load_templates.mjs); each test reads its
part of that one report. Without the frontend folder the module skips (fails in CI, where setup installs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.comfy_harness import (  # noqa: F401  (comfy_factory: session fixture)
    COMFY_0375,
    COMFY_DIR,
    PACK_NAME,
    UI_DIR,
    chromium_path,
    comfy_factory,
    ui_available,
    unavailable,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflows"))
import build_workflows  # noqa: E402

TITLES = {graph.key: graph.title for graph in build_workflows.build_graphs()}
# The core-sampler templates need core 0.33+'s own H3 node, which this server (0.3.75) lacks: its frontend reports
# exactly that type missing (tests/test_core033_comfyui.py loads them in 0.33's page, with nothing missing).
CORE_NAMES = {"t2va_core", "fl2va_core", "ref2va_core"}
CORE_033_ONLY = sorted(build_workflows.CORE_033_SCHEMAS)


def expected_missing(name: str) -> list[str]:
    return CORE_033_ONLY if name in CORE_NAMES else []

NEWEST_VERSION = "1.58.1"  # the comfyui-frontend-package scripts/setup_comfyui.sh installs beside ComfyUI
FRONTEND_ROOT = Path(os.environ.get("H3_FRONTEND_ROOT")
                     or COMFY_DIR / f"frontend-{NEWEST_VERSION}" / "comfyui_frontend_package" / "static")


@pytest.fixture(scope="module")
def newest(request, comfy_factory, tmp_path_factory):  # noqa: F811
    """The one report: every template, then every tiny variant, loaded in one browser session."""
    if not (FRONTEND_ROOT / "index.html").is_file():
        unavailable(f"no frontend at {FRONTEND_ROOT}: scripts/setup_comfyui.sh installs comfyui-frontend-package"
                     f"=={NEWEST_VERSION} there (or set H3_FRONTEND_ROOT to a frontend's static/)")
    ok, reason = ui_available()
    if not ok:
        unavailable(reason)
    tiny_dir = request.getfixturevalue("tiny_dir")  # built only once the frontend is known to be there
    # H3_SHOW_TINY_TWINS: the loaders list the tiny's quantised twins, which the quantised graphs' tiny variants select
    # (this frontend holds combo values to their lists).
    server = comfy_factory(Path(tiny_dir) / "comfyui", {"H3_TINY_DIR": str(tiny_dir), "H3_SHOW_TINY_TWINS": "1"},
                           ("--front-end-root", str(FRONTEND_ROOT)), install=COMFY_0375)
    tiny = build_workflows.tiny_templates(server.object_info())
    folder = tmp_path_factory.mktemp("tiny-templates")
    argv = ["node", str(UI_DIR / "load_templates.mjs")]
    for name in sorted(TITLES):
        argv += ["--template", f"{PACK_NAME}/{TITLES[name]}"]
    for name in sorted(TITLES):
        path = folder / f"tiny_{name}.json"
        path.write_text(json.dumps(tiny[name]))
        argv.append(str(path))
    env = {**os.environ, "COMFY_URL": server.url, "CHROMIUM_PATH": chromium_path() or ""}
    done = subprocess.run(argv, cwd=UI_DIR, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"load_templates.mjs exited {done.returncode}\n{done.stderr[-3000:]}\n{server.log_tail()}"
    report = json.loads(lines[-1])
    assert "error" not in report, report["error"]
    report["tiny"] = tiny
    return report


def test_the_newest_frontend_served_and_lists_the_templates(newest):
    """The page runs the frontend the folder holds (its pip metadata names the version), not the pinned one."""
    installed = [path.name.removeprefix("comfyui_frontend_package-").removesuffix(".dist-info")
                 for path in FRONTEND_ROOT.parents[1].glob("comfyui_frontend_package-*.dist-info")]
    expected = installed or [NEWEST_VERSION]
    assert [newest["frontend_version"]] == expected, (newest["frontend_version"], installed)
    if "H3_FRONTEND_ROOT" not in os.environ:
        assert expected == [NEWEST_VERSION]
    assert sorted(newest["templates_listed"][PACK_NAME]) == sorted(TITLES.values())


@pytest.mark.parametrize("name", sorted(TITLES))
def test_template_loads_cleanly_in_the_newest_frontend(newest, name):
    """From the template browser: no problem, nothing overlaps, and the newer frontend marks exactly the nodes
    whose published file is not installed here (it holds combo values to their lists; 1.32.9 does not)."""
    report = newest["loads"][f"{PACK_NAME}/{TITLES[name]}"]
    assert report["missing_types"] == expected_missing(name) and report["dangling_links"] == [], report
    nodes = json.loads((REPO / build_workflows.TEMPLATES / f"{TITLES[name]}.json").read_text())["nodes"]
    assert report["node_count"] == report["expected_node_count"] == len(nodes)
    if name in CORE_NAMES:
        return
    assert report["problems"] == [], report["problems"]
    assert report["overlaps"] == [], report["boxes"]
    # ... the loaders and the Sampler (its Turbo LoRA): each node listing a published file for download
    listing = {str(node["id"]) for node in nodes if "models" in node["properties"]}
    assert {str(node["id"]) for node in nodes if node["type"] in build_workflows.LOADER_INPUT} <= listing
    assert {str(node["id"]) for node in report["error_nodes"]} == listing


@pytest.mark.parametrize("name", sorted(TITLES))
def test_tiny_variant_loads_without_errors_and_shows_the_badge(newest, name):
    workflow = newest["tiny"][name]
    report = newest["loads"][f"tiny_{name}.json"]
    assert report["missing_types"] == expected_missing(name) and report["dangling_links"] == [], report
    loaders = {str(node["id"]) for node in workflow["nodes"] if node["type"] in build_workflows.PACK_LOADERS}
    assert set(report["tiny_badges"]) == loaders
    if name in CORE_NAMES:
        return
    assert report["problems"] == [] and report["error_nodes"] == [], report
    assert report["overlaps"] == [], report["boxes"]
    # Loader lists by component, as the frontend's combos offer them (the server lists files by what their header
    # holds): the video VAE loader offers no audio VAE file, and the other way round.
    offered = {kind: [] for kind in ("H3SplitVideoVAELoader", "H3SplitAudioVAELoader")}
    for node in workflow["nodes"]:
        if node["type"] in offered:
            offered[node["type"]] += report["combos"][str(node["id"])][build_workflows.LOADER_INPUT[node["type"]]]
    video, audio = offered["H3SplitVideoVAELoader"], offered["H3SplitAudioVAELoader"]
    assert any("video_vae" in name for name in video) and any("audio_vae" in name for name in audio), offered
    assert not any("audio_vae" in name for name in video) and not any("video_vae" in name for name in audio), offered
