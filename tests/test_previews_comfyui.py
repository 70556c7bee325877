"""Live previews and per-node progress inside a real ComfyUI started with `--preview-method auto`.

One shipped workflow (ref2va: every loader, every encoder, the sampler and the decoder) runs on a fresh
server, so no node is served from cache; the websocket's preview frames and progress events are counted.
"""

from __future__ import annotations

import io
import json
import struct
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image
from support.comfy_harness import comfy_factory, progress_as_sent  # noqa: F401  (comfy_factory: session fixture)

REPO = Path(__file__).resolve().parents[1]
PREVIEW_IMAGE = 1  # ComfyUI's binary websocket event type for a preview picture
JPEG = 1


@pytest.fixture(scope="module")
def preview_server(comfy_factory, tiny_dir):  # noqa: F811
    server = comfy_factory(Path(tiny_dir) / "comfyui", {"H3_TINY_DIR": str(tiny_dir)},
                           ("--preview-method", "auto"))
    server.add_model("minimax_h3", tiny_dir, "tiny")
    return server


@pytest.fixture(scope="module")
def ref2va_run(preview_server):
    graph = json.loads((REPO / "workflows" / "api" / "ref2va.json").read_text())
    graph["12"]["inputs"]["seed"] = 31  # a seed no other module uses: nothing cached
    return graph, preview_server.run_prompt(graph, timeout=900)


def progress_by_node(result) -> dict[str, list[tuple[int, int]]]:
    events: dict[str, list[tuple[int, int]]] = {}
    for message in result.of_type("progress"):
        events.setdefault(str(message["node"]), []).append((message["value"], message["max"]))
    return events


def test_sampler_sends_a_preview_every_step(ref2va_run):
    graph, result = ref2va_run
    assert result.status == "success"
    steps = graph["12"]["inputs"]["steps"] - 1
    frames = [frame for frame in result.binary if struct.unpack(">I", frame[:4])[0] == PREVIEW_IMAGE]
    assert len(frames) == steps, f"{len(frames)} previews for {steps} steps"
    for frame in frames:
        assert struct.unpack(">I", frame[4:8])[0] == JPEG
        image = Image.open(io.BytesIO(frame[8:]))
        assert image.format == "JPEG" and image.size[0] == 2 * image.size[1]  # the 128x64 canvas's latent, scaled
    # Each preview rides on the sampler's own progress event for that step.
    assert progress_by_node(result)["12"] == [(0, steps)] + [(k, steps) for k in range(1, steps + 1)]


def test_every_long_node_reports_progress(ref2va_run):
    graph, result = ref2va_run
    events = progress_by_node(result)
    counts = Counter({node: len(values) for node, values in events.items()})
    print("progress events per node:", {graph[n]["class_type"]: c for n, c in sorted(counts.items())})
    for node in ("1", "2", "3", "4"):  # loaders: bytes, start to end
        values = events[node]
        assert values[0][0] == 0 and values[-1][0] == values[-1][1] > 1000, (graph[node]["class_type"], values)
    # One update per unit (core 0.33 sends a bar's updates 100 ms apart at most: progress_as_sent). Text encode: one
    # per layer of the tiny stack; video VAE: one unit for the reference image, one per 17-frame clip of the reference
    # video (3 here); audio VAE: the video's soundtrack and the reference audio.
    assert progress_as_sent(events["9"], [(k, 51) for k in range(52)]), events["9"]
    assert progress_as_sent(events["10"], [(k, 4) for k in range(5)]), events["10"]
    assert progress_as_sent(events["11"], [(0, 2), (1, 2), (2, 2)]), events["11"]
    decode = events["13"]
    tiles = [value for value in decode if value[1] > 1]
    assert tiles[-1][0] == tiles[-1][1] and decode[-2:] == [(0, 1), (1, 1)]  # tiles, then the audio decode
