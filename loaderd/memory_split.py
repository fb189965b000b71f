"""How the daemon shares the memory it may fill between DRAM and its shared-memory rings.

Both are sized by their options (``--dram-bytes``, ``--shm-bytes``) and both take the
daemon's memory: a ring's pages and an arena in ``/dev/shm`` are charged to its memory
cgroup as its heap is. Where the memory the daemon may fill at start (``memory_available``:
the machine's, or its memory cgroup's room where less) cannot hold what they ask, each is
lowered, and the log says so: past a cgroup's limit the kernel kills the daemon mid-run. The
rings take at most ``RINGS_SHARE`` of that room, an arena in memory what it asks (it is
a file of that size), DRAM what is left after ``HEADROOM_SHARE`` for the daemon's own heap,
its miss workers' and page tables. On a machine of ordinary size with the defaults nothing
is lowered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaderd.config import DaemonConfig
from loaderd.storage.durability import VOLATILE_FS_TYPES, filesystem_type
from loaderd.storage.memory import memory_room

logger = logging.getLogger(__name__)

HEADROOM_SHARE = 0.1
RINGS_SHARE = 0.25


@dataclass(frozen=True)
class MemorySplit:
    """The bytes DRAM and all the shared-memory rings together may take, and from what."""

    dram_bytes: int
    rings_bytes: int
    room_bytes: int = 0  # the memory the daemon could fill at start
    bound: str | None = None  # the memory cgroup that set it (None: the machine)
    dram_asked: int = 0
    rings_asked: int = 0

    def stats(self) -> dict[str, Any]:
        """The ``memory`` section of ``loaderd stats``."""
        return {
            "room_bytes": self.room_bytes,
            "cgroup": self.bound,
            "dram_bytes": self.dram_bytes,
            "dram_asked_bytes": self.dram_asked,
            "rings_bytes": self.rings_bytes,
            "rings_asked_bytes": self.rings_asked,
        }


def split_memory(config: DaemonConfig, room: int | None = None) -> MemorySplit:
    """DRAM's and the rings' bytes for ``config``, within ``room`` (None: available now)."""
    group = None
    if room is None:
        room, group = memory_room()
    bound = str(group.path) if group else None
    where = f"this daemon's memory cgroup ({bound})" if bound else "this daemon"
    cache, shm = config.cache, config.shm
    arena = cache.nvram_bytes if cache.nvram_dir is not None and _in_memory(cache.nvram_dir) else 0
    rings = min(shm.max_bytes, int(room * RINGS_SHARE)) if shm.enabled else 0
    dram = min(cache.dram_bytes, max(0, int(room * (1 - HEADROOM_SHARE)) - rings - arena))
    if shm.enabled and rings < shm.max_bytes:
        _lowered("--shm-bytes", shm.max_bytes, rings, where, room, f"{RINGS_SHARE:.0%} of it")
    if dram < cache.dram_bytes:
        beside = f"beside {rings >> 20} MiB of rings" + (
            f" and {arena >> 20} MiB of arena in memory" if arena else ""
        )
        _lowered("--dram-bytes", cache.dram_bytes, dram, where, room, beside)
    asked_rings = shm.max_bytes if shm.enabled else 0
    return MemorySplit(dram, rings, room, bound, cache.dram_bytes, asked_rings)


def _in_memory(folder: Path) -> bool:
    """Whether files made in ``folder`` (or where it will be made) live in RAM (tmpfs)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return filesystem_type(folder) in VOLATILE_FS_TYPES


def _lowered(option: str, asked: int, given: int, where: str, room: int, why: str) -> None:
    # The rings seldom reach their cap, and a job whose ring no longer fits says so itself
    # (it goes over the socket): lowering that cap is news, lowering DRAM a warning.
    log = logger.info if option == "--shm-bytes" else logger.warning
    log(
        "%s %d MiB lowered to %d MiB: %s may fill %d MiB of memory now, %s",
        option,
        asked >> 20,
        given >> 20,
        where,
        room >> 20,
        why,
    )
