"""Tell which H3 component, in which published layout and weight format, a path holds - from headers only.

`detect` never reads tensor data: it parses safetensors headers (seconds for a 66 GB file), decides
the weight format (`formats.FORMATS`: unsupported ones are refused here, so every caller gets the
same message) and recognises the component by its handler's marker keys (`components.HANDLERS`).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from . import components
from .errors import H3WeightsError, UnrecognisedCheckpointError
from .formats import detect_format
from .headers import Header, read_header
from .keymap import LAYOUTS, KeyFamily
from .quant.plan import QuantPlan, read_plan
from .sources import Source, component_paths, component_source, is_root, loose_files, partition_token

COMPONENTS = tuple(components.HANDLERS)
__all__ = ["COMPONENTS", "LAYOUTS", "Detection", "detect", "scan"]


@dataclass(frozen=True)
class Detection:
    """What one component path holds.

    `component` is a key of `components.HANDLERS` (transformer, vae, audio_vae, text_encoder);
    `slot` the pipeline component it fills (a Ref2VA DiT fills `transformer_ref`). `key_format`
    names the handler's key family found in the files: "reference" (Comfy/native DiT and video VAE
    names) or "diffusers"; for the audio VAE "folded" or "weight_norm"; for the text encoder
    "legacy" (`model.layers.N`, `visual.*`) or "transformers". `format` is the weight format;
    `quant` the quantised layers' plan (None for a dense file), read from the markers before any weight.
    """

    component: str
    layout: str
    partition: str | None
    path: str
    key_format: str
    files: tuple[str, ...]
    num_tensors: int
    total_bytes: int
    dtypes: tuple[tuple[str, int], ...]
    notes: tuple[str, ...] = ()
    format: str = "dense"
    header: Header = field(default=None, repr=False, compare=False)
    source: Source = field(default=None, repr=False, compare=False)
    quant: QuantPlan | None = field(default=None, repr=False, compare=False)
    # (device, inode, size, mtime) of each weight file, taken before its header was read: `current()`.
    stamp: tuple = field(default=(), repr=False, compare=False)

    def current(self) -> bool:
        """Whether every weight file is still the one this detection read (same inode, size and mtime), so a load
        may take the detection as it is instead of reading the headers again (`loaders.load`)."""
        return bool(self.stamp) and _stamp(self.files) == self.stamp

    @property
    def dense_shapes(self) -> dict:
        """Tensor shapes as the dense file would have them (what configs are derived from)."""
        return self.header.shapes if self.quant is None else self.quant.dense_shapes(self.header.shapes)

    @property
    def slot(self) -> str:
        return components.slot_of(self.component, self.partition)

    @property
    def handler(self):
        return components.HANDLERS[self.component]

    def summary(self) -> str:
        dtypes = ", ".join(f"{name} x{count}" for name, count in self.dtypes)
        partition = f" ({self.partition})" if self.partition else ""
        return (
            f"{self.component}{partition}: {self.layout} layout, {self.key_format} keys, {self.format} weights, "
            f"{self.num_tensors} tensors, {self.total_bytes / 2**30:.2f} GiB [{dtypes}] in {len(self.files)} file(s)"
        )


def _stamp(files) -> tuple:
    try:
        return tuple((info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns) for info in map(os.stat, files))
    except OSError:
        return ()  # a file gone: nothing to reuse


def _layout(family: KeyFamily, source: Source) -> str:
    if source.container == "file":
        # A single file in diffusers/transformers names (or weight-normed) is a diffusers weight file.
        return "comfyui" if family.comfy else "diffusers"
    if source.native_root is not None:
        return "native"
    # A folder outside a native root: reference names only ever ship in native component folders.
    if family.native or "source_safetensors_path" in source.config or source.extra_config:
        return "native"
    return "diffusers"


def _partition(partitioned: bool, layout: str, source: Source) -> str | None:
    if not partitioned:
        return None  # VAEs and the text encoder are shared by both partitions
    if layout == "native" and source.native_partition:
        return source.native_partition
    name = os.path.basename(os.path.normpath(source.path))
    if layout == "diffusers" and source.container == "folder":
        parent = os.path.dirname(os.path.normpath(source.path))
        if name == "transformer_ref":
            return "ref2va"
        if name == "transformer" and os.path.isfile(os.path.join(parent, "model_index.json")):
            return "fl2va"  # the diffusers root's `transformer` serves t2va and fl2va
    # File name token (the only partition marker of the Comfy-Org files), else the folder names.
    parts = os.path.normpath(source.path).split(os.sep)
    for part in reversed(parts[-3:]):
        token = partition_token(part)
        if token:
            return token
    return None


def detect(path: str) -> Detection:
    """Identify the one component at `path` (a .safetensors file or a component folder)."""
    if is_root(path):
        raise H3WeightsError(
            f"{path} holds several components; use scan() / check() on it, or point at one of "
            f"{[os.path.basename(p) for p in component_paths(path)]}"
        )
    loose = loose_files(path)
    if len(loose) > 1:
        raise H3WeightsError(
            f"{path} is a folder of {len(loose)} separate checkpoints; use scan() or point at one file"
        )
    source = component_source(loose[0] if loose else path)
    stamp = _stamp(source.files)  # before the headers: a file changed while they are read is read again later
    header = read_header(source.files)
    weight_format = detect_format(header, source.path)
    quant = read_plan(header, os.path.basename(os.path.normpath(source.path)))  # refuses unknown formats by name
    handler, family = components.classify(header.tensors, source.path)
    layout = _layout(family, source)
    notes = handler.notes(header.tensors, family.name)
    if "h3.config" in header.metadata:
        notes += ("carries an h3.config metadata block",)
    return Detection(
        component=handler.name,
        layout=layout,
        partition=_partition(handler.partitioned, layout, source),
        path=source.path,
        key_format=family.name,
        files=tuple(source.files),
        num_tensors=len(header.tensors),
        total_bytes=header.total_bytes,
        dtypes=tuple(sorted(Counter(info.dtype for info in header.tensors.values()).items())),
        notes=notes,
        format=weight_format.name,
        header=header,
        source=source,
        quant=quant,
        stamp=stamp,
    )


def scan(path: str) -> list[Detection | H3WeightsError]:
    """Detect every component under `path`: a file, a component folder, a plain folder of single
    files, a diffusers root, a native partition (or the folder holding both), a ComfyUI models
    folder. Per-component failures are returned in place (an exception object carrying `.path`)
    rather than raised, so one refused file does not hide the others."""
    targets = component_paths(path)
    if not targets:
        raise UnrecognisedCheckpointError(f"{path}: no MiniMax-H3 component folder or .safetensors file found")
    results: list[Detection | H3WeightsError] = []
    for target in targets:
        try:
            results.append(detect(target))
        except H3WeightsError as exc:
            exc.path = target
            results.append(exc)
    return results
