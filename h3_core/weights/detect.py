"""Tell which H3 component, in which published layout, a path holds - from headers only.

`detect` never reads tensor data: it parses safetensors headers (seconds for a 66 GB file) and
recognises the component by the marker keys of SPEC.md §5.1. Pruned and quantised checkpoints are
refused here already, so every caller gets the same message.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from . import audio_vae_keys, text_encoder_keys, transformer_keys, video_vae_keys
from .errors import H3WeightsError, UnrecognisedCheckpointError
from .refusal import refuse_unsupported
from .headers import Header, read_header
from .sources import Source, component_paths, component_source, is_root, loose_files, partition_token

COMPONENTS = ("transformer", "video_vae", "audio_vae", "text_encoder")
LAYOUTS = ("diffusers", "comfy", "native")


@dataclass(frozen=True)
class Detection:
    """What one component path holds.

    key_format names the tensor naming found in the files: "reference" (Comfy/native DiT and
    video VAE names) or "diffusers"; for the audio VAE "folded" or "weight_norm"; for the text
    encoder "legacy" (`model.layers.N`, `visual.*`) or "transformers".
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
    header: Header = field(default=None, repr=False, compare=False)
    source: Source = field(default=None, repr=False, compare=False)

    def summary(self) -> str:
        dtypes = ", ".join(f"{name} x{count}" for name, count in self.dtypes)
        partition = f" ({self.partition})" if self.partition else ""
        return (
            f"{self.component}{partition}: {self.layout} layout, {self.key_format} keys, {self.num_tensors} tensors, "
            f"{self.total_bytes / 2**30:.2f} GiB [{dtypes}] in {len(self.files)} file(s)"
        )


def _has_all(keys, markers) -> bool:
    return all(marker in keys for marker in markers)


def classify(header: Header, where: str) -> tuple[str, str]:
    """(component, key_format) from marker keys."""
    keys = header.tensors
    if _has_all(keys, transformer_keys.REFERENCE_MARKERS):
        return "transformer", "reference"
    if _has_all(keys, transformer_keys.DIFFUSERS_MARKERS):
        return "transformer", "diffusers"
    if _has_all(keys, video_vae_keys.REFERENCE_MARKERS):
        return "video_vae", "reference"
    if _has_all(keys, video_vae_keys.DIFFUSERS_MARKERS):
        return "video_vae", "diffusers"
    if _has_all(keys, audio_vae_keys.MARKERS):
        return "audio_vae", "weight_norm" if audio_vae_keys.is_weight_normed(keys) else "folded"
    if _has_all(keys, text_encoder_keys.COMFY_MARKERS):
        return "text_encoder", "legacy"
    if _has_all(keys, text_encoder_keys.TRANSFORMERS_MARKERS):
        return "text_encoder", "transformers"
    raise UnrecognisedCheckpointError(
        f"{where}: not a MiniMax-H3 component: none of the DiT / video VAE / audio VAE / Qwen3-VL marker "
        f"keys are present (first keys: {sorted(keys)[:3]})"
    )


_NATIVE_KEY_FORMATS = {"reference", "legacy"}


def _layout(component: str, key_format: str, source: Source) -> str:
    if source.container == "file":
        # A single file in diffusers/transformers names (or weight-normed) is a diffusers weight file.
        return "comfy" if key_format in ("reference", "folded", "legacy") else "diffusers"
    if source.native_root is not None:
        return "native"
    # A folder outside a native root: reference names only ever ship in native component folders.
    if key_format in _NATIVE_KEY_FORMATS or "source_safetensors_path" in source.config or source.extra_config:
        return "native"
    return "diffusers"


def _partition(component: str, layout: str, source: Source) -> str | None:
    if component != "transformer":
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


def _notes(component: str, key_format: str, header: Header) -> tuple[str, ...]:
    notes = []
    if component == "text_encoder":
        prefix = "model.layers." if key_format == "legacy" else "model.language_model.layers."
        layers = {key[len(prefix):].split(".", 1)[0] for key in header.tensors if key.startswith(prefix)}
        has_norm = any(key.startswith(("model.norm.", "model.language_model.norm.")) for key in header.tensors)
        notes.append(f"{len(layers)} decoder layers, {'with' if has_norm else 'without'} final norm")
    if component == "transformer" and transformer_keys.ROPE_KEY in header.tensors:
        notes.append("stores rope.inv_freq (checked against rope_theta at load)")
    if "h3.config" in header.metadata:
        notes.append("carries an h3.config metadata block")
    return tuple(notes)


def detect(path: str) -> Detection:
    """Identify the one component at `path` (a .safetensors file or a component folder)."""
    if is_root(path):
        raise H3WeightsError(
            f"{path} holds several components; use scan() / check() on it, or point at one of "
            f"{[os.path.basename(p) for p in component_paths(path)]}"
        )
    loose = loose_files(path)
    if len(loose) > 1:
        raise H3WeightsError(f"{path} is a folder of {len(loose)} separate checkpoints; use scan() or point at one file")
    source = component_source(loose[0] if loose else path)
    header = read_header(source.files)
    refuse_unsupported(header, source.path)
    component, key_format = classify(header, source.path)
    layout = _layout(component, key_format, source)
    dtypes = tuple(sorted(Counter(info.dtype for info in header.tensors.values()).items()))
    return Detection(
        component=component,
        layout=layout,
        partition=_partition(component, layout, source),
        path=source.path,
        key_format=key_format,
        files=tuple(source.files),
        num_tensors=len(header.tensors),
        total_bytes=header.total_bytes,
        dtypes=dtypes,
        notes=_notes(component, key_format, header),
        header=header,
        source=source,
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
