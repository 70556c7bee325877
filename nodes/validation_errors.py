"""One validation error per problem, on the input that causes it, in POST /prompt's answer.

ComfyUI 0.3.75 attaches a node's `validate_inputs` result to every input the function received
(execution.py: `for x in input_filtered: ... errors.append({... "input_name": x})`), so a node with eight
inputs shows one problem eight times, and the frontend rings the first socket. The pack's validators return a
report of `input: message` lines (input_checks.report); this middleware replaces those copies, for the pack's
nodes only, with one `custom_validation_failed` error per line whose `input_name` is the input the line names.
Every other error, and every other node's, passes through untouched.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from . import comfy_queue_seam, graph_checks
from .input_checks import parse_report

PACK_PREFIX = "H3Split"
PROMPT_PATHS = ("/prompt", "/api/prompt")
CUSTOM = "custom_validation_failed"


def _inputs_of(class_type: str) -> list[str]:
    import nodes as comfy_nodes  # ComfyUI's registry, present whenever its server runs

    node_class = comfy_nodes.NODE_CLASS_MAPPINGS.get(class_type)
    if node_class is None:
        return []
    declared = node_class.INPUT_TYPES()
    return [*(declared.get("required") or {}), *(declared.get("optional") or {})]


def one_error_per_problem(errors: list[dict], inputs: list[str]) -> list[dict]:
    """The node's errors with the copies of its validate_inputs report replaced by one error per problem."""
    copies = [error for error in errors if error.get("type") == CUSTOM]
    if not copies:
        return errors
    first = copies[0]
    received = (first.get("extra_info") or {}).get("input_name", "")
    details = first.get("details", "")
    text = details.removeprefix(f"{received} - ")
    problems = []
    for name, message in parse_report(text, inputs):
        name = name or received  # a line that names no input stays where ComfyUI put it
        problems.append({
            "type": CUSTOM,
            "message": first.get("message", "Custom validation failed for node"),
            "details": f"{name} - {message}",
            "extra_info": {"input_name": name},
        })
    return [error for error in errors if error.get("type") != CUSTOM] + problems


def rewrite(body: dict) -> dict:
    for node_error in (body.get("node_errors") or {}).values():
        class_type = node_error.get("class_type", "")
        if class_type.startswith(PACK_PREFIX):
            node_error["errors"] = one_error_per_problem(node_error.get("errors") or [], _inputs_of(class_type))
    return body


@web.middleware
async def middleware(request: web.Request, handler):
    response = await handler(request)
    if request.method != "POST" or request.path not in PROMPT_PATHS or response.status != 400:
        return response
    try:
        body = json.loads(response.text)
    except (AttributeError, TypeError, ValueError):  # a streamed or non-JSON answer: not the validation one
        return response
    if not isinstance(body, dict) or not body.get("node_errors"):
        return response
    return web.json_response(rewrite(body), status=response.status)


def install() -> None:
    """Adds the middleware to ComfyUI's server (idempotent). Runs while custom nodes load, before the server
    starts and aiohttp freezes its middleware list; a later call (or no server) changes nothing. Also registers
    the on-prompt handler that shows the validators the whole graph (graph_checks: the rules across nodes)."""
    if not getattr(install, "graph_hook", False):
        install.graph_hook = comfy_queue_seam.add_on_prompt_handler(graph_checks.remember)
    try:
        from server import PromptServer
    except ImportError:  # pragma: no cover - no ComfyUI server in this process
        return
    app = getattr(getattr(PromptServer, "instance", None), "app", None)
    if app is None or middleware in app.middlewares:
        return
    if app.frozen:
        logging.warning("[MiniMax H3] server already started: validation errors stay repeated per input")
        return
    app.middlewares.append(middleware)
