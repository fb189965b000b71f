"""The memory system calls the storage layer makes through ctypes, and which keep the GIL.

A ctypes call through ``CDLL`` lets go of the GIL and must win it back afterwards, from
threads that copy batches with the GIL held (``loaderd/prefetch.py``): for a call of a few
microseconds that wait costs more than the call. So short calls that never wait for I/O go
through ``PyDLL`` and keep the GIL: ``mlock`` of a record just read (~10 us; letting go made
DRAM admission so slow that a store fitting in DRAM took three epochs to be all hits, one
now; a page reclaimed in between is read back with the GIL held, rare and only slower),
``munlock`` and ``mincore``. ``madvise(MADV_POPULATE_READ)`` waits for reads, so it lets go.

A record is locked with ``mlock2(MLOCK_ONFAULT)`` where the C library has it: the record was
just read and checked, so its pages are mapped, and those are locked as ``mlock`` would; what
``mlock`` adds is a walk that faults in the range, a third of its cost (27 us of 100 KB against
9 us). A page reclaimed in between is locked when it is next read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

import pyarrow as pa

_NAME = ctypes.util.find_library("c") or None
_keeping = ctypes.PyDLL(_NAME, use_errno=True)  # the GIL stays held during the call
_releasing = ctypes.CDLL(_NAME, use_errno=True)  # the GIL is let go during the call

MLOCK_ONFAULT = 1
_mlock2 = getattr(_keeping, "mlock2", None)  # None: glibc before 2.27
munlock = _keeping.munlock
mincore = _keeping.mincore
madvise = _releasing.madvise
_mlock = _keeping.mlock
for _f in (_mlock, munlock):
    _f.argtypes, _f.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
if _mlock2 is not None:
    _mlock2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _mlock2.restype = ctypes.c_int
mincore.argtypes, mincore.restype = (
    [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
    ctypes.c_int,
)
madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int


def mlock_onfault(address: int, length: int) -> int:
    """Lock a range's pages as they are mapped, reading none (0, or -1 with ``errno`` set).

    Unlike ``mlock`` there is no fallback: a plain ``mlock`` would read the whole range.
    """
    if _mlock2 is None:
        ctypes.set_errno(errno.ENOSYS)
        return -1
    return int(_mlock2(address, length, MLOCK_ONFAULT))


def mlock(address: int, length: int) -> int:
    """Lock the mapped pages of a range that was just read (0, or -1 with ``errno`` set)."""
    if _mlock2 is not None:
        if _mlock2(address, length, MLOCK_ONFAULT) == 0:
            return 0
        if ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL):  # a kernel before 4.4
            return -1
    return int(_mlock(address, length))


def address_of(view: memoryview) -> int:
    """Where a buffer's first byte lies in this process's memory.

    Through pyarrow: 0.2 us, against 2.4 for numpy's ``__array_interface__`` (a dict of
    formatted strings), and it runs once or more per record on the miss path.
    """
    return int(pa.py_buffer(view).address)


def mapped_at(path: os.PathLike[str] | str) -> int | None:
    """Where this process maps ``path`` from its first byte (``/proc/self/maps``); None: not."""
    try:
        st = os.stat(path)
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, _, offset, dev, inode = line.split(maxsplit=5)[:5]
                if int(inode) == st.st_ino and int(offset, 16) == 0:
                    major, minor = (int(x, 16) for x in dev.split(":"))
                    if os.makedev(major, minor) == st.st_dev:
                        return int(span.split("-")[0], 16)
    except (OSError, ValueError):
        return None
    return None
