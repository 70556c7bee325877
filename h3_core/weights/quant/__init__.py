"""Quantised weights: per-layer `.comfy_quant` markers (and GGUF's GGML types), one class per layer format.

- `layer_format.LayerFormat`: what one layer format is (tensor family, label, dequantise, quantise, optional
  kitchen GEMM); `formats/`: one class per format; `layouts`: the registry, by marker name, and `describe`
  (header-only validation of one layer);
- `markers`: the marker tensor (JSON in uint8);
- `kitchen`: the comfy-kitchen import and the ConvRot group rule the Comfy formats share;
  `ggml`: the GGML block arithmetic the GGUF format and `gguf_file` share;
- `writer.quantise_state_dict`: dense Comfy-file tensors -> the published quantised form;
- `linear.QuantLinear` / `linear.Int8Embedding`: modules that keep the stored form in memory;
- `plan` / `route`: what a checkpoint's header says about its quantised layers, and how the loaders
  carry those layers into the model.
"""

from __future__ import annotations

from .layer_format import LayerFormat, LayerSpec
from .layouts import layer_format, register, supported_formats
from .writer import quantise_state_dict

__all__ = ["LayerFormat", "LayerSpec", "layer_format", "quantise_state_dict", "register", "supported_formats"]
