"""Encode-ahead turns itself off, saying so once, when a ComfyUI internal it reads is not there (as after a core
update), and H3 Remote Encode still works (nodes/comfy_queue_seam.py).

A real ComfyUI whose prompt queue lacks `get_current_queue_volatile` (a custom node loaded beside the pack deletes
it, as a core update renaming it would), a real encoder server on loopback listed in H3_ENCODER_URLS, and queued
prompts that encode-ahead would otherwise consider.
"""

from __future__ import annotations

import time

import pytest
from support.comfy_harness import comfy_available, start_comfy, thread_env

from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.remote.engines.aiohttp_server import ServerThread
from h3_core.remote.server.config import ServerConfig
from h3_core.testing import SERVER_THREADS

OFF_LINE = "encode-ahead off: ComfyUI's PromptQueue.get_current_queue_volatile is missing or not as expected"
# Loaded by ComfyUI as a custom node (a single file): the queue snapshot encode-ahead reads is gone.
REMOVE_QUEUE_SNAPSHOT = '''import execution

del execution.PromptQueue.get_current_queue_volatile
NODE_CLASS_MAPPINGS = {}
'''


@pytest.fixture(scope="module")
def encoder(tiny_dir):
    with ServerThread(EncoderStage(ModelSource.from_path(tiny_dir)), ServerConfig(threads=SERVER_THREADS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def changed_comfy(tiny_dir, encoder, tmp_path_factory):
    ok, reason = comfy_available()
    if not ok:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("comfy-seam")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "h3_test_remove_queue_snapshot.py").write_text(REMOVE_QUEUE_SNAPSHOT)
    env = {**thread_env(), "H3_TINY_DIR": str(tiny_dir), "H3_ENCODER_URLS": encoder.url,
           "H3_ENCODE_AHEAD_DELAY": "0"}
    server = start_comfy(base, models_src=tiny_dir / "comfyui", env=env)
    yield server
    server.stop()


def remote_graph(endpoint: str, prompt: str) -> dict:
    inputs = {"prompt": prompt, "width": 0, "height": 0, "length": 124, "endpoint": endpoint, "task": "auto",
              "timeout_s": 120}
    return {"1": {"class_type": "H3SplitRemoteEncode", "inputs": inputs},
            "2": {"class_type": "H3SplitSaveConditioning",
                  "inputs": {"conditioning": ["1", 0], "filename_prefix": "h3seam/remote"}}}


def test_encode_ahead_is_off_said_once_and_remote_encode_still_works(changed_comfy, encoder):
    for index in range(2):
        result = changed_comfy.run_prompt(remote_graph(encoder.url, f"Fox {index} {time.time()}."), timeout=300)
        assert result.status == "success", result.error
    log = changed_comfy.log_text()
    assert log.count(OFF_LINE) == 1, changed_comfy.log_tail()
    assert "encoded ahead" not in log and "queue watch failed" not in log, changed_comfy.log_tail()
    assert encoder.call(lambda: encoder.service.counters["computed"]) == 2
