"""The pack's progress text in frontend 1.32.9 (ComfyUI 0.3.75's own; UX review 4: a line wrapped under the next
loader's badges and the last line stayed after the run): on the DiT loader of the t2va template's stacked loader
column, the longest lines nodes/progress_text.py sends render as one line (the old tiny-build line took two), and
web/progress_text.js removes the pack's lines, not core's, when a run starts (tests/ui/progress_text.mjs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.comfy_harness import COMFY_0375, UI_DIR, chromium_path, shared_comfy, ui_available, unavailable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflows"))
import build_workflows  # noqa: E402

MAX_TEXT_CHARS = 46  # nodes/progress_text.py (tests/test_node_words.py checks every line against it)
# The longest lines the pack sends under a loader and the Sampler (summaries and heartbeat lines), and the old line.
FITTED = ["building tiny H3 (first use, ~30 s) - 15 s", "done in 123 s, cache skipped 35% of DiT blocks",
          "video VAE: encoding clip 12/12 - 999 s", "decoding audio (one pass) - 125 s"]
OLD = "building the embedded tiny H3 (first use only, about 30 s on a CPU) - 15 s"


@pytest.fixture(scope="module")
def shown(tmp_path_factory) -> dict:
    ok, reason = ui_available()
    if not ok:
        unavailable(reason)
    server = shared_comfy(tmp_path_factory.mktemp("progress-text-ui"), install=COMFY_0375)
    graph = build_workflows.tiny_templates(server.object_info())["t2va"]
    path = tmp_path_factory.mktemp("progress-text-graph") / "t2va.json"
    path.write_text(json.dumps(graph))
    env = {**os.environ, "COMFY_URL": server.url, "CHROMIUM_PATH": chromium_path() or ""}
    done = subprocess.run(["node", str(UI_DIR / "progress_text.mjs"), str(path),
                           json.dumps({"fitted": FITTED, "old": OLD})], cwd=UI_DIR, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"progress_text.mjs exited {done.returncode}\n{done.stderr[-3000:]}\n{server.log_tail()}"
    report = json.loads(lines[-1])
    assert "error" not in report, report["error"]
    return report


def test_the_longest_lines_fit_one_line_of_a_stacked_loader(shown):
    assert shown["frontend_version"].startswith("1.32."), shown
    assert all(len(line) <= MAX_TEXT_CHARS for line in FITTED)
    heights = shown["heights"]
    print(f"[progress text] on {shown['node']}: rendered height / one line's: {heights}")
    assert all(heights[line] is not None and heights[line] < 1.5 for line in FITTED), heights
    assert heights[OLD] >= 1.5, heights  # the measure sees a wrap: the old line took two


def test_a_run_start_clears_the_packs_lines_only(shown):
    assert shown["before_start"] == {"pack": True, "core": True}, shown
    assert shown["after_start"] == {"pack": False, "core": True}, shown
