"""GGUF checkpoints (ComfyUI-GGUF / llama.cpp files): the header as a `Header`, and tensor reads.

A file is GGUF when it starts with the GGUF magic, whatever its name. Its tensor directory (names,
GGML types, shapes, offsets) is parsed by the pack's bounded reader (`gguf_header`: every count checked against the
file before anything is allocated, cached by path, size and mtime; the `gguf` package's reader trusts the counts it
reads, and one 96-byte file hung ComfyUI's model lists); a tensor's bytes are later mapped from the file, not copied
(`read_tensor`: the pages stay the page cache's, as `safe_open` keeps safetensors weights), and every block scale or
dense value is checked finite before it is mapped (`quant.ggml.non_finite`).

Names are the Comfy safetensors names, as ComfyUI-GGUF's converter writes them (its loader also strips a
`model.diffusion_model.` prefix, and so do we), or llama.cpp's names for a Qwen3-VL text encoder and its
vision ("mmproj") file, told by the names and `general.architecture` and mapped to the Comfy names here
(`gguf_llama_names`; the values its metadata states become `h3.config.text_config` / `.vision_config`).
Shapes: GGUF lists dimensions innermost first, so the torch shape is the reversed list, unless the file
states the original shape in `comfy.gguf.orig_shape.<name>` (ComfyUI-GGUF's convention for tensors
quantised in another shape).

Every tensor becomes a `TensorInfo` with the GGML type beside a safetensors dtype tag: F32/F16/BF16 keep
theirs; a block-quantised tensor is described as the U8 bytes it is held as (`quant.ggml.stored_shape`),
and `quant.ggml` turns the file's quantised tensors into a quantisation plan with one synthetic marker a
layer. A GGML type no dequantiser knows is refused by name here, before any weight is read.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

import numpy as np
import torch

from . import gguf_header, gguf_llama_names
from .config_merge import CONFIG_METADATA_KEY
from .errors import H3WeightsError, IncompleteFileError, UnsupportedCheckpointError, preview
from .quant import ggml
from .tensor_info import TensorInfo

MAGIC = b"GGUF"
PREFIX = "model.diffusion_model."  # ComfyUI-GGUF's loader strips it (checkpoint-style names)
ORIG_SHAPE = "comfy.gguf.orig_shape."


def is_gguf(path: str) -> bool:
    """Whether the file starts with the GGUF magic (the format is read from the file, never its name)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == MAGIC
    except OSError:
        return False


_LLAMA_KEYS = (f"{gguf_llama_names.TEXT_ARCHITECTURE}.", "clip.")  # llama.cpp metadata whose values are read
KEPT_ARRAYS = (*_LLAMA_KEYS, ORIG_SHAPE)  # the only metadata arrays read as values; the others are stepped over


def _fields(directory) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict]:
    """(original shapes by tensor name, string metadata, every value of llama.cpp's own keys)."""
    shapes, metadata, values = {}, {}, {}
    for key, value in directory.values.items():
        if key.startswith(_LLAMA_KEYS):
            values[key] = value
        if key.startswith(ORIG_SHAPE):
            if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
                raise H3WeightsError(f"{directory.path}: {key}: expected an array of non-negative integers, got "
                                     f"{str(value)[:200]}")
            shapes[key[len(ORIG_SHAPE):]] = tuple(value)
        elif isinstance(value, str):
            metadata[key] = value
    return shapes, metadata, values


def directory(path: str):
    """The file's GGUF directory (`gguf_header.read`: bounded, cached by path, size and mtime)."""
    return gguf_header.read(path, KEPT_ARRAYS)


PROJECTOR_PREFIX = "visual."  # a vision-projector ("mmproj") file holds only the Comfy `visual.*` tensors


def tensor_names(path: str) -> list[str]:
    """The tensor names of a GGUF file (its directory only), with the loader's prefix stripped."""
    names = [t.name for t in directory(path).tensors]
    strip = any(name.startswith(PREFIX) for name in names)
    names = [name[len(PREFIX):] if strip and name.startswith(PREFIX) else name for name in names]
    if gguf_llama_names.uses_llama_names(names):  # a directory-only look: unmapped names stay as they are
        return sorted({comfy for comfy, _ in gguf_llama_names.comfy_names(names, path, strict=False).values()})
    return names


