"""Per-component results of the encoder stage, by content address (docs/ARCHITECTURE.md §4.3).

The text encoder's output for a prompt and its vision inputs, each keyframe's or reference's video-VAE latents and
each soundtrack's or reference audio's audio-VAE rows are pure functions of (the normalised media actually encoded,
the component's weights, the parameters that change its bits). `EncoderStage` asks the cache installed with
`using(cache, record)` (this thread only) for each of them before computing it, and puts what it computed; without
one installed nothing is hashed and nothing changes. A hit returns the very tensors a miss computes, so the assembled
conditioning is bitwise the uncached one (tests/test_component_cache.py compares every mix of hits and misses).

A cache is anything with `get(key) -> (tensors, tier) | None` and `put(key, tensors)`: `MemoryTier` here, the
server's two tiers in `remote/server/cache.py` and `remote/server/disk_cache.py`.

Not cached separately: the Qwen3-VL vision tower. diffusers' text step hands the pixels to `text_encoder.model(...)`,
which runs the tower inside its forward and injects its DeepStack features into the first decoder layers; neither
that step nor transformers' forward takes precomputed vision features, so they are part of the text entry.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import numpy as np
import torch

# Bump when what an entry holds, or how a key is built, changes: old entries then simply stop matching.
CACHE_VERSION = "h3-components/1"
COMPONENTS = ("text", "video", "audio")
TIERS = ("memory", "disk")

Tensors = dict[str, torch.Tensor]


class ComponentStore(Protocol):
    def get(self, key: str) -> tuple[Tensors, str] | None: ...

    def put(self, key: str, tensors: Tensors) -> None: ...


@dataclass
class CacheRecord:
    """What one encode found: label (`text`, `video.N`, `audio.N`, in the conditioning's order) -> `miss` or the
    tier that answered, and the keys (tests use them to build every mix of hits and misses)."""

    outcomes: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)

    def header(self) -> str:
        """`text=miss, video.0=memory, audio.0=disk`: the answer's `X-H3-Cache-Components` (docs/PROTOCOL.md)."""
        return ", ".join(f"{label}={outcome}" for label, outcome in self.outcomes.items())


_ACTIVE: contextvars.ContextVar[tuple[ComponentStore, CacheRecord] | None] = contextvars.ContextVar(
    "h3_component_cache", default=None)


@contextlib.contextmanager
def using(cache: ComponentStore | None, record: CacheRecord | None = None) -> Iterator[CacheRecord]:
    """Look components up in `cache` (and put the computed ones) for the encodes in this block, in this thread."""
    record = record if record is not None else CacheRecord()
    token = _ACTIVE.set(None if cache is None else (cache, record))
    try:
        yield record
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    return _ACTIVE.get() is not None


# --- keys ------------------------------------------------------------------------------------------------------


def digest(*items) -> str:
    """SHA-256 of arrays / tensors / PIL images (dtype, shape and bytes) and plain JSON values, in order."""
    hasher = hashlib.sha256()
    for item in items:
        if isinstance(item, torch.Tensor):
            item = item.detach().cpu().contiguous()
            hasher.update(f"t:{item.dtype}:{tuple(item.shape)}:".encode())
            hasher.update(item.view(torch.uint8).numpy().tobytes() if item.numel() else b"")
        elif isinstance(item, np.ndarray) or hasattr(item, "__array_interface__"):
            array = np.ascontiguousarray(np.asarray(item))
            hasher.update(f"a:{array.dtype.str}:{array.shape}:".encode())
            hasher.update(memoryview(array).cast("B") if array.size else b"")
        else:
            hasher.update(b"j:" + json.dumps(item, sort_keys=True, default=str).encode())
        hasher.update(b"|")
    return hasher.hexdigest()


def key(component: str, identity: dict, params: dict, content: str) -> str:
    """The entry's address: cache version, component, its model identity (weights digest, dtype, device, torch
    build, CPU threads: all change bits), the encode parameters and the input's content digest."""
    canonical = {"version": CACHE_VERSION, "component": component, "identity": identity, "params": params,
                 "content": content}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def execution_identity(weights: str, dtype: torch.dtype, device: torch.device) -> dict:
    from . import __version__
    from .contract import FORMAT_ID, WIRE_VERSION

    identity = {"weights": weights, "dtype": str(dtype), "device": device.type, "torch": torch.__version__,
                "pack": __version__, "contract": f"{FORMAT_ID}/{WIRE_VERSION}"}
    if device.type == "cpu":  # CPU reductions depend on the thread count (docs/ARCHITECTURE.md §2.1 trap 5)
        identity["threads"] = torch.get_num_threads()
    return identity


# --- lookups ---------------------------------------------------------------------------------------------------


def lookup(label: str, entry_key: Callable[[], str]) -> tuple[str | None, Tensors | None]:
    """(key, cached tensors or None); (None, None) when no cache is installed (the key is then never computed)."""
    active = _ACTIVE.get()
    if active is None:
        return None, None
    cache, record = active
    address = entry_key()
    record.keys[label] = address
    found = cache.get(address)
    if found is None:
        record.outcomes[label] = "miss"
        return address, None
    tensors, tier = found
    record.outcomes[label] = tier
    return address, tensors


def store(address: str | None, tensors: Tensors) -> None:
    active = _ACTIVE.get()
    if active is not None and address is not None:
        active[0].put(address, tensors)


def nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class MemoryTier:
    """LRU of component results in this process, bounded in bytes; thread-safe (the model thread writes, the
    metrics scrape reads)."""

    tier = "memory"

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._items: collections.OrderedDict[str, Tensors] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.evictions = 0

    def get(self, key: str) -> tuple[Tensors, str] | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
        # Copies both ways: whoever holds an answer may change its tensors in place (ComfyUI graphs can) without
        # changing the entry. A memcpy of latents is noise beside the encode it saves.
        return {name: tensor.clone() for name, tensor in item.items()}, self.tier

    def put(self, key: str, tensors: Tensors) -> None:
        size = nbytes(tensors)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= nbytes(old)
            self._items[key] = {name: tensor.detach().clone() for name, tensor in tensors.items()}
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.bytes -= nbytes(evicted)
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._items), "bytes": self.bytes, "evictions": self.evictions}
