"""H3 Remote Encode: the conditioning from an encoder endpoint on another machine.

Same inputs as the local chain (prompt, canvas, length, media), the same conditioning out
(bit-identical to local encoding of the same inputs), but no text encoder or VAE encoder is loaded
here. The bearer token comes only from the environment (H3_ENCODER_TOKEN), never from a widget or
a saved workflow, and goes only to endpoints the environment lists beside it (h3_core.remote.credentials): a
shared workflow naming its own URL gets no token, and a failure's message is built from structured fields, not
from whatever the endpoint answered. The call runs in a worker thread while this node polls ComfyUI's interrupt flag
and forwards a cancel to the server. The progress bar follows the client's steps (polling.STEPS), the server's own
phases included (queued, decode, text, video, audio) when the server publishes them. When this node's prompt waited
in ComfyUI's queue, its encode may have started ahead (nodes/encode_ahead.py): the node then takes that result.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import threading

import comfy.model_management as mm
from comfy_api.latest import io

from ..h3_core.remote import credentials
from ..h3_core.remote.client import (
    EncoderClient,
    ModelMismatchError,
    ProtocolMismatchError,
    RemoteAuthError,
    RemoteEncodeError,
    RemoteRequestError,
    RemoteUnavailableError,
)
from . import comfy_bridge as bridge
from . import encode_ahead
from .encode import TASK_TOOLTIP, TASKS, encode_problems, numbers_inputs, request_from
from .input_checks import check_declared
from .types import CATEGORY, Media

MAX_ERROR_CHARS = 300  # of a server's own error message shown in the node's error
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_KINDS = (  # most specific first
    (RemoteAuthError, "the server wants a valid token (H3_ENCODER_TOKEN with H3_ENCODER_URLS, or "
                      "H3_ENCODER_TOKENS)"),
    (ProtocolMismatchError, "the server speaks another protocol version"),
    (ModelMismatchError, "the server serves other weights than the ones pinned"),
    (RemoteRequestError, "the server refused the request"),
    (RemoteUnavailableError, "the server is unreachable or busy"),
    (RemoteEncodeError, "the remote encode failed"),
)
_NETWORK_HINTS = (("refused", "connection refused"), ("timed out", "timed out"), ("certificate", "TLS certificate "
                  "not trusted"), ("Name or service", "host name not found"), ("resolution", "host name not found"))


def _urls(endpoint: str) -> list[str]:
    return credentials.split_urls(endpoint)


def _client(endpoint: str, timeout_s: int) -> EncoderClient:
    urls = _urls(endpoint)
    token = credentials.token_for(urls)  # raises when the environment does not allow these endpoints
    # "" (not None): no token at all; None would make the client read H3_ENCODER_TOKEN past the binding.
    return EncoderClient(urls, token=token or "", read_timeout=float(timeout_s))


def _clean(text: str) -> str:
    text = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def public_error(error: BaseException, endpoint: str) -> str:
    """What the node reports for a failed remote encode: built from the error's structured fields, never from
    the body of whatever answered. Only a JSON error (status + code) from an endpoint the operator listed in the
    environment contributes its message, cleaned and cut to MAX_ERROR_CHARS."""
    kind = next((text for cls, text in _KINDS if isinstance(error, cls)), "the remote encode failed")
    status = getattr(error, "status", None)
    code = getattr(error, "code", None)
    code = code if isinstance(code, str) and _CODE.fullmatch(code) else None
    url = getattr(error, "url", None) or endpoint
    words = [f"H3 Remote Encode: {kind}"]
    if isinstance(status, int):
        words.append(f"(HTTP {status} {http.client.responses.get(status, '')}".rstrip() + ")")
    if code:
        words.append(f"[{code}]")
    text = str(error)
    marker = f" answered {status} {code}: " if code else None
    if marker and marker in text and credentials.is_configured(url):
        message = text.split(marker, 1)[1]
        message = message.split(" (set the token in ", 1)[0]
        words.append("- " + _clean(message))
    elif status is None:
        hint = next((said for needle, said in _NETWORK_HINTS if needle in text), None)
        if hint:
            words.append(f"- {hint}")
    return " ".join(words) + f" (endpoint {_clean(url)})"


class RemoteEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3SplitRemoteEncode",
            display_name="H3 Remote Encode",
            category=f"{CATEGORY}/encode",
            description="Runs all three H3 encoders (Qwen3-VL text, video VAE, audio VAE) on a remote H3 encoder "
            "endpoint (`python -m h3_core serve`) and returns the same conditioning the local encode nodes make. "
            "The token, if the server wants one, is read from H3_ENCODER_TOKEN and sent only to the endpoints "
            "listed in H3_ENCODER_URLS (or per endpoint from H3_ENCODER_TOKENS), over https:// or to loopback.",
            inputs=[
                io.String.Input("prompt", multiline=True, tooltip="Passed verbatim. Refer to references as "
                                "<Picture i>, <Video k>, <Audio j>."),
                *numbers_inputs(),
                io.String.Input("endpoint", default="http://127.0.0.1:8190",
                                tooltip="Encoder endpoint URL; several, comma-separated, fail over in order. "
                                "Use https:// through a TLS proxy off this machine (docs/DEPLOY.md)."),
                Media.Input("media", optional=True, tooltip="Keyframes (fl2va) or references (ref2va)."),
                io.Combo.Input("task", options=TASKS, default="auto", optional=True, tooltip=TASK_TOOLTIP),
                io.Int.Input("timeout_s", default=600, min=5, max=7200, optional=True,
                             tooltip="Seconds to wait for the server's answer (connecting times out much sooner)."),
            ],
            outputs=[io.Conditioning.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, **kwargs):
        endpoint = []
        if isinstance(kwargs.get("endpoint"), str):
            try:
                credentials.token_for(_urls(kwargs["endpoint"]))  # no network: the URL syntax and the token policy
            except credentials.CredentialPolicyError as error:
                endpoint.append(("endpoint", str(error)))
        return encode_problems(cls, kwargs, endpoint)

    @classmethod
    def fingerprint_inputs(cls, prompt, width, height, length, endpoint, task="auto", timeout_s=600, **kwargs):
        # Runs at queue time, so no network here (it once asked the server for its model identity, with the
        # token, to whatever URL the workflow named). ComfyUI's cache key already covers the linked media, so
        # the widget values make the key: same inputs, same conditioning. After swapping the server's weights,
        # free ComfyUI's cache (or change an input) to encode again; the sampler's DiT checks still apply.
        values = {"prompt": prompt, "width": width, "height": height, "length": length, "endpoint": endpoint,
                  "task": task, "timeout_s": timeout_s}
        return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()

    @classmethod
    def execute(cls, prompt, width, height, length, endpoint, media=None, task="auto", timeout_s=600) -> io.NodeOutput:
        request = request_from(media, prompt, task, width, height, length)
        declared = check_declared(cls, {"width": width, "height": height, "length": length, "timeout_s": timeout_s})
        if declared is not True:  # linked widgets reach execute unchecked
            raise ValueError(declared)
        request.validate()  # the server checks again; failing here costs no upload
        client = _client(endpoint, timeout_s)
        progress = bridge.progress_callback(cls.hidden.unique_id)
        # the encode this prompt's node got while its prompt waited in the queue, if any
        ahead = bridge.run_interruptible(encode_ahead.AHEAD.take, endpoint, request, mm.processing_interrupted)
        if ahead is not None:
            progress(1, 1)
            return io.NodeOutput(ahead.to_comfy())
        cancel = threading.Event()
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
        error = result.get("error")
        if isinstance(error, RemoteEncodeError):  # the remote's own words are not passed on as they came
            raise RuntimeError(public_error(error, endpoint)) from None
        if error is not None:  # local: the request's rules (H3InputError), a cancel, the media
            raise error
        return io.NodeOutput(result["cond"].to_comfy())


NODES = [RemoteEncode]
