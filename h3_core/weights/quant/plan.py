"""What a checkpoint's header says about its quantised layers, read before any weight.

`read_plan(header, where)` finds every `P.comfy_quant` marker, reads those (small, size-checked)
marker tensors and nothing else, refuses every unknown or unimplemented format at once by name,
then validates each marked layer's tensor family (`layouts.describe`). Side tensors without a
marker, and integer / fp8 / packed weights without one, are refused too: the marker is the only
statement of how a layer is stored. A dense checkpoint has no plan (None).
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..errors import UnsupportedCheckpointError, preview
from ..headers import Header
from . import ggml, layouts, markers
from .formats import GGUF

_MARKER_TAIL = "." + markers.MARKER_SUFFIX

# Friendly names of the layer families `check` reports, by the layer name with indices replaced by N.
_FAMILIES = (
    (re.compile(r"blocks\.N\.(attn\.(qkv_proj|out_proj)|mlp\.(fc1|fc2))"), "block linears"),
    (re.compile(r"blocks\.N\.adaln_proj\.linear"), "AdaLN projections"),
    (re.compile(r"token_refiner\..*"), "refiner linears"),
    (re.compile(r"final_layer\..*"), "final layer"),
    (re.compile(r"model\.layers\.N\.(self_attn|mlp)\..*"), "language linears"),
    (re.compile(r"model\.embed_tokens"), "embed_tokens"),
    (re.compile(r"visual\..*"), "vision linears"),
    (re.compile(r"decoder\.transformer_blocks\.N\..*"), "decoder ViT linears"),
)


def family_of(layer: str) -> str:
    generic = re.sub(r"\.\d+(?=\.|$)", ".N", layer)
    for pattern, label in _FAMILIES:
        if pattern.fullmatch(generic):
            return label
    return generic


def split_side(key: str) -> tuple[str, str] | None:
    """`P.weight_scale` -> (`P`, "weight_scale") for every side-tensor suffix; None for other keys."""
    layer, _, suffix = key.rpartition(".")
    return (layer, suffix) if layer and suffix in layouts.side_suffixes() else None


@dataclass(frozen=True)
class QuantPlan:
    """The quantised layers of one checkpoint (file names), their specs and their marker tensors."""

    layers: dict  # layer prefix P -> LayerSpec
    markers: dict = field(repr=False)  # "P.comfy_quant" -> the marker tensor (real, read from the file)

    def stored_keys(self) -> set[str]:
        """Every file key that belongs to a quantised layer's stored form (weight, side tensors, marker)."""
        return {f"{p}.{suffix}" for p, spec in self.layers.items() for suffix in spec.tensors} | set(self.markers)

    def dense_shapes(self, shapes: dict) -> dict:
        """The header's shapes as a dense file would have them: side tensors dropped, weights [N, K]."""
        stored = self.stored_keys()
        dense = {k: v for k, v in shapes.items() if k not in stored}
        dense.update({f"{p}.weight": tuple(spec.shape) for p, spec in self.layers.items()})
        return dense

    def families(self) -> list[tuple[str, str, int]]:
        """(family, layer format label, layer count), in first-seen order of sorted layer names."""
        counts: OrderedDict = OrderedDict()
        for layer in sorted(self.layers):
            key = (family_of(layer), self.layers[layer].label)
            counts[key] = counts.get(key, 0) + 1
        return [(family, label, count) for (family, label), count in counts.items()]

    def formats(self) -> set[str]:
        return {spec.format for spec in self.layers.values()}


def _unmarked_refusal(where: str, header: Header, companions: list, stored: list) -> UnsupportedCheckpointError:
    detail = []
    if stored:
        dtypes = "/".join(sorted({header.tensors[k].dtype for k in stored}))
        detail.append(f"{len(stored)} weights stored as {dtypes} without a .comfy_quant marker (e.g. "
                      f"{preview(stored, 2)})")
    if companions:
        detail.append(f"{len(companions)} quantisation tensors of no marked layer (e.g. {preview(companions, 2)})")
    return UnsupportedCheckpointError(
        f"{where}: quantised tensors this package cannot attribute to a layer format ({'; '.join(detail)}); "
        "quantised files are read through their per-layer .comfy_quant markers (legacy `scale_weight` / "
        f"`scaled_fp8` files are not supported); supported layer formats: {layouts.supported_text()}")


def _read_markers(header: Header, keys: list[str]) -> dict[str, torch.Tensor]:
    """The marker tensors' bytes, read at their offsets (a 66 GB file is neither mapped nor read)."""
    from ...safetensors_header import read_header as parse_file

    by_file: dict[str, list[str]] = {}
    for key in keys:
        by_file.setdefault(header.tensors[key].file, []).append(key)
    out = {}
    for path, names in by_file.items():
        parsed = parse_file(path)
        with open(path, "rb") as handle:
            for name in names:
                entry = parsed.tensors[name]
                handle.seek(parsed.data_start + entry.begin)
                raw = bytearray(handle.read(entry.end - entry.begin))
                out[name] = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return out


