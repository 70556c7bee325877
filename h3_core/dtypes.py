"""The one rule for the dtype each H3 component computes in (CLI, encoder server and ComfyUI nodes).

* CPU: float32 for everything. Exact weights, and the bit-exact parity tests against diffusers'
  monolithic pipeline run there.
* CUDA: bfloat16 for the DiT and the text encoder (the release's own precision; the modules diffusers
  and transformers keep in float32 stay float32 through the loaders' `_keep_in_fp32_modules` rule).
  The video VAE follows the official recipe: weights and encoder in float32, the decoder under float16
  autocast (`vae_decode_autocast`); bfloat16 is never used for it. The audio VAE is float32 only (its
  BigVGAN decoder degrades audibly in half precision).
* A user override (`--dtype`, the loaders' `weight_dtype` widget) replaces the rule for the DiT, the
  text encoder and the video VAE; the audio VAE refuses anything but float32.

Loading never upcasts a stored bfloat16 or quantised weight by default: the GPU default is bfloat16, so a
bf16 file's tensors are used as stored (no float32 copy); integer (quantised) storage is never cast at all.
Only a float32 run (the CPU default, or an explicit `--dtype float32`) widens bf16 weights.
"""

from __future__ import annotations

import contextlib

import torch

# names users type -> torch dtypes ("default"/"auto"/None mean: apply the rule)
NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DEFAULT_NAMES = (None, "", "default", "auto")
CHOICES = ("auto", "float32", "bfloat16", "float16")  # what the CLI offers

# component aliases -> the slot names the models registry uses
_COMPONENTS = {
    "transformer": "transformer",
    "transformer_ref": "transformer",
    "dit": "transformer",
    "text_encoder": "text_encoder",
    "text": "text_encoder",
    "vae": "vae",
    "video": "vae",
    "video_vae": "vae",
    "audio_vae": "audio_vae",
    "audio": "audio_vae",
}


def parse(override) -> torch.dtype | None:
    """A user's dtype spelling -> torch dtype, or None for "apply the rule"."""
    if isinstance(override, torch.dtype):
        if override not in NAMES.values():
            raise ValueError(f"dtype {override} is not supported; choose float32, bfloat16 or float16")
        return override
    if override in DEFAULT_NAMES:
        return None
    key = str(override).strip().lower().removeprefix("torch.")
    if key not in NAMES:
        raise ValueError(f"unknown dtype {override!r}; choose one of {', '.join(CHOICES)}")
    return NAMES[key]


def _device_type(device) -> str:
    if device is None:
        return "cpu"
    return torch.device(device).type


def compute_dtype(component: str, device, override=None) -> torch.dtype:
    """The dtype `component` is loaded and run in on `device` (see the module docstring for the rule)."""
    slot = _COMPONENTS.get(component)
    if slot is None:
        raise ValueError(f"unknown H3 component {component!r}; expected one of {', '.join(sorted(_COMPONENTS))}")
    wanted = parse(override)
    if slot == "audio_vae":
        if wanted not in (None, torch.float32):
            raise ValueError(f"the audio VAE runs in float32 only (half precision degrades its decode), not {wanted}")
        return torch.float32
    if wanted is not None:
        return wanted
    if _device_type(device) == "cpu" or slot == "vae":
        return torch.float32
    return torch.bfloat16


def vae_decode_autocast(device, vae_dtype: torch.dtype = torch.float32):
    """The official video-VAE decode precision: float16 autocast on CUDA for a float32 VAE, nothing
    elsewhere (CPU runs stay float32 and bit-exact)."""
    if _device_type(device) == "cuda" and vae_dtype == torch.float32:
        return torch.autocast("cuda", dtype=torch.float16)
    return contextlib.nullcontext()


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
