"""Queue-time rules that need more than one node's widgets: read from the prompt graph being validated.

ComfyUI 0.3.75 hands a node's `validate_inputs` only that node's own widget values (linked inputs arrive as None,
and the hidden PROMPT is empty at validation time). Some refusals are nevertheless fixed by the graph alone: the task
Text Encode is set to against the media connected to it, the DiT partition a loader's file holds against that task,
the `gpus` of the Sampler against the DiT's attention heads. Without this module they came at run time, after the
loaders and the text encoder had run.

ComfyUI calls each on-prompt handler with the posted JSON right before it validates that prompt, in the same
request task (server.py `post_prompt`: `trigger_on_prompt`, then `await execution.validate_prompt`), so `remember`
keeps the graph in a context variable that the validators read with `graph()`: each request sees its own graph,
concurrent requests never mix. Where there is no graph (no server, or a core without the hook) every rule here
says nothing and the run-time checks stay what they were.

This module imports nothing from ComfyUI; the rules that read model files (`dit_of`) go through the loaders.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass, replace

from ..h3_core import facts, guides, rules, step_cache

_GRAPH: contextvars.ContextVar[dict | None] = contextvars.ContextVar("h3_prompt_graph", default=None)

TEXT_ENCODE, REMOTE_ENCODE = "H3SplitTextEncode", "H3SplitRemoteEncode"
VIDEO_VAE_ENCODE, AUDIO_VAE_ENCODE = "H3SplitVideoVAEEncode", "H3SplitAudioVAEEncode"
KEYFRAMES, REFERENCES = "H3SplitKeyframes", "H3SplitReferences"
GUIDE, CONTINUE_VIDEO = "H3SplitGuide", "H3SplitContinueVideo"
DIT_LOADER = "H3SplitDiTLoader"
KEYFRAMES_NAME, REFERENCES_NAME = "MiniMax H3 Keyframes (first / last frame)", "MiniMax H3 References"


def remember(json_data):
    """The on-prompt handler: keeps the posted graph for this request's validators; returns the data unchanged."""
    prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
    _GRAPH.set(prompt if isinstance(prompt, dict) else None)
    return json_data


def graph() -> dict | None:
    return _GRAPH.get()


def guarded(rules_of):
    """A graph rule that fails says nothing (one log line) rather than refuse the prompt: ComfyUI turns an exception
    in validate_inputs into a refusal, and the run-time checks still hold."""

    def run(*args, **kwargs) -> list:
        try:
            return rules_of(*args, **kwargs)
        except Exception:  # noqa: BLE001 - never block a prompt on this module's own bug
            logging.getLogger(__name__).warning("[MiniMax H3] a queue-time graph check failed; it is skipped",
                                                exc_info=True)
            return []

    run.__name__, run.__doc__ = rules_of.__name__, rules_of.__doc__
    return run


def node(graph_: dict | None, node_id) -> dict | None:
    found = (graph_ or {}).get(str(node_id)) if node_id is not None else None
    return found if isinstance(found, dict) and isinstance(found.get("inputs"), dict) else None


def linked(graph_: dict | None, node_id, name: str) -> tuple[str, dict] | None:
    """(id, node) of what feeds input `name` of node `node_id`; None when it is a widget value or unconnected."""
    here = node(graph_, node_id)
    value = here["inputs"].get(name) if here else None
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int))):
        return None
    source = node(graph_, value[0])
    return (str(value[0]), source) if source else None


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2


# --- the Sampler's `cache` ----------------------------------------------------------------------------------------

CACHE_DIT_PRESETS = "quality, balanced and fast"  # the `cache` options that need cache-dit (step_cache.PRESETS)
CACHE_DIT_INSTALL = (f"`pip install {step_cache.CACHE_DIT_REQUIREMENT}` (or `pip install \".[cache]\"` in the pack's "
                     "folder) in ComfyUI's Python, then restart ComfyUI")


def cache_dit_installed() -> bool:
    """Whether cache-dit can be imported here, without importing it (it pulls in much of diffusers)."""
    import importlib.util

    try:
        return importlib.util.find_spec("cache_dit") is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        return False


def cache_problem(value) -> str | None:
    """Why the run would refuse `cache` (an unknown form, or a cache-dit preset without cache-dit); None when it
    runs. Accepts every form the run accepts (the widget's, every:K for any K >= 2, the CLI's dbcache: form)."""
    if not isinstance(value, str):
        return f"cache must be text, got {value!r}"
    try:
        plan = step_cache.parse(value)
    except rules.H3InputError as error:
        return str(error)
    if isinstance(plan, step_cache.DBCache) and not cache_dit_installed():
        return (f"cache {value} needs cache-dit, which is not installed (the pack's requirements.txt, all that "
                f"ComfyUI Manager installs, leaves it out): run {CACHE_DIT_INSTALL}; or pick off or every:2/3/4, "
                "which need nothing extra")
    return None


# --- the media connected to an encode node ---------------------------------------------------------------------


@dataclass(frozen=True)
class Media:
    """How many of each item a MINIMAX_H3_MEDIA bundle holds, counted from the sockets connected in the graph."""

    keyframes: int = 0
    images: int = 0
    videos: int = 0
    audios: int = 0
    guides: int = 0
    guide_frames: tuple = ()  # each Guide's frame_idx widget value (Continue Video's: 0), where the graph fixes it

    def summary(self) -> rules.MediaSummary:
        # Durations are known only once the clips are decoded; the shortest valid ones keep the duration rules (run
        # time, References' own check) out of this count check.
        return rules.MediaSummary(
            keyframes=self.keyframes,
            image_refs=self.images,
            video_ref_seconds=(facts.MIN_REFERENCE_VIDEO_S,) * self.videos,
            soundtrack_seconds=(None,) * self.videos,
            audio_ref_seconds=(facts.MIN_AUDIO_CLIP_S,) * self.audios,
            guides=self.guides,
        )


