"""The DRAM tier: verified records held in the daemon's memory, bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class DramCache:
    """A byte-bounded LRU map from sample id to record bytes. Thread-safe.

    Records are verified before they are put here and DRAM cannot tear, so hits are served
    without re-checking the checksum.

    Args:
        capacity_bytes: the most record bytes held at once; 0 disables the tier.
    """

    name = "dram"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"`capacity_bytes` must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._items: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, sample_id: int) -> bytes | None:
        """The record, marked most recently used, or None on a miss."""
        with self._lock:
            rec = self._items.get(sample_id)
            if rec is None:
                self.misses += 1
                return None
            self._items.move_to_end(sample_id)
            self.hits += 1
            return rec

    def put(self, sample_id: int, record: bytes) -> bool:
        """Admit a record, evicting the least recently used ones; False if it cannot fit."""
        size = len(record)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            old = self._items.pop(sample_id, None)
            if old is not None:
                self.used_bytes -= len(old)
            while self.used_bytes + size > self.capacity_bytes:
                _, victim = self._items.popitem(last=False)
                self.used_bytes -= len(victim)
                self.evictions += 1
            self._items[sample_id] = record
            self.used_bytes += size
            return True

    def discard(self, sample_id: int) -> bytes | None:
        """Remove a record without counting an eviction; returns it, or None if absent."""
        with self._lock:
            rec = self._items.pop(sample_id, None)
            if rec is not None:
                self.used_bytes -= len(rec)
            return rec

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy."""
        with self._lock:
            lookups = self.hits + self.misses
            return {
                "name": self.name,
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": self.used_bytes,
                "items": len(self._items),
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "hit_rate": self.hits / lookups if lookups else 0.0,
            }
