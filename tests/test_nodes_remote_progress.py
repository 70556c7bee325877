"""The Remote Encode node inside a real ComfyUI shows the encoder server's phases on its progress bar, and an
interrupt still reaches the server.

ComfyUI runs as its own process (tests/support/comfy_harness.py); the encoder server is a real one on 127.0.0.1 in this
process, around the tiny model's real `EncoderStage`, paced so that every phase outlasts a poll.
"""

from __future__ import annotations

import re
import struct
import time

import pytest
from support.comfy_harness import comfy, free_port  # noqa: F401  (session fixture)
from support.remote_cases import PacedStage, SlowStage

from h3_core.remote.client import polling
from h3_core.remote.engines.aiohttp_server import ServerThread
from h3_core.remote.protocol import Limits
from h3_core.remote.server.config import ServerConfig
from h3_core.testing import SERVER_THREADS, wait_until

TEXT_FRAME = 3  # ComfyUI's binary websocket event type for a node's progress text (server.send_progress_text)


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


def node_texts(result, node: str = "1") -> list[str]:
    """The node's progress-text lines, in order: ComfyUI's binary frames of type 3 (TEXT) are the node id's length
    (4 bytes), the node id and the text."""
    texts = []
    for frame in result.binary:
        if struct.unpack(">I", frame[:4])[0] != TEXT_FRAME:
            continue
        (length,) = struct.unpack(">I", frame[4:8])
        if frame[8:8 + length].decode() == node:
            texts.append(frame[8 + length:].decode())
    return texts


def test_remote_encode_node_reports_the_servers_phases(comfy, stage):  # noqa: F811
    with ServerThread(PacedStage(stage, 0.3), ServerConfig(threads=SERVER_THREADS)) as srv:
        result = comfy.run_prompt(remote_graph(srv.url, f"A paced fox {time.time()}."), timeout=300)
    assert result.status == "success"
    values = _node_progress(result)
    # 0 pack, 1 handshake, 2 uploaded, 3 queued, 4 decode, 5 text, 6 video, 7 audio, (8 serialise), 9 answer, 10
    assert values == sorted(set(values)), values
    assert {0, 1, 2, 3, 4, 5, 6, 7, 9, 10}.issubset(values), values
    print(f"\n[progress] ComfyUI ws: {len(values)} progress messages for the Remote Encode node {values}")
    # The same steps in words (UX issue 38 item 5), each phase's line before the next one's, then the summary.
    texts = node_texts(result)
    plain = [line.split(" - ")[0] for line in texts]  # without the heartbeat's " - N s"
    expected = [f"contacting {srv.url}", "sending ", "queued on the server", "decoding the media on the server",
                "encoding text", "encoding video", "encoding audio", "receiving the conditioning ("]
    found = [next((i for i, line in enumerate(plain) if line.startswith(words)), None) for words in expected]
    assert None not in found and found == sorted(found), list(zip(expected, found, strict=True))
    assert re.fullmatch(rf"encoded on {re.escape(srv.url)} in [0-9.]+ (s|ms) \(text: miss.*\)", texts[-1]), texts
    print(f"[progress] Remote Encode's text: {len(texts)} lines, from {texts[0]!r} to {texts[-1]!r}")


def test_the_summary_says_when_the_servers_cache_answered(comfy, stage):  # noqa: F811
    prompt = f"Twice the same fox {time.time()}."
    with ServerThread(stage, ServerConfig(threads=SERVER_THREADS)) as srv:
        graph = remote_graph(srv.url, prompt)
        comfy.run_prompt(graph, timeout=300)
        graph["1"]["inputs"]["timeout_s"] = 119  # another cache key for ComfyUI, the same request for the server
        result = comfy.run_prompt(graph, timeout=300)
    assert result.status == "success"
    assert node_texts(result)[-1].endswith("(cache hit: the whole conditioning)"), node_texts(result)


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
        assert any(line.startswith("cancel") for line in node_texts(result)), node_texts(result)  # acknowledged
        assert wait_until(lambda: slow.cancelled == 1, 20)  # the model thread stopped at its next checkpoint
        stopped_after = time.monotonic() - seen["sent"]
        # Real time: cancelled at a checkpoint, not after the 20 s of work; the margin is for a loaded machine
        # (load average 8 on 2 cores: ComfyUI's interrupt, the poller and the server all share 2 cores).
        assert stopped_after < 12.0, stopped_after
        assert srv.call(lambda: srv.service.counters["client_gone"]) == 1
    print(f"\n[progress] interrupt -> server job cancelled {stopped_after * 1000:.0f} ms after the ws message")


# --- a failed remote encode says the next step (issue 29 item 8) ------------------------------------------------


def _node_error(comfy, endpoint: str, prompt: str) -> str:  # noqa: F811
    result = comfy.run_prompt(remote_graph(endpoint, prompt), timeout=120, check=False)
    assert result.status == "error", result.status
    return result.error["exception_message"]


def test_a_closed_port_says_to_start_the_server_or_edit_the_endpoint(comfy):  # noqa: F811
    port = free_port()  # nothing listens there
    message = _node_error(comfy, f"http://127.0.0.1:{port}", f"Nobody home {time.time()}.")
    assert "the server is unreachable or busy - connection refused" in message, message
    assert f"python -m h3_core serve --models DIR --port {port}" in message, message
    assert "set this node's endpoint" in message, message


def test_a_token_refusal_says_where_the_token_goes(comfy, stage):  # noqa: F811
    config = ServerConfig(token="t" * 40, threads=SERVER_THREADS)
    with ServerThread(stage, config) as srv:
        message = _node_error(comfy, srv.url, f"Locked out {time.time()}.")
    assert "wants a valid token (HTTP 401 Unauthorized) [unauthorized]" in message, message
    for words in ("H3_ENCODER_TOKEN", "H3_ENCODER_URLS", "H3_ENCODER_TOKENS", "in the environment ComfyUI starts from",
                  "never in a widget", "restart ComfyUI"):
        assert words in message, (words, message)


def test_a_refused_input_names_the_field_with_the_servers_message(comfy, stage):  # noqa: F811
    config = ServerConfig(limits=Limits(max_prompt_chars=20), threads=SERVER_THREADS)
    with ServerThread(stage, config) as srv:
        message = _node_error(comfy, srv.url, f"A fox walks through the deep snow {time.time()}.")
    assert "the server refused the request (HTTP 4" in message, message
    assert "- prompt: " in message and "max_prompt_chars=20" in message, message
    assert "Change the input the server names" in message, message
