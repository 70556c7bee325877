"""The Remote Encode node inside a real ComfyUI shows the encoder server's phases on its progress bar, and an
interrupt still reaches the server.

ComfyUI runs as its own process (tests/support/comfy_harness.py); the encoder server is a real one on 127.0.0.1 in this
process, around the tiny model's real `EncoderStage`, paced so that every phase outlasts a poll.
"""

from __future__ import annotations

import time

import pytest
from support.comfy_harness import comfy, free_port  # noqa: F401  (session fixture)
from support.remote_cases import PacedStage, SlowStage

from h3_core.remote import polling
from h3_core.remote.server import ServerConfig, ServerThread
from h3_core.testing import SERVER_THREADS, wait_until


@pytest.fixture(scope="module")
def stage(encoder_stage):
    return encoder_stage  # conftest: loaded once per session


def remote_graph(endpoint: str, prompt: str) -> dict:
    inputs = {"prompt": prompt, "width": 0, "height": 0, "length": 124, "endpoint": endpoint, "task": "auto",
              "timeout_s": 120}
    return {"1": {"class_type": "H3SplitRemoteEncode", "inputs": inputs},
            "2": {"class_type": "H3SplitSaveConditioning",
                  "inputs": {"conditioning": ["1", 0], "filename_prefix": "h3progress/remote"}}}


def _node_progress(result, node: str = "1") -> list[int]:
    return [m["value"] for m in result.of_type("progress") if m.get("node") == node and m.get("max") == polling.STEPS]


def test_remote_encode_node_reports_the_servers_phases(comfy, stage):  # noqa: F811
    with ServerThread(PacedStage(stage, 0.3), ServerConfig(threads=SERVER_THREADS)) as srv:
        result = comfy.run_prompt(remote_graph(srv.url, f"A paced fox {time.time()}."), timeout=300)
    assert result.status == "success"
    values = _node_progress(result)
    # 0 pack, 1 handshake, 2 uploaded, 3 queued, 4 decode, 5 text, 6 video, 7 audio, (8 serialise), 9 answer, 10
    assert values == sorted(set(values)), values
    assert {0, 1, 2, 3, 4, 5, 6, 7, 9, 10}.issubset(values), values
    print(f"\n[progress] ComfyUI ws: {len(values)} progress messages for the Remote Encode node {values}")


def test_interrupting_the_node_cancels_the_servers_job(comfy, stage):  # noqa: F811
    slow = SlowStage(stage, delay=20.0)
    with ServerThread(slow, ServerConfig(threads=SERVER_THREADS)) as srv:
        seen = {}

        def on_message(message):
            data = message.get("data", {})
            if message.get("type") == "progress" and data.get("node") == "1" and data.get("max") == polling.STEPS \
                    and data.get("value", 0) >= 4 and "sent" not in seen:  # the server is decoding
                seen["sent"] = time.monotonic()
                comfy.interrupt()

        result = comfy.run_prompt(remote_graph(srv.url, f"Interrupt me {time.time()}."), timeout=120,
                                  check=False, on_message=on_message)
        assert result.status == "interrupted", result.error
        assert "sent" in seen
        assert wait_until(lambda: slow.cancelled == 1, 20)  # the model thread stopped at its next checkpoint
        stopped_after = time.monotonic() - seen["sent"]
        # Real time: cancelled at a checkpoint, not after the 20 s of work; the margin is for a loaded machine
        # (load average 8 on 2 cores: ComfyUI's interrupt, the poller and the server all share 2 cores).
        assert stopped_after < 12.0, stopped_after
        assert srv.call(lambda: srv.service.counters["client_gone"]) == 1
    print(f"\n[progress] interrupt -> server job cancelled {stopped_after * 1000:.0f} ms after the ws message")
