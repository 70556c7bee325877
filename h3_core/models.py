"""Where each H3 component's weights live, and loading exactly the components a stage needs.

`ModelSource.from_path(DIR)` accepts every folder `--models` and `check` take, because it *is*
`check`'s walk (`weights.scan`): a diffusers root, a native MiniMaxAI partition (`FL2VA/`, `Ref2VA/`
or the folder holding both), a ComfyUI `models/` folder (`diffusion_models/` or legacy `unet/`,
`text_encoders/` or legacy `clip/`, `vae/`), or the folder `python -m h3_core tiny --out` wrote (its
`diffusers/` root is used; `layout=` picks `comfyui` or `native`). Components are named by their
diffusers folder (`weights.SLOTS`: transformer, transformer_ref, vae, audio_vae, text_encoder) and
layouts by `weights.LAYOUTS`, the names the pipeline and `check` use too.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import configs, weights
from .weights.sources import partition_roots

COMPONENT_NAMES = weights.SLOT_LABELS
PARTITION_OF_TASK = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}


class ModelSourceError(ValueError):
    """A models folder is missing a component a stage needs, or holds something we cannot load."""


@dataclass
class ModelSource:
    root: Path
    layout: str  # one of weights.LAYOUTS
    paths: dict[str, Path] = field(default_factory=dict)  # slot -> file or folder
    tokenizer: Path | None = None  # None: rebuilt from the real Qwen BPE ranks (qwen_assets)
    processor: Path | None = None
    pipeline_config: dict = field(default_factory=dict)
    tiny: bool = False
    problems: dict[str, str] = field(default_factory=dict)  # path -> why it was skipped
    # slot -> the `weights.Detection` that found it: `load` hands it on, so a file is detected once per load (a
    # detection whose file changed since, or whose slot was pointed elsewhere, is detected again there).
    detections: dict = field(default_factory=dict, repr=False, compare=False)

    # --- discovery -------------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path, layout: str | None = None) -> "ModelSource":
        root = Path(path).expanduser()
        if not root.exists():
            raise ModelSourceError(f"models path does not exist: {root}")
        if (root / "tiny.json").is_file():
            return cls._tiny(root, layout or "diffusers")
        found, problems = {}, {}
        try:
            results = weights.scan(str(root))
        except weights.H3WeightsError as error:
            results = [error]
        for item in results:
            if isinstance(item, weights.Detection):
                # Several files for one slot (bf16 + int8_convrot, ...): the largest, i.e. most precise, wins;
                # equal sizes keep scan order. Quantised files are picked explicitly (CLI flags, loader nodes).
                if item.slot not in found or item.total_bytes > found[item.slot].total_bytes:
                    found[item.slot] = item
            else:  # ComfyUI folders hold other models too; say why if a needed slot stays empty
                problems[str(getattr(item, "path", root))] = str(item)
        if not found:
            raise ModelSourceError(
                f"{root} is not an H3 models folder: expected a diffusers root (model_index.json), a native "
                "partition (FL2VA/ or Ref2VA/), a ComfyUI models/ folder (diffusion_models/ or unet/, text_encoders/ "
                "or clip/, vae/), or the output of `python -m h3_core tiny`"
                + "".join(f"\n  {Path(p).name}: {why}" for p, why in problems.items())
            )
        bases = [root, *map(Path, partition_roots(str(root)))]
        # The most common layout names the folder (a ComfyUI folder may hold one diffusers-named file).
        layouts = Counter(det.layout for det in found.values())
        tiny = all(_in_tiny_build(Path(det.path)) for det in found.values())
        return cls(
            root=root,
            layout=max(weights.LAYOUTS, key=lambda name: layouts[name]),
            paths={slot: Path(det.path) for slot, det in found.items()},
            tokenizer=next((b / "tokenizer" for b in bases if (b / "tokenizer").is_dir()), None),
            processor=next((b / "processor" for b in bases if (b / "processor").is_dir()), None),
            pipeline_config=_pipeline_config(root, tiny),
            tiny=tiny,
            problems=problems,
            detections=dict(found),
        )

    @classmethod
    def _tiny(cls, root: Path, choice: str) -> "ModelSource":
        if choice not in weights.LAYOUTS:
            raise ModelSourceError(f"layout must be one of {', '.join(weights.LAYOUTS)}, got {choice!r}")
        source = cls.from_path(root / choice)  # tiny, at the tiny's settings: its files lie in this build
        if source.tokenizer is None and (root / "diffusers" / "tokenizer").is_dir():
            # The ComfyUI text-encoder file carries no tokenizer; the tiny build's is the real one.
            source.tokenizer = root / "diffusers" / "tokenizer"
            source.processor = root / "diffusers" / "processor"
        return source

    @classmethod
    def for_file(cls, component: str, path: str | Path) -> "ModelSource":
        """A source holding one single-file component (what a ComfyUI loader node picks).

        The file's own header decides what it is; a DiT file named for the other partition is
        refused (one whose name carries no fl2va/ref2va token is taken as the requested one).
        """
        path = Path(path)
        found = weights.detect(path)
        kind = found.slot
        if found.handler.partitioned and found.partition is None and component in PARTITION_OF_TASK.values():
            kind = component
        if kind != component:
            raise ModelSourceError(
                f"{path.name} holds the H3 {COMPONENT_NAMES[kind]}, not the {COMPONENT_NAMES[component]}"
            )
        tiny = _in_tiny_build(path)
        return cls(
            root=path.parent,
            layout=found.layout,
            paths={component: path},
            pipeline_config=configs.get("pipeline", tiny=tiny),
            tiny=tiny,
            detections={component: found},
        )

    # --- loading ---------------------------------------------------------------------------------

    def require(self, *names: str) -> None:
        missing = [name for name in names if name not in self.paths]
        if missing:
            skipped = "".join(f"; skipped {Path(p).name}: {why}" for p, why in self.problems.items())
            raise ModelSourceError(
                f"{self.root} ({self.layout} layout) has no {', '.join(COMPONENT_NAMES[name] for name in missing)}; "
                f"the requested stage needs it{skipped}"
            )

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """Load one component as the diffusers/transformers module diffusers' blocks expect."""
        self.require(name)
        return weights.load(self.paths[name], weights.components.handler_of_slot(name).name, dtype=dtype,
                            detection=self.detections.get(name))

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
        """Identity of the weights (and tokenizer) this source would load: every byte counts (a large file is hashed
        whole once per version and remembered per user, `weights/digest.py`)."""
        named = {**self.paths, "tokenizer": self.tokenizer, "processor": self.processor}
        return weights.sources.identity(self.layout, {name: path for name, path in named.items() if path is not None})

    def component_fingerprint(self, component: str) -> str:
        """Identity of one encoder's weights ("text": text encoder + tokenizer + processor, "video", "audio")."""
        slots = {"text": ("text_encoder", "tokenizer", "processor"), "video": ("vae",), "audio": ("audio_vae",)}
        named = {**self.paths, "tokenizer": self.tokenizer, "processor": self.processor}
        chosen = {name: named.get(name) for name in slots[component]}
        return weights.sources.identity(f"{self.layout}/{component}",
                                        {name: path for name, path in chosen.items() if path is not None})


def _in_tiny_build(path: Path) -> bool:
    """Whether `path` lies in a `python -m h3_core tiny` build (its tiny.json at most four folders up), links
    followed: a models folder of links into the build holds tiny weights, which run at the tiny's settings (canvas,
    Qwen processor), not the release's 2048-px references and thousands of vision tokens."""
    return any((parent / "tiny.json").is_file() for parent in list(Path(path).resolve().parents)[:4])


def _pipeline_config(root: Path, tiny: bool) -> dict:
    """The release (or tiny) pipeline settings, overridden by what a diffusers root's modular index states."""
    config = configs.get("pipeline", tiny=tiny)
    index = root / "modular_model_index.json"
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        config.update({key: data[key] for key in config if key in data})
    return config
