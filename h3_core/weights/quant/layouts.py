"""The registry of quantised layer formats, by marker name: every format question goes through here.

Each format is one `LayerFormat` class (`formats/`, registered from `formats.BUILT_IN`; see `layer_format` for
what a class holds). `describe` validates one layer against its marker's class; `refuse_formats` names unknown
and unimplemented formats at once. The sets other modules need are derived from the registered classes, so
they cannot drift apart: `side_suffixes()` (every key suffix that belongs to a quantised layer), `STORAGE_DTYPES`
(the storage dtypes that mean a quantised weight), `file_formats()` (file-level names the writer accepts).
"""

from __future__ import annotations

from ..errors import UnsupportedCheckpointError
from .formats import BUILT_IN
from .layer_format import LayerFormat, LayerSpec
from .markers import MARKER_SUFFIX

# Integer / fp8 / fp4 storage for a weight means a quantised (or packed) tensor, whatever its name: such a
# tensor without a marker is refused (`plan.read_plan`), and makes a file "quantised" (`weights.formats`).
STORAGE_DTYPES = frozenset({"I8", "U8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "I4", "U4"})
# Marker formats ComfyUI core knows but this package does not run (named in refusals).
UNIMPLEMENTED_FORMATS = ("float8_e5m2", "convrot_w4a4", "svdquant_w4a4", "awq_w4a16")
# Companion tensors of quantisers no registered format reads (W4A8 corrections, legacy `scale_weight` fp8 files,
# GPTQ / AWQ packs): recognised as quantisation tensors only to be refused by name.
FOREIGN_SUFFIXES = ("weight_correction", "scale_weight", "qweight", "qzeros", "scales")

_REGISTRY: dict[str, LayerFormat] = {}


def register(fmt: LayerFormat | type[LayerFormat]) -> LayerFormat:
    """Register a layer format (a class or an instance) under its marker name; returns the instance."""
    instance = fmt() if isinstance(fmt, type) else fmt
    if not instance.name or instance.name in _REGISTRY:
        raise ValueError(f"layer format name {instance.name!r} is empty or already registered")
    _REGISTRY[instance.name] = instance
    return instance


for _builtin in BUILT_IN:
    register(_builtin)


def layer_format(name: str) -> LayerFormat:
    """The registered format of marker name `name` (refused by name, with the supported ones, if none)."""
    found = _REGISTRY.get(name)
    if found is None:
        refuse_formats("layer", {name: "layer"})
    return found


def supported_formats() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def supported_text() -> str:
    return ", ".join(fmt.summary for fmt in _REGISTRY.values() if fmt.summary)


def side_suffixes() -> tuple[str, ...]:
    """Every key suffix besides `weight` / `bias` that belongs to a quantised layer P (`P.<suffix>`): the marker,
    each registered format's side tensors, and the foreign ones refused by name."""
    sides = dict.fromkeys(suffix for fmt in _REGISTRY.values() for suffix in fmt.side_tensors)
    return (MARKER_SUFFIX, *sides, *FOREIGN_SUFFIXES)


def file_formats() -> dict[str, tuple[LayerFormat, dict]]:
    """Quantisation names the writer accepts -> (format, default options): each format's marker name and the
    file-level names it declares ("int8_convrot", "fp8_scaled", "w6a8", "nvfp4_awq", ...)."""
    out = {}
    for fmt in _REGISTRY.values():
        out[fmt.name] = (fmt, {})
        out.update({name: (fmt, dict(defaults)) for name, defaults in fmt.file_names.items()})
    return out


def refuse_formats(where: str, formats: dict) -> None:
    """Refuse unknown / unimplemented marker formats, all named at once. `formats`: format -> a layer."""
    bad = {name: layer for name, layer in formats.items() if name not in _REGISTRY}
    if not bad:
        return
    named = "; ".join(
        f"{name!r} ({'known to ComfyUI, not implemented here' if name in UNIMPLEMENTED_FORMATS else 'unknown'}; "
        f"e.g. {layer})" for name, layer in sorted(bad.items()))
    raise UnsupportedCheckpointError(
        f"{where}: quantised layer format {named} is not supported; supported layer formats: {supported_text()}")


def describe(where: str, marker: dict, tensors: dict) -> LayerSpec:
    """Validate one layer's tensors (`suffix -> (dtype tag, shape)`) against its marker's format."""
    fmt = marker["format"]
    refuse_formats(where, {fmt: where})
    return _REGISTRY[fmt].describe(where, marker, tensors)


__all__ = ["FOREIGN_SUFFIXES", "STORAGE_DTYPES", "UNIMPLEMENTED_FORMATS", "describe", "file_formats", "layer_format",
           "refuse_formats", "register", "side_suffixes", "supported_formats", "supported_text"]