_OPTIONS: dict = {}  # marker bytes -> their options (what `markers.parse` returns for them)
_OPTIONS_SIZE = 256  # distinct markers of one model: a format and its options (GGUF: a GGML type, a shape) each


def marker_options(marker: torch.Tensor, where: str) -> dict:
    """`markers.parse`, once per distinct marker: a split copies a layer's marker to every part and the check and
    the load both read them, while a model holds only a few distinct ones (a GGUF plan's own markers are never
    parsed: `_gguf_plan` remembers the options it encoded). Anything `parse` would refuse before reading (not a small
    1-D uint8 CPU tensor) goes to it uncached, so its size bound holds before any byte is hashed."""
    if (marker.device.type != "cpu" or marker.dtype != torch.uint8 or marker.dim() != 1
            or marker.numel() > markers.MAX_MARKER_BYTES):
        return markers.parse(marker, where)
    raw = marker.numpy().tobytes()
    found = _OPTIONS.get(raw)
    if found is None:
        found = _remember(raw, markers.parse(marker, where))
    return copy.deepcopy(found)  # callers own theirs (a LayerSpec keeps its marker)


def _remember(raw: bytes, options: dict) -> dict:
    if len(_OPTIONS) >= _OPTIONS_SIZE:
        _OPTIONS.clear()
    _OPTIONS[raw] = options
    return options


def _gguf_plan(header: Header, where: str) -> QuantPlan | None:
    """A GGUF file's block-quantised tensors as layers, each with a synthetic marker (`formats.GGUF.marker`): the
    file states their types in its tensor directory, not in markers."""
    quantised = sorted(k for k, info in header.tensors.items() if info.ggml_type not in ggml.DENSE_TYPES)
    not_weights = [k for k in quantised if not k.endswith(".weight")]
    if not_weights:
        raise UnsupportedCheckpointError(
            f"{where}: block-quantised GGUF tensors that are not layer weights ({preview(not_weights, 3)}); only "
            "Linear weights are read quantised, keep other tensors in F32/F16/BF16")
    gguf = layouts.layer_format(GGUF.name)
    specs, made = {}, {}
    for key in quantised:
        info, layer = header.tensors[key], key[: -len(".weight")]
        marker = gguf.marker(info.ggml_type, info.dense_shape)
        specs[layer] = layouts.describe(f"{where}: {layer}", marker, {"weight": (info.dtype, tuple(info.shape))})
        made[f"{layer}{_MARKER_TAIL}"] = encoded = markers.encode(marker)
        # The options are JSON's own types, flat: exactly what parsing the encoded bytes gives back.
        _remember(encoded.numpy().tobytes(), copy.deepcopy(marker))
    return QuantPlan(layers=specs, markers=made) if specs else None


def read_plan(header: Header, where: str) -> QuantPlan | None:
    """The checkpoint's quantised layers, or None for a dense one (see the module docstring)."""
    if header.container == "gguf":
        return _gguf_plan(header, where)
    marker_keys = sorted(k for k in header.tensors if k.endswith(_MARKER_TAIL))
    layer_names = {k[: -len(_MARKER_TAIL)] for k in marker_keys}
    companions = sorted(k for k in header.tensors
                        if (side := split_side(k)) is not None and side[0] not in layer_names)
    stored = sorted(k for k, info in header.tensors.items()
                    if info.dtype in layouts.STORAGE_DTYPES and k not in marker_keys
                    and k.rpartition(".")[0] not in layer_names)
    if companions or stored:
        raise _unmarked_refusal(where, header, companions, stored)
    if not marker_keys:
        return None
    for key in marker_keys:  # bounded before a single byte of them is read
        info = header.tensors[key]
        if info.dtype != "U8" or len(info.shape) != 1 or info.shape[0] > markers.MAX_MARKER_BYTES:
            raise UnsupportedCheckpointError(
                f"{where}: {key} is not a .comfy_quant marker (U8, at most {markers.MAX_MARKER_BYTES} bytes; got "
                f"{info.dtype} {list(info.shape)})")
    raw = _read_markers(header, marker_keys)
    parsed = {key[: -len(_MARKER_TAIL)]: markers.parse(raw[key], f"{where}: {key}") for key in marker_keys}
    first_layer: dict = {}
    for layer, marker in sorted(parsed.items()):
        first_layer.setdefault(marker["format"], layer)
    layouts.refuse_formats(where, first_layer)
    by_layer: dict[str, dict] = {layer: {} for layer in parsed}
    for key, info in header.tensors.items():
        layer, _, suffix = key.rpartition(".")
        if layer in by_layer:
            by_layer[layer][suffix] = (info.dtype, tuple(info.shape))
    specs = {layer: layouts.describe(f"{where}: {layer}", parsed[layer], by_layer[layer]) for layer in sorted(parsed)}
    return QuantPlan(layers=specs, markers={key: raw[key] for key in marker_keys})


def meta_with_markers(plan: QuantPlan | None, meta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A data-free state dict whose markers are the real ones (converters and `install` read them)."""
    return meta if plan is None else {**meta, **plan.markers}
