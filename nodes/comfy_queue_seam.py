"""The ComfyUI internals encode-ahead reads, in one place, each checked before encode-ahead relies on it.

Encode-ahead (encode_ahead.py) watches ComfyUI's queue from outside the executor; core has no API for that, so every
core change to the queue or the executor can break it. What it reads (ComfyUI 0.3.75):

* the on-prompt hook: ``server.PromptServer.instance.add_on_prompt_handler`` (public: custom nodes use it);
* a snapshot of the queue: ``PromptServer.instance.prompt_queue.get_current_queue_volatile()`` -> (running, pending),
  items ``(number, prompt_id, graph, ...)`` (internal);
* where the executor is: ``comfy_execution.progress.get_progress_state()`` -> ``.prompt_id`` and
  ``.nodes[node_id]["state"]`` (internal);
* core's node classes, to run the file loaders ahead: ``nodes.NODE_CLASS_MAPPINGS``.

`missing()` looks for each of them (the first time a prompt is posted, when the server and its queue exist) and
names the first that is not as expected; encode-ahead then turns itself off with one log line, and each H3 Remote
Encode node encodes when it runs, as with ``H3_ENCODE_AHEAD=0``. The readers check the shapes they get at each use
and raise `SeamChanged` for one they do not know, which turns encode-ahead off the same way.
"""

from __future__ import annotations

import inspect


class SeamChanged(RuntimeError):
    """A ComfyUI internal encode-ahead reads is missing or shaped differently than this module expects."""


def _server():
    import server

    return getattr(server.PromptServer, "instance", None)


def missing() -> str | None:
    """The first internal encode-ahead needs that this ComfyUI does not have as expected; None when all are there."""
    try:
        from comfy_execution import progress

        import nodes as core_nodes
    except ImportError as error:
        return f"module {error.name}"
    try:
        instance = _server()
    except ImportError:
        return "module server"
    queue = getattr(instance, "prompt_queue", None)
    checks = (
        (instance is not None, "server.PromptServer.instance"),
        (callable(getattr(instance, "add_on_prompt_handler", None)), "PromptServer.add_on_prompt_handler"),
        (callable(getattr(queue, "get_current_queue_volatile", None)), "PromptQueue.get_current_queue_volatile"),
        (callable(getattr(progress, "get_progress_state", None)), "comfy_execution.progress.get_progress_state"),
        (isinstance(getattr(core_nodes, "NODE_CLASS_MAPPINGS", None), dict), "nodes.NODE_CLASS_MAPPINGS"),
    )
    for present, name in checks:
        if not present:
            return name
    registry = progress.get_progress_state()
    if not hasattr(registry, "prompt_id") or not isinstance(getattr(registry, "nodes", None), dict):
        return "the progress registry's prompt_id / nodes"
    return None


def add_on_prompt_handler(handler) -> bool:
    """Have ComfyUI's server call `handler(json_data) -> json_data` for every prompt posted (before validation);
    False when there is no server to call it (h3_core's CLI, tests importing the pack)."""
    try:
        instance = _server()
    except ImportError:
        return False
    if instance is None or not callable(getattr(instance, "add_on_prompt_handler", None)):
        return False
    instance.add_on_prompt_handler(handler)
    return True


def queue_state() -> tuple[dict[str, dict], list[tuple[float, str]]]:
    """({id: graph} of the running prompts, [(number, id)] of the waiting ones): a snapshot of ComfyUI's queue."""
    try:
        running, pending = _server().prompt_queue.get_current_queue_volatile()
        return ({item[1]: item[2] for item in running}, [(item[0], item[1]) for item in pending])
    except (AttributeError, TypeError, ValueError, IndexError, KeyError) as error:
        raise SeamChanged(f"the prompt queue's snapshot ({type(error).__name__}: {error})") from None


def node_states() -> tuple[str, dict[str, str]]:
    """(id of the prompt the executor works on, {node id: "pending" / "running" / "finished"}) from ComfyUI's
    progress registry; nodes served from ComfyUI's cache never appear."""
    from comfy_execution.progress import get_progress_state

    try:
        registry = get_progress_state()
        return str(registry.prompt_id or ""), {str(node): str(getattr(entry["state"], "value", entry["state"])).lower()
                                              for node, entry in list(registry.nodes.items())}
    except (AttributeError, TypeError, KeyError) as error:
        raise SeamChanged(f"the progress registry ({type(error).__name__}: {error})") from None


def run_core_node(class_type: str, inputs: dict) -> tuple:
    """Run one node of a prompt outside the executor, as the executor would call it (a V1 node's FUNCTION, a V3 node's
    `execute`); its outputs as a tuple. Used only for the file loaders and media bundlers encode-ahead allows."""
    import nodes as core_nodes

    cls = core_nodes.NODE_CLASS_MAPPINGS[class_type]
    if hasattr(cls, "define_schema"):  # V3
        function = cls.execute
    else:
        function = getattr(cls(), cls.FUNCTION)
    parameters = inspect.signature(function).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        inputs = {name: value for name, value in inputs.items() if name in parameters}
    out = function(**inputs)
    if isinstance(out, dict):
        out = out.get("result", ())
    return tuple(getattr(out, "args", out))