def is_projector(path: str) -> bool:
    """A GGUF file holding only a vision projector (`visual.*`): part of a text encoder, not a component. An
    unreadable or cut file is none (logged once): detected on its own, it is refused by its own name, and a good
    projector beside a cut copy still pairs."""
    try:
        names = tensor_names(path)
        if not names or not all(name.startswith(PROJECTOR_PREFIX) for name in names):
            return False
        read_file_header(path)  # the whole directory judged: types, shapes, data within the file
    except H3WeightsError as error:
        _skipped(path, error)
        return False
    return True


_LOGGED: set = set()


def _skipped(path: str, error: Exception) -> None:
    """Say once per file and reason why a GGUF file beside another was passed over (a listing must not fail)."""
    key = (path, str(error))
    if key not in _LOGGED and len(_LOGGED) < 4096:
        _LOGGED.add(key)
        logging.getLogger(__name__).warning("MiniMax H3: %s is not read as a vision projector: %s",
                                            os.path.basename(path), error)


def projector_for(path: str) -> list[str]:
    """The vision-projector GGUF beside a text-encoder GGUF that has none (llama.cpp ships the projector as a
    separate `mmproj` file): [] when the file has its own tower or is no text encoder; told by contents. A broken
    neighbour is passed over (`is_projector`), never the reason the good file beside it cannot be read."""
    names = tensor_names(path)
    if not any(n.startswith("model.layers.") for n in names) or any(n.startswith(PROJECTOR_PREFIX) for n in names):
        return []
    folder = os.path.dirname(path)
    found = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".gguf")
                   and os.path.join(folder, f) != path and is_gguf(os.path.join(folder, f))
                   and is_projector(os.path.join(folder, f)))
    if len(found) > 1:
        raise H3WeightsError(f"{path}: several vision-projector GGUF files beside it "
                             f"({[os.path.basename(f) for f in found]}); keep the one that belongs to it")
    return found


_HEADERS: OrderedDict = OrderedDict()  # id(directory) -> (directory, tensors, metadata): `read_file_header`
_HEADERS_SIZE = 16  # as `gguf_header`'s cache: one load's file and its neighbours
_HEADERS_LOCK = threading.Lock()


def read_file_header(path: str):
    """`({name: TensorInfo}, metadata)` of one GGUF file (see the module docstring); described once per directory
    `gguf_header` parsed (so once per file version): pairing a projector and reading the pair's header both ask."""
    found = directory(path)
    with _HEADERS_LOCK:
        entry = _HEADERS.get(id(found))
        if entry is not None and entry[0] is found:  # the entry holds its directory: an id is never reused in it
            _HEADERS.move_to_end(id(found))
            return dict(entry[1]), dict(entry[2])
    tensors, metadata = _describe(found, path)
    with _HEADERS_LOCK:
        _HEADERS[id(found)] = (found, tensors, metadata)
        while len(_HEADERS) > _HEADERS_SIZE:
            _HEADERS.popitem(last=False)
    return dict(tensors), dict(metadata)


