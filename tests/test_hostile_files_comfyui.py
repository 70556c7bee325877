"""Hostile files in a real ComfyUI: a conditioning file replaced while the Sampler uses it, and the widgets' bounds.

The Load Conditioning node once handed the Sampler views of the memory-mapped file: a client that
re-uploaded a 64-byte file over it (`POST /upload/image` with `overwrite=true`) killed ComfyUI with SIGBUS and the
whole queue with it. Now the file is read into memory and checked, so the prompt finishes with what it read.
"""

from __future__ import annotations

import copy
import json
import threading
import urllib.request
import uuid

import torch
from support.comfy_harness import comfy  # noqa: F401  (session fixture)
from support.contract_cases import make

from h3_core import facts

TINY = "[embedded] tiny H3 (random weights, outputs are noise)"
NAME = "h3_hostile_cond.safetensors"


def _graph(steps: int) -> dict:
    return {
        "1": {"class_type": "H3SplitLoadConditioning", "inputs": {"conditioning_file": NAME}},
        "2": {"class_type": "H3SplitVideoVAELoader", "inputs": {"vae": TINY}},
        "3": {"class_type": "H3SplitAudioVAELoader", "inputs": {"audio_vae": TINY}},
        "4": {"class_type": "H3SplitDiTLoader", "inputs": {"dit": TINY, "partition": "fl2va (t2va, first/last frame)",
                                                           "weight_dtype": "default"}},
        "6": {"class_type": "H3SplitSampler", "inputs": {"dit": ["4", 0], "conditioning": ["1", 0], "seed": 0,
                                                         "steps": steps, "video_shift": 12.0, "audio_shift": 3.0}},
        "7": {"class_type": "H3SplitDecode", "inputs": {"latent": ["6", 0], "vae": ["2", 0], "audio_vae": ["3", 0]}},
        "8": {"class_type": "SaveVideo", "inputs": {"video": ["7", 0], "filename_prefix": "h3test/hostile_files",
                                                    "format": "auto", "codec": "auto"}},
    }


def _upload(url: str, name: str, data: bytes) -> int:
    """ComfyUI's own upload endpoint, as a client would call it: replace input/<name> in place."""
    boundary = uuid.uuid4().hex
    body = b"".join([
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"{name}\"\r\n"
        "Content-Type: application/octet-stream\r\n\r\n".encode(), data, b"\r\n",
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"overwrite\"\r\n\r\ntrue\r\n".encode(),
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"type\"\r\n\r\ninput\r\n".encode(),
        f"--{boundary}--\r\n".encode(),
    ])
    request = urllib.request.Request(f"{url}/upload/image", data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.status


def test_a_conditioning_replaced_mid_sample_does_not_kill_comfyui(comfy):  # noqa: F811
    # Half a MB of embeddings, which the Sampler reads at every step (the file was 1.69 MB; any size works,
    # the SIGBUS came from reading a mapped page past the new end of the file).
    cond = make("t2va", prompt_embeds=torch.randn(1, 2000, 64, generator=torch.Generator().manual_seed(22)),
                text_token_tags=torch.ones(2000, dtype=torch.int64))
    assert _upload(comfy.url, NAME, cond.to_bytes()) == 200
    pid = comfy.proc.pid
    replaced = threading.Event()

    def on_message(message):  # the Sampler reports its first step: replace the file under it
        data = message.get("data") or {}
        if message.get("type") == "progress" and data.get("node") == "6" and not replaced.is_set():
            replaced.set()
            assert _upload(comfy.url, NAME, b"\0" * 64) == 200

    result = comfy.run_prompt(_graph(steps=8), timeout=600, check=False, on_message=on_message)
    assert replaced.is_set(), result.types()
    assert comfy.alive() and comfy.proc.pid == pid, comfy.log_tail()
    # The prompt finishes with the data it read (or fails with a clear error; it never takes ComfyUI down).
    if result.status != "success":
        assert "payload" in json.dumps(result.error), result.error
    assert (comfy.input_dir / NAME).stat().st_size == 64
    # The queue goes on: the 64-byte file is refused with a clear error, a good file runs.
    refused = comfy.run_prompt(_graph(steps=2), timeout=600, check=False)
    assert refused.status == "error" and "not a safetensors file" in json.dumps(refused.error), refused.error
    assert _upload(comfy.url, NAME, cond.to_bytes()) == 200
    assert comfy.run_prompt(_graph(steps=2), timeout=600).status == "success"
    print(f"conditioning replaced mid-sample: prompt {result.status} in {result.elapsed_s:.1f} s, ComfyUI alive")


def test_encode_widgets_stop_at_the_absolute_canvas_bound(comfy):  # noqa: F811
    inputs = comfy.object_info("H3SplitTextEncode")["input"]
    widgets = {**inputs.get("required", {}), **inputs.get("optional", {})}
    assert widgets["width"][1]["max"] == widgets["height"][1]["max"] == facts.MAX_CANVAS_EDGE
    assert widgets["length"][1]["max"] == facts.MAX_FRAMES
    graph = copy.deepcopy(_graph(2))
    graph["1"] = {"class_type": "H3SplitTextEncode", "inputs": {"text_encoder": ["9", 0], "prompt": "A fox.",
                                                                 "width": 4096, "height": 4096, "length": 124,
                                                                 "task": "t2va"}}
    graph["9"] = {"class_type": "H3SplitTextEncoderLoader", "inputs": {"text_encoder": TINY}}
    status, body = comfy.post_prompt_expect_error(graph)
    assert status == 400 and "larger than the pack runs" in json.dumps(body), body
