"""The names of every single file the tiny build writes under `comfyui/`, without building it.

The ComfyUI loaders offer them as embedded choices (the shipped quantised workflows select them), so a name
is listed before the tiny H3 exists and resolved to a file only when a loader runs.
"""

from __future__ import annotations

from .. import tiny
from . import gguf_twins as tiny_gguf
from . import pruned as tiny_pruned
from . import twins as tiny_twins


def comfy_files() -> list[str]:
    """`folder/name` of every tiny single file: the fp32 ones, the precision / quantised twins, the pruned twins,
    the GGUF twins of the plain build (a text encoder's vision-projector file goes with it, unlisted)."""
    files = list(tiny.COMFY_FILES.values()) + tiny_gguf.default_files()
    files += [tiny_twins.twin_path(family, v) for family, variants in tiny_twins.TWIN_FILES.items() for v in variants]
    files += [tiny_pruned.twin_path(part, v) for part in tiny_pruned.PARTITION_FILES for v in tiny_pruned.VARIANTS]
    return sorted(files)


def in_folder(folder: str) -> list[str]:
    """The names of the tiny files in one ComfyUI model folder (diffusion_models, text_encoders, vae)."""
    return [path.split("/", 1)[1] for path in comfy_files() if path.split("/", 1)[0] == folder]
