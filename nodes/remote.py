"""MiniMax H3 Remote Encode: the conditioning from an encoder endpoint on another machine.

Same inputs as the local chain (prompt, canvas, length, media), the same conditioning out
(bit-identical to local encoding of the same inputs), but no text encoder or VAE encoder is loaded
here. The bearer token comes only from the environment (H3_ENCODER_TOKEN), never from a widget or
a saved workflow, and goes only to endpoints the environment lists beside it (h3_core.remote.client.credentials): a
shared workflow naming its own URL gets no token, and a failure's message is built from the error's fields
(`RemoteEncodeError`), not from whatever the endpoint answered, and ends with the next step (start the server,
set the token in ComfyUI's environment, fix the named input). The client runs on the node's thread with ComfyUI's
interrupt flag as its cancel, as the Sampler does: an interrupt closes the connection and the server abandons
the work. The progress bar follows the client's steps (polling.STEPS), the server's own
phases included (queued, decode, text, video, audio) when the server publishes them, and the progress text says
each in words (nodes/progress_text.RemoteText), ending with a summary left on the node: "encoded on URL in 8.2 s
(text: cache hit, video: miss)". When this node's prompt waited
in ComfyUI's queue, its encode may have started ahead (nodes/encode_ahead.py): the node then takes that result.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
from urllib.parse import urlsplit

from comfy_api.latest import io

from ..h3_core.remote import protocol
from ..h3_core.remote.client import credentials, polling, transport
from ..h3_core.remote.client.encoder_client import EncoderClient
from ..h3_core.remote.client.transport import (
    ModelMismatchError,
    ProtocolMismatchError,
    RemoteAuthError,
    RemoteEncodeError,
    RemoteRequestError,
    RemoteUnavailableError,
)
from . import comfy_bridge as bridge
from . import encode_ahead, progress_text
from .encode import TASK_TOOLTIP, TASKS, encode_problems, numbers_inputs, request_from
from .input_checks import check_declared
from .types import CONDITIONING_CATEGORY, Media, Schema

MAX_ERROR_CHARS = 300  # of a server's own error message shown in the node's error
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\[\]]{0,63}")  # a request field as the server names it: ref_videos[0]
_KINDS = (  # most specific first
    (RemoteAuthError, "the server wants a valid token"),
    (ProtocolMismatchError, "the server speaks another protocol version"),
    (ModelMismatchError, "the server serves other weights than the ones pinned"),
    (RemoteRequestError, "the server refused the request"),
    (RemoteUnavailableError, "the server is unreachable or busy"),
    (RemoteEncodeError, "the remote encode failed"),
)
# What the client's own codes (transport.py) mean, for an endpoint that never answered usefully.
_NETWORK = {transport.CONNECTION_REFUSED: "connection refused", transport.HOST_NOT_FOUND: "host name not found",
            transport.TIMED_OUT: "timed out", transport.CONNECTION_LOST: "connection lost",
            transport.NETWORK_ERROR: "network error", transport.MALFORMED_ANSWER: "not an HTTP answer",
            transport.TLS_UNTRUSTED: "TLS certificate not trusted"}
_CODE_STEPS = {  # (code, field): refusals the client makes itself from the server's capabilities, or the server's
    ("component_not_loaded", None): "Start the encoder server with every encoder (no --components), or encode this "
                                    "request with the local encode nodes.",
    ("too_large", "body"): "Send shorter or smaller references, or raise the server's --max-body-mb.",
    ("feature_not_supported", "guides"): "This encoder server predates guides: update it, or encode the guides "
                                         "with the local encode nodes.",
}
_UNREACHABLE = {transport.CONNECTION_REFUSED, transport.HOST_NOT_FOUND, transport.NETWORK_ERROR}
TOKEN_STEP = ("Set H3_ENCODER_TOKEN and H3_ENCODER_URLS (this endpoint's URL; comma-separated for several), or "
              "H3_ENCODER_TOKENS, in the environment ComfyUI starts from (never in a widget or the workflow), then "
              "restart ComfyUI: it reads them at start.")


def token_step(url: str, env=None) -> str:
    """The next step for a 401/403: set the variables when ComfyUI sent no token to `url`; when it sent one, the
    server refused that token, so say which variable it came from and that it must match the server's. Names the
    variable, never its value."""
    try:
        url = (credentials.split_urls(url) or [url])[0]  # the endpoint that answered (a failover list: its first)
        policy = credentials.Policy.from_env(env)
        key = credentials.origin(url)
        sent = policy.token_for(url)
    except (credentials.CredentialPolicyError, ValueError):
        return TOKEN_STEP
    if not sent:
        return TOKEN_STEP
    source = credentials.TOKENS_ENV if key in policy.per_origin else credentials.TOKEN_ENV
    return (f"ComfyUI sent this endpoint the token from {source} and the server refused it: check that it is the "
            "token the encoder server was started with (the server's H3_ENCODER_TOKEN, or the variable its "
            "--token-env names), then restart ComfyUI: it reads the environment at start.")


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


def public_error(error: RemoteEncodeError, endpoint: str) -> str:
    """What the node reports for a failed remote encode, and the next step: built from the error's fields
    (`RemoteEncodeError`), never from the body of whatever answered. Only a JSON error from an endpoint the operator
    listed in the environment contributes its message, cleaned and cut to MAX_ERROR_CHARS."""
    kind = next((text for cls, text in _KINDS if isinstance(error, cls)), "the remote encode failed")
    status = error.status if isinstance(error.status, int) else None
    code = error.code if isinstance(error.code, str) and _CODE.fullmatch(error.code) else None
    field = error.field if isinstance(error.field, str) and _FIELD.fullmatch(error.field) else None
    url = error.url or endpoint
    words = [f"MiniMax H3 Remote Encode: {kind}"]
    if status is not None:
        words.append(f"(HTTP {status} {http.client.responses.get(status, '')}".rstrip() + ")")
        if code:
            words.append(f"[{code}]")
    elif code in _NETWORK:
        words.append(f"- {_NETWORK[code]}")
    shown = error.message is not None and status is not None and _trusted(url)
    if shown:
        words.append("- " + (f"{field}: " if field else "") + _clean(error.message))
    elif field:
        words.append(f"- in {field}")
    text = " ".join(words) + f" (endpoint {_clean(url)})."
    step = _next_step(error, status, code, field, url, shown)
    return f"{text} {step}" if step else text


def _next_step(error: RemoteEncodeError, status: int | None, code: str | None, field: str | None, url: str,
               shown: bool) -> str:
    """The sentence that says what to do about it."""
    if isinstance(error, RemoteAuthError):
        return token_step(url)
    if status is None and code in _UNREACHABLE:
        port = _port(url)
        return ("Start the encoder server on that machine: python -m h3_core serve --models DIR"
                + (f" --port {port}" if port else "") + " (README, \"Headless: CLI and encoder endpoint\"), or set "
                "this node's endpoint to where one runs.")
    if status is None and code == transport.TIMED_OUT:
        return "Raise this node's timeout_s, or check that the server is running and not overloaded."
    if (code, field) in _CODE_STEPS:
        return _CODE_STEPS[code, field]
    if status is not None and 400 <= status < 500 and error.message is not None and not shown:
        return "List this endpoint in H3_ENCODER_URLS to see the server's own message, or read the server's log."
    if isinstance(error, RemoteRequestError):
        return "Change the input the server names; retrying the same request will not help."
    return ""


def _trusted(url: str) -> bool:
    """Whether an endpoint's own error message may be shown: the operator listed it in the environment, or it runs
    on this machine (a workflow naming someone else's URL gets its status and code shown, never its words)."""
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return False
    return credentials.is_configured(url) or protocol.is_loopback(host)


def _port(url: str) -> int | None:
    try:
        return urlsplit(url).port
    except ValueError:
        return None


class RemoteEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return Schema(
            node_id="H3SplitRemoteEncode",
            display_name="MiniMax H3 Remote Encode",
            category=CONDITIONING_CATEGORY,
            description="Does what Text Encode, Video VAE Encode and Audio VAE Encode do, on a remote H3 encoder "
            "server (`python -m h3_core serve`): this machine loads no text encoder. Connect keyframes or references "
            "to `media` and the conditioning to MiniMax H3 Sampler; it is the same conditioning the local nodes make. "
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
        progress = bridge.progress_callback(cls.hidden.unique_id, every_step=True)  # ~11 phases, each one shown
        interrupt = bridge.InterruptFlag()  # as the Sampler: an interrupt cancels the work within 50 ms polls
        # the encode this prompt's node got while its prompt waited in the queue, if any
        ahead = bridge.run_interruptible(AHEAD.take, endpoint, request, interrupt.is_set)
        if ahead is not None:
            progress(1, 1)
            progress_text.RemoteText.leave(cls.hidden.unique_id, f"encoded ahead on {_clean(endpoint)}, while the "
                                           "previous prompt ran")
            return io.NodeOutput(ahead.to_comfy())
        # A line for every step of the client and every phase of the server (queued at position n, text, video,
        # audio), then where and how fast it encoded and what the server's cache had.
        with progress_text.RemoteText(cls.hidden.unique_id, _clean(endpoint), cancel=interrupt) as text:
            try:
                # On interrupt the client closes the connection (the server abandons the work) and raises
                # Cancelled, which run_interruptible turns into ComfyUI's own interrupt.
                conditioning = bridge.run_interruptible(client.encode, request, cancel=interrupt, progress=progress,
                                                        on_server_progress=text.event, on_status=text.event)
            except RemoteEncodeError as error:  # the remote's own words are not passed on as they came
                raise RuntimeError(public_error(error, endpoint)) from None
        if text.done is not None:
            text.leave(cls.hidden.unique_id, polling.summary(text.done))
        return io.NodeOutput(conditioning.to_comfy())


# Encode-ahead for this node: its client factory, its widgets and their defaults, read from the schema.
AHEAD = encode_ahead.EncodeAhead(make_client=_client, schema=RemoteEncode.define_schema())

NODES = [RemoteEncode]
