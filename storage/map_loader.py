"""The whole store brought into a locked map in file order, when DRAM can hold all of it.

A DRAM tier with room for the whole of data.mdb locks the store's map (``SampleStore.lock_map``)
and holds each record as its pages, locked as they are mapped. Left to the epochs, pages are
mapped record by record in the plan's random order: a cold record is read from the disk at
the rate of random reads (and LMDB's map reads nothing ahead of a fault), and a warm one
costs the DRAM admission 11-14 us of mapping a 100 KB record whose pages the page cache
holds one by one, as every random reader leaves them.

Read in file order instead, a chunk at a time with the kernel's sequential hint, the file
streams from the disk at its sequential rate (3.4-4.0 GB/s on the development VM in a quiet
hour, against 1.4-1.8 GB/s for 32 threads of random 100 KB reads) into large folios, which a
map takes 2 MiB at a time: a warm record is then mapped in 0.2 us, and an admission finds
its pages mapped already. So the tier stack starts one ``MapLoader`` thread when it locks
the map, and the first epoch's records come from RAM as soon as the loader has passed them.
The thread lets go of the GIL for each chunk (``madvise`` waits for the disk) and stops at
``close``.

It runs only where the file fits in the memory available to the daemon (the machine's, or
its memory cgroup's where less: ``memory.memory_available``): a DRAM budget larger than the
machine or the container must not take all of its memory at start.

A daemon that may not lock pages (an ordinary user's ``RLIMIT_MEMLOCK``) holds the map
another way (``SampleStore.own_map``): the loader copies each chunk of the file into memory
of the daemon's own and moves it over the map's pages at the same addresses
(``syscalls.private_copy``, ``move_over``). LMDB and every view read the same bytes there,
from memory the kernel cannot take back as page cache. Left to each admission instead, a
record was copied into fresh heap memory, its first touch on the serving loop: a 3 KB warm
first epoch ran at 73-77 % of a locked map's speed. The copy is niced, as the admission
thread that copies is: it yields the cores to serving, and always progresses.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from loaderd.storage.admission import BACKGROUND_NICE
from loaderd.storage.syscalls import madvise, move_over, private_copy, unmap

logger = logging.getLogger(__name__)

MADV_RANDOM: Final = 1  # what LMDB asks of its map when opened without read-ahead
MADV_SEQUENTIAL: Final = 2
MADV_POPULATE_READ: Final = 22  # Linux 5.14
CHUNK_BYTES: Final = 64 << 20  # one madvise: 16-45 ms of a cold disk here, so close is prompt
_STOPPED: Final = -1  # ``_copy``: ``close`` came first, the chunk was not moved
MEMORY_SHARE: Final = 0.9  # of ``memory.memory_available()`` the file may take


def _background() -> None:
    """Lower this thread's CPU priority by ``BACKGROUND_NICE``: a copy yields to serving.

    Where the system refuses (not Linux), the thread keeps the daemon's priority.
    """
    tid = threading.get_native_id()
    try:
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
        )
    except OSError as e:
        logger.debug("the store's copy keeps the daemon's priority: %s", e)


class MapLoader:
    """Maps ``[address, address + length)`` of a file map in file order, on a thread of its own.

    Args:
        address: the first byte of the range (a page boundary) in this process.
        length: its length in bytes.
        label: names the map in log lines.
        on_done: called on the loader's thread once the whole range is mapped.
        chunk_bytes: bytes per system call (> 0, a multiple of the page size).
        copy_from: the mapped file: each chunk is read from it into memory of this process's
            own, which replaces the map's pages (``move_over``); None: the map's own pages
            are mapped (a locked map).
    """

    def __init__(
        self,
        address: int,
        length: int,
        *,
        label: str,
        on_done: Callable[[], None] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        copy_from: Path | None = None,
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes % os.sysconf("SC_PAGE_SIZE"):
            raise ValueError(f"`chunk_bytes` must be a positive number of pages, got {chunk_bytes}")
        self.address = address
        self.length = length
        self.label = label
        self.chunk_bytes = chunk_bytes
        self._on_done = on_done
        self._copy_from = copy_from
        self.loaded_bytes = 0
        self.seconds = 0.0
        self.error: str | None = None  # why it stopped short, if it did
        self._stop = threading.Event()
        self._moving = threading.Lock()  # a chunk's move, which ``close`` waits for
        self._thread = threading.Thread(target=self._run, name="loaderd-map-load", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the loader is still mapping (not done, not stopped)."""
        return self._thread.is_alive()

    @property
    def done(self) -> bool:
        """Whether the whole range is mapped."""
        return self.loaded_bytes >= self.length

    def _run(self) -> None:
        fd = -1
        if self._copy_from is not None:
            try:
                fd = os.open(self._copy_from, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                self.error = e.strerror
                logger.info("%s: cannot bring it into RAM: %s", self.label, e)
                return
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            _background()
        try:
            self._run_from(fd)
        finally:
            if fd >= 0:
                os.close(fd)

    def _run_from(self, fd: int) -> None:
        t0 = time.perf_counter()
        offset = 0
        while offset < self.length and not self._stop.is_set():
            n = min(self.chunk_bytes, self.length - offset)
            err = self._load(self.address + offset, n) if fd < 0 else self._copy(offset, n, fd)
            if err == errno.EINTR:
                continue  # a signal came: the same chunk again (what is done stays done)
            if err == _STOPPED:
                break
            if err:
                self.error = os.strerror(err)
                logger.info(
                    "%s: stopped bringing the store into RAM at %d of %d bytes (%s); the "
                    "rest comes in as records are read",
                    self.label,
                    offset,
                    self.length,
                    self.error,
                )
                break
            offset += n
            self.loaded_bytes = offset
            self.seconds = time.perf_counter() - t0
        if self.done:
            if self._on_done is not None:
                self._on_done()
            logger.info(
                "%s: the store is in RAM (%d MiB in %.1f s)",
                self.label,
                self.length >> 20,
                self.seconds,
            )

    def _copy(self, offset: int, length: int, fd: int) -> int:
        """Copy one chunk and move it over the map's pages; 0 or the error.

        Never once ``close`` has begun: the store's map may be gone after it, and its
        addresses mapped again to something else.
        """
        # The chunk and the next asked of the disk at once: the copy's faults would read
        # around each page alone. A cold 2 GB store copied at 1.5-1.6 GB/s in 6 runs of 10
        # (0.44-0.82 in the others), against 0.43-0.65 asking nothing (the locked map's
        # loader: 1.4).
        os.posix_fadvise(fd, offset, 2 * length, os.POSIX_FADV_WILLNEED)
        try:
            fresh = private_copy(length, fd, offset)
        except OSError as e:
            return e.errno or errno.EIO
        with self._moving:
            if self._stop.is_set():
                unmap(fresh, length)
                return _STOPPED
            try:
                move_over(fresh, length, self.address + offset)
            except OSError as e:
                return e.errno or errno.EIO
        return 0

    @staticmethod
    def _load(address: int, length: int) -> int:
        """Map one chunk, read ahead as a sequential stream; 0 or the error."""
        madvise(address, length, MADV_SEQUENTIAL)
        failed = madvise(address, length, MADV_POPULATE_READ) != 0
        err = ctypes.get_errno() if failed else 0
        madvise(address, length, MADV_RANDOM)  # back to LMDB's own hint for its faults
        return err

    def stats(self) -> dict[str, Any]:
        """``loaded_bytes``, ``total_bytes``, ``seconds`` so far, ``error`` (or None)."""
        return {
            "loaded_bytes": self.loaded_bytes,
            "total_bytes": self.length,
            "seconds": round(self.seconds, 3),
            "error": self.error,
        }

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop after the chunk under way (safe to call twice).

        Past ``timeout_s`` the thread is left to finish its chunk, but a copy is never moved
        over the map once this returns.
        """
        with self._moving:
            self._stop.set()
        self._thread.join(timeout_s)
