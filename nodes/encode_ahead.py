"""Encode-ahead: the remote encode of the prompt that runs next starts while the current prompt still runs.

When prompts are queued, each MiniMax H3 Remote Encode node of the next prompt would otherwise start its upload and
encode only once the executor reaches it, after the current prompt's sampling and decoding. This module starts that
encode early, in a background thread, and hands its result to the node, which then sends nothing at all.

What is sent, when, and to whom (the rules this module keeps):

* Only to endpoints the operator listed in the environment (H3_ENCODER_URLS / H3_ENCODER_TOKENS, the allow-list that
  guards the token, h3_core.remote.client.credentials). With no allow-list, or an endpoint outside it, nothing is sent
  early: the node encodes when it runs, as before. ComfyUI calls the on-prompt hook before it validates a prompt,
  so the hook checks this itself.
* Only for the first prompt waiting in ComfyUI's queue, only while another prompt is running (otherwise the executor
  is about to run it anyway) and is past its own Remote Encode nodes (so the early encode never queues at the server
  in front of the running prompt's own), and only once it has waited `H3_ENCODE_AHEAD_DELAY` seconds (default 1): a
  prompt further back, or one deleted from the queue within that grace time, sends nothing. A prompt deleted after its
  encode started has the request cancelled (the client drops the connection; the server abandons the work); what
  was uploaded by then was uploaded, to the operator's own endpoint.
* Only what the node would send: the node's widget values from the queued prompt, and media from core's LoadImage,
  LoadVideo and LoadAudio through MiniMax H3 References / MiniMax H3 Keyframes (run here exactly as the executor would
  run them).
  A node with any other input linked is left to run as usual.
* No double work: requests are keyed by their content (endpoint, widgets, media bytes). A key the node already
  encoded in this process is not encoded ahead (ComfyUI's own cache serves that node when nothing changed), a key
  already in flight is not sent twice, and the node takes an in-flight encode of its key instead of sending its own.
* Memory: a result is held only until its node takes it or its prompt leaves the queue.

Off with H3_ENCODE_AHEAD=0; per prompt, with `"extra_data": {"h3_encode_ahead": false}` in the POST /prompt body.
Off by itself, with one log line, when the ComfyUI internals it reads (comfy_queue_seam.py) are not as expected.

The Remote Encode node builds its registry (`EncodeAhead(make_client, schema)`, nodes/remote.py): the client factory
and the widgets with their defaults come from the node, so a default changed in its schema changes the request
encoded ahead too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..h3_core.progress import Cancelled
from ..h3_core.remote.client import credentials
from . import comfy_queue_seam
from .encode import request_from

log = logging.getLogger("h3.encode_ahead")

ENABLE_ENV = "H3_ENCODE_AHEAD"
DELAY_ENV = "H3_ENCODE_AHEAD_DELAY"
NODE_CLASS = "H3SplitRemoteEncode"
OPT_OUT = "h3_encode_ahead"  # a prompt posted with extra_data {"h3_encode_ahead": false} is never encoded ahead
# Nodes whose outputs this module may compute ahead: core's file loaders (they read one file of input/) and the pack's
# media bundlers. Anything else upstream of a Remote Encode node leaves that node to the executor.
MEDIA_NODES = frozenset({"LoadImage", "LoadVideo", "LoadAudio", "H3SplitReferences", "H3SplitKeyframes"})
MEDIA_INPUT = "media"  # the Remote Encode node's one linked input; every other input is a widget
POLL_S = 0.05
EXECUTED_KEYS = 256  # request keys the node ran itself, remembered (oldest forgotten first)


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def delay_s() -> float:
    try:
        return max(0.0, float(os.environ.get(DELAY_ENV, "1")))
    except ValueError:
        return 1.0


def allowed(endpoint: object) -> bool:
    """Whether encode-ahead may contact `endpoint` (a URL or comma-separated failover list): every URL listed by
    the operator, and the token policy content with the whole list."""
    if not isinstance(endpoint, str):
        return False
    urls = credentials.split_urls(endpoint)
    if not urls or not all(credentials.is_configured(url) for url in urls):
        return False
    try:
        credentials.token_for(urls)
    except credentials.CredentialPolicyError:
        return False
    return True


def request_key(endpoint: str, request) -> str:
    """What identifies one remote encode: the endpoint, the request's settings and every media byte."""
    digest = hashlib.sha256()

    def add(value) -> None:
        if isinstance(value, np.ndarray):
            array = np.ascontiguousarray(value)
            digest.update(f"{array.dtype.str}{array.shape}".encode())
            digest.update(memoryview(array).cast("B"))
        else:
            digest.update(repr(value).encode())
        digest.update(b"\x00")

    for value in (endpoint, request.prompt, request.task, request.width, request.height, request.num_frames,
                  request.first_frame, request.last_frame):
        add(value)
    for image in request.ref_images:
        add(image)
    for video in request.ref_videos:
        for value in (video.frames, video.fps, video.audio, video.sample_rate):
            add(value)
    for audio in request.ref_audios:
        add(audio.waveform)
        add(audio.sample_rate)
    for guide in request.guides:  # two prompts that differ only in their guides are different encodes
        for value in (guide.frame_index, guide.frames, guide.audio, guide.sample_rate):
            add(value)
    return digest.hexdigest()


