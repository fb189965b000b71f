"""Mapping the store's pages into the daemon ahead of the reads (``MADV_POPULATE_READ``).

``posix_fadvise(WILLNEED)`` brings a record's pages into the page cache, but not into the
daemon's map of data.mdb: the first touch of each page through the map is still a page fault,
paid by the assembler that reads the record (measured here: reading a 100 KB record whose
pages are cached but not mapped costs ~29 us in LMDB's get, against ~8 us once mapped).
``madvise(MADV_POPULATE_READ)`` (Linux 5.14) maps a range's pages in one system call, which
costs less than half of faulting them one by one (~9 us against ~21 us a 100 KB record),
and can run on the read-ahead's thread, off the serving path. For pages not yet read it waits
for their I/O, so it is called only after the ranges were advised. A batch's ranges go in one
call where the kernel takes many (``syscalls.populate_read``), which lets go of the GIL.

Where the kernel refuses the advice (``EINVAL`` before Linux 5.14) prefaulting is switched
off, logged once, and the records are faulted in by their readers as before.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from loaderd.storage.syscalls import populate_read

logger = logging.getLogger(__name__)


class Prefault:
    """``MADV_POPULATE_READ`` of file ranges of one map, switched off at the first refusal.

    Args:
        base: the address of the map's first byte (file offset 0).
        size: the map's length in bytes; a range beyond it is not populated.
    """

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.size = size
        self.enabled = True

    def populate(self, starts: np.ndarray, lengths: np.ndarray) -> int:
        """Map the pages of these page-aligned file ranges; returns the system calls made."""
        inside = starts < self.size
        if not self.enabled or not inside.any():
            return 0
        starts = starts[inside]
        lengths = np.minimum(lengths[inside], self.size - starts)
        calls, err = populate_read(self.base + starts, lengths)
        if err:
            self.enabled = False
            logger.info(
                "cannot prefault store pages (madvise: %s): readers fault them in",
                os.strerror(err),
            )
        return calls
