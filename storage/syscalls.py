"""The memory system calls the storage layer makes through ctypes, and which keep the GIL.

A ctypes call through ``CDLL`` lets go of the GIL and must win it back afterwards, from
threads that copy batches with the GIL held (``loaderd/prefetch.py``): for a call of a few
microseconds that wait costs more than the call. So short calls that never wait for I/O go
through ``PyDLL`` and keep the GIL: ``mlock`` of a record just read (~10 us; letting go made
DRAM admission so slow that a store fitting in DRAM took three epochs to be all hits, one
now; a page reclaimed in between is read back with the GIL held, rare and only slower),
``munlock`` and ``mincore``. ``madvise(MADV_POPULATE_READ)`` waits for reads, so it lets go,
and ``populate_read`` maps a batch's records with one call (one wait for the GIL, not one
per record). ``msync`` waits for the disk, so it lets go too (``mmap.flush`` holds the GIL
for the whole write-back: every thread of the daemon stopped while the arena flushed).

A record is locked with ``mlock2(MLOCK_ONFAULT)`` where the C library has it: the record was
just read and checked, so its pages are mapped, and those are locked as ``mlock`` would; what
``mlock`` adds is a walk that faults in the range, a third of its cost (27 us of 100 KB against
9 us). A page reclaimed in between is locked when it is next read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading

import numpy as np
import pyarrow as pa

_NAME = ctypes.util.find_library("c") or None
_keeping = ctypes.PyDLL(_NAME, use_errno=True)  # the GIL stays held during the call
_releasing = ctypes.CDLL(_NAME, use_errno=True)  # the GIL is let go during the call

MLOCK_ONFAULT = 1
_mlock2 = getattr(_keeping, "mlock2", None)  # None: glibc before 2.27
munlock = _keeping.munlock
mincore = _keeping.mincore
madvise = _releasing.madvise
_msync = _releasing.msync
_msync.argtypes, _msync.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
MS_SYNC = 4
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
_syscall = _releasing.syscall
_syscall.restype = ctypes.c_long
# Each maps or moves a range of pages (and faults in a fresh one's): the GIL is let go.
_mmap, _mremap, _mprotect, _munmap = (
    _releasing.mmap,
    _releasing.mremap,
    _releasing.mprotect,
    _releasing.munmap,
)
_p, _n = ctypes.c_void_p, ctypes.c_size_t
_mmap.argtypes, _mmap.restype = (
    [_p, _n, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long],
    _p,
)
_mremap.argtypes, _mremap.restype = [_p, _n, _n, ctypes.c_int, _p], _p
_mprotect.argtypes, _mprotect.restype = [_p, _n, ctypes.c_int], ctypes.c_int
_munmap.argtypes, _munmap.restype = [_p, _n], ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
MAP_POPULATE = 0x8000
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
POPULATE_STEP = 2 << 20  # ``_populate_write``: ~1 ms a call here

MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14
# Numbered alike on every architecture (added after the tables were unified).
_SYS_PIDFD_OPEN, _SYS_PROCESS_MADVISE = 434, 440
_IOV_MAX = 1024


class _Self:
    """A pidfd of this process for ``process_madvise``, reopened after a fork; -1: none."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._fd = -1
        self.usable = True  # False once the kernel refused populating many ranges at once

    def fd(self) -> int:
        with self._lock:
            if self._pid != os.getpid():  # a fork: the inherited one names the parent
                self._pid = os.getpid()
                self._fd = int(_syscall(_SYS_PIDFD_OPEN, self._pid, 0))
                if self._fd < 0:
                    self.usable = False
            return self._fd


_self = _Self()


def populate_read(addresses: np.ndarray, lengths: np.ndarray) -> tuple[int, int]:
    """Map the pages of these ranges of a file map into this process.

    ``process_madvise(MADV_POPULATE_READ)`` on this process takes up to 1024 ranges a call
    (Linux 6.13 and later): one system call, and one wait to win the GIL back, for a batch's
    records, where ``madvise`` per record let the GIL go and waited for it 64 times a batch
    beside the busy server loop. The ranges go to the kernel as one numpy array of iovecs,
    with no Python step per range: on a node of many cores the admission thread's Python
    is GIL time the server loop waits for. Older kernels refuse it; then each range is
    advised alone. A page left unmapped is mapped (and, in a locked map, locked) when it
    is next read.

    Args:
        addresses: each range's first byte in this process (int64).
        lengths: each range's length in bytes.

    Returns:
        The system calls made, and the error of the range ``madvise`` refused (the ranges
        after it are left), or 0. An interrupted call (``EINTR``) is not a refusal.
    """
    iov = np.empty((len(addresses), 2), np.uint64)  # struct iovec: base, length
    iov[:, 0] = addresses
    iov[:, 1] = lengths
    calls = 0
    for lo in range(0, len(iov), _IOV_MAX):
        chunk = iov[lo : lo + _IOV_MAX]
        if _self.usable:
            fd = _self.fd()
            if fd >= 0:
                calls += 1
                ptr = ctypes.c_void_p(chunk.ctypes.data)
                done = _syscall(_SYS_PROCESS_MADVISE, fd, ptr, len(chunk), MADV_POPULATE_READ, 0)
                if done == int(chunk[:, 1].sum()):
                    continue
                if done < 0 and ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                    _self.usable = False
        for address, length in chunk.tolist():  # one by one (again, where one failed part way)
            calls += 1
            if madvise(address, length, MADV_POPULATE_READ) != 0:
                err = ctypes.get_errno()
                if err != errno.EINTR:
                    return calls, err
    return calls, 0


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