def media_of(graph_: dict | None, node_id, name: str = "media", depth: int = 0) -> Media | None:
    """The media input `name` of `node_id` carries; Media() when unconnected, None when the graph does not say
    (a node this pack does not know, a loop)."""
    here = node(graph_, node_id)
    if here is None:
        return None
    source = linked(graph_, node_id, name)
    if source is None:
        return None if _is_link(here["inputs"].get(name)) else Media()
    source_id, source_node = source
    inputs, kind = source_node["inputs"], source_node.get("class_type")
    if kind == KEYFRAMES:
        return Media(keyframes=sum(_is_link(inputs.get(socket)) for socket in ("first_frame", "last_frame")))
    if kind == REFERENCES and depth < 64:
        before = media_of(graph_, source_id, "media", depth + 1)
        if before is None:
            return None

        def count(prefix: str) -> int:
            return sum(_is_link(value) for socket, value in inputs.items() if socket.startswith(prefix))

        return Media(before.keyframes, before.images + count("ref_image_"), before.videos + count("ref_video_"),
                     before.audios + count("ref_audio_"), before.guides)
    if kind in (GUIDE, CONTINUE_VIDEO) and depth < 64:
        before = media_of(graph_, source_id, "media", depth + 1)
        if before is None:
            return None
        frame = 0 if kind == CONTINUE_VIDEO else inputs.get("frame_idx")
        frames = before.guide_frames + ((frame,) if isinstance(frame, int) and not isinstance(frame, bool) else ())
        return replace(before, guides=before.guides + 1, guide_frames=frames)
    return None


def guide_problem(media: Media | None, length) -> str | None:
    """A guide whose frame_idx lies outside the output (`length` frames): what the run would refuse, said at queue time
    (a clip's own length is known only once its frames are, so the run checks that)."""
    if media is None or not isinstance(length, int) or isinstance(length, bool):
        return None
    for frame in media.guide_frames:
        problem = guides.fit_error(frame, 1, length)
        if problem:
            return f"MiniMax H3 Guide: {problem}: set its frame_idx within -{length}..{length - 1}, or raise length"
    return None


def task_problem(task, media: Media | None) -> str | None:
    """What the run would refuse about `task` with this media (h3_core.rules.check_request's counting rules), with
    what to change; None when it is fine or the graph does not say."""
    if media is None or not isinstance(task, str):
        return None
    resolved = rules.infer_task(media.summary()) if task == "auto" else task
    try:
        rules.check_request(resolved, "-", media.summary(), facts.DEFAULT_FRAMES)
    except rules.H3InputError as error:
        return f"{error}: {_next_step(task, media)}"
    return None


def _next_step(task: str, media: Media) -> str:
    refs = media.images + media.videos + media.audios
    if media.guides and refs:
        return ("guides (MiniMax H3 Guide, Continue Video) and references cannot go together: guides make an fl2va "
                "job, references a ref2va one")
    if task == "auto":
        return (f"keyframes and references cannot go together; connect either {KEYFRAMES_NAME} or "
                f"{REFERENCES_NAME} to media")
    if task == "fl2va" and not media.keyframes and not refs:
        return (f"connect {KEYFRAMES_NAME} to media, with a first and/or last frame image, or a MiniMax H3 Guide, or "
                "set task to t2va or auto")
    if task == "ref2va" and not media.keyframes and not media.images + media.videos:
        return (f"connect {REFERENCES_NAME} to media, with an image or video reference, or set task to t2va or "
                "auto")
    inferred = rules.infer_task(media.summary())
    if inferred != task and not (media.keyframes and refs):
        return f"set task to {inferred} or auto (the media connected make a {inferred} job)"
    if task == "ref2va" and not media.keyframes:
        return f"connect fewer references to the {REFERENCES_NAME} nodes"
    return "connect either keyframes or references to media, and set task to match"


def resolved_task(graph_: dict | None, node_id) -> str | None:
    """The task the encode node `node_id` will run (its widget, or what `auto` infers from the media connected);
    None when the graph does not fix it, or when that node refuses its task and media itself."""
    here = node(graph_, node_id)
    if here is None:
        return None
    task = here["inputs"].get("task", "auto")
    media = media_of(graph_, node_id)
    if not isinstance(task, str) or task not in ("auto", *rules.TASKS) or media is None:
        return None
    if task_problem(task, media):
        return None
    return rules.infer_task(media.summary()) if task == "auto" else task


def conditioning_task(graph_: dict | None, node_id, name: str = "conditioning") -> str | None:
    """The task of the conditioning reaching input `name` of `node_id`, through the pack's VAE encode nodes; None
    when something else (Load Conditioning, a core conditioning node) makes or edits it."""
    seen = set()
    source = linked(graph_, node_id, name)
    while source is not None and source[0] not in seen:
        source_id, source_node = source
        seen.add(source_id)
        kind = source_node.get("class_type")
        if kind in (TEXT_ENCODE, REMOTE_ENCODE):
            return resolved_task(graph_, source_id)
        if kind not in (VIDEO_VAE_ENCODE, AUDIO_VAE_ENCODE):
            return None
        source = linked(graph_, source_id, "conditioning")
    return None
