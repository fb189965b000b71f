"""Whether the page cache holds the store already, learnt from a sample of the read-ahead.

``posix_fadvise(WILLNEED)`` on pages the page cache holds reads nothing, yet it costs a system
call per record (~2 us for a 100 KB record, and the GIL handed over and won back each time):
measured here, a read-ahead advising a store that sits in the page cache whole took about a
quarter of the daemon's time on a warm miss. Asking which pages are resident costs as much
(``mincore``, ~2-4 us a range), so it is asked of one batch in ``every``: once ``trust``
probes in a row found every page resident, the batches between probes are not advised; the
first probe that finds a page missing advises again at once. A store larger than the page
cache, or one evicted meanwhile, is advised as before within ``every`` batches; a page
evicted between probes is faulted in by its reader, never read wrong. A batch a reader took
before its advice is not probed (``SampleStore.advise``): its pages are cached because they
were just read.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import numpy as np

from loaderd.storage.syscalls import mincore

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE


class ResidencyProbe:
    """Decides, batch by batch, whether advising a map's ranges can be skipped.

    Args:
        base: the address of the map's first byte (file offset 0), page-aligned.
        every: one batch in ``every`` is probed with ``mincore``.
        trust: probes in a row that must find every page resident before advice is skipped.
    """

    def __init__(self, base: int, every: int = 16, trust: int = 2) -> None:
        if every < 1 or trust < 1:
            raise ValueError(f"`every` and `trust` must be >= 1, got {every}, {trust}")
        self.base = base
        self.every = every
        self.trust = trust
        self.enabled = True
        self.probes = 0
        self.skipped = 0  # batches not advised: their pages were found resident
        self._streak = 0  # probes in a row that found everything resident
        self._count = 0
        self._vec = np.zeros(64, np.uint8)

    def resident(self, starts: np.ndarray, lengths: np.ndarray) -> bool:
        """Whether to take these page-aligned file ranges as in the page cache (skip advice)."""
        if not self.enabled:
            return False
        self._count += 1
        if self._streak >= self.trust and self._count % self.every:
            self.skipped += 1
            return True
        self.probes += 1
        whole = self._probe(starts, lengths)
        self._streak = self._streak + 1 if whole else 0
        self.skipped += whole  # a probe that found every page cached advises nothing either
        return whole

    def _probe(self, starts: np.ndarray, lengths: np.ndarray) -> bool:
        """Whether every page of these ranges is in the page cache (``mincore``).

        One vector for the whole batch, its address taken once and checked once at the end:
        per range, only the system call. (A vector per range, its address and an ``all`` each,
        cost 35 us a range, 2.2 ms a probe of 64 records of 100 KB, against 9 us for the
        call.)
        """
        pages = -(-lengths // _PAGE)
        total = int(pages.sum())
        if len(self._vec) < total:
            self._vec = np.zeros(total, np.uint8)
        at = self._vec.ctypes.data
        for off, n, count in zip(starts.tolist(), lengths.tolist(), pages.tolist(), strict=True):
            if mincore(self.base + off, n, at) != 0:
                self.enabled = False
                logger.info(
                    "cannot ask which store pages are cached (mincore: %s): every batch is advised",
                    os.strerror(ctypes.get_errno()),
                )
                return False
            at += count
        return bool((self._vec[:total] & 1).all())
