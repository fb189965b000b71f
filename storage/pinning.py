"""Locking pages of the store's map in RAM, so the DRAM tier can hold a record without a copy.

A record read from LMDB is a view into the store's map: its bytes already sit in RAM, in the
page cache. Copying them into the daemon's heap to admit them into the DRAM tier costs a
pass over fresh memory (about 1.6 GB/s on a 4 KiB-page VM, against 12 GB/s for a copy into
memory already touched), the one copy a first epoch cannot share with anything. ``mlock`` on
the record's pages gives the same guarantee, that the record stays in RAM until the tier
drops it, for one system call. Where locking is not allowed (``RLIMIT_MEMLOCK`` of an
unprivileged daemon, 8 MiB by default), the tier copies as before; the first refusal is
logged once and locking is not tried again.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

from loaderd.storage.syscalls import mlock, munlock

logger = logging.getLogger(__name__)


def still_locked() -> None:
    """The unlock of a record whose pages stay locked as long as the store is open.

    Its map is locked whole (``SampleStore.lock_map``): nothing to undo. The DRAM tier keeps
    no object for such a record, only where it lies (``DramCache``).
    """


class PageLocks:
    """``mlock`` / ``munlock`` of page ranges, switched off for good at the first refusal."""

    def __init__(self) -> None:
        self.enabled = True
        self.locked_bytes = 0
        self._lock = threading.Lock()

    def lock(self, address: int, length: int) -> bool:
        """Lock ``[address, address + length)`` (page-aligned) in RAM; False if not allowed."""
        if not self.enabled:
            return False
        if mlock(address, length) != 0:
            err = ctypes.get_errno()
            self.enabled = False
            logger.info(
                "cannot lock store pages in RAM (%s): the DRAM tier copies records instead",
                os.strerror(err),
            )
            return False
        with self._lock:
            self.locked_bytes += length
        return True

    def unlock(self, address: int, length: int) -> None:
        """Undo one ``lock`` of exactly this range."""
        munlock(address, length)
        with self._lock:
            self.locked_bytes -= length
