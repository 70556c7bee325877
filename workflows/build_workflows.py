"""The one source of the shipped workflows: each graph is declared once here and written as
- a UI-format JSON in `example_workflows/` (drag and drop; ComfyUI lists that folder in its template
  browser), with a generated thumbnail `<name>.jpg` and the list of real model files (name, Comfy-Org
  download URL, target folder) that the frontend offers to download when they are missing;
- an API-format JSON in `workflows/api/` (headless `POST /prompt`).

Each template defaults to the files core's own H3 templates use and a Turbo LoRA at its step count, and every node
carries `cnr_id` / `ver` (the pack's registry id and version, or comfy-core's); the core-sampler templates
(`*_core`: the pack's Remote Encode, core 0.33's UNETLoader -> ModelSamplingMiniMaxH3 -> KSampler, the pack's Decode)
need ComfyUI 0.33+. The API forms run the embedded tiny H3 (no LoRA).

The UI form needs every node's sockets and widget order, which come from a live ComfyUI's
`/object_info`, so the files cannot drift from the node definitions: the test suite regenerates
them against the real server and fails if a committed file differs. The UI files are valid against
the frontend's workflow schema (top-level `id` a UUID, `models` entries {name, url, directory}).

    python workflows/build_workflows.py --server http://127.0.0.1:8188   # rewrite all generated files
    python workflows/build_workflows.py --inputs-only                    # (re)write the example media

The example media (`workflows/inputs/h3_example_*`) are synthesised deterministically; the pack
copies them into ComfyUI's input/ folder so the workflows run out of the box.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
INPUTS = HERE / "inputs"
TEMPLATES = "example_workflows"  # relative to the repo root; ComfyUI serves it as the pack's templates
TINY = "[embedded] tiny H3 (noise)"  # the loaders' embedded choice (nodes/comfy_bridge.py TINY_CHOICE)
TINY_FILE = "[embedded] tiny H3 / "  # + one of the tiny's single files (the quantised API graphs pick them)
FL2VA = "fl2va (t2va, first/last frame)"
REF2VA = "ref2va (references)"
DEFAULT_ENDPOINT = "http://127.0.0.1:8190"
STEPS = 8  # the tiny model's demo setting (API workflows, the tiny form of the templates)


def _pack_identity() -> tuple[str, str]:
    """The pack's registry id and version (pyproject.toml [project] name / version): every template node of the
    pack carries them as `cnr_id` / `ver`, as core's templates do, so the frontend knows which pack a node needs."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    return (re.search(r'^name\s*=\s*"([^"]+)"', project, re.M).group(1),
            re.search(r'^version\s*=\s*"([^"]+)"', project, re.M).group(1))


PACK_ID, PACK_VERSION = _pack_identity()
CORE_ID = "comfy-core"  # what core's templates put in a core node's cnr_id
# A core node's `ver`: the oldest core the pack supports (0.3.75), or the core that added the node.
CORE_VERSION, CORE_H3_VERSION = "0.3.75", "0.33.0"


@dataclass(frozen=True)
class Turbo:
    """A Turbo LoRA (lightx2v's distillation, Comfy-Org's ComfyUI export) at the steps and shifts its card asks:
    `forwards` DiT passes (core's KSampler `steps`); the pack's Sampler counts noise levels, forwards + 1."""

    model: str  # its REAL_MODELS key
    forwards: int
    video_shift: float = 12.0
    audio_shift: float = 3.0

    @property
    def sampler_steps(self) -> int:
        return self.forwards + 1


# What core's official H3 templates default to: FL2V 8-step v1.0 (544p) for t2va / fl2va, Ref2V 4-step v0.1.
TURBO = {"fl2va": Turbo("lora fl2v_turbo_8step", 8), "ref2va": Turbo("lora ref2v_turbo_4step", 4)}
CORE_SAMPLER = ("res_multistep", "simple")  # core's H3 templates' sampler and scheduler

EXAMPLE_MEDIA = {
    "first": "h3_example_first_frame.png",
    "last": "h3_example_last_frame.png",
    "image": "h3_example_reference_image.png",
    "video": "h3_example_reference_video.mp4",
    "audio": "h3_example_reference_audio.wav",
}

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


@dataclass(frozen=True)
class ModelFile:
    """A published file a loader selects in the user templates, and the embedded tiny H3's stand-in for it in the
    API workflows (the demo and tests run those)."""

    name: str
    directory: str
    tiny: str


