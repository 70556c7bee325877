"""Module fixtures for tests that run the pack's graphs in a real ComfyUI: the session's ComfyUI with the tiny H3
installed as the loaders' embedded-tiny choice (`server`), and a real encoder endpoint on loopback (`encoder_url`).

Import both into a test module (`from support.comfy_pack import encoder_url, server`): each module gets its own.
"""

from __future__ import annotations

import os
import signal

import pytest

from .comfy_harness import free_port
from .encoder_process import spawn_serve, wait_healthy

#: The node types this pack registers (every one `H3Split*`), in every ComfyUI the tests run.
PACK_NODES = (
    "H3SplitTextEncoderLoader", "H3SplitVideoVAELoader", "H3SplitAudioVAELoader", "H3SplitDiTLoader",
    "H3SplitKeyframes", "H3SplitReferences", "H3SplitTextEncode", "H3SplitVideoVAEEncode", "H3SplitAudioVAEEncode",
    "H3SplitRemoteEncode", "H3SplitSampler", "H3SplitDecode", "H3SplitSaveConditioning", "H3SplitLoadConditioning",
    "H3SplitEmptyLatentFromConditioning",
)


@pytest.fixture(scope="module")
def server(comfy, tiny_dir):
    comfy.add_model("minimax_h3", tiny_dir, "tiny")  # the loaders' embedded-tiny choice, prebuilt
    return comfy


@pytest.fixture(scope="module")
def encoder_url(tiny_dir, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("encoder") / "server.log", "w")
    env = {**os.environ, "H3_THREADS": os.environ.get("H3_THREADS", "2")}
    proc = spawn_serve(tiny_dir, port, log, env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout=300)
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    log.close()
