"""The one source of the shipped workflows: each graph is declared once here and written as
- a UI-format JSON in `example_workflows/` (drag and drop; ComfyUI lists that folder in its template
  browser), with a generated thumbnail `<name>.jpg` and the list of real model files (name, Comfy-Org
  download URL, target folder) that the frontend offers to download when they are missing;
- an API-format JSON in `workflows/api/` (headless `POST /prompt`).

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
TINY = "[embedded] tiny H3 (random weights, outputs are noise)"
TINY_FILE = "[embedded] tiny H3 / "  # + one of the tiny's single files (the quantised graphs pick them)
FL2VA = "fl2va (t2va, first/last frame)"
REF2VA = "ref2va (references)"
DEFAULT_ENDPOINT = "http://127.0.0.1:8190"
STEPS = 8  # the tiny model's demo setting; real weights use 50 (or a Turbo LoRA's 5/9)

EXAMPLE_MEDIA = {
    "first": "h3_example_first_frame.png",
    "last": "h3_example_last_frame.png",
    "image": "h3_example_reference_image.png",
    "video": "h3_example_reference_video.mp4",
    "audio": "h3_example_reference_audio.wav",
}

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}

# The real files each loader stands for (the shipped graphs select the embedded tiny model). The frontend
# offers the missing ones for download into models/<directory>/; it only accepts safetensors files.
HF = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main"
REAL_MODELS = {
    "text_encoder": ("qwen3vl_32b_minimax_h3_bf16.safetensors", "text_encoders"),
    "vae": ("minimax_h3_video_vae_fp16.safetensors", "vae"),
    "audio_vae": ("minimax_h3_audio_vae_fp32.safetensors", "vae"),
    FL2VA: ("minimax_h3_fl2va_bf16.safetensors", "diffusion_models"),
    REF2VA: ("minimax_h3_ref2va_bf16.safetensors", "diffusion_models"),
    # A loader set to a tiny twin stands for the published file of the same format ("<key> <variant>").
    "text_encoder int8_convrot": ("qwen3vl_32b_minimax_h3_int8_convrot.safetensors", "text_encoders"),
    "text_encoder nvfp4_awq": ("qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", "text_encoders"),
    f"{FL2VA} pruned_int8_convrot": ("minimax_h3_fl2va_pruned_int8_convrot.safetensors", "diffusion_models"),
    f"{FL2VA} pruned_fp8_scaled": ("minimax_h3_fl2va_pruned_fp8_scaled.safetensors", "diffusion_models"),
}


def _with_variant(key: str, choice: str) -> str:
    """`key`, or `key variant` when the loader picks a tiny twin (`..._tiny_[fl2va_|ref2va_]<variant>.safetensors`)."""
    match = re.search(r"_tiny_(?:fl2va_|ref2va_)?(.+)\.safetensors$", choice) if choice.startswith(TINY_FILE) else None
    return key if match is None or match.group(1) == "fp32" else f"{key} {match.group(1)}"


LOADER_MODEL_KEY = {
    "H3SplitTextEncoderLoader": lambda inputs: _with_variant("text_encoder", inputs["text_encoder"]),
    "H3SplitVideoVAELoader": lambda inputs: "vae",
    "H3SplitAudioVAELoader": lambda inputs: "audio_vae",
    "H3SplitDiTLoader": lambda inputs: _with_variant(inputs["partition"], inputs["dit"]),
}


def model_entry(key: str) -> dict:
    name, directory = REAL_MODELS[key]
    return {"name": name, "url": f"{HF}/{directory}/{name}", "directory": directory}


@dataclass
class Node:
    id: int
    class_type: str
    inputs: dict  # name -> widget value, or (node, output slot) for a link
    title: str | None = None


@dataclass
class Graph:
    name: str
    description: str
    nodes: list[Node] = field(default_factory=list)

    def add(self, class_type: str, title: str | None = None, **inputs) -> Node:
        node = Node(len(self.nodes) + 1, class_type, inputs, title)
        self.nodes.append(node)
        return node

    # --- API format ------------------------------------------------------------------------------

    def api(self) -> dict:
        out = {}
        for node in self.nodes:
            inputs = {
                name: [str(value[0].id), value[1]] if _is_link(value) else value for name, value in node.inputs.items()
            }
            out[str(node.id)] = {"class_type": node.class_type, "inputs": inputs}
            if node.title:
                out[str(node.id)]["_meta"] = {"title": node.title}
        return out

    # --- UI format -------------------------------------------------------------------------------

    def ui(self, object_info: dict) -> dict:
        links, ui_nodes = [], []
        out_links: dict[tuple[int, int], list[int]] = {}
        for node in self.nodes:
            for value in node.inputs.values():
                if _is_link(value):
                    link_id = len(links) + 1
                    links.append([link_id, value[0].id, value[1], node.id, None, None])
                    out_links.setdefault((value[0].id, value[1]), []).append(link_id)
        depth = self._depths()
        rows: dict[int, int] = {}
        for node in self.nodes:
            info = object_info.get(node.class_type)
            if info is None:
                raise KeyError(f"{node.class_type} is not registered in this ComfyUI (is the pack loaded?)")
            order = info.get("input_order", {})
            specs = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
            names = list(order.get("required", [])) + list(order.get("optional", []))
            sockets, widgets = [], []
            for name in names:
                kind = specs[name][0]
                options = specs[name][1] if len(specs[name]) > 1 else {}
                is_widget = isinstance(kind, list) or kind in WIDGET_TYPES
                value = node.inputs.get(name)
                if is_widget and not _is_link(value):
                    widgets.append(options.get("default") if value is None else value)
                    if options.get("control_after_generate"):
                        widgets.append("fixed")
                    continue
                if value is None and not is_widget and name not in node.inputs:
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
            column = depth[node.id]
            row = rows.get(column, 0)
            rows[column] = row + 1
            entry = {
                "id": node.id,
                "type": node.class_type,
                "pos": [40 + 400 * column, 40 + 300 * row],
                "size": [360, 120 + 26 * (len(widgets) + max(len(sockets), len(outputs)))],
                "flags": {},
                "order": self._order().index(node.id),
                "mode": 0,
                "inputs": sockets,
                "outputs": outputs,
                "properties": {"Node name for S&R": node.class_type},
                "widgets_values": widgets,
            }
            if node.class_type in LOADER_MODEL_KEY:
                entry["properties"]["models"] = [model_entry(LOADER_MODEL_KEY[node.class_type](node.inputs))]
            if node.title:
                entry["title"] = node.title
            ui_nodes.append(entry)
        return {
            # The frontend's schema wants a UUID; a name-based one keeps the file reproducible.
            "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"minimax-h3-split/workflows/{self.name}")),
            "revision": 0,
            "last_node_id": len(self.nodes),
            "last_link_id": len(links),
            "nodes": ui_nodes,
            "links": links,
            "groups": [],
            "config": {},
            "extra": {"info": {"name": self.name, "description": self.description}},
            "version": 0.4,
            "models": self.models(),
        }

    def models(self) -> list[dict]:
        """The real files this graph's loaders stand for, in node order, once each."""
        keys = [LOADER_MODEL_KEY[n.class_type](n.inputs) for n in self.nodes if n.class_type in LOADER_MODEL_KEY]
        return [model_entry(key) for key in dict.fromkeys(keys)]

    def _order(self) -> list[int]:
        return [node.id for node in sorted(self.nodes, key=lambda n: (self._depths()[n.id], n.id))]

    def _depths(self) -> dict[int, int]:
        depth: dict[int, int] = {}
        for node in self.nodes:  # nodes are declared after their inputs
            parents = [value[0].id for value in node.inputs.values() if _is_link(value)]
            depth[node.id] = 1 + max((depth[p] for p in parents), default=-1)
        return depth


