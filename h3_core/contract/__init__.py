"""The MiniMax-H3 conditioning contract between the encoder stage and the diffusion stage.

`H3Conditioning` (in `conditioning`) is the type: validated on construction, frozen, bit-exact equality.
Its outside forms live one per module, each an adapter to a format that changes on its own schedule:

    conditioning.py  the dataclass, validation, derived values, __eq__/__repr__, check_compatible
    layout.py        patchify/unpatchify and audio rows <-> latents (what the DiT sees)
    wire.py          encode/to_bytes/from_buffer/from_bytes/fingerprint: safetensors bytes, never pickle
    files.py         save/load: those bytes in a file, memory-mapped when loaded
    comfy.py         to_comfy/from_comfy: ComfyUI core's H3 CONDITIONING
    comfy_edits.py   read_comfy: that CONDITIONING after core's conditioning nodes, honoured or refused by name
    vllm.py          to_vllm/from_vllm: vLLM-Omni's unified stage-0 payload

The class keeps one-line delegate methods (`cond.to_vllm()`, `H3Conditioning.load(path)`), so callers
import only from `h3_core.contract`. Nothing here imports ComfyUI, diffusers or vLLM.
"""

from . import layout
from .comfy import COMFY_PACK_KEY
from .comfy_edits import RefusedEdit
from .conditioning import (
    KEYFRAME_ANCHOR_SETS,
    PROMPT_EMBED_DTYPES,
    REFERENCE_KINDS,
    TASKS,
    H3Conditioning,
    H3Reference,
)
from .errors import ChecksumError, ContractError
from .layout import *  # noqa: F403 (the layout helpers are part of the contract's public surface)
from .vllm import VLLM_LAYOUT_KEY, VLLM_STAGE_SCHEMA_VERSION, VLLM_WIRE_SCHEMA_ID
from .wire import CHECKSUM_KEY, FORMAT_ID, FORMAT_VERSION, HEADER_KEY, WIRE_VERSION

__all__ = [
    "CHECKSUM_KEY",
    "COMFY_PACK_KEY",
    "FORMAT_ID",
    "FORMAT_VERSION",
    "HEADER_KEY",
    "KEYFRAME_ANCHOR_SETS",
    "PROMPT_EMBED_DTYPES",
    "REFERENCE_KINDS",
    "TASKS",
    "VLLM_LAYOUT_KEY",
    "VLLM_STAGE_SCHEMA_VERSION",
    "VLLM_WIRE_SCHEMA_ID",
    "WIRE_VERSION",
    "ChecksumError",
    "ContractError",
    "H3Conditioning",
    "H3Reference",
    "RefusedEdit",
    *layout.__all__,
]