# The frontend offers the missing files for download into models/<directory>/; it only accepts safetensors files.
# The templates default to the files core's own H3 templates use (about 44.5 GB: the nvfp4-AWQ text encoder, the
# pruned int8-ConvRot DiT, the int8-ConvRot video VAE, the fp32 audio VAE, a Turbo LoRA); their API twins run the
# embedded tiny H3 (core's UNETLoader: the tiny Comfy-format DiT in models/diffusion_models).
HF = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main"
REAL_MODELS = {
    "text_encoder": ModelFile("qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", "text_encoders", TINY),
    "vae": ModelFile("minimax_h3_video_vae_int8_convrot.safetensors", "vae", TINY),
    "audio_vae": ModelFile("minimax_h3_audio_vae_fp32.safetensors", "vae", TINY),
    "fl2va": ModelFile("minimax_h3_fl2va_pruned_int8_convrot.safetensors", "diffusion_models", TINY),
    "ref2va": ModelFile("minimax_h3_ref2va_pruned_int8_convrot.safetensors", "diffusion_models", TINY),
    "core fl2va": ModelFile("minimax_h3_fl2va_pruned_int8_convrot.safetensors", "diffusion_models",
                            "minimax_h3_tiny_fl2va_fp32.safetensors"),
    "core ref2va": ModelFile("minimax_h3_ref2va_pruned_int8_convrot.safetensors", "diffusion_models",
                             "minimax_h3_tiny_ref2va_fp32.safetensors"),
    # No tiny stand-in: the tiny forms leave the LoRA out (the Sampler's `lora` empty, no LoraLoaderModelOnly).
    "lora fl2v_turbo_8step": ModelFile("minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", "loras", ""),
    "lora ref2v_turbo_4step": ModelFile("minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors", "loras", ""),
    "text_encoder int8_convrot": ModelFile("qwen3vl_32b_minimax_h3_int8_convrot.safetensors", "text_encoders",
                                           TINY_FILE + "qwen3vl_minimax_h3_tiny_int8_convrot.safetensors"),
    "text_encoder nvfp4_awq": ModelFile("qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", "text_encoders",
                                        TINY_FILE + "qwen3vl_minimax_h3_tiny_nvfp4_awq.safetensors"),
    "fl2va pruned_int8_convrot": ModelFile("minimax_h3_fl2va_pruned_int8_convrot.safetensors", "diffusion_models",
                                           TINY_FILE + "minimax_h3_tiny_fl2va_pruned_int8_convrot.safetensors"),
    "fl2va pruned_fp8_scaled": ModelFile("minimax_h3_fl2va_pruned_fp8_scaled.safetensors", "diffusion_models",
                                         TINY_FILE + "minimax_h3_tiny_fl2va_pruned_fp8_scaled.safetensors"),
}
PARTITION_OF = {"fl2va": FL2VA, "ref2va": REF2VA}

# The widget of each loader that names its file: the pack's (PACK_LOADERS: the embedded tiny H3 among their
# choices, its badge when selected) and core's in the core-sampler templates.
PACK_LOADERS = {
    "H3SplitTextEncoderLoader": "text_encoder",
    "H3SplitVideoVAELoader": "vae",
    "H3SplitAudioVAELoader": "audio_vae",
    "H3SplitDiTLoader": "dit",
}
LOADER_INPUT = {**PACK_LOADERS, "UNETLoader": "unet_name", "LoraLoaderModelOnly": "lora_name"}

# Core 0.33's H3 node the core-sampler templates use, as 0.33's /object_info declares it (the parts the UI form
# reads): the templates render the same against 0.3.75, which lacks it (tests/test_core033_comfyui.py checks this
# copy against 0.33's server).
CORE_033_SCHEMAS = {
    "MiniMaxH3SigmaShift": {
        "input": {"required": {
            "model": ["MODEL", {}],
            "shift_video": ["FLOAT", {"default": 12.0, "min": 0.01, "max": 100.0, "step": 0.01}],
            "shift_audio": ["FLOAT", {"default": 3.0, "min": 0.01, "max": 100.0, "step": 0.01}],
        }},
        "input_order": {"required": ["model", "shift_video", "shift_audio"]},
        "output": ["MODEL"],
        "output_name": ["MODEL"],
    },
}
# Core's save nodes as every template writes them, 0.3.75's declarations: SaveVideo's `format`, `codec` plain combos
# (widgets [prefix, "mp4", "h264"]), no outputs. Core 0.33 declares SaveVideo's `format` a dynamic combo whose `codec`
# follows the chosen format, and gives both an output to chain (`video`, `images`); its frontend reads these
# forms and its API takes the same inputs, so the files render the same against either server.
WRITTEN_SCHEMAS = {
    "SaveImage": {
        "input": {"required": {"images": ["IMAGE", {}], "filename_prefix": ["STRING", {"default": "ComfyUI"}]}},
        "input_order": {"required": ["images", "filename_prefix"]},
        "output": [],
        "output_name": [],
    },
    "SaveVideo": {
        "input": {"required": {
            "video": ["VIDEO", {}], "filename_prefix": ["STRING", {"default": "video/ComfyUI"}],
            "format": ["COMBO", {"default": "auto", "options": ["auto", "mp4"]}],
            "codec": ["COMBO", {"default": "auto", "options": ["auto", "h264"]}],
        }},
        "input_order": {"required": ["video", "filename_prefix", "format", "codec"]},
        "output": [],
        "output_name": [],
    },
}


def node_identity(class_type: str) -> dict:
    """`cnr_id` / `ver` of a template node: the pack's for its nodes, comfy-core's for core's (Note included)."""
    if class_type.startswith("H3Split"):
        return {"cnr_id": PACK_ID, "ver": PACK_VERSION}
    return {"cnr_id": CORE_ID, "ver": CORE_H3_VERSION if class_type in CORE_033_SCHEMAS else CORE_VERSION}


def model_entry(key: str) -> dict:
    model = REAL_MODELS[key]
    return {"name": model.name, "url": f"{HF}/{model.directory}/{model.name}", "directory": model.directory}


@dataclass
class Node:
    id: int
    class_type: str
    inputs: dict  # name -> widget value, or (node, output slot) for a link
    title: str | None = None
    model: str | None = None  # a loader's REAL_MODELS key
    before: Node | None = None  # a note: the node it sits above
    column: int | None = None  # canvas column (None: one after its inputs)
    published: dict = field(default_factory=dict)  # widget values of the form on the published files
    extra_models: tuple = ()  # REAL_MODELS keys a widget of `published` selects (a Sampler's Turbo LoRA)

    def model_keys(self) -> list[str]:
        return ([self.model] if self.model is not None else []) + list(self.extra_models)

    def inputs_for(self, tiny: bool) -> dict:
        """The inputs with a loader's file: the published one, or (tiny) the embedded tiny H3's stand-in."""
        if not tiny and self.published:
            return {**self.inputs, **self.published}
        if self.model is None:
            return self.inputs
        model = REAL_MODELS[self.model]
        return {LOADER_INPUT[self.class_type]: model.tiny if tiny else model.name, **self.inputs}


