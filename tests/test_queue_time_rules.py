"""The queue-time rules of nodes/graph_checks.py as plain functions (no ComfyUI): the media a graph connects, the
task it fixes, the `cache` forms the Sampler accepts, and the sentence that says how to get cache-dit.

tests/test_queue_time_errors_comfyui.py rings each rule in a real ComfyUI; this module covers what that server cannot
show (cache-dit is installed beside it) and the graph walk's corner cases. graph_checks imports nothing from ComfyUI;
it is loaded here under a stand-in package so that the pack's own `nodes/__init__.py` (which imports ComfyUI) does
not run.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "h3_pack_under_test"


@pytest.fixture(scope="module")
def checks():
    """nodes/graph_checks.py, its `..h3_core` being the h3_core every other test imports (one copy of its modules)."""
    if PACKAGE not in sys.modules:
        for name in ("facts", "rules", "step_cache"):  # `from ..h3_core import x` then finds them as attributes
            importlib.import_module(f"h3_core.{name}")
        pack = types.ModuleType(PACKAGE)
        pack.__path__ = [str(ROOT)]
        nodes = types.ModuleType(f"{PACKAGE}.nodes")
        nodes.__path__ = [str(ROOT / "nodes")]
        sys.modules.update({PACKAGE: pack, f"{PACKAGE}.nodes": nodes, f"{PACKAGE}.h3_core": sys.modules["h3_core"]})
    module = importlib.import_module(f"{PACKAGE}.nodes.graph_checks")
    assert module.rules is sys.modules["h3_core.rules"]
    return module


def t2va(task: str = "t2va", media=None) -> dict:
    graph = {
        "1": {"class_type": "H3SplitTextEncoderLoader", "inputs": {"text_encoder": "x"}},
        "5": {"class_type": "H3SplitTextEncode", "inputs": {"text_encoder": ["1", 0], "prompt": "p", "task": task}},
        "9": {"class_type": "H3SplitVideoVAEEncode", "inputs": {"conditioning": ["5", 0], "vae": ["2", 0]}},
        "6": {"class_type": "H3SplitSampler", "inputs": {"dit": ["4", 0], "conditioning": ["9", 0]}},
    }
    if media is not None:
        graph.update(media)
        graph["5"]["inputs"]["media"] = ["7", 0]
    return graph


KEYFRAMES = {"7": {"class_type": "H3SplitKeyframes", "inputs": {"first_frame": ["20", 0]}}}
REFERENCES = {  # two chained References nodes: 1 image + 1 audio, then 1 video
    "7": {"class_type": "H3SplitReferences", "inputs": {"media": ["8", 0], "ref_video_1": ["21", 0]}},
    "8": {"class_type": "H3SplitReferences", "inputs": {"ref_image_1": ["20", 0], "ref_audio_2": ["22", 0]}},
}


def test_media_is_counted_from_the_sockets_connected(checks):
    assert checks.media_of(t2va(), "5") == checks.Media()
    assert checks.media_of(t2va(media=KEYFRAMES), "5") == checks.Media(keyframes=1)
    assert checks.media_of(t2va(media=REFERENCES), "5") == checks.Media(images=1, videos=1, audios=1)
    unknown = t2va(media={"7": {"class_type": "SomeoneElsesMedia", "inputs": {}}})
    assert checks.media_of(unknown, "5") is None  # the graph does not say: no rule rings
    looped = t2va(media={"7": {"class_type": "H3SplitReferences", "inputs": {"media": ["7", 0]}}})
    assert checks.media_of(looped, "5") is None


@pytest.mark.parametrize("task, media, fragment", [
    ("fl2va", None, "fl2va needs 1 or 2 keyframes (first and/or last frame) or a guide, got 0 keyframes: connect "
                    "MiniMax H3 Keyframes"),
    ("fl2va", REFERENCES, "fl2va takes first/last keyframes and guides only; references need task ref2va: set task "
                          "to ref2va"),
    ("t2va", KEYFRAMES, "t2va takes a prompt only"),
    ("ref2va", None, "ref2va needs at least one image or video reference"),
    ("ref2va", KEYFRAMES, "ref2va takes references, not keyframes"),
])
def test_task_against_the_media_connected(checks, task, media, fragment):
    graph = t2va(task, media)
    problem = checks.task_problem(task, checks.media_of(graph, "5"))
    assert problem and fragment in problem, problem
    assert checks.resolved_task(graph, "5") is None  # Text Encode refuses it: the Sampler's partition rule waits


@pytest.mark.parametrize("task, media, resolved", [
    ("auto", None, "t2va"), ("auto", KEYFRAMES, "fl2va"), ("auto", REFERENCES, "ref2va"),
    ("fl2va", KEYFRAMES, "fl2va"), ("ref2va", REFERENCES, "ref2va"), ("t2va", None, "t2va"),
])
def test_the_task_the_sampler_gets_through_the_vae_encodes(checks, task, media, resolved):
    graph = t2va(task, media)
    assert checks.task_problem(task, checks.media_of(graph, "5")) is None
    assert checks.conditioning_task(graph, "6") == resolved


def test_no_task_where_something_else_makes_the_conditioning(checks):
    graph = t2va()
    graph["9"]["inputs"]["conditioning"] = ["30", 0]
    graph["30"] = {"class_type": "H3SplitLoadConditioning", "inputs": {"conditioning_file": "a.h3cond"}}
    assert checks.conditioning_task(graph, "6") is None
    assert checks.conditioning_task(None, "6") is None  # no graph (no server): every graph rule is silent


@pytest.mark.parametrize("value", ["off", "every:2", "every:3", "every:4", "every:9", " Every:2 ", "OFF"])
def test_cache_values_that_need_nothing_extra(checks, value, monkeypatch):
    monkeypatch.setattr(checks, "cache_dit_installed", lambda: False)
    assert checks.cache_problem(value) is None


@pytest.mark.parametrize("value, fragment", [
    ("turbo", "cache must be off, quality, balanced, fast, every:K (an integer K >= 2) or dbcache:"),
    ("every:1", "every:K needs an integer K >= 2, got 'every:1'"),
    ("every:two", "every:K needs an integer K >= 2"),
    (3, "cache must be text, got 3"),
])
def test_unknown_cache_values_name_the_accepted_forms(checks, value, fragment):
    problem = checks.cache_problem(value)
    assert problem and fragment in problem, problem


@pytest.mark.parametrize("value", ["quality", "balanced", "fast", "Fast", "dbcache:threshold=0.2"])
def test_cache_dit_presets_without_cache_dit_say_how_to_get_it(checks, value, monkeypatch):
    monkeypatch.setattr(checks, "cache_dit_installed", lambda: False)
    problem = checks.cache_problem(value)
    assert problem == (
        f"cache {value} needs cache-dit, which is not installed (the pack's requirements.txt, all that ComfyUI "
        "Manager installs, leaves it out): run `pip install cache-dit==1.5.3` (or `pip install \".[cache]\"` in the "
        "pack's folder) in ComfyUI's Python, then restart ComfyUI; or pick off or every:2/3/4, which need nothing "
        "extra"
    )
    monkeypatch.setattr(checks, "cache_dit_installed", lambda: True)
    assert checks.cache_problem(value) is None


def test_cache_dit_is_looked_up_not_imported(checks, monkeypatch):
    """find_spec only: the check never imports cache-dit (it pulls in much of diffusers)."""
    asked = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: asked.append(name))
    monkeypatch.delitem(sys.modules, "cache_dit", raising=False)
    assert checks.cache_dit_installed() is False and asked == ["cache_dit"]
    assert "cache_dit" not in sys.modules


def test_a_failing_graph_rule_never_blocks_a_prompt(checks, caplog):
    """ComfyUI refuses a prompt whose validate_inputs raises: a bug in a graph rule must say nothing instead."""

    @checks.guarded
    def broken(graph):
        raise KeyError("a graph shape this module did not expect")

    assert broken({}) == []
    assert "a queue-time graph check failed" in caplog.text


def test_each_request_sees_its_own_graph(checks):
    """The graph rides in a context variable: what one request remembers, another (another task) never reads."""
    import asyncio

    async def post(graph):
        checks.remember({"prompt": graph})
        await asyncio.sleep(0)
        return checks.graph()

    async def both():
        return await asyncio.gather(post({"1": {}}), post({"2": {}}))

    assert asyncio.run(both()) == [{"1": {}}, {"2": {}}]
    assert checks.graph() is None
