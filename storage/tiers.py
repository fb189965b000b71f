"""The tier stack: the only code that knows the order in which tiers are searched.

A read walks DRAM first, then the LMDB store; a record read from the store is verified and
admitted to DRAM. The daemon only ever calls ``get_many``, so tiers and admission policies can
change here without the daemon noticing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from loaderd.storage.dram import DramCache
from loaderd.storage.store import SampleStore

logger = logging.getLogger(__name__)


class TierStack:
    """DRAM in front of the LMDB store.

    Args:
        store: the backing store (the source of truth).
        dram: the DRAM tier.
    """

    def __init__(self, store: SampleStore, dram: DramCache) -> None:
        self.store = store
        self.dram = dram

    def get_many(self, ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """Verified records for ids, in order, from the fastest tier that holds each."""
        out: list[bytes | None] = [self.dram.get(int(i)) for i in ids]
        missing = [k for k, rec in enumerate(out) if rec is None]
        if missing:
            fetched = self.store.get_many([int(ids[k]) for k in missing])
            for k, rec in zip(missing, fetched, strict=True):
                out[k] = rec
                self.dram.put(int(ids[k]), rec)
        return out  # type: ignore[return-value]  # every None was filled above

    def stats(self) -> dict[str, Any]:
        """``cache`` (all tiers together), ``tiers`` (each) and ``backing`` (the store)."""
        dram = self.dram.stats()
        return {
            "cache": {k: v for k, v in dram.items() if k != "name"},
            "tiers": [dram],
            "backing": {"reads": self.store.reads, "bytes_read": self.store.bytes_read},
        }

    def close(self) -> None:
        """Close the store (safe to call twice)."""
        self.store.close()