NOTE = "Note"  # core's frontend-only note node: shown on the canvas, never part of a prompt

# Canvas layout: the model loaders in the first column, then one column per step of the graph (a node may name
# its column to share one with the step before, as a chain of encoders or Decode and Save do), nodes stacked in
# declaration order. Heights are what frontend 1.32.9 draws each node at (previews and
# players included), so nothing overlaps and no loader has an empty body (tests/ui checks the boxes).
COLUMN_X, COLUMN_GAP, ROW_GAP, TOP = 420, 60, 50, 40
NODE_WIDTH = {"H3SplitTextEncode": 400, "H3SplitRemoteEncode": 400, NOTE: 360, "SaveVideo": 400, "SaveImage": 400}
TITLE_H, SLOT_H, WIDGET_H, PAD = 30, 20, 24, 12
EXTRA_H = {  # what a node draws below its widgets
    "LoadImage": 240,  # the image preview
    "LoadVideo": 310,  # the video player
    "LoadAudio": 70,  # the audio player
    "SaveVideo": 260,  # the result's player
    "SaveImage": 260,  # the result's preview
    "H3SplitTextEncode": 110,  # the multiline prompt
    "H3SplitRemoteEncode": 110,
    NOTE: 0,
}


def estimated_height(class_type: str, sockets: int, outputs: int, widgets: int, text: str = "") -> int:
    if class_type == NOTE:
        return TITLE_H + 20 + 18 * (len(text) // 44 + text.count("\n") + 1)
    return TITLE_H + SLOT_H * max(sockets, outputs) + WIDGET_H * widgets + EXTRA_H.get(class_type, 0) + PAD


@dataclass
class Graph:
    key: str  # the API file's name and the workflow's identity (its UUID)
    title: str  # the template's name in ComfyUI's template browser: what its search reads
    description: str
    tiny: bool = False  # built for the tiny forms (API workflow, tiny UI): no node that needs a published file only
    nodes: list[Node] = field(default_factory=list)
    notes: list[Node] = field(default_factory=list)  # numbered after the nodes: the API form keeps its ids

    def add(self, class_type: str, title: str | None = None, model: str | None = None, column: int | None = None,
            named: dict | None = None, **inputs) -> Node:
        """A node; `named`: inputs whose names clash with this method's (core's `model` sockets)."""
        node = Node(len(self.nodes) + 1, class_type, {**(named or {}), **inputs}, title, model, column=column)
        self.nodes.append(node)
        return node

    def note(self, text: str, before: Node) -> Node:
        """A note on the canvas, placed right above `before` in its column."""
        node = Node(0, NOTE, {"text": text}, before=before)
        self.notes.append(node)
        return node

    def runnable(self) -> list[Node]:
        return self.nodes

    def _canvas_nodes(self) -> list[Node]:
        """The nodes, then the notes numbered after them."""
        for number, note in enumerate(self.notes, start=len(self.nodes) + 1):
            note.id = number
        return self.nodes + self.notes

    # --- API format ------------------------------------------------------------------------------

    def api(self) -> dict:
        """The API workflow: every loader on the embedded tiny H3 (the demo and the tests run these)."""
        out = {}
        for node in self.runnable():
            inputs = {
                name: [str(value[0].id), value[1]] if _is_link(value) else value
                for name, value in node.inputs_for(tiny=True).items()
            }
            out[str(node.id)] = {"class_type": node.class_type, "inputs": inputs}
            if node.title:
                out[str(node.id)]["_meta"] = {"title": node.title}
        return out

    # --- UI format -------------------------------------------------------------------------------

    def ui(self, object_info: dict, tiny: bool = False) -> dict:
        """The UI workflow: loaders on the published files (tiny=True: on the embedded tiny H3, for tests)."""
        links, ui_nodes = [], []
        out_links: dict[tuple[int, int], list[int]] = {}
        for node in self.runnable():
            for value in node.inputs.values():
                if _is_link(value):
                    link_id = len(links) + 1
                    links.append([link_id, value[0].id, value[1], node.id, None, None])
                    out_links.setdefault((value[0].id, value[1]), []).append(link_id)
        order = self._order()
        entries = {}
        for node in self._canvas_nodes():
            if node.class_type == NOTE:
                text = node.inputs["text"]
                entries[node.id] = {
                    "id": node.id, "type": NOTE, "size": [NODE_WIDTH[NOTE], estimated_height(NOTE, 0, 0, 0, text)],
                    "flags": {}, "order": len(order) + node.id, "mode": 0, "inputs": [], "outputs": [],
                    "properties": {**node_identity(NOTE), "text": ""}, "widgets_values": [text], "color": "#432",
                    "bgcolor": "#653",
                }  # fmt: skip
                continue
            info = (CORE_033_SCHEMAS.get(node.class_type) or WRITTEN_SCHEMAS.get(node.class_type)
                    or object_info.get(node.class_type))
            if info is None:
                raise KeyError(f"{node.class_type} is not registered in this ComfyUI (is the pack loaded?)")
            inputs = node.inputs_for(tiny)
            input_order = info.get("input_order", {})
            specs = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
            names = list(input_order.get("required", [])) + list(input_order.get("optional", []))
            sockets, widgets = [], []
            for name in names:
                kind = specs[name][0]
                options = specs[name][1] if len(specs[name]) > 1 else {}
                is_widget = isinstance(kind, list) or kind in WIDGET_TYPES
                value = inputs.get(name)
                if is_widget and not _is_link(value):
                    widgets.append(options.get("default") if value is None else value)
                    if options.get("control_after_generate"):
                        widgets.append("fixed")
                    continue
                if value is None and not is_widget and name not in inputs:
                    sockets.append({"name": name, "type": kind, "link": None})
                    continue
                link_id = next(
                    link[0]
                    for link in links
                    if link[3] == node.id and link[1] == value[0].id and link[2] == value[1] and link[4] is None
                )
                slot = len(sockets)
                for link in links:
                    if link[0] == link_id:
                        link[4] = slot
                        link[5] = kind
                sockets.append({"name": name, "type": kind, "link": link_id})
            outputs = [
                {
                    "name": info["output_name"][i],
                    "type": info["output"][i],
                    "links": out_links.get((node.id, i), []),
                    "slot_index": i,
                }
                for i in range(len(info["output"]))
            ]
            shown_widgets = len(widgets) - (1 if node.class_type in ("LoadImage", "LoadVideo", "LoadAudio") else 0)
            height = estimated_height(node.class_type, len(sockets), len(outputs), shown_widgets + (
                1 if node.class_type in ("LoadImage", "LoadVideo", "LoadAudio") else 0))
            entry = {
                "id": node.id,
                "type": node.class_type,
                "size": [NODE_WIDTH.get(node.class_type, 340), height],
                "flags": {},
                "order": order.index(node.id),
                "mode": 0,
                "inputs": sockets,
                "outputs": outputs,
                "properties": {**node_identity(node.class_type), "Node name for S&R": node.class_type},
                "widgets_values": widgets,
            }
            if node.model_keys():
                entry["properties"]["models"] = [model_entry(key) for key in node.model_keys()]
            if node.title:
                entry["title"] = node.title
            entries[node.id] = entry
        for node_id, pos in self._layout(entries).items():
            entries[node_id]["pos"] = pos
        ui_nodes = [{"id": e["id"], "type": e["type"], "pos": e["pos"], **{k: v for k, v in e.items()
                                                                            if k not in ("id", "type", "pos")}}
                    for e in (entries[node.id] for node in self._canvas_nodes())]
        return {
            # The frontend's schema wants a UUID; a name-based one keeps the file reproducible.
            "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"minimax-h3-split/workflows/{self.key}")),
            "revision": 0,
            "last_node_id": len(self._canvas_nodes()),
            "last_link_id": len(links),
            "nodes": ui_nodes,
            "links": links,
            "groups": [],
            "config": {},
            "extra": {"info": {"name": self.title, "description": self.description}},
            "version": 0.4,
            "models": self.models(),
        }

    def _layout(self, entries: dict) -> dict[int, list[int]]:
        """Top-left corner of every node: columns by step, a loader one column before its first user, a note above
        the node it explains; each column stacked top-down in declaration order."""
        column = self._columns()
        column.update({node.id: node.column for node in self.runnable() if node.column is not None})
        stacks: dict[int, list[Node]] = {}
        for node in self.nodes:
            for note in (n for n in self.notes if n.before is node):
                stacks.setdefault(column[node.id], []).append(note)
            stacks.setdefault(column[node.id], []).append(node)
        widths = {c: max(entries[n.id]["size"][0] for n in nodes) for c, nodes in stacks.items()}
        positions, x = {}, TOP
        for c in sorted(stacks):
            y = TOP
            for node in stacks[c]:
                positions[node.id] = [x, y]
                y += entries[node.id]["size"][1] + ROW_GAP
            x += widths[c] + COLUMN_GAP
        return positions

    def _columns(self) -> dict[int, int]:
        depth = self._depths()
        column = dict(depth)
        for node in reversed(self.runnable()):  # users are declared after what they use
            users = [n for n in self.runnable() if any(_is_link(v) and v[0] is node for v in n.inputs.values())]
            if not any(_is_link(v) for v in node.inputs.values()) and users:
                column[node.id] = max(0, min(column[u.id] for u in users) - 1)
        return column

    def models(self) -> list[dict]:
        """The published files this graph's loaders select, in node order, once each."""
        return [model_entry(key) for key in dict.fromkeys(k for n in self.nodes for k in n.model_keys())]

    def _order(self) -> list[int]:
        depth = self._depths()
        return [node.id for node in sorted(self.runnable(), key=lambda n: (depth[n.id], n.id))]

    def _depths(self) -> dict[int, int]:
        depth: dict[int, int] = {}
        for node in self.runnable():  # nodes are declared after their inputs
            parents = [value[0].id for value in node.inputs.values() if _is_link(value)]
            depth[node.id] = 1 + max((depth[p] for p in parents), default=-1)
        return depth


def _is_link(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Node)


# --- the shipped graphs ------------------------------------------------------------------------

MODELS_NOTE = (
    "The loaders select the published MiniMax H3 files core's own H3 templates use (the Missing Models dialog "
    "downloads them into models/), and the Sampler a Turbo LoRA at its step count (empty its `lora` and set steps "
    "to 50 for the release setting). To try this graph without them, set each loader to '[embedded] tiny H3 "
    "(noise)' and the LoRA to none: a built-in miniature with random weights, so the output is noise."
)
CORE_NOTE = (
    "Needs ComfyUI 0.33+ (core's own MiniMax H3 nodes). MiniMax H3 Remote Encode runs the 32B text encoder and the "
    "VAE encoders on another machine (`python -m h3_core serve` at the endpoint; list it in H3_ENCODER_URLS, the "
    "token in H3_ENCODER_TOKEN); this machine loads the DiT in core's UNETLoader with core's Turbo LoRA, samples in "
    "core's KSampler (cfg 1) and decodes with MiniMax H3 VAE Decode. Canvas and length come from the conditioning."
)
AUDIO_NOTE = (
    "Reference tags count each kind in order: <Picture 1> is the image, <Video 1> the video. Audio is numbered "
    "soundtracks first: <Audio 1> is Video 1's soundtrack, so the Load Audio file is <Audio 2>."
)


def _models(graph: Graph, dit: str, text_encoder: str | None = "text_encoder"):
    """The four loaders on published files (REAL_MODELS keys); the API form puts each on its tiny stand-in."""
    te = graph.add("H3SplitTextEncoderLoader", model=text_encoder, column=0) if text_encoder else None
    vae = graph.add("H3SplitVideoVAELoader", model="vae", column=0)
    audio_vae = graph.add("H3SplitAudioVAELoader", model="audio_vae", column=0)
    partition = PARTITION_OF[dit.split()[0]]
    dit_node = graph.add("H3SplitDiTLoader", model=dit, partition=partition, weight_dtype="default", column=0)
    graph.note(MODELS_NOTE, before=te or vae)
    return te, vae, audio_vae, dit_node


def _finish(graph: Graph, dit, conditioning, vae, audio_vae, prefix: str, column: int, image: bool = False) -> None:
    """Sampler, then Decode with Save Video below it (image: Save Image of Decode's first frame, its `image`)."""
    latent = graph.add(
        "H3SplitSampler",
        column=column,
        dit=(dit, 0),
        conditioning=(conditioning, 0),
        seed=0,
        steps=STEPS,
        video_shift=12.0,
        audio_shift=3.0,
    )
    turbo = TURBO[_partition_of(dit)]
    latent.published = {"steps": turbo.sampler_steps, "lora": REAL_MODELS[turbo.model].name, "lora_strength": 1.0,
                        "video_shift": turbo.video_shift, "audio_shift": turbo.audio_shift}
    latent.extra_models = (turbo.model,)
    decoded = graph.add("H3SplitDecode", latent=(latent, 0), vae=(vae, 0), audio_vae=(audio_vae, 0), column=column + 1)
    if image:
        graph.add("SaveImage", images=(decoded, DECODE_IMAGE_OUTPUT), filename_prefix=f"h3/{prefix}",
                  column=column + 1)
        return
    graph.add("SaveVideo", video=(decoded, 0), filename_prefix=f"h3/{prefix}", format="mp4", codec="h264",
              column=column + 1)


def _partition_of(dit: Node) -> str:
    """"fl2va" or "ref2va": the partition of a DiT loader (the pack's or core's UNETLoader) by its model key."""
    return next(part for part in PARTITION_OF if part in dit.model.split())


def _core_stage_1(graph: Graph, conditioning: Node, partition: str, vae, audio_vae, prefix: str, column: int):
    """Core 0.33's stage 1 on the pack's conditioning, as core's H3 templates sample: UNETLoader (the pruned int8
    DiT) -> LoraLoaderModelOnly (the Turbo LoRA; not in the tiny forms) -> ModelSamplingMiniMaxH3 -> KSampler (cfg
    1, the negative ConditioningZeroOut, Turbo's step count) on MiniMax H3 Empty Latent from Conditioning, then the
    pack's Decode and SaveVideo."""
    turbo = TURBO[partition]
    unet = graph.add("UNETLoader", model=f"core {partition}", weight_dtype="default", column=0)
    model = unet
    if not graph.tiny:
        model = graph.add("LoraLoaderModelOnly", model=turbo.model, named={"model": (unet, 0)}, strength_model=1.0,
                          column=column)
    shifted = graph.add("MiniMaxH3SigmaShift", named={"model": (model, 0)},
                        shift_video=turbo.video_shift, shift_audio=turbo.audio_shift, column=column)
    latent = graph.add("H3SplitEmptyLatentFromConditioning", conditioning=(conditioning, 0), column=column)
    negative = graph.add("ConditioningZeroOut", conditioning=(conditioning, 0), column=column)
    sampler, scheduler = CORE_SAMPLER
    sampled = graph.add("KSampler", named={"model": (shifted, 0)}, seed=0, steps=turbo.forwards, cfg=1.0,
                        sampler_name=sampler, scheduler=scheduler, positive=(conditioning, 0), negative=(negative, 0),
                        latent_image=(latent, 0), denoise=1.0, column=column + 1)
    decoded = graph.add("H3SplitDecode", latent=(sampled, 0), vae=(vae, 0), audio_vae=(audio_vae, 0),
                        column=column + 2)
    graph.add("SaveVideo", video=(decoded, 0), filename_prefix=f"h3/{prefix}", format="mp4", codec="h264",
              column=column + 2)


def _references(graph: Graph):
    image = graph.add("LoadImage", image=EXAMPLE_MEDIA["image"], column=1)
    video = graph.add("LoadVideo", file=EXAMPLE_MEDIA["video"], column=1)
    audio = graph.add("LoadAudio", audio=EXAMPLE_MEDIA["audio"], column=1)
    refs = graph.add("H3SplitReferences", ref_image_1=(image, 0), ref_video_1=(video, 0), ref_audio_1=(audio, 0),
                     column=2)
    graph.note(AUDIO_NOTE, before=refs)
    return refs


def _keyframes(graph: Graph):
    first = graph.add("LoadImage", image=EXAMPLE_MEDIA["first"], column=1)
    last = graph.add("LoadImage", image=EXAMPLE_MEDIA["last"], column=1)
    return graph.add("H3SplitKeyframes", first_frame=(first, 0), last_frame=(last, 0), column=2)


def _text_encode(graph: Graph, text_encoder, prompt: str, task: str, media=None, column: int = 1,
                 length: int = 124):
    """The Text Encode node every example uses: the canvas from H3's rule (0 x 0), the shortest trained output (124
    frames; text to image: IMAGE_FRAMES)."""
    inputs = {"text_encoder": (text_encoder, 0), "prompt": prompt, "width": 0, "height": 0, "length": length}
    if media is not None:
        inputs["media"] = (media, 0)
    return graph.add("H3SplitTextEncode", **inputs, task=task, column=column)


def _encode_all(graph: Graph, text_encoder, vae, audio_vae, prompt: str, task: str, media, column: int):
    """Text Encode -> Video VAE Encode -> Audio VAE Encode on `media` (references, guides): the conditioning."""
    text = _text_encode(graph, text_encoder, prompt, task, media=media, column=column)
    video_cond = graph.add("H3SplitVideoVAEEncode", conditioning=(text, 0), vae=(vae, 0), column=column)
    return graph.add("H3SplitAudioVAEEncode", conditioning=(video_cond, 0), audio_vae=(audio_vae, 0), column=column)


# Text to image, as ComfyUI core's: the shortest clip H3 makes (facts.IMAGE_FRAMES, 5 frames), its first frame
# (MiniMax H3 VAE Decode's appended `image` output, its 4th), the audio discarded.
IMAGE_FRAMES = 5
DECODE_IMAGE_OUTPUT = 3
T2I_PROMPT = "A red fox sits in fresh snow at dawn, pine trees behind it, soft morning light."
T2VA_PROMPT = "A red fox trots through fresh snow at dawn; wind in the pines, crunching steps."
FL2VA_PROMPT = "The test card slides into the night sky; a low hum rises."
REF2VA_PROMPT = "<Picture 1> rolls across the floor like <Video 1>, to the rhythm of <Audio 2>."
GUIDES_PROMPT = "The test card drifts into the night sky, holds still for a moment, then fades; a low hum rises."
CONTINUE_PROMPT = "The ball keeps rolling, slows down and stops against the wall; the rhythm fades out."


def build_graphs(tiny: bool = False) -> list[Graph]:
    """The shipped graphs. Titles start with "MiniMax H3", then the graph's short name, then what it does: frontend
    1.32.9's template search reads only a custom node template's file name (the title is the file name), and its
    fuzzy match scores a word by how far from the start it stands (a word past ~40 characters is not found).
    tiny: the graphs of the tiny forms (the API workflows, the tiny UI variants): the core-sampler graphs without
    their Turbo LoRA loader (the tiny H3 has no LoRA)."""
    graphs = []

    def new(*args) -> Graph:
        return Graph(*args, tiny=tiny)

    g = new("t2va", "MiniMax H3 t2va - text to video with audio",
              "MiniMax H3 text to video with stereo audio: a prompt in, a 5 s mp4 with sound out (FL2VA DiT).")
    te, vae, audio_vae, dit = _models(g, "fl2va")
    cond = _text_encode(g, te, T2VA_PROMPT, "t2va")
    _finish(g, dit, cond, vae, audio_vae, "t2va", column=2)
    graphs.append(g)

    g = new("t2i", "MiniMax H3 t2i - text to image",
              "MiniMax H3 text to image: a prompt in, one still frame out (the first frame of the shortest, 5-frame "
              "clip, as ComfyUI core's text to image; the audio is discarded) (FL2VA DiT).")
    te, vae, audio_vae, dit = _models(g, "fl2va")
    cond = _text_encode(g, te, T2I_PROMPT, "t2va", length=IMAGE_FRAMES)
    _finish(g, dit, cond, vae, audio_vae, "t2i", column=2, image=True)
    graphs.append(g)

    g = new("fl2va", "MiniMax H3 fl2va - first and last frame to video",
              "MiniMax H3 image to video with audio: the clip starts on the first image and ends on the last "
              "(FL2VA DiT).")
    te, vae, audio_vae, dit = _models(g, "fl2va")
    keyframes = _keyframes(g)
    text = _text_encode(g, te, FL2VA_PROMPT, "fl2va", media=keyframes, column=2)
    cond = g.add("H3SplitVideoVAEEncode", conditioning=(text, 0), vae=(vae, 0), column=2)
    _finish(g, dit, cond, vae, audio_vae, "fl2va", column=3)
    graphs.append(g)

    g = new("ref2va", "MiniMax H3 ref2va - reference image, video and audio to video",
              "MiniMax H3 reference to video with audio: the prompt names an image, a video with its soundtrack "
              "and an audio clip as <Picture 1>, <Video 1>, <Audio 2> (Ref2VA DiT).")
    te, vae, audio_vae, dit = _models(g, "ref2va")
    cond = _encode_all(g, te, vae, audio_vae, REF2VA_PROMPT, "ref2va", _references(g), column=3)
    _finish(g, dit, cond, vae, audio_vae, "ref2va", column=4)
    graphs.append(g)

    g = new(
        "ref2va_remote",
        "MiniMax H3 ref2va_remote - references to video with a remote encoder",
        "MiniMax H3 reference to video with every encoder on a remote H3 encoder endpoint "
        "(`python -m h3_core serve`): this machine loads only the DiT and the VAE decoders. The token, if the "
        "server needs one, comes from the H3_ENCODER_TOKEN environment variable.",
    )
    _, vae, audio_vae, dit = _models(g, "ref2va", text_encoder=None)
    refs = _references(g)
    cond = g.add(
        "H3SplitRemoteEncode",
        prompt=REF2VA_PROMPT,
        width=0,
        height=0,
        length=124,
        endpoint=DEFAULT_ENDPOINT,
        media=(refs, 0),
        task="ref2va",
        column=3,
    )
    _finish(g, dit, cond, vae, audio_vae, "ref2va_remote", column=4)
    graphs.append(g)

    g = new(
        "t2va_pruned_int8",
        "MiniMax H3 t2va_pruned_int8 - text to video on int8 files",
        "MiniMax H3 text to video with audio on quantised files: the pruned int8 (ConvRot) DiT and the int8 text "
        "encoder, about 21 GB + 27 GB instead of 66 GB + 51 GB.",
    )
    te, vae, audio_vae, dit = _models(g, "fl2va pruned_int8_convrot", text_encoder="text_encoder int8_convrot")
    cond = _text_encode(g, te, T2VA_PROMPT, "t2va")
    _finish(g, dit, cond, vae, audio_vae, "t2va_pruned_int8", column=2)
    graphs.append(g)

    g = new(
        "fl2va_pruned_fp8_nvfp4",
        "MiniMax H3 fl2va_pruned_fp8_nvfp4 - first and last frame on fp8 and NVFP4 files",
        "MiniMax H3 first and last frame to video on the smallest files: the pruned fp8 DiT (about 21 GB) and "
        "the NVFP4 (AWQ) text encoder (about 16 GB).",
    )
    te, vae, audio_vae, dit = _models(g, "fl2va pruned_fp8_scaled", text_encoder="text_encoder nvfp4_awq")
    keyframes = _keyframes(g)
    text = _text_encode(g, te, FL2VA_PROMPT, "fl2va", media=keyframes, column=2)
    cond = g.add("H3SplitVideoVAEEncode", conditioning=(text, 0), vae=(vae, 0), column=2)
    _finish(g, dit, cond, vae, audio_vae, "fl2va_pruned_fp8_nvfp4", column=3)
    graphs.append(g)

    # ComfyUI 0.33+: the pack's Remote Encode (the 32B text encoder and the VAE encoders on another machine) in place
    # of core's text and reference encoding, core's own H3 stage 1 (DiT, Turbo LoRA, KSampler), the pack's Decode.
    for key, task, what in (("t2va_core", "t2va", "text to video"),
                            ("fl2va_core", "fl2va", "first and last frame to video"),
                            ("ref2va_core", "ref2va", "references to video")):
        partition = "ref2va" if task == "ref2va" else "fl2va"
        g = new(key, f"MiniMax H3 {key} - remote encode, core sampler ({what})",
                f"MiniMax H3 {what} with audio in ComfyUI 0.33+'s own H3 nodes: MiniMax H3 Remote Encode runs the "
                "32B text encoder (and the VAE encoders) on an encoder endpoint (`python -m h3_core serve`), core's "
                "UNETLoader, Turbo LoRA, ModelSamplingMiniMaxH3 and KSampler sample, MiniMax H3 VAE Decode decodes. "
                "The token, if the server needs one, comes from the H3_ENCODER_TOKEN environment variable.")
        vae = g.add("H3SplitVideoVAELoader", model="vae", column=0)
        audio_vae = g.add("H3SplitAudioVAELoader", model="audio_vae", column=0)
        g.note(CORE_NOTE, before=vae)
        media, column = None, 1
        if task == "fl2va":
            media, column = _keyframes(g), 3
        elif task == "ref2va":
            media, column = _references(g), 3
        prompt = {"t2va": T2VA_PROMPT, "fl2va": FL2VA_PROMPT, "ref2va": REF2VA_PROMPT}[task]
        inputs = {"media": (media, 0)} if media is not None else {}
        cond = g.add("H3SplitRemoteEncode", prompt=prompt, width=0, height=0, length=124, endpoint=DEFAULT_ENDPOINT,
                     **inputs, task=task, column=column)
        _core_stage_1(g, cond, partition, vae, audio_vae, key, column=column + 1)
        graphs.append(g)

    # Guides at any frame and continuation (core's MiniMaxH3AddGuide semantics): guides ride in the media bundle, the
    # VAE encode nodes encode their frames and their audio.
    g = new("guides", "MiniMax H3 guides - images and sound at any frame",
            "MiniMax H3 guided video with audio: a first frame, an image held at frame 62 and an audio starting at "
            "frame 24, each anchored where the Guide node says (negative frames count from the end) (FL2VA DiT).")
    te, vae, audio_vae, dit = _models(g, "fl2va")
    first = g.add("LoadImage", image=EXAMPLE_MEDIA["first"], column=1)
    middle = g.add("LoadImage", image=EXAMPLE_MEDIA["last"], column=1)
    sound = g.add("LoadAudio", audio=EXAMPLE_MEDIA["audio"], column=1)
    keyframes = g.add("H3SplitKeyframes", first_frame=(first, 0), column=2)
    held = g.add("H3SplitGuide", media=(keyframes, 0), frame_idx=62, image=(middle, 0), column=2)
    guided = g.add("H3SplitGuide", media=(held, 0), frame_idx=24, audio=(sound, 0), column=2)
    cond = _encode_all(g, te, vae, audio_vae, GUIDES_PROMPT, "fl2va", guided, column=3)
    _finish(g, dit, cond, vae, audio_vae, "guides", column=4)
    graphs.append(g)

    g = new("continue", "MiniMax H3 continue - extend a video and its sound",
            "MiniMax H3 video continuation: the last 22 frames of a clip and the sound under them start the new "
            "video, the prompt says what happens next (FL2VA DiT).")
    te, vae, audio_vae, dit = _models(g, "fl2va")
    source = g.add("LoadVideo", file=EXAMPLE_MEDIA["video"], column=1)
    tail = g.add("H3SplitContinueVideo", video=(source, 0), overlap_frames=22, column=2)
    cond = _encode_all(g, te, vae, audio_vae, CONTINUE_PROMPT, "fl2va", tail, column=3)
    _finish(g, dit, cond, vae, audio_vae, "continue", column=4)
    graphs.append(g)
    return graphs


# --- example media -----------------------------------------------------------------------------


def write_example_media(folder: Path = INPUTS) -> list[Path]:
    """Deterministic test-card images, a 2 s video with a tone soundtrack and a 3 s stereo tone."""
    import numpy as np

    sys.path.insert(0, str(HERE.parent))
    from h3_core import media

    folder.mkdir(parents=True, exist_ok=True)

    def card(height: int, width: int, phase: int) -> np.ndarray:
        y, x = np.mgrid[0:height, 0:width]
        bars = ((x * 8 // width + phase) % 8)[..., None] * np.array([[[32, 96, 160]]]) % 256
        ring = (((x - width / 2) ** 2 + (y - height / 2) ** 2) ** 0.5 % 16 < 2)[..., None] * 255
        return np.clip(bars + ring, 0, 255).astype(np.uint8)

    def tone(seconds: float, freq: float, rate: int = 32000) -> np.ndarray:
        t = np.arange(int(seconds * rate)) / rate
        return np.stack([0.3 * np.sin(2 * np.pi * freq * t), 0.3 * np.sin(2 * np.pi * freq * 1.5 * t)]).astype(
            np.float32
        )

    written = []
    for key, image in (("first", card(64, 96, 0)), ("last", card(64, 96, 4)), ("image", card(96, 64, 2))):
        path = folder / EXAMPLE_MEDIA[key]
        path.write_bytes(media.encode_png_bytes(image))
        written.append(path)
    frames = np.stack([np.roll(card(64, 64, 1), 2 * i, axis=1) for i in range(48)])
    written.append(Path(media.write_mp4(folder / EXAMPLE_MEDIA["video"], frames, tone(2.0, 220.0), fps=24)))
    path = folder / EXAMPLE_MEDIA["audio"]
    path.write_bytes(media.encode_wav_bytes(tone(3.0, 330.0), 32000, sample_format="s16"))
    written.append(path)
    return written


# --- thumbnails --------------------------------------------------------------------------------

THUMB_SIZE = (480, 360)
COLOURS = {  # by role, so the four graphs are told apart at a glance
    "loader": (52, 101, 164),
    "media": (78, 154, 6),
    "encode": (206, 92, 0),
    "sample": (117, 80, 123),
    "save": (85, 87, 83),
}


def _role(class_type: str) -> str:
    if class_type.endswith("Loader"):
        return "loader"
    if class_type.startswith("Load") or class_type in ("H3SplitKeyframes", "H3SplitReferences"):
        return "media"
    if "Encode" in class_type:
        return "encode"
    return "save" if class_type.startswith("Save") else "sample"


def render_thumbnail(graph: Graph) -> bytes:
    """The graph drawn as a diagram (one column per depth, a box per node, its links), as a small JPEG."""
    import io

    from PIL import Image, ImageDraw, ImageFont

    width, height = THUMB_SIZE
    image = Image.new("RGB", THUMB_SIZE, (24, 24, 28))
    draw = ImageDraw.Draw(image)
    title_font = ImageFont.load_default(size=26)
    font = ImageFont.load_default(size=10)
    draw.text((16, 12), f"MiniMax H3 · {graph.key}", fill=(235, 235, 235), font=title_font)
    depth = graph._depths()
    columns = max(depth.values()) + 1
    by_column: dict[int, list[Node]] = {}
    for node in graph.runnable():
        by_column.setdefault(depth[node.id], []).append(node)
    box_w = (width - 24) / columns - 8
    centre = {}
    boxes = {}
    for column, nodes in by_column.items():
        box_h = min(34, (height - 64) / len(nodes) - 6)
        for row, node in enumerate(nodes):
            x0 = 12 + column * (box_w + 8)
            y0 = 56 + row * (box_h + 6)
            boxes[node.id] = (x0, y0, x0 + box_w, y0 + box_h)
            centre[node.id] = (x0 + box_w / 2, y0 + box_h / 2)
    for node in graph.runnable():  # links under the boxes
        for value in node.inputs.values():
            if _is_link(value):
                y0, y1 = centre[value[0].id][1], centre[node.id][1]
                draw.line([(boxes[value[0].id][2], y0), (boxes[node.id][0], y1)], fill=(150, 150, 150), width=2)
    for node in graph.runnable():
        draw.rounded_rectangle(boxes[node.id], radius=4, fill=COLOURS[_role(node.class_type)])
        label = node.class_type.removeprefix("H3Split")
        while font.getlength(label) > box_w - 8:  # clip to the box
            label = label[:-1]
        draw.text((boxes[node.id][0] + 4, boxes[node.id][1] + 3), label, fill=(255, 255, 255), font=font)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=80, optimize=True)
    return out.getvalue()


def render_all(object_info: dict) -> dict[str, str | bytes]:
    """Repo-relative path -> content of every generated workflow file: the UI form and its thumbnail in
    example_workflows/, the API form in workflows/api/."""
    files: dict[str, str | bytes] = {}
    for graph, tiny in zip(build_graphs(), build_graphs(tiny=True)):
        files[f"{TEMPLATES}/{graph.title}.json"] = json.dumps(graph.ui(object_info), indent=2) + "\n"
        files[f"{TEMPLATES}/{graph.title}.jpg"] = render_thumbnail(graph)
        files[f"workflows/api/{graph.key}.json"] = json.dumps(tiny.api(), indent=2) + "\n"
    return files


def tiny_templates(object_info: dict) -> dict[str, dict]:
    """Key -> the UI workflow with every loader on the embedded tiny H3: what the tests run through the frontend
    (built from the same graphs as the shipped templates, never written to example_workflows/)."""
    return {graph.key: graph.ui(object_info, tiny=True) for graph in build_graphs(tiny=True)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", help="a running ComfyUI with this pack loaded (for /object_info)")
    parser.add_argument("--inputs-only", action="store_true", help="only (re)write workflows/inputs/")
    args = parser.parse_args(argv)
    write_example_media()
    if args.inputs_only:
        return 0
    if not args.server:
        parser.error("--server is required to render the UI format")
    with urllib.request.urlopen(args.server.rstrip("/") + "/object_info", timeout=60) as response:
        object_info = json.loads(response.read())
    for name, content in render_all(object_info).items():
        path = REPO / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
