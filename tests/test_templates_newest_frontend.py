"""The shipped templates in the newest ComfyUI frontend, served by the ComfyUI the suite runs (0.3.75).

The frontend is a separate PyPI package (comfyui-frontend-package); ComfyUI serves another one with
`--front-end-root`. Install it beside the venv, never into it (0.3.75 pins 1.32.9):

    pip install --no-deps --target /tmp/fe comfyui-frontend-package==1.58.1
    H3_FRONTEND_ROOT=/tmp/fe/comfyui_frontend_package/static pytest tests/test_templates_newest_frontend.py

Without H3_FRONTEND_ROOT the module skips (CI runs the pinned frontend's tests in test_nodes_comfyui.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support.comfy_harness import PACK_NAME, comfy_factory  # noqa: F401  (session fixture)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflows"))
import build_workflows  # noqa: E402

TITLES = {graph.key: graph.title for graph in build_workflows.build_graphs()}

FRONTEND_ROOT = os.environ.get("H3_FRONTEND_ROOT")
pytestmark = pytest.mark.skipif(not FRONTEND_ROOT, reason="H3_FRONTEND_ROOT (a newer frontend's static/) is not set")


@pytest.fixture(scope="module")
def newest(comfy_factory, tiny_dir):  # noqa: F811
    server = comfy_factory(Path(tiny_dir) / "comfyui", {"H3_TINY_DIR": str(tiny_dir)},
                           ("--front-end-root", FRONTEND_ROOT))
    assert "<html" in (Path(FRONTEND_ROOT) / "index.html").read_text().lower()
    return server


@pytest.mark.parametrize("name", sorted(TITLES))
def test_template_loads_cleanly_in_the_newest_frontend(newest, name):
    """From the template browser: no problem, nothing overlaps, and the newer frontend marks exactly the loaders
    whose published file is not installed here (it holds combo values to their lists; 1.32.9 does not)."""
    report = newest.load_workflow_ui(template=TITLES[name])
    assert sorted(report["templates_listed"][PACK_NAME]) == sorted(TITLES.values())
    assert report["missing_types"] == [] and report["dangling_links"] == [], report
    nodes = json.loads((REPO / build_workflows.TEMPLATES / f"{TITLES[name]}.json").read_text())["nodes"]
    assert report["node_count"] == len(nodes)
    assert report["problems"] == [] and report["returncode"] == 0, report["problems"]
    assert report["overlaps"] == [], report["boxes"]
    loaders = {str(node["id"]) for node in nodes if node["type"] in build_workflows.LOADER_INPUT}
    assert {str(node["id"]) for node in report["error_nodes"]} == loaders


@pytest.mark.parametrize("name", sorted(TITLES))
def test_tiny_variant_loads_without_errors_and_shows_the_badge(newest, name):
    workflow = build_workflows.tiny_templates(newest.object_info())[name]
    report = newest.load_workflow_ui(workflow)
    assert report["problems"] == [] and report["returncode"] == 0 and report["error_nodes"] == [], report
    loaders = {str(node["id"]) for node in workflow["nodes"] if node["type"] in build_workflows.LOADER_INPUT}
    assert set(report["tiny_badges"]) == loaders
