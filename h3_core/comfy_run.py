"""`python -m h3_core comfy-run`: run an API workflow on a ComfyUI server headlessly, the way the browser does.

ComfyUI's HTTP API (no ComfyUI import here: this is a client of any running ComfyUI, local or remote):
- `POST /prompt` takes `{"prompt": <the API graph>, "client_id": ID}` (an API-format file, as Save (API) exports it,
  is the *value* of "prompt", not the body) and answers `{"prompt_id": ...}`, or 400 with `node_errors` per node.
- `GET /ws?clientId=ID` streams JSON events (`executing`, `progress`, `executed`, `execution_error`,
  `execution_success`, ...) and binary frames: a 4-byte big-endian type, then 1 = a preview image, 3 = a node's
  progress text (a 4-byte length, the node id, the UTF-8 text).
- What a node saved is listed in its `executed` event and in `GET /history/<prompt_id>`: SaveVideo's mp4 appears
  under `images` (with `animated`), SaveAudio under `audio`; each item `{filename, subfolder, type}` downloads from
  `GET /view?filename=&subfolder=&type=`.
The exit code says how it ended: 0 done, 1 the graph failed on the server (the node and its message are printed),
2 the workflow or an override is unusable, 3 no ComfyUI answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import struct
import sys
import uuid
from pathlib import Path

#: Output keys whose items are files in ComfyUI's output folder (SaveVideo lists its mp4 under "images").
FILE_KEYS = ("images", "gifs", "audio", "video", "videos")
#: The largest websocket message read (previews are small JPEGs; aiohttp's default is 4 MiB).
MAX_WS_MESSAGE = 16 << 20
MAX_WORKFLOW_BYTES = 16 << 20
TEXT_FRAME = 3


class WorkflowError(ValueError):
    """The workflow file or an override cannot be posted as it is (exit code 2)."""


def load_workflow(path: str | Path, overrides: list[str]) -> dict:
    """An API-format graph from `path`, with `NODE.INPUT=VALUE` overrides applied (VALUE read as JSON when it parses,
    else as a string)."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_WORKFLOW_BYTES:
            raise WorkflowError(f"{path}: over {MAX_WORKFLOW_BYTES >> 20} MiB: not a workflow")
        graph = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WorkflowError(f"{path}: not a readable JSON workflow ({error})") from None
    if isinstance(graph, dict) and isinstance(graph.get("nodes"), list):
        raise WorkflowError(f"{path} is a UI workflow (the canvas' format): export it with Workflow > Export (API), or "
                            "use a file from workflows/api/")
    if isinstance(graph, dict) and isinstance(graph.get("prompt"), dict):
        graph = graph["prompt"]  # a saved request body: its graph
    if not isinstance(graph, dict) or not graph or not all(
            isinstance(node, dict) and "class_type" in node for node in graph.values()):
        raise WorkflowError(f"{path}: not an API workflow (an object of node id -> {{class_type, inputs}})")
    for override in overrides:
        target, sep, raw = override.partition("=")
        node_id, dot, name = target.partition(".")
        if not sep or not dot or not name:
            raise WorkflowError(f"--set {override!r}: expected NODE.INPUT=VALUE, e.g. 5.prompt=\"a fox\" or 6.seed=7")
        if node_id not in graph:
            raise WorkflowError(f"--set {override!r}: the workflow has no node {node_id!r} (it has "
                                f"{', '.join(sorted(graph, key=lambda k: (len(k), k)))})")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        graph[node_id].setdefault("inputs", {})[name] = value
    return graph


def _node_label(graph: dict, node_id) -> str:
    node = graph.get(str(node_id), {})
    title = node.get("_meta", {}).get("title") or node.get("class_type", "?")
    return f"node {node_id} ({title})"


def _error_lines(graph: dict, body: dict) -> list[str]:
    """POST /prompt's 400 answer, one line per problem, each naming its node and input."""
    lines = []
    error = body.get("error", {})
    if isinstance(error, dict) and error.get("message"):
        lines.append(f"{error.get('message')}: {error.get('details', '')}".rstrip(": "))
    for node_id, node in (body.get("node_errors") or {}).items():
        for item in node.get("errors", []):
            name = item.get("extra_info", {}).get("input_name")
            where = f"{_node_label(graph, node_id)}{f' input {name}' if name else ''}"
            lines.append(f"{where}: {item.get('details') or item.get('message')}")
    return lines or [json.dumps(body)[:2000]]


async def _run(args, graph: dict, out: Path) -> int:
    import aiohttp

    base = args.server.rstrip("/")
    client_id = uuid.uuid4().hex
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            ws_url = "ws" + base[len("http"):] + f"/ws?clientId={client_id}"
            async with session.ws_connect(ws_url, max_msg_size=MAX_WS_MESSAGE, heartbeat=30) as ws:
                async with session.post(f"{base}/prompt", json={"prompt": graph, "client_id": client_id}) as answer:
                    body = await answer.json(content_type=None)
                if answer.status != 200 or "prompt_id" not in body:
                    print(f"refused ({answer.status}):", *_error_lines(graph, body), sep="\n  ", file=sys.stderr)
                    return 1
                prompt_id = body["prompt_id"]
                print(f"queued prompt {prompt_id} on {base}", flush=True)
                outputs, failed = await asyncio.wait_for(_follow(ws, graph, prompt_id), args.timeout)
            if failed:
                return 1
            saved = await _download(session, base, outputs, out)
    except (aiohttp.ClientConnectionError, aiohttp.WSServerHandshakeError) as error:
        print(f"error: no ComfyUI answered at {base} ({error})", file=sys.stderr)
        return 3
    except asyncio.TimeoutError:
        print(f"error: the prompt did not finish in {args.timeout:g} s (it may still run on the server)",
              file=sys.stderr)
        return 1
    for path in saved:
        print(path)
    return 0


