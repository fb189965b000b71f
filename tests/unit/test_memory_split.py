"""How the daemon shares the memory it may fill between DRAM and its rings."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from loaderd.config import CacheConfig, DaemonConfig, ShmConfig
from loaderd.memory_split import HEADROOM_SHARE, RINGS_SHARE, MemorySplit, split_memory
from loaderd.storage.durability import VOLATILE_FS_TYPES, filesystem_type

MiB = 1 << 20


def _sizes(split: MemorySplit) -> tuple[int, int]:
    return split.dram_bytes, split.rings_bytes


def _config(dram: int, shm: ShmConfig | None = None, nvram_dir: Path | None = None) -> DaemonConfig:
    return DaemonConfig(
        db="db",
        socket="ipc:///tmp/x.sock",
        state_dir="s",
        cache=CacheConfig(dram_bytes=dram, nvram_dir=nvram_dir, nvram_bytes=256 * MiB),
        shm=shm or ShmConfig(max_bytes=1024 * MiB),
    )


def test_where_the_memory_holds_what_is_asked_nothing_is_lowered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, "loaderd.memory_split"):
        assert _sizes(split_memory(_config(2048 * MiB), room=16 << 30)) == (2048 * MiB, 1024 * MiB)
    assert not caplog.records


def test_in_a_small_room_the_rings_take_a_share_and_dram_what_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    room = 1000 * MiB
    with caplog.at_level(logging.INFO, "loaderd.memory_split"):
        split = split_memory(_config(3072 * MiB), room=room)
    assert split.rings_bytes == int(room * RINGS_SHARE)
    assert split.dram_bytes == int(room * (1 - HEADROOM_SHARE)) - split.rings_bytes
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == [
        f"--dram-bytes 3072 MiB lowered to {split.dram_bytes >> 20} MiB: this daemon may fill "
        "1000 MiB of memory now, beside 250 MiB of rings"
    ]


def test_an_arena_in_memory_counts_and_one_on_disk_does_not(tmp_path: Path) -> None:
    room = 1000 * MiB
    left = int(room * (1 - HEADROOM_SHARE)) - int(room * RINGS_SHARE)
    for folder in (tmp_path / "arena", Path("/dev/shm/loaderd-test-not-made")):
        if not folder.parent.is_dir():
            continue
        in_memory = filesystem_type(folder.parent) in VOLATILE_FS_TYPES
        dram = split_memory(_config(3072 * MiB, nvram_dir=folder), room=room).dram_bytes
        assert dram == left - (256 * MiB if in_memory else 0)
        assert not folder.exists()  # nothing made


def test_without_shared_memory_dram_may_take_the_rings_share() -> None:
    split = split_memory(_config(3072 * MiB, ShmConfig(enabled=False)), room=1000 * MiB)
    assert _sizes(split) == (int(1000 * MiB * (1 - HEADROOM_SHARE)), 0)
    assert split.rings_asked == 0 and split.dram_asked == 3072 * MiB


def test_a_room_too_small_for_anything_leaves_dram_empty_not_negative() -> None:
    assert _sizes(split_memory(_config(64 * MiB), room=0)) == (0, 0)
