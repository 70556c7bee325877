"""The conditioning cache: answers by content address (request numbers, prompt, media digests, model)."""

from __future__ import annotations

import collections


class ConditioningCache:
    """LRU of conditioning bytes by content address, bounded in bytes and entries. Event-loop thread only."""

    def __init__(self, max_bytes: int, max_entries: int):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._items: collections.OrderedDict[str, tuple[bytes, str]] = collections.OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: str) -> tuple[bytes, str] | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item

    def put(self, key: str, data: bytes, digest: str) -> None:
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
