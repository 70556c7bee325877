"""Module fixtures for tests that run the pack's graphs in a real ComfyUI: the session's ComfyUI with the tiny H3
installed as the loaders' embedded-tiny choice (`server`), and a real encoder endpoint on loopback (`encoder_url`).

Import both into a test module (`from support.comfy_pack import encoder_url, server`). Both are shared by every module
of a test process: the ComfyUI per configuration (comfy_harness), the encoder endpoint once (`_SharedEncoder`).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess

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


class _SharedEncoder:
    """The one `python -m h3_core serve` on the tiny H3 that every graph test of this process sends Remote Encode to
    (its answers are pure functions of the request, so modules need no server of their own: a start is ~9 CPU-s
    and a model load). Started on first use, restarted if it died, stopped at exit."""

    proc = None
    url = None
    log = None

    @classmethod
    def get(cls, tiny_dir, log_dir) -> str:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.stop()
            port = free_port()
            cls.log = open(log_dir / "server.log", "w")
            env = {**os.environ, "H3_THREADS": os.environ.get("H3_THREADS", "2")}
            cls.proc, cls.url = spawn_serve(tiny_dir, port, cls.log, env), f"http://127.0.0.1:{port}"
            wait_healthy(cls.url, cls.proc, timeout=300)
        return cls.url

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.send_signal(signal.SIGTERM)
            try:
                cls.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                cls.proc.kill()
                cls.proc.wait(timeout=30)
        if cls.log is not None:
            cls.log.close()
        cls.proc = cls.log = None


atexit.register(_SharedEncoder.stop)


@pytest.fixture(scope="module")
def encoder_url(tiny_dir, tmp_path_factory):
    """The process's shared encoder endpoint (`_SharedEncoder`), checked alive for each module."""
    return _SharedEncoder.get(tiny_dir, tmp_path_factory.mktemp("encoder"))
