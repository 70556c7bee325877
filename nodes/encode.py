"""The three encoder nodes: Text Encode starts a conditioning, the VAE encoders add their parts.

    media --> MiniMax H3 Text Encode --> MiniMax H3 Video VAE Encode --> MiniMax H3 Audio VAE Encode --> CONDITIONING
                 (Qwen3-VL)         (keyframes, refs)       (soundtracks, audio)

Each node calls the same h3_core functions the encoder stage runs (`h3_core.assembly`), so the
graph's conditioning is bit-identical to `python -m h3_core encode` on the same inputs. A VAE node
whose part the request does not need, or that gets a complete conditioning, passes it through untouched.
Once the last part is added, the CONDITIONING is the contract in core's form only (no encode parts ride on).
"""

from __future__ import annotations

import logging

from comfy_api.latest import io

from ..h3_core import assembly, component_cache, facts, rules
from ..h3_core.encoder import EncoderStage
from . import comfy_bridge as bridge
from . import graph_checks, loaders, memory, progress_text
from .input_checks import Problem, declared_problems, report
from .media import MediaBundle
from .types import CONDITIONING_CATEGORY, AudioVAE, Media, Schema, TextEncoder, VideoVAE

TASKS = ["auto", "t2va", "fl2va", "ref2va"]
TASK_TOOLTIP = ("What to make: t2va from the prompt alone, fl2va from first/last frames (MiniMax H3 Keyframes), "
                "ref2va from references (MiniMax H3 References). auto: decided by the media connected (references -> "
                "ref2va, keyframes -> fl2va, nothing -> t2va).")
# ComfyUI re-runs a VAE encode node whenever its input conditioning changes, and a new prompt changes it: without
# this, every prompt edit re-encodes unchanged reference videos. Parts are keyed by content and VAE identity
# (h3_core/component_cache.py), so an entry is only reused for the very pixels and weights that produced it.
VAE_PARTS = component_cache.MemoryTier(512 << 20)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def numbers_problems(width, height, length) -> list[Problem]:
    """The canvas and length problems Text Encode and Remote Encode share, each on the input that causes it.
    Values of the wrong type are left to the declared check."""
    problems: list[Problem] = []
    if _is_int(length):
        try:
            rules.check_output_frames(length)
        except rules.H3InputError as error:
            problems.append(("length", str(error)))
    if not (_is_int(width) and _is_int(height)):
        return problems
    if (width == 0) != (height == 0):
        unset, other = ("height", "width") if width else ("width", "height")
        problems.append((unset, f"width and height must both be 0 (auto) or both be set: set {unset} too, or set "
                                f"{other} to 0"))
        return problems
    if not width:
        return problems
    step = facts.CANVAS_MULTIPLE
    off_grid = [(name, value) for name, value in (("width", width), ("height", height)) if value % step]
    for name, value in off_grid:
        problems.append((name, f"{name} must be a multiple of {step} px (VAE /16 x DiT patch 2), got {value}; nearest "
                               f"valid: {max(step, value // step * step)} or {-(-value // step) * step}"))
    if not off_grid:
        try:
            rules.check_canvas(width, height)
        except rules.H3InputError as error:
            # aspect or size: both edges cause it; reported once, on width (the edge listed first)
            problems.append(("width", str(error)))
    return problems


def prompt_problems(prompt) -> list[Problem]:
    if isinstance(prompt, str) and not prompt.strip():
        return [("prompt", "the prompt is empty: describe the video and its sound (H3 needs a non-empty prompt)")]
    return []


def encode_problems(node_cls, values: dict, more: list[Problem] = ()) -> bool | str:
    """validate_inputs of Text Encode / Remote Encode: each input's declared type and bounds first, then the rules
    (and `more`, the node's own) on the inputs that passed them; one problem per input."""
    declared = declared_problems(node_cls, values)
    # an integer length gets the rules' message (the 5-3592 range and the 17k+5 grid, with the nearest valid)
    declared = [problem for problem in declared if problem[0] != "length" or not _is_int(values.get("length"))]
    blamed = {name for name, _ in declared}
    passed = {name: (None if name in blamed else values.get(name)) for name in ("width", "height", "length")}
    problems = declared + prompt_problems(values.get("prompt")) + numbers_problems(**passed)
    if "task" not in blamed:
        problems += media_problems(node_cls, values.get("task", "auto"), passed["length"])
    return report(problems + [problem for problem in more if problem[0] not in blamed])


@graph_checks.guarded
def media_problems(node_cls, task, length=None) -> list[Problem]:
    """`task` against the media the graph connects to this node (graph_checks): fl2va with no keyframes, t2va with
    media, references with keyframes... On `task` when it is set, on `media` when it is auto. And each Guide's
    frame_idx against `length` (on `media`)."""
    node_id = getattr(getattr(node_cls, "hidden", None), "unique_id", None)
    graph_ = graph_checks.graph()
    if graph_ is None or node_id is None:
        return []
    media = graph_checks.media_of(graph_, node_id)
    problem = graph_checks.task_problem(task, media)
    problems = [("media" if task == "auto" else "task", problem)] if problem else []
    guide = graph_checks.guide_problem(media, length)
    return problems + ([("media", guide)] if guide and not (problems and problems[0][0] == "media") else [])


