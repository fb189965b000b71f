"""Records read as slices of the store's map, where LMDB has shown once where each one lies.

py-lmdb's ``get`` lets go of the GIL (and touches every page of the value meanwhile). A
thread that lets go must win it back, and beside a thread running Python that takes up to
the switch interval: measured here, 440 us a ``get`` of a mapped 100 KB record next to one
such thread, against 8 us alone, once per record of every batch that misses DRAM. The value
index (``value_index.py``) already knows where each record lies in ``data.mdb``, and the map
starts at a known address, so a record can be a slice of one view of the whole map: no call
into LMDB, the GIL kept.

The index is a hint, read by our own walk of LMDB's pages. In a store whose checksums do not
name their samples (written before record version 2), a wrong offset that landed on another
record would pass its checksum. So a record is sliced only once LMDB itself has returned it at
that address and length (``confirm``, on its first read through ``get``); the first
disagreement turns slicing off for good. The store is never written while it is served, so
what LMDB said once holds.

Where every checksum is seeded with its sample's id (``trusted``), the checksum itself proves
that a slice is the sample's record: a miss worker may slice a record the first time
(``spans``), and one that fails is read again through LMDB by the daemon, whose ``confirm``
then tells a wrong index from a damaged record. The daemon's own slices (``slices``) still
wait for LMDB: its records are verified after the read, where a failure is an error.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

from loaderd.storage.syscalls import address_of
from loaderd.storage.value_index import ValueIndex

logger = logging.getLogger(__name__)


def map_view(base: int, size: int) -> memoryview:
    """A read-only byte view of a map of the store (valid while the store is open)."""
    return memoryview((ctypes.c_char * size).from_address(base)).cast("B").toreadonly()


class MapSlices:
    """Slices of a store's map at confirmed value-index offsets.

    Args:
        base: the address of the map's first byte (file offset 0).
        size: the map's length in bytes.
        index: each sample's offset and length in the file.
        trusted: every record's checksum names its sample (record version 2): ``spans``
            need no confirmation.
    """

    def __init__(self, base: int, size: int, index: ValueIndex, trusted: bool = False) -> None:
        self._map = map_view(base, size)
        self._base = base
        self._offsets = index.offsets
        self._ends = index.offsets + index.lengths.astype(np.int64)
        self._confirmed = np.zeros(len(index), bool)
        # What a worker may slice: confirmed records, or, trusted, any record not damaged.
        self._spannable = self._confirmed
        if trusted:
            self._spannable = np.ones(len(index), bool)
            self._spannable[index.damaged] = False
        self.enabled = True
        self.sliced = 0  # records handed out as slices (a statistic: races may lose some)

    def slices(self, ids: np.ndarray) -> list[memoryview] | None:
        """Each record as a slice of the map; None unless every one is confirmed."""
        if not self._all(self._confirmed, ids):
            return None
        whole = self._map
        self.sliced += len(ids)
        return [
            whole[a:b]
            for a, b in zip(self._offsets[ids].tolist(), self._ends[ids].tolist(), strict=True)
        ]

    def spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(file offsets, lengths) of the records; None unless another process may slice all.

        For another process's map of the same file (``SampleStore.views_at``), which verifies
        each record: confirmed records, or in a ``trusted`` store any that is not damaged.
        """
        if not self._all(self._spannable, ids):
            return None
        starts = self._offsets[ids]
        return starts, self._ends[ids] - starts

    def _all(self, mask: np.ndarray, ids: np.ndarray) -> bool:
        if not self.enabled or not len(ids) or ids.min() < 0 or ids.max() >= len(mask):
            return False
        return bool(mask[ids].all())

    def confirm(self, sample_id: int, view: memoryview) -> None:
        """Compare LMDB's view of a record with the index: equal, it may be sliced from now on."""
        if not self.enabled or self._confirmed[sample_id]:
            return
        start = int(self._offsets[sample_id])
        if (
            address_of(view) == self._base + start
            and view.nbytes == int(self._ends[sample_id]) - start
        ):
            self._confirmed[sample_id] = True
            return
        self.enabled = False
        logger.warning(
            "sample %d is not where the value index says: records are read through LMDB",
            sample_id,
        )

    @property
    def confirmed(self) -> int:
        """Records that may be sliced."""
        return int(self._confirmed.sum())

    def confirm_many(self, ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """``confirm`` for records LMDB returned to another process at these file offsets.

        A miss worker (``loaderd.miss_workers``) reads through its own map of the same file:
        an address less its map's start is the same file offset. Any disagreement turns
        slicing off, as in ``confirm``.
        """
        if not self.enabled or not len(ids):
            return
        ids = np.asarray(ids, np.int64)
        starts = self._offsets[ids]
        same = (starts == offsets) & (self._ends[ids] - starts == lengths)
        if same.all():
            self._confirmed[ids] = True
            return
        self.enabled = False
        logger.warning(
            "sample %d is not where the value index says: records are read through LMDB",
            int(ids[np.argmin(same)]),
        )