def _is_link(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Node)


# --- the shipped graphs ------------------------------------------------------------------------


def _models(graph: Graph, partition: str, text_encoder: bool = True, te_file: str = "", dit_file: str = ""):
    """The four loaders on the embedded tiny H3, or on one of its single files (`te_file`, `dit_file`)."""
    te_choice = TINY_FILE + te_file if te_file else TINY
    te = graph.add("H3SplitTextEncoderLoader", text_encoder=te_choice) if text_encoder else None
    vae = graph.add("H3SplitVideoVAELoader", vae=TINY)
    audio_vae = graph.add("H3SplitAudioVAELoader", audio_vae=TINY)
    dit_choice = TINY_FILE + dit_file if dit_file else TINY
    dit = graph.add("H3SplitDiTLoader", dit=dit_choice, partition=partition, weight_dtype="default")
    return te, vae, audio_vae, dit


def _finish(graph: Graph, dit, conditioning, vae, audio_vae, prefix: str) -> None:
    latent = graph.add(
        "H3SplitSampler",
        dit=(dit, 0),
        conditioning=(conditioning, 0),
        seed=0,
        steps=STEPS,
        video_shift=12.0,
        audio_shift=3.0,
    )
    decoded = graph.add("H3SplitDecode", latent=(latent, 0), vae=(vae, 0), audio_vae=(audio_vae, 0))
    graph.add("SaveVideo", video=(decoded, 0), filename_prefix=f"h3/{prefix}", format="mp4", codec="h264")


