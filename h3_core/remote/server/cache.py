"""The server's caches: whole answers by content address (request numbers, prompt, media digests, model), and
the encoder's per-component results in two tiers (memory, and an optional directory on disk)."""

from __future__ import annotations

import collections
from typing import Any


class ConditioningCache:
    """LRU of answers by content address, bounded in bytes and entries: a conditioning's wire form (`Encoded`, or
    form-2 bytes on the Ray ingress) and its checksum (None for form 3, hashed as it is sent). Event-loop thread
    only."""

    def __init__(self, max_bytes: int, max_entries: int):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._items: collections.OrderedDict[str, tuple[Any, str | None]] = collections.OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: str) -> tuple[Any, str | None] | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item

    def put(self, key: str, data: Any, digest: str | None) -> None:
        if self.max_bytes <= 0 or len(data) > self.max_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= len(old[0])
        self._items[key] = (data, digest)
        self.bytes += len(data)
        while self._items and (self.bytes > self.max_bytes or len(self._items) > self.max_entries):
            _, (evicted, _) = self._items.popitem(last=False)
            self.bytes -= len(evicted)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._items), "bytes": self.bytes, "hits": self.hits, "misses": self.misses}


class ComponentTiers:
    """The encoder's per-component cache (h3_core/component_cache.py): this process's memory LRU, then the optional
    disk tier shared by every server process using the same directory (`disk_cache.DiskTier`). A disk hit is
    copied into memory; a computed part goes to both. Thread-safe (the model thread uses it)."""

    def __init__(self, memory_bytes: int, cache_dir: str | None = None, disk_bytes: int = 0):
        from ...component_cache import MemoryTier

        self.memory = MemoryTier(memory_bytes) if memory_bytes > 0 else None
        self.disk = None
        if cache_dir is not None and disk_bytes > 0:
            from .disk_cache import DiskTier

            self.disk = DiskTier(cache_dir, disk_bytes)

    @classmethod
    def from_config(cls, config) -> "ComponentTiers | None":
        tiers = cls(config.component_cache_bytes, config.cache_dir, config.cache_disk_bytes)
        return tiers if tiers.memory is not None or tiers.disk is not None else None

    def get(self, key: str):
        if self.memory is not None:
            found = self.memory.get(key)
            if found is not None:
                return found
        if self.disk is not None:
            found = self.disk.get(key)
            if found is not None:
                if self.memory is not None:
                    self.memory.put(key, found[0])
                return found
        return None

    def put(self, key: str, tensors) -> None:
        if self.memory is not None:
            self.memory.put(key, tensors)
        if self.disk is not None:
            self.disk.put(key, tensors)

    def stats(self) -> dict[str, dict[str, int]]:
        """tier -> bytes, evictions (entries, corrupt, write_errors where the tier has them)."""
        out = {}
        if self.memory is not None:
            out["memory"] = self.memory.stats()
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out
