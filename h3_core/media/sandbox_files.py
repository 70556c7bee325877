"""What crosses between a sandbox call's caller and its worker process (`sandbox.py`), none of it pickled.

The call's arguments travel as JSON (numbers, strings, None, and `media.VideoTarget` as a tagged object); the
result comes back as files in the call's private directory: ``result.json`` (what it is, and its numbers) and
``result.safetensors`` (its arrays), written straight from the arrays and read straight into new ones, so a large
clip is in memory once on each side. The reader checks the header: known dtypes, offsets that tile the data,
shapes that match their byte counts; anything else is a `media.MediaError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from .. import media, safetensors_header

__all__ = ["encode_kwargs", "decode_kwargs", "flatten", "rebuild", "write_arrays", "read_arrays"]


def encode_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    encoded = {}
    for key, value in kwargs.items():
        if isinstance(value, media.VideoTarget):
            value = {"VideoTarget": dataclasses.asdict(value)}
        elif not (value is None or isinstance(value, (bool, int, float, str))):
            raise TypeError(f"decode_isolated: argument {key}={value!r} is not a number, string, None or VideoTarget")
        encoded[key] = value
    return encoded


def decode_kwargs(encoded: dict[str, Any]) -> dict[str, Any]:
    return {
        key: media.VideoTarget(**value["VideoTarget"]) if isinstance(value, dict) else value
        for key, value in encoded.items()
    }


def flatten(fn_name: str, result: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    if fn_name in ("read_image", "selftest_allocate"):
        return {"kind": "image"}, {"image": result}
    if fn_name == "read_audio":
        waveform, rate = result
        return {"kind": "audio", "sample_rate": int(rate)}, {"waveform": waveform}
    if fn_name == "read_video":
        tensors = {"frames": result.frames}
        if result.audio is not None:
            tensors["audio"] = result.audio
        meta = {
            "kind": "video",
            "fps": result.fps,
            "sample_rate": result.sample_rate,
            "source_frames": result.source_frames,
            "source_fps": result.source_fps,
        }
        return meta, tensors
    return {"kind": "json", "value": result}, {}


_DTYPES = {np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32"}


def write_arrays(path: str, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors layout, written straight from the arrays (``safetensors.numpy.save_file`` first copies each
    array into a bytes object, which would double the worker's peak for a large clip). Read back by the library."""
    header, offset = {}, 0
    arrays = {name: np.ascontiguousarray(tensors[name]) for name in sorted(tensors)}
    for name, array in arrays.items():
        header[name] = {"dtype": _DTYPES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the format pads its header to 8 bytes
    with open(path, "wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for array in arrays.values():
            file.write(memoryview(array.reshape(-1)))


def read_arrays(path: str) -> dict[str, np.ndarray]:
    """Arrays of a safetensors file, each read from the file straight into its own array (the library's
    ``load_file`` reads the whole file into a bytes object first: twice the clip at the peak). The header is
    checked: known dtypes, offsets that tile the data exactly, shapes that match their byte counts."""
    names = {code: dtype for dtype, code in _DTYPES.items()}
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        try:  # the pack's one header parser: bounded length, bounded JSON, every span matching its shape
            parsed = safetensors_header.read_header(file, max_bytes=1 << 20, size=size)
        except safetensors_header.HeaderError as error:
            raise media.MediaError(f"the media decoder returned a malformed result ({error})") from None
        tensors, expected = {}, 0
        for entry in sorted(parsed.tensors.values(), key=lambda entry: entry.begin):
            dtype = names.get(entry.dtype)
            if dtype is None or entry.begin != expected or parsed.data_start + entry.end > size:
                raise media.MediaError(f"the media decoder returned a malformed result (tensor {entry.name!r})")
            file.seek(parsed.data_start + entry.begin)
            count = entry.nbytes // dtype.itemsize
            tensors[entry.name] = np.fromfile(file, dtype=dtype, count=count).reshape(entry.shape)
            expected = entry.end
    return tensors


def rebuild(meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> Any:
    kind = meta["kind"]
    if kind == "image":
        return tensors["image"]
    if kind == "audio":
        return tensors["waveform"], meta["sample_rate"]
    if kind == "video":
        return media.VideoClip(
            frames=tensors["frames"],
            fps=meta["fps"],
            audio=tensors.get("audio"),
            sample_rate=meta["sample_rate"],
            source_frames=meta["source_frames"],
            source_fps=meta["source_fps"],
        )
    return meta["value"]