# --- the queued prompts' encodes -----------------------------------------------------------------------------------


@dataclass
class _Job:
    key: str
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None  # the H3Conditioning, once done without error
    error: BaseException | None = None


@dataclass
class _Pending:
    prompt_id: str
    nodes: dict  # node id -> the Remote Encode node's entry of the prompt
    graph: dict
    queued: float
    started: bool = False
    seen_running: bool = False
    keys: list = field(default_factory=list)


def widgets_of(schema) -> dict:
    """{widget name: its default (None: none)} of the Remote Encode node's schema (a V3 `io.Schema`): every input
    but the media socket, in the schema's order."""
    return {item.id: getattr(item, "default", None) for item in schema.inputs if item.id != MEDIA_INPUT}


class EncodeAhead:
    """The registry of queued prompts and in-flight / finished encodes, and the thread that watches the queue.

    make_client: `(endpoint, timeout_s) -> EncoderClient`, as the node makes its own
    schema:      the Remote Encode node's `io.Schema`: which inputs are widgets, and their defaults
    seam:        the ComfyUI internals read (comfy_queue_seam: `missing`, `queue_state`, `node_states`,
                 `run_core_node`)
    """

    def __init__(self, make_client, schema, seam=comfy_queue_seam):
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._jobs: dict[str, _Job] = {}
        self._executed: dict[str, None] = {}  # insertion-ordered set
        self._make_client = make_client
        self.widgets = widgets_of(schema)
        self._seam = seam
        self._off_because: str | None = None  # set once the seam is found wanting: encode-ahead stays off
        self._seam_checked = False
        self._watcher: threading.Thread | None = None
        self.sent = 0  # encodes started ahead (for logs and tests)

    @property
    def active(self) -> bool:
        """On (H3_ENCODE_AHEAD) and the ComfyUI internals it reads as expected (looked at once, on first use)."""
        if not enabled():
            return False
        if not self._seam_checked:
            self._seam_checked = True
            problem = self._seam.missing()
            if problem:
                self._turn_off(f"{problem} is missing or not as expected")
        return self._off_because is None

    def _turn_off(self, why: str) -> None:
        """Encode-ahead off for this process, said once in the log; what is in flight is cancelled."""
        with self._lock:
            if self._off_because is not None:
                return
            self._off_because = why
            for entry in self._pending.values():
                self._drop(entry, cancel=True)
            self._pending.clear()
        log.warning("encode-ahead off: ComfyUI's %s (a ComfyUI update?); MiniMax H3 Remote Encode nodes encode when "
                    "they run", why)

    # -- the on-prompt hook (ComfyUI's server thread: quick, never raises) ---------------------------------------

    def on_prompt(self, json_data):
        try:
            if self.active:
                self._note(json_data)
        except Exception:  # noqa: BLE001 - a queued prompt must never fail because of encode-ahead
            log.exception("encode-ahead: ignoring a prompt it could not read")
        return json_data

    def _note(self, json_data) -> None:
        graph = json_data.get("prompt") if isinstance(json_data, dict) else None
        extra = json_data.get("extra_data") if isinstance(json_data, dict) else None
        if not isinstance(graph, dict) or (isinstance(extra, dict) and extra.get(OPT_OUT) is False):
            return
        nodes = {node_id: node for node_id, node in graph.items() if isinstance(node, dict)
                 and node.get("class_type") == NODE_CLASS and _ready(graph, node, self.widgets)}
        if not nodes:
            return
        import uuid

        # ComfyUI uses the prompt_id a client sends and makes one up otherwise; naming it here lets the watcher find
        # this prompt in the queue.
        prompt_id = json_data.get("prompt_id")
        if not isinstance(prompt_id, str) or not prompt_id:
            prompt_id = json_data["prompt_id"] = str(uuid.uuid4())
        with self._lock:
            self._pending[prompt_id] = _Pending(prompt_id, nodes, graph, time.monotonic())
            self._ensure_watcher()

    # -- the watcher --------------------------------------------------------------------------------------------

    def _ensure_watcher(self) -> None:
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(target=self._watch, name="h3-encode-ahead", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        while self._off_because is None:
            time.sleep(POLL_S)
            try:
                if not self.step():
                    return
            except comfy_queue_seam.SeamChanged as error:
                self._turn_off(str(error))
            except Exception:  # noqa: BLE001 - keep watching; the node encodes itself if this fails
                log.exception("encode-ahead: queue watch failed")

    def step(self) -> bool:
        """One look at the queue: start the head's encode when due, drop prompts that left. False: nothing to watch."""
        running, pending = self._seam.queue_state()
        head = min(pending)[1] if pending else None
        waiting = {prompt_id for _, prompt_id in pending}
        start = None
        with self._lock:
            for prompt_id, entry in list(self._pending.items()):
                if prompt_id in running:
                    entry.seen_running = True
                elif prompt_id not in waiting and (entry.seen_running or time.monotonic() - entry.queued > 2.0):
                    # Finished, or deleted from the queue: cancel what it still has in flight, forget its results.
                    # (The 2 s margin covers a prompt noted by the hook but not yet put in the queue.)
                    self._drop(entry, cancel=not entry.seen_running)
                    del self._pending[prompt_id]
            entry = self._pending.get(head) if head is not None else None
            if (entry is not None and running and not entry.started
                    and time.monotonic() - entry.queued >= delay_s() and self._encodes_done(running)):
                entry.started = True
                start = entry
            busy = bool(self._pending)
        if start is not None:
            threading.Thread(target=self._prefetch, args=(start,), name="h3-encode-ahead-job", daemon=True).start()
        return busy

    def _encodes_done(self, running: dict) -> bool:
        """Whether the running prompt is past its own Remote Encode nodes (an encode started ahead would otherwise
        queue at the same server in front of, or beside, the running prompt's own encode and delay it). A node is
        past when it finished, or when a node that consumes its output started (it ran, or ComfyUI's cache served
        it)."""
        executing, states = self._seam.node_states()
        for prompt_id, graph in running.items():
            remotes = [node_id for node_id, node in graph.items()
                       if isinstance(node, dict) and node.get("class_type") == NODE_CLASS]
            if not remotes:
                continue
            if prompt_id != executing:
                return False  # not started executing yet
            for node_id in remotes:
                if states.get(node_id) != "finished" and not any(
                        other in states for other in _downstream(graph, node_id)):
                    return False
        return True

    def _drop(self, entry: _Pending, cancel: bool) -> None:
        for key in entry.keys:
            job = self._jobs.get(key)
            if job is None:
                continue
            if cancel and not job.done.is_set():
                job.cancel.set()
            self._jobs.pop(key, None)

    # -- encoding ahead (a worker thread per started prompt) -------------------------------------------------------

    def _prefetch(self, entry: _Pending) -> None:
        for node_id, node in entry.nodes.items():
            inputs = node["inputs"]
            try:
                media = (_evaluate(entry.graph, inputs[MEDIA_INPUT], self._seam.run_core_node)
                         if MEDIA_INPUT in inputs else None)
                values = {name: inputs.get(name, default) for name, default in self.widgets.items()}
                request = request_from(media, values["prompt"], values["task"], values["width"], values["height"],
                                       values["length"])
                request.validate()
                key = request_key(values["endpoint"], request)
            except Exception as error:  # noqa: BLE001 - the node reports the same problem when it runs
                log.info("encode-ahead: prompt %s node %s not encoded ahead (%s)", entry.prompt_id, node_id,
                         type(error).__name__)
                continue
            with self._lock:
                if entry.prompt_id not in self._pending or key in self._executed or key in self._jobs:
                    continue  # deleted meanwhile, or nothing changed since the node last ran, or already in flight
                job = self._jobs[key] = _Job(key)
                entry.keys.append(key)
                self.sent += 1
            try:
                client = self._make_client(values["endpoint"], int(values["timeout_s"]))
                job.result = client.encode(request, cancel=job.cancel)
            except BaseException as error:  # noqa: BLE001 - the node sees `error` and encodes itself
                job.error = error
            finally:
                job.done.set()
            log.info("encode-ahead: prompt %s node %s %s", entry.prompt_id, node_id,
                     "encoded ahead" if job.error is None else f"not encoded ahead ({type(job.error).__name__})")

    # -- the node's side ------------------------------------------------------------------------------------------

    def take(self, endpoint: str, request, interrupted=None):
        """The conditioning encoded ahead for this request, waiting for it if it is still in flight; None when there
        is none (or it failed: the node then encodes itself). Records the key as run by the node."""
        if not self.active:
            return None  # nothing was encoded ahead: no key to record either
        key = request_key(endpoint, request)
        with self._lock:
            job = self._jobs.get(key)
            self._executed[key] = None
            while len(self._executed) > EXECUTED_KEYS:
                self._executed.pop(next(iter(self._executed)))
        if job is None:
            return None
        while not job.done.wait(0.1):
            if interrupted is not None and interrupted():
                job.cancel.set()
                raise Cancelled("interrupted while the encode started ahead was still running")
        with self._lock:
            if self._jobs.get(key) is job:
                del self._jobs[key]  # handed over: held no longer
        return job.result if job.error is None else None


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def _ready(graph: dict, node: dict, widgets) -> bool:
    """Whether every input of a Remote Encode node is known from the prompt alone, and its endpoint allowed."""
    inputs = node.get("inputs")
    if not isinstance(inputs, dict) or not allowed(inputs.get("endpoint")):
        return False
    if any(_is_link(inputs.get(name)) for name in widgets):
        return False
    return MEDIA_INPUT not in inputs or _media_known(graph, inputs[MEDIA_INPUT], depth=0)


def _media_known(graph: dict, link, depth: int) -> bool:
    if not _is_link(link) or depth > 8:
        return False
    node = graph.get(link[0])
    if not isinstance(node, dict) or node.get("class_type") not in MEDIA_NODES:
        return False
    inputs = node.get("inputs") if isinstance(node.get("inputs"), dict) else {}
    return all(_media_known(graph, value, depth + 1) for value in inputs.values() if _is_link(value))


def _downstream(graph: dict, node_id: str) -> set[str]:
    """Every node of `graph` that consumes `node_id`'s outputs, directly or through others."""
    children: dict[str, set[str]] = {}
    for other, node in graph.items():
        inputs = node.get("inputs") if isinstance(node, dict) else None
        for value in (inputs or {}).values():
            if _is_link(value):
                children.setdefault(value[0], set()).add(other)
    found, todo = set(), [node_id]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _evaluate(graph: dict, link, run_node, cache: dict | None = None):
    """The value at `link` ([node id, output index]) of the prompt, computing only MEDIA_NODES (checked before)."""
    cache = {} if cache is None else cache
    node_id, index = link
    if node_id not in cache:
        node = graph[node_id]
        inputs = {name: _evaluate(graph, value, run_node, cache) if _is_link(value) else value
                  for name, value in node["inputs"].items()}
        cache[node_id] = run_node(node["class_type"], inputs)
    return cache[node_id][index]


def install(ahead: EncodeAhead) -> bool:
    """Register `ahead`'s on-prompt hook with the running ComfyUI server (once); False when there is no server."""
    if getattr(install, "done", False):
        return True
    install.done = comfy_queue_seam.add_on_prompt_handler(ahead.on_prompt)
    return install.done