def _describe(found, path: str):
    orig_shapes, metadata, values = _fields(found)
    names = [t.name for t in found.tensors]
    strip = any(name.startswith(PREFIX) for name in names)
    dequantisable = set(ggml.quantised_types())
    refused: dict[str, list[str]] = {}
    tensors = {}
    for tensor in found.tensors:
        type_name = ggml.type_name(tensor.type_id)
        if type_name not in ggml.DENSE_TYPES and type_name not in dequantisable:
            refused.setdefault(type_name, []).append(tensor.name)
            continue
        name = tensor.name[len(PREFIX):] if strip and tensor.name.startswith(PREFIX) else tensor.name
        stored_bytes = ggml.tensor_bytes(type_name, tensor.dims, f"{path}: {tensor.name}")
        shape = orig_shapes.get(tensor.name) or tuple(reversed(tensor.dims))
        if type_name in ggml.DENSE_TYPES:
            tag, stored = ggml.DENSE_TYPES[type_name], shape
        else:
            tag, stored = "U8", ggml.stored_shape(type_name, shape)
        info = TensorInfo(dtype=tag, shape=tuple(stored), file=path, ggml_type=type_name,
                          offset=tensor.offset, dense_shape=tuple(shape))
        if info.nbytes != stored_bytes:
            raise H3WeightsError(f"{path}: {tensor.name}: {type_name} {list(shape)} should take {info.nbytes} bytes, "
                                 f"the file's dimensions {list(tensor.dims)} take {stored_bytes}")
        if info.offset + info.nbytes > found.size:
            raise IncompleteFileError(f"{path}: incomplete file - {tensor.name} ends at byte "
                                      f"{info.offset + info.nbytes}, past the file's {found.size} bytes "
                                      "(interrupted download?)")
        tensors[name] = info
    if refused:
        named = "; ".join(f"{kind} x{len(keys)} (e.g. {preview(keys, 2)})" for kind, keys in sorted(refused.items()))
        raise UnsupportedCheckpointError(f"{path}: GGML tensor type {named} is not supported; supported: "
                                         f"{ggml.supported_text()}")
    if gguf_llama_names.uses_llama_names(tensors):
        return _from_llama_names(tensors, metadata, values, path)
    return tensors, metadata


def _from_llama_names(tensors: dict, metadata: dict, values: dict, path: str):
    """A llama.cpp-named Qwen3-VL file's tensors under the Comfy names (the two temporal halves of the patch
    kernel become one tensor read as their stack), and the config values its metadata states."""
    import json

    from .. import configs

    gguf_llama_names.check_architecture(metadata, path)
    mapping = gguf_llama_names.comfy_names(tensors, path)
    out, parts = {}, {}
    for name, info in tensors.items():
        comfy, part = mapping[name]
        if comfy == gguf_llama_names.PATCH:
            parts[part] = (name, info)
        else:
            out[comfy] = info
    if parts:
        (name0, first), (name1, second) = parts[0], parts[1]
        if first.ggml_type not in ggml.DENSE_TYPES or (first.ggml_type, first.shape) != (second.ggml_type,
                                                                                            second.shape):
            raise UnsupportedCheckpointError(
                f"{path}: the patch-embedding halves {name0} ({first.ggml_type} {list(first.shape)}) and {name1} "
                f"({second.ggml_type} {list(second.shape)}) must be one dense type and shape (llama.cpp writes "
                "them F16 or F32)")
        shape = (*first.shape[:gguf_llama_names.TEMPORAL_DIM], 2, *first.shape[gguf_llama_names.TEMPORAL_DIM:])
        out[gguf_llama_names.PATCH] = TensorInfo(dtype=first.dtype, shape=shape, file=path,
                                                 ggml_type=first.ggml_type, dense_shape=shape, parts=(first, second))
    stated = gguf_llama_names.stated_config(values, tensors, configs.get("text_encoder", tiny=False))
    metadata = dict(metadata)
    for part, config in stated.items():
        metadata[f"{CONFIG_METADATA_KEY}.{part}"] = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return out, metadata


def read_tensor(info) -> torch.Tensor:
    """One tensor's stored bytes as a CPU tensor of its `TensorInfo` dtype and (stored) shape: a view of the file's
    pages (`_mapped`), as ComfyUI-GGUF and `safe_open` hold weights, never a private copy of them."""
    from ..safetensors_header import DTYPES

    if info.parts:
        return torch.stack([read_tensor(part) for part in info.parts], dim=gguf_llama_names.TEMPORAL_DIM)
    dtype = DTYPES[info.dtype]
    if not info.nbytes:
        return torch.empty(info.shape, dtype=dtype)
    # A view of another dtype needs its start aligned to that dtype; GGUF aligns data to `general.alignment` (32 by
    # default), so only a hostile or odd file lands here, and pays a plain read instead.
    if info.offset % dtype.itemsize:
        raw = _copied(info)
        bad = ggml.non_finite(raw, info.ggml_type)
    else:
        bad = _non_finite_read(info)
        raw = None if bad else _mapped(info)
    if bad:
        raise H3WeightsError(f"{info.file}: {_name_at(info)} ({info.ggml_type}) holds NaN or infinite "
                             f"{'values' if info.ggml_type in ggml.DENSE_TYPES else 'block scales'} (a corrupted or "
                             "hostile file; every output of that layer would be NaN)")
    return torch.from_numpy(raw).view(dtype).reshape(info.shape)


