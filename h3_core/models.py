"""Where each H3 component's weights live, and loading exactly the components a stage needs.

`ModelSource.from_path(DIR)` accepts every folder shape `--models` takes:
- the folder `python -m h3_core tiny --out` wrote (its `diffusers/` root is used; `layout=` picks
  `comfyui` or `native` instead),
- an official diffusers root (`modular_model_index.json` / `model_index.json`, `transformer/`, ...),
- a native MiniMaxAI partition (`FL2VA/` or `Ref2VA/`, or the folder holding both),
- a ComfyUI `models/` folder (`diffusion_models/`, `text_encoders/`, `vae/` with Comfy-Org files).
Per-file layout handling (key conversion, config from shapes) lives in `h3_core.weights`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import configs

COMPONENTS = ("transformer", "transformer_ref", "vae", "audio_vae", "text_encoder")
COMPONENT_NAMES = {
    "transformer": "FL2VA DiT partition",
    "transformer_ref": "Ref2VA DiT partition",
    "vae": "video VAE",
    "audio_vae": "audio VAE",
    "text_encoder": "text encoder",
}
PARTITION_OF_TASK = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}


class ModelSourceError(ValueError):
    """A models folder is missing a component a stage needs, or holds something we cannot load."""


@dataclass
class ModelSource:
    root: Path
    layout: str  # "diffusers" | "native" | "comfyui"
    paths: dict[str, Path] = field(default_factory=dict)  # component -> file or folder
    tokenizer: Path | None = None  # None: rebuilt from the real Qwen BPE ranks (qwen_assets)
    processor: Path | None = None
    pipeline_config: dict = field(default_factory=dict)
    tiny: bool = False

    # --- discovery -------------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path, layout: str | None = None) -> "ModelSource":
        root = Path(path).expanduser()
        if not root.exists():
            raise ModelSourceError(f"models path does not exist: {root}")
        if (root / "tiny.json").is_file():
            choice = layout or "diffusers"
            sub = {"diffusers": "diffusers", "comfyui": "comfyui", "native": "native"}.get(choice)
            if sub is None:
                raise ModelSourceError(f"layout must be diffusers, comfyui or native, got {choice!r}")
            source = cls.from_path(root / sub)
            source.tiny = True
            if choice != "diffusers":  # the diffusers root records its own; single files carry none
                source.pipeline_config = configs.get("pipeline", tiny=True)
            if source.tokenizer is None and (root / "diffusers" / "tokenizer").is_dir():
                # The ComfyUI text-encoder file carries no tokenizer; the tiny build's is the real one.
                source.tokenizer = root / "diffusers" / "tokenizer"
                source.processor = root / "diffusers" / "processor"
            return source
        if (root / "modular_model_index.json").is_file() or (
            (root / "model_index.json").is_file() and (root / "transformer").is_dir() and not _native_index(root)
        ):
            return cls._diffusers(root)
        if _native_index(root) or (root / "FL2VA").is_dir() or (root / "Ref2VA").is_dir():
            return cls._native(root)
        if any((root / sub).is_dir() for sub in ("diffusion_models", "text_encoders", "vae")):
            return cls._comfyui(root)
        raise ModelSourceError(
            f"{root} is not an H3 models folder: expected a diffusers root (modular_model_index.json), a native "
            "partition (FL2VA/ or Ref2VA/), a ComfyUI models/ folder (diffusion_models/, text_encoders/, vae/), "
            "or the output of `python -m h3_core tiny`"
        )

    @classmethod
    def for_file(cls, component: str, path: str | Path) -> "ModelSource":
        """A source holding one single-file component (what a ComfyUI loader node picks).

        The file's own header decides what it is; a DiT file named for the other partition is
        refused (one whose name carries no fl2va/ref2va token is taken as the requested one).
        """
        from .weights import detect

        path = Path(path)
        found = detect(path)
        kind = {"video_vae": "vae"}.get(found.component, found.component)
        if kind == "transformer":
            kind = {"ref2va": "transformer_ref", "fl2va": "transformer"}.get(found.partition, component)
        if kind != component:
            raise ModelSourceError(f"{path.name} holds the H3 {COMPONENT_NAMES[kind]}, not the {COMPONENT_NAMES[component]}")
        tiny = any((parent / "tiny.json").is_file() for parent in list(path.parents)[:4])
        return cls(
            root=path.parent,
            layout=found.layout,
            paths={component: path},
            pipeline_config=configs.get("pipeline", tiny=tiny),
            tiny=tiny,
        )

    @classmethod
    def _diffusers(cls, root: Path) -> "ModelSource":
        paths = {name: root / name for name in COMPONENTS if (root / name).is_dir()}
        index = root / "modular_model_index.json"
        pipeline_config = configs.get("pipeline", tiny=False)
        if index.is_file():
            data = json.loads(index.read_text(encoding="utf-8"))
            pipeline_config.update({key: data[key] for key in pipeline_config if key in data})
        return cls(
            root=root,
            layout="diffusers",
            paths=paths,
            tokenizer=root / "tokenizer" if (root / "tokenizer").is_dir() else None,
            processor=root / "processor" if (root / "processor").is_dir() else None,
            pipeline_config=pipeline_config,
        )

    @classmethod
    def _native(cls, root: Path) -> "ModelSource":
        partitions = {}
        if _native_index(root):
            partitions[_native_index(root)] = root
        for name in ("FL2VA", "Ref2VA"):
            if _native_index(root / name):
                partitions[_native_index(root / name)] = root / name
        if not partitions:
            raise ModelSourceError(f"{root}: no native partition (model_index.json with a `_minimax_h3` block)")
        paths: dict[str, Path] = {}
        if "fl2va" in partitions:
            paths["transformer"] = partitions["fl2va"] / "transformer"
        if "ref2va" in partitions:
            paths["transformer_ref"] = partitions["ref2va"] / "transformer"
        any_partition = next(iter(partitions.values()))
        for name, sub in (("vae", "video_vae"), ("audio_vae", "audio_vae"), ("text_encoder", "text_encoder")):
            if (any_partition / sub).is_dir():
                paths[name] = any_partition / sub
        return cls(
            root=root,
            layout="native",
            paths=paths,
            tokenizer=any_partition / "tokenizer" if (any_partition / "tokenizer").is_dir() else None,
            processor=any_partition / "processor" if (any_partition / "processor").is_dir() else None,
            pipeline_config=configs.get("pipeline", tiny=False),
        )

    @classmethod
    def _comfyui(cls, root: Path) -> "ModelSource":
        from .weights import detect

        paths: dict[str, Path] = {}
        for sub in ("diffusion_models", "text_encoders", "vae"):
            for file in sorted((root / sub).glob("*.safetensors")) if (root / sub).is_dir() else []:
                try:
                    found = detect(file)
                except ValueError:
                    continue  # not an H3 file: ComfyUI folders hold other models too
                name = found.component
                if name == "transformer" and found.partition == "ref2va":
                    name = "transformer_ref"
                elif name == "video_vae":
                    name = "vae"
                paths.setdefault(name, file)
        if not paths:
            raise ModelSourceError(f"{root}: no MiniMax H3 files in diffusion_models/, text_encoders/ or vae/")
        return cls(root=root, layout="comfyui", paths=paths, pipeline_config=configs.get("pipeline", tiny=False))

    # --- loading ---------------------------------------------------------------------------------

    def require(self, *names: str) -> None:
        missing = [name for name in names if name not in self.paths]
        if missing:
            raise ModelSourceError(
                f"{self.root} ({self.layout} layout) has no {', '.join(COMPONENT_NAMES[name] for name in missing)}; "
                "the requested stage needs it"
            )

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """Load one component as the diffusers/transformers module diffusers' blocks expect."""
        self.require(name)
        from . import weights

        loader = {
            "transformer": weights.load_transformer,
            "transformer_ref": weights.load_transformer,
            "vae": weights.load_video_vae,
            "audio_vae": weights.load_audio_vae,
            "text_encoder": weights.load_text_encoder,
        }[name]
        model = loader(self.paths[name], dtype=dtype)
        model.eval()
        return model

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        if self.tokenizer is not None:
            return AutoTokenizer.from_pretrained(self.tokenizer)
        from . import qwen_assets

        return qwen_assets.build_tokenizer()

    def load_processor(self):
        from transformers import Qwen3VLProcessor

        if self.processor is not None:
            return Qwen3VLProcessor.from_pretrained(self.processor)
        from . import qwen_assets

        return qwen_assets.build_processor(tiny=self.tiny)

    def fingerprint(self) -> str:
        """Identity of the weights this source would load, cheap even for 66 GB files.

        A large file contributes its size and its first and last MiB (for safetensors that covers the
        header: names, dtypes, shapes, offsets); small files (configs, tokenizer) their whole bytes.
        Touching or moving the folder does not change it; new weights (or a re-quantisation) do.
        """
        digest = hashlib.sha256(self.layout.encode())
        sources = {**self.paths, "tokenizer": self.tokenizer, "processor": self.processor}
        for name, path in sorted(sources.items()):
            if path is None:
                continue
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            for file in files:
                digest.update(f"{name}/{file.name}:".encode())
                digest.update(_file_identity(file))
        return digest.hexdigest()[:16]


def _file_identity(path: Path, window: int = 1 << 20) -> bytes:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        if size <= 16 * window:
            return hashlib.sha256(handle.read()).digest()
        head = handle.read(window)
        handle.seek(size - window)
        tail = handle.read(window)
    return hashlib.sha256(str(size).encode() + head + tail).digest()


def _native_index(folder: Path) -> str | None:
    """The partition ('fl2va'/'ref2va') a native model_index.json declares, else None."""
    index = folder / "model_index.json"
    if not index.is_file():
        return None
    try:
        block = json.loads(index.read_text(encoding="utf-8")).get("_minimax_h3")
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(block, dict):
        return None
    partition = str(block.get("partition", "")).lower().replace("_", "")
    return partition if partition in ("fl2va", "ref2va") else None
