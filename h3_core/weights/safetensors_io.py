"""Read tensor data from safetensors checkpoints and write deterministic files.

Reading goes through `safetensors.safe_open` (memory-mapped, one tensor at a time); nothing in
this package ever unpickles. Writing is byte-deterministic for equal inputs: the header is
serialised here with sorted keys (safetensors' writer orders `__metadata__` by hash), every tensor
is contiguous and on the CPU, and metadata is given explicitly by the caller, so the embedded tiny
H3 files are reproducible bit for bit. The files are standard safetensors (read back by
`safe_open` and by ComfyUI).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile

import torch
from safetensors import safe_open

from .. import progress
from .errors import H3WeightsError
from .headers import Header

SHARD_INDEX_SUFFIX = ".safetensors.index.json"


def load_tensors(header: Header, names: set[str] | None = None, *, report: bool = False) -> dict[str, torch.Tensor]:
    """Load the named tensors (all by default) of a checkpoint whose header was read earlier.

    `report`: count the bytes read as the `load` progress phase (whole-model loads only, so the
    small reads of statistics and check tables do not start bars of their own)."""
    wanted = set(header.tensors) if names is None else set(names)
    unknown = wanted - set(header.tensors)
    if unknown:
        raise H3WeightsError(f"tensors not in checkpoint: {sorted(unknown)[:5]}")
    by_file: dict[str, list[str]] = {}
    for name in sorted(wanted):
        by_file.setdefault(header.tensors[name].file, []).append(name)
    counter = None
    if report and progress.active():
        counter = progress.Counter("load", sum(header.tensors[name].nbytes for name in wanted))
    tensors: dict[str, torch.Tensor] = {}
    for path, file_names in by_file.items():
        if header.tensors[file_names[0]].ggml_type is not None:  # a GGUF file: plain reads at the offsets
            from .gguf_file import read_tensor

            for name in file_names:
                tensors[name] = read_tensor(header.tensors[name])
                if counter is not None:
                    counter.advance(header.tensors[name].nbytes)
            continue
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in file_names:
                tensors[name] = handle.get_tensor(name)
                if counter is not None:
                    counter.advance(header.tensors[name].nbytes)
    if counter is not None:
        counter.finish()
    return tensors


def _plain_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sorted, detached, contiguous CPU tensors (no copy when already so: views are fine, each
    tensor's bytes are written on their own, so a release-size model is never duplicated)."""
    plain = {}
    for name in sorted(tensors):
        tensor = tensors[name]
        if not isinstance(tensor, torch.Tensor):
            raise H3WeightsError(f"cannot write {name!r}: not a tensor ({type(tensor).__name__})")
        if tensor.device.type == "meta":
            raise H3WeightsError(f"cannot write {name!r}: it is a meta tensor (weights were never loaded)")
        plain[name] = tensor.detach().to("cpu").contiguous()
    return plain


_DTYPE_TAGS = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",  # quantised (fp8_scaled) weights and nvfp4 / w6a8 scales
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",  # mxfp8 block scales
}


def _serialise_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[str]]:
    """The safetensors header, and the order the tensor bytes follow in.

    safetensors' own writer keeps `__metadata__` in a hash map, so its byte order varies from run
    to run; this header is serialised here with sorted keys instead. Tensors are laid out largest
    item size first, then by name (safetensors' own rule), which keeps each one aligned to its
    item size once the header is padded to 8 bytes.
    """
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _DTYPE_TAGS:
            raise H3WeightsError(f"cannot write {name!r}: dtype {tensor.dtype} has no safetensors tag here")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPE_TAGS[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write one safetensors file atomically (temp file + rename), deterministic bytes."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    plain = _plain_cpu(tensors)
    header, order = _serialise_header(plain, {str(k): str(v) for k, v in metadata.items()})
    descriptor, temp_path = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=directory)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(header)
            for name in order:
                # Raw bytes straight from the tensor's storage (bf16 included), no copy.
                handle.write(plain[name].reshape(-1).view(torch.uint8).numpy().data)
        os.replace(temp_path, path)
    finally:
        if os.path.exists(temp_path):
            os.remove(temp_path)


def write_sharded(
    directory: str,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    prefix: str,
    max_shard_bytes: int,
) -> list[str]:
    """Write `prefix-0000i-of-0000n.safetensors` shards plus `prefix.safetensors.index.json`.

    Shards are filled in sorted key order so the split is a pure function of the tensors, and the
    index is the standard Hugging Face `{"metadata": {"total_size"}, "weight_map"}` form.
    """
    if max_shard_bytes <= 0:
        raise H3WeightsError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    plain = _plain_cpu(tensors)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in plain.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    os.makedirs(directory, exist_ok=True)
    weight_map = {}
    written = []
    for index, shard in enumerate(shards):
        file_name = f"{prefix}-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        write_file(os.path.join(directory, file_name), shard, metadata)
        weight_map.update({name: file_name for name in shard})
        written.append(os.path.join(directory, file_name))
    total = sum(t.numel() * t.element_size() for t in plain.values())
    index_path = os.path.join(directory, prefix + SHARD_INDEX_SUFFIX)
    with open(index_path, "w", encoding="utf-8") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2, sort_keys=True)
        handle.write("\n")
    return written


def write_json(path: str, payload: dict) -> None:
    """Deterministic JSON (sorted keys, trailing newline) for config files written next to weights."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.write("\n")
