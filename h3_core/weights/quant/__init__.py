"""Quantised Comfy-Org weights: per-layer `.comfy_quant` markers, read and written through comfy-kitchen.

- `layouts`: the supported layer formats and their tensor families (header-only validation);
- `markers`: the marker tensor (JSON in uint8);
- `kitchen`: quantise / dequantise one layer with comfy-kitchen's own layouts;
- `writer.quantise_state_dict`: dense Comfy-file tensors -> the published quantised form;
- `linear.QuantLinear` / `linear.Int8Embedding`: modules that keep the stored form in memory;
- `plan` / `route`: what a checkpoint's header says about its quantised layers, and how the loaders
  carry those layers into the model.
"""

from __future__ import annotations

from .layouts import SUPPORTED_FORMATS, LayerSpec
from .writer import FILE_FORMATS, quantise_state_dict

__all__ = ["FILE_FORMATS", "SUPPORTED_FORMATS", "LayerSpec", "quantise_state_dict"]
