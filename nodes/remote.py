"""H3 Remote Encode: the conditioning from an encoder endpoint on another machine.

Same inputs as the local chain (prompt, canvas, length, media), the same conditioning out
(bit-identical to local encoding of the same inputs), but no text encoder or VAE encoder is loaded
here. The bearer token comes only from the environment (H3_ENCODER_TOKEN), never from a widget or
a saved workflow. The call runs in a worker thread while this node polls ComfyUI's interrupt flag
and forwards a cancel to the server.
"""

from __future__ import annotations

import threading
import time

import comfy.model_management as mm
from comfy_api.latest import io

from ..h3_core.remote.client import EncoderClient
from . import comfy_bridge as bridge
from .encode import TASKS, check_numbers, numbers_inputs, request_from
from .types import CATEGORY, Media

TOKEN_ENV = "H3_ENCODER_TOKEN"


def _client(endpoint: str, timeout_s: int) -> EncoderClient:
    urls = [url.strip() for url in endpoint.split(",") if url.strip()]
    return EncoderClient(urls, token_env=TOKEN_ENV, read_timeout=float(timeout_s))


class RemoteEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3SplitRemoteEncode",
            display_name="H3 Remote Encode",
            category=f"{CATEGORY}/encode",
            description="Runs all three H3 encoders (Qwen3-VL text, video VAE, audio VAE) on a remote H3 encoder "
            "endpoint (`python -m h3_core serve`) and returns the same conditioning the local encode nodes make. "
            "The token, if the server wants one, is read from the H3_ENCODER_TOKEN environment variable.",
            inputs=[
                io.String.Input("prompt", multiline=True, tooltip="Passed verbatim. Refer to references as "
                                "<Picture i>, <Video k>, <Audio j>."),
                *numbers_inputs(),
                io.String.Input("endpoint", default="http://127.0.0.1:8190",
                                tooltip="Encoder endpoint URL; several, comma-separated, fail over in order. "
                                "Use https:// through a TLS proxy off this machine (docs/DEPLOY.md)."),
                Media.Input("media", optional=True, tooltip="Keyframes (fl2va) or references (ref2va)."),
                io.Combo.Input("task", options=TASKS, default="auto", optional=True),
                io.Int.Input("timeout_s", default=600, min=5, max=7200, optional=True,
                             tooltip="Seconds to wait for the server's answer (connecting times out much sooner)."),
            ],
            outputs=[io.Conditioning.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, width, height, length, endpoint, **kwargs):
        if not endpoint.strip().lower().startswith(("http://", "https://")):
            return f"endpoint must be an http:// or https:// URL, got {endpoint!r}"
        return check_numbers(width, height, length)

    @classmethod
    def fingerprint_inputs(cls, endpoint, timeout_s=600, **kwargs):
        # A weights swap on the server must invalidate cached conditioning: key on its model identity.
        try:
            capabilities = _client(endpoint, timeout_s).capabilities()
            return f"{endpoint}|{capabilities.get('model', {}).get('fingerprint')}"
        except Exception:  # unreachable now: run again, and let execute report the error
            return f"{endpoint}|unreachable|{time.time()}"

    @classmethod
    def execute(cls, prompt, width, height, length, endpoint, media=None, task="auto", timeout_s=600) -> io.NodeOutput:
        request = request_from(media, prompt, task, width, height, length)
        request.validate()  # the server checks again; failing here costs no upload
        client = _client(endpoint, timeout_s)
        cancel = threading.Event()
        progress = bridge.progress_callback(cls.hidden.unique_id)
        result: dict = {}

        def work():
            try:
                result["cond"] = client.encode(request, cancel=cancel, progress=progress)
            except BaseException as error:  # handed to the node thread below
                result["error"] = error

        worker = threading.Thread(target=work, name="h3-remote-encode", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(timeout=0.1)
            if mm.processing_interrupted():
                cancel.set()  # the client closes the connection; the server abandons the work
                worker.join(timeout=5.0)
                mm.throw_exception_if_processing_interrupted()
        if "error" in result:
            raise result["error"]
        return io.NodeOutput(result["cond"].to_comfy())


NODES = [RemoteEncode]
