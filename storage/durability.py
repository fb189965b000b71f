"""What survives what: probe a file for the arena's durability class, and map it accordingly.

Three classes, reported honestly (never call a volatile file persistent):

- ``pmem-sync``: a DAX file that accepts ``MAP_SHARED_VALIDATE | MAP_SYNC``; stores reach
  persistent memory once their cache lines are flushed.
- ``volatile``: tmpfs, ramfs, hugetlbfs (``/dev/shm``, CXL-backed DRAM): survives a process
  crash, not a power loss.
- ``file-msync``: anything else; pages are made durable with ``msync``.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import tempfile
from pathlib import Path
from typing import Final

from loaderd.storage.syscalls import msync

logger = logging.getLogger(__name__)

PMEM_SYNC: Final = "pmem-sync"
FILE_MSYNC: Final = "file-msync"
VOLATILE: Final = "volatile"
DURABILITY_CLASSES: Final = (PMEM_SYNC, FILE_MSYNC, VOLATILE)

# Linux has the values, Python's mmap module exports no constants for them.
MAP_SHARED_VALIDATE: Final = 0x03
MAP_SYNC: Final = 0x80000
MAP_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)

# File systems whose pages live only in RAM.
VOLATILE_FS_TYPES: Final = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})

_MOUNTINFO = Path("/proc/self/mountinfo")


def unescape_mount_field(field: str) -> str:
    """A path field of mountinfo, its octal escapes undone (space, tab, newline, backslash)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def filesystem_type(path: Path) -> str | None:
    """Return the type of the file system that holds ``path``, e.g. ``"ext4"`` or ``"tmpfs"``.

    The mount is found by the device number of ``path`` (exact even under bind mounts and
    mounts stacked on one point), falling back to the longest mount point that is a prefix
    of the resolved path.

    Args:
        path: An existing file or directory.

    Returns:
        The file system type from ``/proc/self/mountinfo``, or None where it cannot be read
        (not Linux, no procfs).
    """
    try:
        st = os.stat(path)
        text = _MOUNTINFO.read_text()
    except OSError as e:
        logger.debug("cannot determine the file system of %s: %s", path, e)
        return None
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    real = os.path.realpath(path)
    by_dev: str | None = None
    best_prefix, best_type = -1, None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or not rfields:
            continue
        fstype = rfields[0]
        if fields[2] == dev:
            by_dev = fstype  # later lines are mounted on top of earlier ones: keep the last
        mount_point = unescape_mount_field(fields[4])
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= best_prefix:
            best_prefix, best_type = len(mount_point), fstype
    return by_dev if by_dev is not None else best_type


def _map_sync_works(fd: int) -> bool:
    try:
        probe = mmap.mmap(
            fd,
            mmap.PAGESIZE,
            flags=MAP_SHARED_VALIDATE | MAP_SYNC,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    except OSError as e:
        # EOPNOTSUPP: not DAX; EINVAL: a kernel that predates MAP_SHARED_VALIDATE.
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            logger.debug("MAP_SYNC probe failed unexpectedly: %s", e)
        return False
    probe.close()
    return True


def probe_durability(path: Path) -> str:
    """Say what a file mapped at ``path`` survives.

    DAX is a per-file property, so the file itself is probed with a ``MAP_SYNC`` mapping.
    When the file is missing or shorter than a page, a temporary file in the same directory
    is probed instead (new files inherit the directory's DAX setting).

    Args:
        path: The arena file (or where it will be created; its directory must exist).

    Returns:
        ``"volatile"``, ``"pmem-sync"`` or ``"file-msync"``.
    """
    target = path if path.exists() else path.parent
    if filesystem_type(target) in VOLATILE_FS_TYPES:
        return VOLATILE
    try:
        if path.is_file() and path.stat().st_size >= mmap.PAGESIZE:
            fd = os.open(path, os.O_RDWR)
            try:
                ok = _map_sync_works(fd)
            finally:
                os.close(fd)
        else:
            with tempfile.TemporaryFile(dir=path.parent) as tmp:
                os.ftruncate(tmp.fileno(), mmap.PAGESIZE)
                ok = _map_sync_works(tmp.fileno())
    except OSError as e:
        logger.debug("cannot probe %s for MAP_SYNC: %s", path, e)
        ok = False
    return PMEM_SYNC if ok else FILE_MSYNC


def map_file(fd: int, length: int, durability: str) -> mmap.mmap:
    """Map ``length`` bytes of ``fd`` shared and writable, with ``MAP_SYNC`` on ``pmem-sync``.

    Args:
        fd: A file descriptor open for reading and writing.
        length: Bytes to map (the file must be at least this long).
        durability: The file's class from :func:`probe_durability`.

    Returns:
        The mapping.
    """
    flags = MAP_SHARED_VALIDATE | MAP_SYNC if durability == PMEM_SYNC else mmap.MAP_SHARED
    # The recovery scan reads the whole file at once: faulting it in up front is 3-10x faster
    # than page by page.
    flags |= MAP_POPULATE
    return mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def flush_range(mm: mmap.mmap, start: int, end: int, durability: str) -> None:
    """Make the bytes ``[start, end)`` of a mapping durable, as far as its class allows.

    Args:
        mm: The mapping.
        start: First byte written.
        end: One past the last byte written.
        durability: The mapping's class.
    """
    if durability == VOLATILE or end <= start:
        # tmpfs has nothing to write back; a process crash cannot lose stores already
        # made to a shared mapping, and a power loss loses everything anyway.
        return
    # On pmem-sync the right flush is a cache-line flush (clwb + sfence), which Python
    # cannot issue; msync on a DAX mapping makes the kernel flush those cache lines instead.
    page = mmap.PAGESIZE
    lo = start - start % page
    msync(mm, lo, end - lo)  # not mm.flush: that holds the GIL while the disk writes
