"""The memory system calls the storage layer makes through ctypes, and which keep the GIL.

A ctypes call through ``CDLL`` lets go of the GIL and must win it back afterwards, from
threads that copy batches with the GIL held (``loaderd/prefetch.py``): for a call of a few
microseconds that wait costs more than the call. So short calls that never wait for I/O go
through ``PyDLL`` and keep the GIL: ``mlock`` of a record just read (~10 us; letting go made
DRAM admission so slow that a store fitting in DRAM took three epochs to be all hits, one
now; a page reclaimed in between is read back with the GIL held, rare and only slower),
``munlock`` and ``mincore``. ``madvise(MADV_POPULATE_READ)`` waits for reads, so it lets go.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

_NAME = ctypes.util.find_library("c") or None
_keeping = ctypes.PyDLL(_NAME, use_errno=True)  # the GIL stays held during the call
_releasing = ctypes.CDLL(_NAME, use_errno=True)  # the GIL is let go during the call

mlock = _keeping.mlock
munlock = _keeping.munlock
mincore = _keeping.mincore
madvise = _releasing.madvise
for _f in (mlock, munlock):
    _f.argtypes, _f.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
mincore.argtypes, mincore.restype = (
    [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
    ctypes.c_int,
)
madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int


def address_of(view: memoryview) -> int:
    """Where a buffer's first byte lies in this process's memory."""
    return int(np.frombuffer(view, np.uint8).ctypes.data)
