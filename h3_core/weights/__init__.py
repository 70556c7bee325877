"""MiniMax-H3 checkpoints: detect, check, load and write every published layout.

Public API (see the README-style docstrings of each function):
- `detect(path) -> Detection`, `scan(path)`: which component / layout / partition / weight format,
  headers only;
- `check(path) -> CheckReport`: header-only key and shape verification against a meta model;
- `load(path, component)` (and its spellings `load_transformer`, `load_video_vae`, `load_audio_vae`,
  `load_text_encoder`): ready modules;
- `HANDLERS` (component name -> `ComponentHandler`), `FORMATS`: the two registries everything above
  dispatches through;
- `save_comfy_transformer`, `save_comfy_video_vae`, `save_comfy_audio_vae`,
  `save_comfy_text_encoder`, `save_native_transformer`: deterministic writers.

This package never imports ComfyUI, never touches the network, and never unpickles.
"""

from .check import CheckReport, ComponentCheck, check
from .components import HANDLERS, SLOT_LABELS, SLOTS
from .detect import Detection, detect, scan
from .errors import (
    H3WeightsError,
    IncompleteFileError,
    KeyMismatchError,
    UnrecognisedCheckpointError,
    UnsupportedCheckpointError,
)
from .formats import FORMATS
from .keymap import LAYOUTS, ComponentHandler, KeyFamily
from .loaders import load, load_audio_vae, load_text_encoder, load_transformer, load_video_vae
from .writers import (
    save_comfy_audio_vae,
    save_comfy_text_encoder,
    save_comfy_transformer,
    save_comfy_video_vae,
    save_native_transformer,
)

__all__ = [
    "CheckReport",
    "ComponentCheck",
    "ComponentHandler",
    "Detection",
    "FORMATS",
    "H3WeightsError",
    "HANDLERS",
    "IncompleteFileError",
    "KeyFamily",
    "KeyMismatchError",
    "LAYOUTS",
    "SLOTS",
    "SLOT_LABELS",
    "UnrecognisedCheckpointError",
    "UnsupportedCheckpointError",
    "check",
    "detect",
    "load",
    "load_audio_vae",
    "load_text_encoder",
    "load_transformer",
    "load_video_vae",
    "save_comfy_audio_vae",
    "save_comfy_text_encoder",
    "save_comfy_transformer",
    "save_comfy_video_vae",
    "save_native_transformer",
    "scan",
]
