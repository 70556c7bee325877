"""What one quantised layer format is: the `LayerFormat` base class, and `LayerSpec`, one layer as stored.

A quantised linear `P` of dense shape [N, K] is stored as `P.weight` plus side tensors next to it and the
`P.comfy_quant` marker (see `markers`). Each format the package reads is one `LayerFormat` subclass in
`formats/` (as ComfyUI core has one `QuantizedLayout` class per format), registered by its marker name in
`layouts`. The class holds everything format-specific, so the rest of the package never branches on a
format name:

- the tensor family: `side_tensors` (optional ones included, in registration order), `required`,
  `check(where, marker, tensors)` (dtypes, shapes, marker options) -> a `LayerSpec`;
- `label(spec)`: how `check` names the layer; `row_aligned(suffix, shape)`: how a side tensor follows a
  fused-row split (`route.follow_rows`), and `follow_rows` for tensors that need re-tiling;
- `dequantise(spec, stored, dtype)`, `quantise(weight, options)` (the writer / tiny twins) and its
  header-only twin `stored_header(shape, options)` (the release-size headers the planner counts);
- optionally a kitchen GEMM: `kitchen_forward(spec, stored, x, bias)` and `gemm_min_sm()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import H3WeightsError
from .markers import MARKER_SUFFIX

SCALAR = ((), (1,))


def roundup(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def is_power_of_4(value: int) -> bool:
    return value >= 4 and value & (value - 1) == 0 and (value.bit_length() - 1) % 2 == 0


def want(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise H3WeightsError(f"{where}: {what}")


def positive_int(marker: dict, key: str, default: int, where: str) -> int:
    value = marker.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise H3WeightsError(f"{where}: marker option {key}={value!r} is not a positive integer")
    return value


def scalar_f32(tensors: dict, suffixes, where: str, fmt: str) -> None:
    """Each of `suffixes` the layer carries must be an F32 scalar (per-tensor scales)."""
    for suffix in suffixes:
        if suffix in tensors:
            dtype, shape = tensors[suffix]
            want(dtype == "F32" and tuple(shape) in SCALAR, where,
                 f"{fmt} {suffix} must be an F32 scalar, got {dtype} {list(shape)}")


@dataclass(frozen=True)
class LayerSpec:
    """One quantised layer as its file stores it. `shape` is the dense [out, in] it stands for."""

    layer_format: "LayerFormat"  # the registered format that validated it (and computes with it)
    shape: tuple[int, int]
    marker: dict
    tensors: dict  # suffix -> (dtype tag, shape): weight and side tensors, as stored
    convrot: bool = False
    convrot_groupsize: int = 0
    group_size: int = 0  # w6a8 scale groups; nvfp4 blocks (16)
    bits: int = 8

    @property
    def format(self) -> str:
        """The marker name of the layer's format."""
        return self.layer_format.name

    @property
    def label(self) -> str:
        """How `check` names the layer format, e.g. "int8_convrot (group 256)"."""
        return self.layer_format.label(self)


class LayerFormat:
    """One quantised layer format (see the module docstring). Subclasses set the class attributes and override
    `check`, `label`, `dequantise`, `quantise` and `stored_header`; the rest has defaults."""

    name: str = ""  # the marker's "format"
    side_tensors: tuple[str, ...] = ()  # every side tensor the format may store, in registration order
    required: frozenset = frozenset()  # those it must store
    copied: frozenset = frozenset()  # side tensors per tensor / per input channel: copied to every row part
    tiled: frozenset = frozenset()  # side tensors in a blocked (tiled) layout: cannot simply follow rows
    file_names: dict = {}  # file-level names (as published file names spell them) -> default quantise options
    summary: str | None = None  # how refusals list the format among the supported ones (None: not listed)
    non_linear: str = "refuse"  # a layer of a module that is not a Linear: "refuse" it, or "dequantise" at load

    # --- the tensor family -----------------------------------------------------------------------------

    def describe(self, where: str, marker: dict, tensors: dict) -> LayerSpec:
        """Validate one layer's tensors (`suffix -> (dtype tag, shape)`, bias and marker included) -> its spec."""
        if "weight" not in tensors:
            raise H3WeightsError(f"{where}: .comfy_quant marker without a weight")
        extra = set(tensors) - {"weight", "bias", MARKER_SUFFIX} - set(self.side_tensors)
        if extra:
            raise H3WeightsError(f"{where}: {self.name} layer carries unexpected tensors {sorted(extra)}")
        missing = self.required - set(tensors)
        if missing:
            raise H3WeightsError(f"{where}: {self.name} layer lacks {sorted(missing)}")
        return self.check(where, marker, {k: v for k, v in tensors.items() if k not in ("bias", MARKER_SUFFIX)})

    def check(self, where: str, marker: dict, tensors: dict) -> LayerSpec:
        raise NotImplementedError

    def label(self, spec: LayerSpec) -> str:
        raise NotImplementedError

    def stored_order(self) -> tuple[str, ...]:
        """The stored tensors' names in the order a module registers them."""
        return ("weight", *self.side_tensors)

    def row_aligned(self, suffix: str, shape) -> bool | None:
        """Whether tensor `suffix` has one entry per output row, so it follows its weight through a fused-row
        split (qkv) or half swap (fc1); False: per tensor or per input channel (copied to every part); None: it
        cannot follow a row change as it is (a blocked layout, see `follow_rows`)."""
        if suffix == MARKER_SUFFIX or suffix in self.copied:
            return False
        if suffix == "weight":
            return True
        if suffix in self.tiled:
            return None
        return tuple(shape) not in SCALAR

    def embeddable(self, spec: LayerSpec) -> bool:
        """Whether an `nn.Embedding` table may be held in this form (`linear.Int8Embedding`)."""
        return False

    def follow_rows(self, layer: str, suffix: str, weight: torch.Tensor, tensor: torch.Tensor, op,
                    count: int) -> tuple:
        """A tiled side tensor through the row operation `op` of its weight (`count` parts); refused here."""
        raise H3WeightsError(
            f"{layer}: {self.name} {suffix} cannot follow a fused-projection split or half swap (its blocked layout "
            "would have to be re-tiled); such a layer is not supported in a fused projection")

    # --- numbers -----------------------------------------------------------------------------------------

    def dequantise(self, spec: LayerSpec, stored: dict, dtype: torch.dtype) -> torch.Tensor:
        """The dense [N, K] weight in `dtype` (an AWQ pre_quant_scale not folded in)."""
        raise NotImplementedError

    def quantise(self, weight: torch.Tensor, options: dict) -> tuple[dict, dict]:
        """One dense [N, K] weight -> (stored tensors by suffix, marker)."""
        raise H3WeightsError(f"cannot quantise to layer format {self.name!r}")

    def stored_header(self, shape: tuple[int, int], options: dict) -> tuple[dict, dict]:
        """What `quantise` stores for one [N, K] layer, without data: ({suffix: (dtype tag, shape)}, marker)."""
        raise H3WeightsError(f"cannot describe a {self.name!r} layer without its data")

    # --- the optional quantised GEMM ---------------------------------------------------------------------

    def gemm_min_sm(self) -> tuple[int, int] | None:
        """The CUDA capability kitchen's GEMM for this format needs; None: the format has no such GEMM."""
        return None

    def kitchen_forward(self, spec: LayerSpec, stored: dict, x: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor | None:
        """Kitchen's quantised GEMM for this layer, or None where it has none (the weight-only path runs)."""
        return None