def private_copy(length: int, fd: int, offset: int) -> int:
    """Read-only pages of this process's own holding ``length`` bytes of a file from ``offset``.

    For ``move_over``: a copy to take the place of a file map's pages. It is made in a private
    map of that range of the file, whose every page is written to at once
    (``MADV_POPULATE_WRITE``): each page is copied from the page cache into a page of its own,
    one pass over memory (2.5-2.8 GB/s here, against 1.8-1.9 for reading the file into fresh
    anonymous memory, zeroed first, the way left for a kernel before 5.14). ``offset`` and
    ``length`` are whole pages; past the file's end the copy reads as zeros, as the map does.
    Returns the copy's address.

    Raises:
        OSError: the kernel refused (no memory, an I/O error); nothing is left mapped.
    """
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    fresh = _mmap(None, length, rw, mmap.MAP_PRIVATE, fd, offset)
    if fresh in (None, _MAP_FAILED):
        raise _errno_error("mmap")
    try:
        if _populate_write(fresh, length) != 0:
            if ctypes.get_errno() != errno.EINVAL:
                raise _errno_error("madvise")
            unmap(fresh, length)
            fresh = None
            fresh = _read_into_fresh(length, fd, offset)
        if _mprotect(fresh, length, mmap.PROT_READ) != 0:
            raise _errno_error("mprotect")
    except BaseException:
        if fresh is not None:
            unmap(fresh, length)
        raise
    return int(fresh)


def move_over(source: int, length: int, address: int) -> None:
    """Move the pages at ``source`` to ``address`` in one step, in the place of what lies there.

    ``mremap(MREMAP_FIXED)``: a thread reading ``[address, address + length)`` sees the old
    pages, then the moved ones, never a hole.

    Raises:
        OSError: the kernel refused; ``source`` is unmapped, ``address`` left as it was.
    """
    if _mremap(source, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, address) != address:
        err = _errno_error("mremap")
        unmap(source, length)
        raise err


def unmap(address: int, length: int) -> None:
    """``munmap`` of pages this module mapped (``private_copy``)."""
    _munmap(address, length)


def _errno_error(call: str) -> OSError:
    err = ctypes.get_errno() or errno.ENOMEM
    return OSError(err, f"{call}: {os.strerror(err)}")


def _populate_write(address: int, length: int) -> int:
    """``MADV_POPULATE_WRITE`` of a range, ``POPULATE_STEP`` bytes a call (0 or -1, ``errno``).

    A call holds the process's memory map lock throughout, and every ``mmap`` of the daemon
    (an allocation of a large array among them) waits for it: one call for a 64 MiB chunk
    held it ~25 ms, and fresh daemons' first epochs of 100 KB records, the copy under way,
    ran 28-34k samples/s against 36-39k in steps of 2 MiB (38-41k with the copy left until
    after the epoch).
    """
    for lo in range(0, length, POPULATE_STEP):
        if madvise(address + lo, min(POPULATE_STEP, length - lo), MADV_POPULATE_WRITE) != 0:
            return -1
    return 0


def _read_into_fresh(length: int, fd: int, offset: int) -> int:
    """Anonymous pages holding ``length`` bytes of the file from ``offset``, zeros past its end.

    Raises:
        OSError: no memory, or the read's error (nothing is left mapped).
    """
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    fresh = _mmap(None, length, rw, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_POPULATE, -1, 0)
    if fresh in (None, _MAP_FAILED):
        raise _errno_error("mmap")
    try:
        into = memoryview((ctypes.c_char * length).from_address(fresh)).cast("B")
        done = 0
        while done < length and (n := os.preadv(fd, [into[done:]], offset + done)):
            done += n
    except OSError:
        unmap(fresh, length)
        raise
    return int(fresh)


def msync(mm: mmap.mmap, start: int, length: int) -> None:
    """``msync(MS_SYNC)`` of a writable map's bytes ``[start, start + length)``.

    ``start`` lies on a page. The GIL is let go while the kernel writes the pages back.

    Raises:
        OSError: the kernel refused (an I/O error writing back, say).
    """
    if length <= 0:
        return
    export = ctypes.c_char.from_buffer(mm, start)  # the address; released before the wait
    addr = ctypes.addressof(export)
    del export
    if _msync(addr, length, MS_SYNC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"msync: {os.strerror(err)}")


def address_of(view: bytes | memoryview) -> int:
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
