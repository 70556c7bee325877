"""Hostile workflows against the nodes, inside a real ComfyUI: files outside input/ and models/, FIFOs and
devices, a Remote Encode pointed at someone else's URL, widget values outside their declared bounds.

The server runs with an encoder token bound to one endpoint (H3_ENCODER_URLS); two recording HTTP servers on
loopback stand for "the endpoint the operator configured" and "a URL a shared workflow names".
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.comfy_harness import comfy_factory, free_port  # noqa: F401  (session fixture)
from support.contract_cases import make
from support.nested_dirs import remove_nested

TOKEN = "sekrit-" + "t" * 33
LEAK = "INTERNAL-ONLY-BODY-4f1e"


class Recorder(ThreadingHTTPServer):
    """An HTTP server that records every connection and request, and answers each request per `mode`."""

    daemon_threads = True

    def __init__(self):
        self.connections = 0
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        self.mode = "html500"
        super().__init__(("127.0.0.1", free_port()), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def verify_request(self, request, client_address):
        self.connections += 1
        return True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def reset(self, mode: str = "html500") -> None:
        self.connections, self.requests, self.mode = 0, [], mode


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self):
        server: Recorder = self.server  # type: ignore[assignment]
        server.requests.append((self.command, self.path, self.headers.get("Authorization")))
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if server.mode == "json400":
            status, ctype = 400, "application/json"
            body = json.dumps({"error": {"code": "bad_request", "message": "M" * 1000 + LEAK}}).encode()
        else:
            status, ctype = 500, "text/html"
            body = f"<html><body>{LEAK} root:x:0:0 secret config</body></html>".encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


@pytest.fixture(scope="module")
def allowed():
    server = Recorder()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def foreign():
    server = Recorder()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def server(comfy_factory, allowed):  # noqa: F811
    return comfy_factory(env={"H3_ENCODER_TOKEN": TOKEN, "H3_ENCODER_URLS": allowed.url})


def _error_text(body) -> str:
    return json.dumps(body)


def load_graph(name: str) -> dict:
    return {"1": {"class_type": "H3SplitLoadConditioning", "inputs": {"conditioning_file": name}},
            "2": {"class_type": "H3SplitSaveConditioning",
                  "inputs": {"conditioning": ["1", 0], "filename_prefix": "h3sec/cond"}}}


def remote_graph(endpoint: str, **widgets) -> dict:
    inputs = {"prompt": "a cat", "width": 0, "height": 0, "length": 124, "endpoint": endpoint, "task": "auto",
              "timeout_s": 30, **widgets}
    return {"1": {"class_type": "H3SplitRemoteEncode", "inputs": inputs},
            "2": {"class_type": "H3SplitSaveConditioning",
                  "inputs": {"conditioning": ["1", 0], "filename_prefix": "h3sec/remote"}}}


def _expect_400(server, graph, *needles, within_s: float = 20.0) -> str:
    started = time.monotonic()
    status, body = server.post_prompt_expect_error(graph)
    # Real time, a hang guard: refused at validation, not after a network wait (the node's 30 s timeout); a
    # validation takes well under a second idle, and 20 s holds at load average 8 on 2 cores.
    assert time.monotonic() - started < within_s
    text = _error_text(body)
    assert status == 400, (status, text[:2000])
    for needle in needles:
        assert needle in text, (needle, text[:2000])
    return text


# --- item 4: Load Conditioning reads only its own files in input/ -------------------------------------------


def test_load_conditioning_refuses_paths_outside_input(server):
    outside = server.base_dir / "outside_secret.safetensors"  # next to input/, not in it
    make("t2va").save(outside)
    before = set((server.output_dir).rglob("*.safetensors"))
    for name in ("/etc/passwd", str(outside), "../outside_secret.safetensors", "../../etc/passwd",
                 "sub/../../outside_secret.safetensors", "/dev/zero"):
        _expect_400(server, load_graph(name), "conditioning_file", "not one of the .safetensors files")
    assert set((server.output_dir).rglob("*.safetensors")) == before  # nothing re-saved into output/


def test_load_conditioning_refuses_links_fifos_and_devices_promptly(server):
    inp = server.input_dir
    links = {"h3sec_zero.safetensors": "/dev/zero", "h3sec_out.safetensors": "/etc/passwd"}
    for name, target in links.items():
        if not (inp / name).is_symlink():
            (inp / name).symlink_to(target)
    fifo = inp / "h3sec_fifo.safetensors"
    if not fifo.exists():
        os.mkfifo(fifo)
    listed = server.object_info("H3SplitLoadConditioning")["input"]["required"]["conditioning_file"]
    assert not any(name.startswith("h3sec_") for name in json.dumps(listed).split('"')), listed
    for name in (*links, fifo.name):
        _expect_400(server, load_graph(name), "conditioning_file", within_s=10.0)
    # The queue is not blocked: a good file in input/ still loads, and /interrupt answers.
    good = inp / "h3sec_good.safetensors"
    make("t2va").save(good)
    result = server.run_prompt(load_graph(good.name), timeout=60)
    assert result.status == "success"
    server.interrupt()


def test_load_conditioning_errors_never_quote_file_bytes(server):
    junk = server.input_dir / "h3sec_junk.safetensors"
    payload = b"ZYXWVUTS" + b"SECRETBYTES" * 20
    junk.write_bytes(payload)
    result = server.run_prompt(load_graph(junk.name), timeout=60, check=False)
    assert result.status == "error"
    text = json.dumps(result.error)
    assert "not a safetensors file" in text, text[:2000]
    assert str(int.from_bytes(payload[:8], "little")) not in text and "SECRETBYTES" not in text
    assert "ZYXWVUTS" not in text


def _upload(server, name: str, data: bytes, subfolder: str) -> dict:
    import urllib.request
    import uuid

    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"{name}\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + data + (
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"subfolder\"\r\n\r\n{subfolder}"
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"type\"\r\n\r\ninput\r\n--{boundary}--\r\n"
    ).encode()
    request = urllib.request.Request(f"{server.url}/upload/image", data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


def test_nested_uploads_do_not_hide_load_conditioning(server):
    """Uploads into a subfolder nested 1,500 deep (core's /upload/image takes any `subfolder`) once made the node's
    listing raise RecursionError, so it vanished from /object_info for every user. Now the listing is depth-capped
    and iterative, and a prompt naming a file in input/ is validated without listing the folder."""
    data = make("t2va").to_bytes()
    top = server.input_dir / "h3sec_nest"
    try:
        for index in range(1, 6):  # 300 levels more each time: core's os.makedirs recurses once per missing level
            answer = _upload(server, f"h3sec_deep{index}.safetensors", data,
                             "/".join(["h3sec_nest"] + ["d"] * (300 * index)))
            assert answer["type"] == "input"
        assert _upload(server, "h3sec_shallow.safetensors", data, "h3sec_nest")["subfolder"] == "h3sec_nest"
        info = server.object_info("H3SplitLoadConditioning")
        options = json.dumps(info["input"]["required"]["conditioning_file"])
        assert "h3sec_nest/h3sec_shallow.safetensors" in options and "h3sec_deep" not in options
        result = server.run_prompt(load_graph("h3sec_nest/h3sec_shallow.safetensors"), timeout=120)
        assert result.status == "success"
        _expect_400(server, load_graph("/".join(["h3sec_nest"] + ["d"] * 1500 + ["h3sec_deep5.safetensors"])),
                    "conditioning_file", "more than 3 folders deep")
    finally:
        if top.exists():
            remove_nested(top)


# --- item 4: the loaders' minimax_h3/... choices stay inside models/minimax_h3 ------------------------------


def test_loader_folder_choices_stay_inside_models_minimax_h3(server):
    escape = server.base_dir / "escape_model"
    escape.mkdir(exist_ok=True)
    (escape / "model_index.json").write_text("{}")
    for choice in ("minimax_h3/../../escape_model", "minimax_h3/../../../" + str(escape).lstrip("/"),
                   "minimax_h3//etc", "minimax_h3/" + str(escape)):
        graph = {"1": {"class_type": "H3SplitVideoVAELoader", "inputs": {"vae": choice}},
                 "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
        # refused at queue time (the loader's validate_inputs resolves the choice), on the `vae` input
        status, body = server.post_prompt_expect_error(graph)
        errors = body["node_errors"]["1"]["errors"]
        assert status == 400 and [e["extra_info"]["input_name"] for e in errors] == ["vae"], body
        assert errors[0]["details"].startswith("vae - model folder: "), errors
    (server.base_dir / "models" / "vae" / "h3sec.ckpt").write_bytes(b"not a pickle, but never read")
    graph = {"1": {"class_type": "H3SplitVideoVAELoader", "inputs": {"vae": "h3sec.ckpt"}},
             "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    status, body = server.post_prompt_expect_error(graph)
    assert status == 400 and "is not a .safetensors file" in json.dumps(body["node_errors"]["1"])


def test_a_marked_entry_names_only_a_file_of_the_loaders_folder(server):
    """A loader's `⚠ NAME — reason` entry (a file it cannot load, UX issue 38 item 7) is resolved from NAME like any
    choice: a workflow that makes one up naming a path outside the folder is refused without reading that path."""
    outside = server.base_dir / "h3sec_outside.safetensors"
    outside.write_bytes(b"\xff" * 64)  # read, it would say "not a safetensors file (corrupted: ...)"
    for name in ("../h3sec_outside.safetensors", "../../h3sec_outside.safetensors", str(outside),
                 "minimax_h3/../../escape_model"):
        graph = {"1": {"class_type": "H3SplitVideoVAELoader", "inputs": {"vae": f"⚠ {name} — not readable: x"}},
                 "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
        status, body = server.post_prompt_expect_error(graph)
        errors = body["node_errors"]["1"]["errors"]
        assert status == 400 and [e["extra_info"]["input_name"] for e in errors] == ["vae"], body
        assert "corrupted" not in errors[0]["details"], errors


# --- item 5: Remote Encode sends the token only where the environment says ----------------------------------


def test_remote_encode_refuses_a_foreign_endpoint_without_contacting_it(server, foreign):
    foreign.reset()
    for url in (foreign.url, foreign.url.replace("127.0.0.1", "localhost"), "https://attacker.example:8443"):
        _expect_400(server, remote_graph(url), "H3_ENCODER_URLS", "not allowed")
    time.sleep(1.0)  # real time for a stray connection to show up; a late one could only make this pass wrongly
    assert foreign.connections == 0 and foreign.requests == []


def test_no_network_at_queue_time(server, allowed):
    """fingerprint_inputs runs for every node when the prompt starts: it must not call the endpoint. Here the
    media input fails first, so Remote Encode never executes and the endpoint must see nothing at all."""
    allowed.reset()
    graph = remote_graph(allowed.url)
    graph["3"] = {"class_type": "H3SplitReferences", "inputs": {}}
    graph["1"]["inputs"]["media"] = ["3", 0]
    result = server.run_prompt(graph, timeout=60, check=False)
    assert result.status == "error" and "H3SplitReferences" in json.dumps(result.error)
    time.sleep(0.5)
    assert allowed.connections == 0, allowed.requests


def test_remote_encode_sends_the_token_only_to_the_bound_endpoint_and_hides_its_body(server, allowed, foreign):
    foreign.reset()
    allowed.reset("html500")
    result = server.run_prompt(remote_graph(allowed.url), timeout=60, check=False)
    assert result.status == "error"
    assert allowed.requests and all(auth == f"Bearer {TOKEN}" for _, _, auth in allowed.requests)
    text = json.dumps(result.error)
    assert "HTTP 500" in text and LEAK not in text and "root:x" not in text and TOKEN not in text, text[:2000]
    allowed.reset("json400")  # a JSON error from the configured endpoint: its message, cut short
    result = server.run_prompt(remote_graph(allowed.url, prompt="another cat"), timeout=60, check=False)
    message = result.error["exception_message"]
    assert "[bad_request]" in message and "MMMM" in message and LEAK not in message and len(message) < 600
    assert foreign.connections == 0


# --- item 9: widget bounds hold although validate_inputs takes **kwargs -------------------------------------


@pytest.mark.parametrize("value, bound", [(1, "at least 5"), (999999, "at most 7200")])
def test_remote_encode_timeout_bounds(server, allowed, value, bound):
    allowed.reset()
    _expect_400(server, remote_graph(allowed.url, timeout_s=value), "timeout_s", bound)
    _expect_400(server, remote_graph(allowed.url, task="t9va"), "task must be one of")
    assert allowed.connections == 0


def test_text_encode_checks_its_declared_bounds(server):
    graph = {"1": {"class_type": "H3SplitTextEncoderLoader",
                   "inputs": {"text_encoder": "[embedded] tiny H3 (random weights, outputs are noise)"}},
             "2": {"class_type": "H3SplitTextEncode",
                   "inputs": {"text_encoder": ["1", 0], "prompt": "x", "width": 0, "height": 0, "length": 124,
                              "task": "nope"}},
             "3": {"class_type": "H3SplitSaveConditioning",
                   "inputs": {"conditioning": ["2", 0], "filename_prefix": "h3sec/te"}}}
    _expect_400(server, graph, "task must be one of")
    graph["2"]["inputs"].update(task="auto", width=-32, height=64)
    _expect_400(server, graph, "width must be at least 0")