def check_numbers(width: int, height: int, length: int) -> bool | str:
    """True, or the first canvas/length problem (for callers that raise one message)."""
    problems = numbers_problems(width, height, length)
    return f"{problems[0][0]}: {problems[0][1]}" if problems else True


def numbers_inputs() -> list:
    return [
        io.Int.Input(
            "width",
            default=0,
            min=0,
            max=facts.MAX_CANVAS_EDGE,
            step=32,
            tooltip=f"Output width in px, a multiple of 32, at most {facts.MAX_CANVAS_EDGE} px and "
            f"{facts.MAX_CANVAS_PIXELS} px in area. H3 was trained up to {facts.TRAINED_CANVAS_EDGE} px a side and "
            f"{facts.TRAINED_CANVAS_PIXELS} px (e.g. 1344x768): larger runs with a warning, quality untested, memory "
            "grows with the area (python -m h3_core plan). 0 = automatic: 16:9, or the first keyframe's aspect, at a "
            "768 px short edge (64 px for the tiny model).",
        ),
        io.Int.Input(
            "height", default=0, min=0, max=facts.MAX_CANVAS_EDGE, step=32,
            tooltip=f"Output height in px, a multiple of 32, at most {facts.MAX_CANVAS_EDGE} px; 0 = automatic "
            "(set both or neither).",
        ),
        io.Int.Input(
            # min 5 + step 17 keeps the arrows on the 17k+5 grid (5, 22, ..., 124, ..., 3592); validate_inputs refuses
            # a typed value off the grid. Saved workflows store a value, so the bounds change no saved graph.
            "length",
            default=facts.DEFAULT_FRAMES,
            min=facts.MIN_FRAMES,
            max=facts.MAX_FRAMES,
            step=facts.FRAMES_PER_CLIP,
            tooltip=f"Video length in frames at {facts.FPS} fps, in steps of {facts.FRAMES_PER_CLIP} frames (the "
            f"video VAE's clip grid, 17k+5): {facts.MIN_FRAMES} to {facts.MAX_FRAMES} "
            f"({facts.MAX_FRAMES / facts.FPS:.0f} s), as ComfyUI core allows. H3 was trained on "
            f"{facts.TRAINED_MIN_FRAMES} (5.2 s) to {facts.TRAINED_MAX_FRAMES} (14.4 s): outside that range it runs "
            "with a warning, quality untested; memory grows with the length (python -m h3_core plan). "
            f"{facts.IMAGE_FRAMES} = text to image (the Decode node's `image` output is the first frame).",
        ),
    ]


def request_from(media, prompt, task, width, height, length):
    untrained = rules.trained_range_warning(length) if _is_int(length) else None
    if untrained:  # valid, as in ComfyUI core; said in the log, as the tooltip says it
        logging.getLogger("h3_core").warning("MiniMax H3: length %s", untrained)
    large = rules.canvas_trained_warning(width, height) if _is_int(width) and _is_int(height) and width else None
    if large:
        logging.getLogger("h3_core").warning("MiniMax H3: %s", large)
    bundle = media if media is not None else MediaBundle()
    return bundle.to_request(
        prompt=prompt,
        task=None if task == "auto" else task,
        width=width or None,
        height=height or None,
        num_frames=length,
    )


def parts_of(conditioning, node: str) -> assembly.EncodingParts | None:
    """The parts a VAE encode node adds to; None when the conditioning is already complete (it passes through)."""
    parts = assembly.from_core(conditioning)
    if parts is None:
        if _is_h3(conditioning):
            return None
        raise ValueError(f"{node} adds to a conditioning started by MiniMax H3 Text Encode; connect that node's "
                         "output here")
    if not assembly.is_untouched(conditioning, parts):
        raise ValueError(
            f"{node}: another node changed this conditioning before its encode parts were complete; connect the H3 "
            "encode nodes directly to each other and put core conditioning nodes after the last one, right before "
            "the MiniMax H3 Sampler"
        )
    return parts


def _is_h3(conditioning) -> bool:
    try:
        return isinstance(conditioning[0][1], dict) and "minimax_token_tags" in conditioning[0][1]
    except (TypeError, IndexError, KeyError):
        return False


class TextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return Schema(
            node_id="H3SplitTextEncode",
            display_name="MiniMax H3 Text Encode",
            category=CONDITIONING_CATEGORY,
            description="Starts the conditioning: the text encoder reads the prompt together with the pictures it "
            "refers to (keyframes or references connected to `media`), and this node sets the video's size and "
            "length. Chain MiniMax H3 Video VAE Encode and Audio VAE Encode after it, then the Sampler.",
            inputs=[
                TextEncoder.Input("text_encoder", tooltip=f"From {loaders.TextEncoderLoader.DISPLAY_NAME}."),
                io.String.Input(
                    "prompt",
                    multiline=True,
                    tooltip="Passed verbatim (no chat template). Refer to "
                    "references as <Picture i>, <Video k>, <Audio j>.",
                ),
                *numbers_inputs(),
                Media.Input("media", optional=True, tooltip="Keyframes (fl2va) or references (ref2va)."),
                io.Combo.Input(
                    "task",
                    options=TASKS,
                    default="auto",
                    optional=True,
                    tooltip=TASK_TOOLTIP,
                ),
            ],
            outputs=[io.Conditioning.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, **kwargs):
        return encode_problems(cls, kwargs)

    @classmethod
    def execute(cls, text_encoder, prompt, width, height, length, media=None, task="auto") -> io.NodeOutput:
        request = request_from(media, prompt, task, width, height, length)
        parts = assembly.start(request, text_encoder.pipeline_config)  # all rules checked before the model moves
        needed = memory.text_encoding_bytes(
            parts.media(), text_encoder.extra["tokenizer"], text_encoder.module, text_encoder.dtype
        )
        device = bridge.use(text_encoder.patcher, memory_required=needed)  # layers that do not fit stream
        stage = EncoderStage(
            modules={"text_encoder": text_encoder.module, **text_encoder.extra},
            pipeline_config=text_encoder.pipeline_config,
            fingerprint=text_encoder.fingerprint,
            device=device,
        )
        with progress_text.phases():  # None: the running node (ComfyUI's executing context)
            return io.NodeOutput(assembly.to_core(assembly.add_text(parts, stage)))


class _VAEEncode(io.ComfyNode):
    """Adds one VAE encoder's part to a conditioning started by MiniMax H3 Text Encode."""

    NODE_ID = DISPLAY_NAME = DESCRIPTION = MODEL_INPUT = LOADER = ""
    MODEL_TYPE = None
    NEEDED = ""  # the Prepared property saying whether the request needs this encoder
    ADD = None  # the h3_core.assembly function adding the part
    STAGE_KEY = ""  # the module's key in EncoderStage(modules=...)

    @classmethod
    def define_schema(cls):
        return Schema(
            node_id=cls.NODE_ID,
            display_name=cls.DISPLAY_NAME,
            category=CONDITIONING_CATEGORY,
            description=cls.DESCRIPTION,
            inputs=[
                io.Conditioning.Input("conditioning",
                                      tooltip="From MiniMax H3 Text Encode (or the encode node before this)."),
                cls.MODEL_TYPE.Input(cls.MODEL_INPUT, tooltip=f"From {cls.LOADER}."),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, conditioning, **models) -> io.NodeOutput:
        parts = parts_of(conditioning, cls.DISPLAY_NAME)
        if parts is None or not getattr(parts.resolved, cls.NEEDED):
            return io.NodeOutput(conditioning)
        model = models[cls.MODEL_INPUT]
        device = bridge.use(model.patcher)
        stage = EncoderStage(
            modules={cls.STAGE_KEY: model.module}, pipeline_config=parts.pipeline_config, device=device,
            fingerprint=model.fingerprint,
        )
        with progress_text.phases(), component_cache.using(VAE_PARTS):
            return io.NodeOutput(assembly.to_core(cls.ADD(parts, stage)))


class VideoVAEEncode(_VAEEncode):
    NODE_ID, DISPLAY_NAME = "H3SplitVideoVAEEncode", "MiniMax H3 Video VAE Encode"
    DESCRIPTION = (
        "Adds the keyframes and the reference images and videos (Text Encode's `media`) to the conditioning, "
        "encoded by the video VAE. Connect Text Encode's conditioning and the video VAE loader; then Audio VAE "
        "Encode. A text-only (t2va) conditioning passes through unchanged."
    )
    MODEL_INPUT, MODEL_TYPE, STAGE_KEY, LOADER = "vae", VideoVAE, "vae", loaders.VideoVAELoader.DISPLAY_NAME
    NEEDED, ADD = "needs_video_vae", staticmethod(assembly.add_video)


class AudioVAEEncode(_VAEEncode):
    NODE_ID, DISPLAY_NAME = "H3SplitAudioVAEEncode", "MiniMax H3 Audio VAE Encode"
    DESCRIPTION = (
        "Adds the reference audios and the reference videos' soundtracks to the conditioning, encoded by the audio "
        "VAE. Connect Video VAE Encode's conditioning and the audio VAE loader; then the Sampler. A conditioning "
        "without audio passes through unchanged."
    )
    MODEL_INPUT, MODEL_TYPE, STAGE_KEY, LOADER = "audio_vae", AudioVAE, "audio_vae", loaders.AudioVAELoader.DISPLAY_NAME
    NEEDED, ADD = "needs_audio_vae", staticmethod(assembly.add_audio)


NODES = [TextEncode, VideoVAEEncode, AudioVAEEncode]
