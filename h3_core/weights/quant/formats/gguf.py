"""gguf: a GGUF file's block-quantised layer, one class for every GGML block type (the marker's `ggml_type`).

The GGML types differ only in their block arithmetic, which the `gguf` package and diffusers' dequantisers own
(`quant.ggml`): this class is parameterised by the marker's `ggml_type`, not subclassed per type, so every type
those libraries know is read without a line here. GGUF files carry no markers: the loaders make one a layer
(`marker`), with the dense shape only when the storage is flat (see `quant.ggml`'s docstring). The layer is held
as its U8 bytes, with no side tensors; a layer of a module that is not a Linear is dequantised at load.
"""

from __future__ import annotations

import math

import torch

from ...errors import H3WeightsError
from .. import ggml
from ..layer_format import LayerFormat, LayerSpec, want


class GGUF(LayerFormat):
    name = "gguf"
    non_linear = "dequantise"  # convolutions, embedding tables: dense at load, as ComfyUI-GGUF does

    def marker(self, ggml_type: str, shape: tuple[int, ...]) -> dict:
        """The marker the loaders give a GGUF layer: its type, and its dense shape only when the storage is flat
        (a row-aligned layer's shape follows from its bytes, also after a row split)."""
        out = {"format": self.name, "ggml_type": ggml_type}
        if len(shape) != 2 or shape[1] % ggml.block_sizes(ggml_type)[0]:
            out["shape"] = [int(dim) for dim in shape]
        return out

    def check(self, where: str, marker: dict, tensors: dict) -> LayerSpec:
        dtype, shape = tensors["weight"]
        want(dtype == "U8", where, f"a GGUF block-quantised weight is held as U8 bytes, got {dtype} {list(shape)}")
        return LayerSpec(self, self._dense_shape(marker, tuple(shape), where), marker, tensors)

    @staticmethod
    def _dense_shape(marker: dict, stored: tuple[int, ...], where: str) -> tuple[int, ...]:
        """The shape a GGUF tensor stands for ([N, K] for a layer), from its marker and stored bytes (validated)."""
        ggml_type = marker.get("ggml_type")
        if ggml_type not in ggml.quantised_types():
            raise H3WeightsError(f"{where}: GGML type {ggml_type!r} is not read (supported: {ggml.supported_text()})")
        block, size = ggml.block_sizes(ggml_type)
        if len(stored) != 2:
            raise H3WeightsError(f"{where}: a {ggml_type} layer is stored as U8 2-D bytes, got {list(stored)}")
        if "shape" in marker:
            shape = tuple(int(d) for d in marker["shape"])
            if math.prod(shape) != stored[0] * stored[1] // size * block or stored[1] != size:
                raise H3WeightsError(f"{where}: {ggml_type} bytes {list(stored)} do not hold a {list(shape)} weight")
            return shape
        if stored[1] % size:
            raise H3WeightsError(f"{where}: {ggml_type} rows of {stored[1]} bytes are not whole {size}-byte blocks")
        return (stored[0], stored[1] // size * block)

    def label(self, spec: LayerSpec) -> str:
        return f"GGUF {spec.marker['ggml_type']}"

    def dequantise(self, spec: LayerSpec, stored: dict, dtype: torch.dtype) -> torch.Tensor:
        """Diffusers' GGUF dequantiser, run in float32 and cast once (not kitchen's)."""
        return ggml.dequantise(stored["weight"], spec.marker["ggml_type"], spec.shape, dtype)

    def quantise(self, weight: torch.Tensor, options: dict) -> tuple[dict, dict]:
        """Option `ggml_type` (required): the `gguf` package's own quantiser, for the types it implements
        (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); the others are refused by name."""
        ggml_type = options.get("ggml_type")
        if ggml_type not in ggml.quantised_types():
            raise H3WeightsError(f"GGML type {ggml_type!r} is not read (supported: {ggml.supported_text()})")
        import gguf

        shape = tuple(weight.shape)
        storage = ggml.stored_shape(ggml_type, shape)  # refuses a size that is no whole number of blocks
        block = ggml.block_sizes(ggml_type)[0]
        dense = weight.detach().to(torch.float32).cpu().numpy()
        rows = dense if dense.ndim == 2 and shape[1] % block == 0 else dense.reshape(-1, block)
        try:
            raw = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[ggml_type])
        except (NotImplementedError, gguf.quants.QuantError) as exc:
            reason = exc or "not implemented"
            raise H3WeightsError(f"the gguf package cannot quantise to {ggml_type} ({reason})") from None
        stored = torch.from_numpy(raw.copy()).reshape(storage)
        return {"weight": stored}, self.marker(ggml_type, shape)

    def stored_header(self, shape: tuple[int, int], options: dict) -> tuple[dict, dict]:
        ggml_type = options.get("ggml_type")
        if ggml_type not in ggml.quantised_types():
            raise H3WeightsError(f"GGML type {ggml_type!r} is not read (supported: {ggml.supported_text()})")
        return {"weight": ("U8", ggml.stored_shape(ggml_type, tuple(shape)))}, self.marker(ggml_type, tuple(shape))
