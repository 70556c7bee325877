"""`python -m h3_core comfy-run` without a ComfyUI: what it refuses before posting, how it throttles progress, and
its exit code when nothing answers (tests/test_headless_api_comfyui.py runs it against a real ComfyUI)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from h3_core import comfy_run

REPO = Path(__file__).resolve().parents[1]
T2VA = REPO / "workflows" / "api" / "t2va.json"


def test_overrides_are_applied_and_typed():
    graph = comfy_run.load_workflow(T2VA, ["6.seed=7", "5.prompt=a fox", '5.task="t2va"', "6.steps=2"])
    assert graph["6"]["inputs"]["seed"] == 7 and graph["6"]["inputs"]["steps"] == 2
    assert graph["5"]["inputs"]["prompt"] == "a fox" and graph["5"]["inputs"]["task"] == "t2va"


@pytest.mark.parametrize("overrides, fragment", [
    (["99.seed=1"], "has no node '99' (it has 1, 2, 3, 4, 5, 6, 7, 8)"),
    (["seed=1"], "expected NODE.INPUT=VALUE"),
    (["6.seed"], "expected NODE.INPUT=VALUE"),
])
def test_a_bad_override_is_refused_naming_the_form(overrides, fragment):
    with pytest.raises(comfy_run.WorkflowError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        comfy_run.load_workflow(T2VA, overrides)


def test_files_that_are_not_api_workflows_are_refused_with_what_to_do(tmp_path):
    ui = next((REPO / "example_workflows").glob("*t2va - *.json"))
    with pytest.raises(comfy_run.WorkflowError, match=r"is a UI workflow .*Export \(API\)"):
        comfy_run.load_workflow(ui, [])
    for name, text in (("empty.json", "{}"), ("list.json", "[1]"), ("broken.json", "{"), ("nodes.json", '{"1": 2}')):
        (tmp_path / name).write_text(text)
        with pytest.raises(comfy_run.WorkflowError, match="not an API workflow|not a readable JSON workflow"):
            comfy_run.load_workflow(tmp_path / name, [])
    body = tmp_path / "body.json"  # a saved POST /prompt body: its graph is taken
    body.write_text(json.dumps({"prompt": json.loads(T2VA.read_text()), "client_id": "x"}))
    assert comfy_run.load_workflow(body, [])["6"]["class_type"] == "H3SplitSampler"


def test_progress_prints_each_phase_itslast_step_and_a_line_every_two_seconds():
    now = [0.0]
    show = comfy_run.Throttle(clock=lambda: now[0])
    lines = ["reading the weights: 5%", "reading the weights: 6%", "decoding audio (one pass) - 1 s"]
    assert [show("n3", line) for line in lines] == [True, False, True]  # 6% is the same phase as 5%
    assert [show("n6", "1/8"), show("n6", "2/8"), show("n6", "8/8", final=True)] == [True, False, True]
    now[0] = 2.5
    assert show("n3", "decoding audio (one pass) - 3 s")  # the same phase, two seconds later
    assert [comfy_run.last_step(line) for line in ("DiT forward 7/7", "DiT forward 3/7", "tile 0/7", "done")] == [
        True, False, False, False]


def test_no_comfyui_at_the_url_is_exit_code_3(tmp_path, capsys):
    args = argparse.Namespace(workflow=str(T2VA), set=[], server="http://127.0.0.1:9", out=str(tmp_path),
                              timeout=30.0)
    assert comfy_run.command(args) == 3
    assert "no ComfyUI answered at http://127.0.0.1:9" in capsys.readouterr().err
