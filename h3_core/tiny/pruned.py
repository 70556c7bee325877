"""The embedded tiny H3's pruned DiT twins: the Comfy-Org `*_pruned_*` files at miniature size.

For each partition, `write_pruned_twins(models_dir)` reads the tiny full DiT's Comfy file and writes into
`diffusion_models/`

    minimax_h3_tiny_{fl2va,ref2va}_pruned_bf16.safetensors          the release's dtypes: bf16, F32 islands,
                                                                    AdaLN F16, adaln_t_table F32
    minimax_h3_tiny_{fl2va,ref2va}_pruned_{int8_convrot,fp8_scaled,w6a8}.safetensors
                                                                    the same with the 4 linears of every block
                                                                    quantised (qkv, out, fc1, fc2), as released,
                                                                    from the float32 weights (as `tiny_twins`)

The table is the tiny full DiT's own time-embedding curve sampled on the release grid (1025 points, K =
time_embed_dim, `weights.pruned.prune_comfy_state_dict`), so a pruned twin and its full DiT differ only by the
interpolation between grid points (and by the stored dtypes). Deterministic: the same full file gives the same
bytes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..weights.headers import read_header
from ..weights.pruned import RELEASE_GRID, TABLE_KEY, is_adaln_key, prune_comfy_state_dict
from ..weights.safetensors_io import load_tensors, write_file

PARTITION_FILES = {  # partition -> the tiny full DiT it is pruned from (tiny.COMFY_FILES' names)
    "fl2va": "diffusion_models/minimax_h3_tiny_fl2va_fp32.safetensors",
    "ref2va": "diffusion_models/minimax_h3_tiny_ref2va_fp32.safetensors",
}
# Variant -> the quantised format of its block linears (None: unquantised), in quantise_state_dict's names.
VARIANTS = {
    "pruned_bf16": None,
    "pruned_int8_convrot": "int8_convrot",
    "pruned_fp8_scaled": "fp8_scaled",
    "pruned_w6a8": "w6a8",
}
# Tensors the release stores float32 in every DiT file: the patch projections, the output heads, the rope table.
_F32_PREFIXES = ("video_patch_proj.", "audio_patch_proj.", "final_layer.video_out.", "final_layer.audio_out.", "rope.")
_FP8_INPUT_SCALE = 8.0 / 448.0
_BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def twin_path(partition: str, variant: str) -> str:
    return f"diffusion_models/minimax_h3_tiny_{partition}_{variant}.safetensors"


def release_dtypes(state: dict) -> dict:
    """A pruned state dict in the published pruned_bf16 dtypes (AdaLN F16 and the F32 table kept as they are)."""
    out = {}
    for key, tensor in state.items():
        if key == TABLE_KEY or is_adaln_key(key) or key.startswith(_F32_PREFIXES) or not tensor.is_floating_point():
            out[key] = tensor
        else:
            out[key] = tensor.to(torch.bfloat16)
    return out


def block_linears(state: dict) -> list[str]:
    """The quantised layers of the published pruned files: qkv, out, fc1, fc2 of every block (not the refiner)."""
    blocks = sorted({int(key.split(".")[1]) for key in state if key.startswith("blocks.")})
    return [f"blocks.{index}.{name}" for index in blocks for name in _BLOCK_LINEARS]


def layer_options(fmt: str, layers: list[str]) -> dict[str, dict]:
    """Per-layer options as the release has them: fp8 fc2 asks for a full-precision matmul, the other fp8
    linears carry a static activation scale (the tiny's is a fixed stand-in: activations within +-8)."""
    if fmt != "fp8_scaled":
        return {layer: {} for layer in layers}
    return {
        layer: {"full_precision_matrix_mult": True} if layer.endswith("mlp.fc2") else {"input_scale": _FP8_INPUT_SCALE}
        for layer in layers
    }


def pruned_twins(full_path: Path, *, grid: int = RELEASE_GRID) -> dict[str, tuple[dict, dict]]:
    """variant -> (tensors, metadata) of every pruned twin of one full tiny DiT file."""
    from ..weights.quant import quantise_state_dict

    header = read_header([str(full_path)])
    exact = prune_comfy_state_dict(load_tensors(header), grid=grid)
    released = release_dtypes(exact)
    layers = block_linears(exact)
    twins = {}
    for variant, fmt in VARIANTS.items():
        tensors = released
        if fmt is not None:  # quantised from the float32 weights (as the non-pruned twins); the rest as released
            quantised = quantise_state_dict(exact, fmt, layer_options(fmt, layers))
            tensors = {key: released[key] if t is exact.get(key) else t for key, t in quantised.items()}
        twins[variant] = (tensors, dict(header.metadata))  # the h3.config of the full DiT still holds (K unchanged)
    return twins


def write_pruned_twins(models_dir: str | Path, *, grid: int = RELEASE_GRID) -> list[Path]:
    """Write every pruned twin of both partitions under a tiny ComfyUI `models/` folder; returns the paths."""
    models_dir = Path(models_dir)
    written = []
    for partition, full in PARTITION_FILES.items():
        for variant, (tensors, metadata) in pruned_twins(models_dir / full, grid=grid).items():
            path = models_dir / twin_path(partition, variant)
            write_file(str(path), tensors, metadata)
            written.append(path)
    return written