def _references(graph: Graph):
    image = graph.add("LoadImage", image=EXAMPLE_MEDIA["image"])
    video = graph.add("LoadVideo", file=EXAMPLE_MEDIA["video"])
    audio = graph.add("LoadAudio", audio=EXAMPLE_MEDIA["audio"])
    return graph.add("H3SplitReferences", ref_image_1=(image, 0), ref_video_1=(video, 0), ref_audio_1=(audio, 0))


def _text_encode(graph: Graph, text_encoder, prompt: str, task: str, media=None):
    """The Text Encode node every example uses: the canvas from H3's rule (0 x 0), the shortest output (124)."""
    inputs = {"text_encoder": (text_encoder, 0), "prompt": prompt, "width": 0, "height": 0, "length": 124}
    if media is not None:
        inputs["media"] = (media, 0)
    return graph.add("H3SplitTextEncode", **inputs, task=task)


def build_graphs() -> list[Graph]:
    graphs = []

    g = Graph("t2va", "Text to video + audio (FL2VA DiT). Tiny model: replace each loader's choice with real weights.")
    te, vae, audio_vae, dit = _models(g, FL2VA)
    cond = _text_encode(
        g, te, "A red fox trots through fresh snow at dawn; wind in the pines, crunching steps.", "t2va"
    )
    _finish(g, dit, cond, vae, audio_vae, "t2va")
    graphs.append(g)

    g = Graph("fl2va", "First and last frame to video + audio (FL2VA DiT).")
    te, vae, audio_vae, dit = _models(g, FL2VA)
    first = g.add("LoadImage", image=EXAMPLE_MEDIA["first"])
    last = g.add("LoadImage", image=EXAMPLE_MEDIA["last"])
    keyframes = g.add("H3SplitKeyframes", first_frame=(first, 0), last_frame=(last, 0))
    text = _text_encode(g, te, "The test card slides into the night sky; a low hum rises.", "fl2va", media=keyframes)
    cond = g.add("H3SplitVideoVAEEncode", conditioning=(text, 0), vae=(vae, 0))
    _finish(g, dit, cond, vae, audio_vae, "fl2va")
    graphs.append(g)

    g = Graph("ref2va", "References (image, video with soundtrack, audio) to video + audio (Ref2VA DiT).")
    te, vae, audio_vae, dit = _models(g, REF2VA)
    refs = _references(g)
    text = _text_encode(
        g, te, "<Picture 1> rolls across the floor like <Video 1>, to the rhythm of <Audio 2>.", "ref2va", media=refs
    )
    video_cond = g.add("H3SplitVideoVAEEncode", conditioning=(text, 0), vae=(vae, 0))
    cond = g.add("H3SplitAudioVAEEncode", conditioning=(video_cond, 0), audio_vae=(audio_vae, 0))
    _finish(g, dit, cond, vae, audio_vae, "ref2va")
    graphs.append(g)

    g = Graph(
        "ref2va_remote",
        "The ref2va graph with every encoder on a remote H3 encoder endpoint "
        "(`python -m h3_core serve`): this machine loads only the DiT and the VAE decoders. The token, if the "
        "server needs one, comes from the H3_ENCODER_TOKEN environment variable.",
    )
    _, vae, audio_vae, dit = _models(g, REF2VA, text_encoder=False)
    refs = _references(g)
    cond = g.add(
        "H3SplitRemoteEncode",
        prompt="<Picture 1> rolls across the floor like <Video 1>, to the rhythm of <Audio 2>.",
        width=0,
        height=0,
        length=124,
        endpoint=DEFAULT_ENDPOINT,
        media=(refs, 0),
        task="ref2va",
    )
    _finish(g, dit, cond, vae, audio_vae, "ref2va_remote")
    graphs.append(g)

    g = Graph(
        "t2va_pruned_int8",
        "Text to video + audio on quantised files: the pruned int8 (ConvRot) DiT and the int8 text encoder, about "
        "21 GB + 27 GB instead of 66 GB + 51 GB. Set on the embedded tiny H3's twins of those files.",
    )
    te, vae, audio_vae, dit = _models(g, FL2VA, te_file="qwen3vl_minimax_h3_tiny_int8_convrot.safetensors",
                                      dit_file="minimax_h3_tiny_fl2va_pruned_int8_convrot.safetensors")
    cond = _text_encode(
        g, te, "A red fox trots through fresh snow at dawn; wind in the pines, crunching steps.", "t2va"
    )
    _finish(g, dit, cond, vae, audio_vae, "t2va_pruned_int8")
    graphs.append(g)

    g = Graph(
        "fl2va_pruned_fp8_nvfp4",
        "First and last frame to video + audio on the smallest text encoder: the pruned fp8 DiT (about 21 GB) and "
        "the NVFP4 (AWQ) text encoder (about 16 GB). Set on the embedded tiny H3's twins of those files.",
    )
    te, vae, audio_vae, dit = _models(g, FL2VA, te_file="qwen3vl_minimax_h3_tiny_nvfp4_awq.safetensors",
                                      dit_file="minimax_h3_tiny_fl2va_pruned_fp8_scaled.safetensors")
    first = g.add("LoadImage", image=EXAMPLE_MEDIA["first"])
    last = g.add("LoadImage", image=EXAMPLE_MEDIA["last"])
    keyframes = g.add("H3SplitKeyframes", first_frame=(first, 0), last_frame=(last, 0))
    text = _text_encode(g, te, "The test card slides into the night sky; a low hum rises.", "fl2va", media=keyframes)
    cond = g.add("H3SplitVideoVAEEncode", conditioning=(text, 0), vae=(vae, 0))
    _finish(g, dit, cond, vae, audio_vae, "fl2va_pruned_fp8_nvfp4")
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
    draw.text((16, 12), f"MiniMax H3 · {graph.name}", fill=(235, 235, 235), font=title_font)
    depth = graph._depths()
    columns = max(depth.values()) + 1
    by_column: dict[int, list[Node]] = {}
    for node in graph.nodes:
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
    for node in graph.nodes:  # links under the boxes
        for value in node.inputs.values():
            if _is_link(value):
                y0, y1 = centre[value[0].id][1], centre[node.id][1]
                draw.line([(boxes[value[0].id][2], y0), (boxes[node.id][0], y1)], fill=(150, 150, 150), width=2)
    for node in graph.nodes:
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
    for graph in build_graphs():
        files[f"{TEMPLATES}/{graph.name}.json"] = json.dumps(graph.ui(object_info), indent=2) + "\n"
        files[f"{TEMPLATES}/{graph.name}.jpg"] = render_thumbnail(graph)
        files[f"workflows/api/{graph.name}.json"] = json.dumps(graph.api(), indent=2) + "\n"
    return files


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
