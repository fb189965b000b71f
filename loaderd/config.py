"""The daemon's configuration: frozen, keyword-only, validated where it is built."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from loaderd.importance import ImportanceConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?))?B?\s*$", re.IGNORECASE)
_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``2GiB``, ``512MB``, ``64k`` or ``1048576``.

    ``KiB/MiB/GiB`` are powers of 1024; ``KB/MB/GB`` and bare ``K/M/G`` are too, because a
    cache is sized against memory, which is counted in powers of two.

    Raises:
        ValueError: the text is not a size.
    """
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. 512MiB, 2GiB, 1048576)")
    number, unit, _ = m.groups()
    return int(float(number) * (1024 ** _UNITS[(unit or "").upper()]))


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheConfig:
    """The cache tiers in front of the store (see ``storage/tiers.py``)."""

    dram_bytes: int = 2 << 30
    nvram_dir: Path | None = None  # where the arena file lives; None: no NVRAM tier
    nvram_bytes: int = 8 << 30  # the arena file's size, snapshot region included
    snapshot_bytes: int | None = None  # the snapshot region (two slots); None: a quarter
    policy: str = "importance"

    def __post_init__(self) -> None:
        from loaderd.storage.policies import POLICIES

        if self.dram_bytes < 0:
            raise ValueError(f"`dram_bytes` must be >= 0, got {self.dram_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(
                f"`cache_policy` must be one of {', '.join(POLICIES)}, got {self.policy!r}"
            )
        if self.nvram_bytes < 256 << 10:
            raise ValueError(f"`nvram_bytes` must be at least 256 KiB, got {self.nvram_bytes}")
        snap = self.snapshot_bytes
        if snap is not None and not (snap == 0 or 16384 <= snap <= self.nvram_bytes - (64 << 10)):
            raise ValueError(
                f"`snapshot_bytes` must be 0 or in [16 KiB, nvram_bytes - 64 KiB], got {snap}"
            )

    @property
    def snapshot_region_bytes(self) -> int:
        """Bytes of the arena reserved for the two snapshot slots."""
        if self.snapshot_bytes is not None:
            return self.snapshot_bytes
        return self.nvram_bytes // 4


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefetchConfig:
    """How far ahead of demand batches are assembled, and by how many threads."""

    depth: int = 8  # batches assembled ahead of the first unassigned one, per rank and pass
    workers: int = 2  # assembly threads (LMDB reads and copies release the GIL)

    def __post_init__(self) -> None:
        if self.depth < 0:
            raise ValueError(f"`depth` must be >= 0, got {self.depth}")
        if self.workers < 1:
            raise ValueError(f"`workers` must be >= 1, got {self.workers}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShmConfig:
    """Same-host delivery through a shared-memory ring (``loaderd.shm_delivery``)."""

    enabled: bool = True
    slots: int | None = None  # None: ``auto_slots``, within a share of /dev/shm
    slot_bytes: int | None = None  # None: one batch of the first shm job's batch size
    auto_slots: int = 32

    def __post_init__(self) -> None:
        if self.slots is not None and not 1 <= self.slots <= 65536:
            raise ValueError(f"`shm_slots` must be in 1..65536, got {self.slots}")
        if self.slot_bytes is not None and self.slot_bytes <= 0:
            raise ValueError(f"`shm_slot_bytes` must be positive, got {self.slot_bytes}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonConfig:
    """Everything ``loaderd serve`` needs; each part goes to the object that uses it."""

    db: Path
    socket: str
    state_dir: Path
    cache: CacheConfig = field(default_factory=CacheConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    importance: ImportanceConfig = field(default_factory=ImportanceConfig)  # jobs' defaults
    shm: ShmConfig = field(default_factory=ShmConfig)
    max_batch_size: int = 65536
    # A consumer silent this long is gone and its batches go back to its rank (a local
    # consumer whose process exited is noticed at once, see loaderd.consumers).
    consumer_timeout_s: float = 600.0
    # A second, authenticated endpoint for other hosts: tcp:// with CURVE keys (loaderd.auth).
    tcp: str | None = None
    curve_dir: Path | None = None

    def __post_init__(self) -> None:
        if not self.socket.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(
                f"`socket` must be an ipc://, tcp:// or inproc:// address, got {self.socket!r}"
            )
        if self.socket.startswith("ipc://") and len(self.socket) - 6 > 100:
            # sockaddr_un holds 107 bytes; longer ipc paths fail late and obscurely in libzmq.
            raise ValueError(f"`socket` path is longer than 100 characters: {self.socket}")