_PIECE = 16 << 20  # bytes tested at a time by `_non_finite_read` (rounded down to whole blocks)


def _non_finite_read(info) -> bool:
    """`ggml.non_finite` over the tensor's bytes read in bounded pieces of whole blocks. Read, not through the
    mapping: reads leave the pages in the page cache only, while touching them through the mapping would count the
    whole file in this process's RSS at load (the pages a forward touches come in as it runs)."""
    block = 1 if info.ggml_type in ggml.DENSE_TYPES else ggml.block_sizes(info.ggml_type)[1]
    step = max(block, _PIECE // block * block)
    buffer = bytearray(min(step, info.nbytes))
    try:
        with open(info.file, "rb") as handle:
            handle.seek(info.offset)
            for start in range(0, info.nbytes, step):
                count = min(step, info.nbytes - start)
                view = memoryview(buffer)[:count]
                if handle.readinto(view) != count:
                    raise IncompleteFileError(f"{info.file}: tensor data ends early (interrupted download?)")
                if ggml.non_finite(np.frombuffer(view, dtype=np.uint8), info.ggml_type):
                    return True
    except OSError as exc:
        raise H3WeightsError(f"{info.file}: cannot read tensor data ({exc.strerror or exc})") from None
    return False


def _mapped(info) -> np.ndarray:
    """The tensor's bytes as a private (copy-on-write, `mode="c"`) mapping of its range of the file.

    Why a mapping: a copy doubles what a 9-13 GB GGUF costs while it loads and keeps it as anonymous memory for as
    long as the model lives; mapped, the weights are the page cache's clean file pages, shared with any other
    process reading the file and dropped under pressure. Why copy-on-write rather than read-only: `torch.from_numpy`
    refuses a read-only array, and nothing writes weights in place (casts and device moves make new tensors); were
    anything to, its write would land in a private page, never in the operator's file. The cost is safetensors'
    (`safe_open` maps too): a file truncated in place under a live mapping kills the process with SIGBUS on the next
    read of a lost page, so `file_identity` (the loaders remember every weight file) refuses a file rewritten in
    place before the next run. One mapping a tensor: freeing a tensor unmaps its range."""
    try:
        return np.memmap(info.file, dtype=np.uint8, mode="c", offset=info.offset, shape=(info.nbytes,))
    except ValueError:  # "mmap length is greater than file size": cut since its header (and its check) was read
        raise IncompleteFileError(f"{info.file}: tensor data ends early (interrupted download?)") from None
    except OSError as exc:
        raise H3WeightsError(f"{info.file}: cannot map tensor data ({exc.strerror or exc})") from None


def _copied(info) -> np.ndarray:
    """The tensor's bytes read into a private buffer (a start the dtype cannot be viewed at)."""
    raw = np.empty(info.nbytes, dtype=np.uint8)
    try:
        with open(info.file, "rb") as handle:
            handle.seek(info.offset)
            count = handle.readinto(memoryview(raw))
    except OSError as exc:
        raise H3WeightsError(f"{info.file}: cannot read tensor data ({exc.strerror or exc})") from None
    if count != info.nbytes:
        raise IncompleteFileError(f"{info.file}: tensor data ends early (interrupted download?)")
    return raw


def _name_at(info) -> str:
    """The tensor name the file gives the data at `info.offset` (for messages: `TensorInfo` holds no name)."""
    try:
        return next(t.name for t in directory(info.file).tensors if t.offset == info.offset)
    except (H3WeightsError, StopIteration):
        return f"the tensor at byte {info.offset}"


def numpy_dequantise(info) -> np.ndarray:
    """The `gguf` package's own numpy dequantisation of one tensor, float32 (the reference tests compare to)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = read_tensor(info).numpy()
    dense = dequantize(raw.reshape(-1).view(np.uint8), GGMLQuantizationType[info.ggml_type])
    return np.asarray(dense, dtype=np.float32).reshape(info.dense_shape)