class Throttle:
    """Which progress lines to print: the first of each phase of a node (a phase is the line with its numbers
    blanked: "reading the weights: 5%" and "...: 6%" are one), its last step, and otherwise one a `every` seconds,
    so a terminal or a CI log gets a line per phase, not one per byte read."""

    def __init__(self, every: float = 2.0, clock=None):
        import time

        self.every, self.clock, self.last = every, clock or time.monotonic, {}

    def __call__(self, node, line: str, final: bool = False) -> bool:
        phase, now = re.sub(r"\d+(\.\d+)?", "#", line), self.clock()
        was = self.last.get(node)
        if final or was is None or was[0] != phase or now - was[1] >= self.every:
            self.last[node] = (phase, now)
            return True
        return False


def last_step(text: str) -> bool:
    """Whether a progress line reports a phase's last step ("DiT forward 7/7"): always shown."""
    match = re.search(r"(\d+)/(\d+)\s*$", text)
    return bool(match) and match.group(1) == match.group(2)


async def _follow(ws, graph: dict, prompt_id: str) -> tuple[dict, bool]:
    """Print the prompt's progress until it ends; its outputs (node id -> output dict) and whether it failed."""
    import aiohttp

    outputs: dict = {}
    show = Throttle()
    talking: set = set()  # nodes that say what they do in text: their bare step counts would repeat it
    async for message in ws:
        if message.type == aiohttp.WSMsgType.BINARY:
            data = message.data
            if len(data) >= 8 and struct.unpack(">I", data[:4])[0] == TEXT_FRAME:
                length = struct.unpack(">I", data[4:8])[0]
                node_id, text = data[8:8 + length].decode("utf-8", "replace"), data[8 + length:].decode("utf-8",
                                                                                                     "replace")
                talking.add(node_id)
                if text and show(f"text {node_id}", text, final=last_step(text)):
                    print(f"  {_node_label(graph, node_id)}: {text}", flush=True)
            continue
        if message.type != aiohttp.WSMsgType.TEXT:
            raise aiohttp.ClientConnectionError(f"the websocket closed ({message.type.name}) before the prompt ended")
        event = json.loads(message.data)
        kind, data = event.get("type"), event.get("data") or {}
        if data.get("prompt_id") not in (None, prompt_id):
            continue  # another client's prompt (some events are broadcast)
        if kind == "executing" and data.get("node") is not None:
            print(f"{_node_label(graph, data['node'])}", flush=True)
        elif kind == "progress" and data.get("max") and str(data.get("node")) not in talking:
            line = f"{data.get('value')}/{data['max']}"
            if show(f"steps {data.get('node')}", line, final=data.get("value") == data["max"]):
                print(f"  {_node_label(graph, data.get('node'))}: {line}", flush=True)
        elif kind == "executed":
            outputs[str(data.get("node"))] = data.get("output") or {}
        elif kind == "execution_error":
            print(f"failed in {_node_label(graph, data.get('node_id'))}: {data.get('exception_type', 'error')}: "
                  f"{data.get('exception_message', '').strip()}", file=sys.stderr)
            return outputs, True
        elif kind == "execution_interrupted":
            print(f"interrupted in {_node_label(graph, data.get('node_id'))}", file=sys.stderr)
            return outputs, True
        elif kind == "execution_success" or (kind == "executing" and data.get("node") is None):
            return outputs, False
    raise aiohttp.ClientConnectionError("the websocket closed before the prompt ended")


async def _download(session, base: str, outputs: dict, out: Path) -> list[Path]:
    """Fetch every file the prompt saved (`executed` outputs) into `out`, keeping ComfyUI's subfolders."""
    saved = []
    for output in outputs.values():
        for key in FILE_KEYS:
            for item in output.get(key) or []:
                if not isinstance(item, dict) or item.get("type") != "output" or not item.get("filename"):
                    continue  # previews (type "temp") are not results
                name, subfolder = Path(item["filename"]).name, item.get("subfolder", "")
                parts = [part for part in Path(subfolder).parts if part not in ("", ".", "..", "/")]
                target = out.joinpath(*parts, name)
                target.parent.mkdir(parents=True, exist_ok=True)
                query = {"filename": item["filename"], "subfolder": subfolder, "type": "output"}
                async with session.get(f"{base}/view", params=query) as answer:
                    answer.raise_for_status()
                    with open(target, "wb") as handle:
                        async for chunk in answer.content.iter_chunked(1 << 20):
                            handle.write(chunk)
                saved.append(target)
    return saved


def command(args) -> int:
    """The `comfy-run` command: load, post, follow, download; its exit code (module docstring)."""
    try:
        graph = load_workflow(args.workflow, args.set or [])
    except WorkflowError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return asyncio.run(_run(args, graph, Path(args.out)))


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `comfy-run` on the CLI's subparsers."""
    run = sub.add_parser("comfy-run", help="run an API workflow on a ComfyUI server and download what it saved")
    run.add_argument("workflow", help="an API-format workflow (workflows/api/*.json, or ComfyUI's Export (API))")
    run.add_argument("--server", default="http://127.0.0.1:8188", help="ComfyUI's URL (default http://127.0.0.1:8188)")
    run.add_argument("--out", default="output/headless", help="folder for the saved files (default output/headless)")
    run.add_argument("--set", action="append", metavar="NODE.INPUT=VALUE",
                     help="change one input before posting, e.g. --set 5.prompt='a fox' --set 6.seed=7 (repeatable)")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the prompt (default 3600)")
    run.set_defaults(func=command)
    return run
