"""Batches that miss DRAM, assembled by worker processes: the store's bytes, DRAM admission
behind them, a worker killed mid-epoch, and workers that never outlive their daemon."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from loaderd.client import LoaderdDataset
from loaderd.shm_ring import process_alive
from tests.helpers import Daemon, wait_until
from tests.integration.test_datapath import IMAGE, N, admitted, check_epoch, stats, store

pytestmark = pytest.mark.integration

__all__ = ["store"]  # the module's store fixture, shared


@pytest.mark.parametrize("procs", [2, 0])
def test_misses_from_worker_processes_are_the_stores_bytes(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path, procs: int
) -> None:
    # DRAM holds about half of the store: every epoch has batches that miss.
    extra = ["--dram-bytes", "1MiB", "--miss-procs", str(procs)]
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d:
        ds = LoaderdDataset(d.address, job="miss", batch_size=10)
        for _ in range(3):
            assert sorted(check_epoch(ds, store[1])) == list(range(N))
            admitted(d.address)
        if procs:  # workers start while the daemon serves the first batches itself
            wait_until(lambda: stats(d.address)["miss_workers"]["running"] == procs)
            assert sorted(check_epoch(ds, store[1])) == list(range(N))
            admitted(d.address)
        s = stats(d.address)
        workers, dram = s["miss_workers"], s["tiers"][0]
        assert workers["fallbacks"] == 0 and workers["lost"] == 0
        if procs:
            assert workers["batches"] > 0 and 1 <= workers["started"] <= procs
        else:
            assert workers["batches"] == workers["started"] == workers["running"] == 0
        # The records the workers read were admitted into DRAM, and hit there later.
        assert dram["items"] > 0 and dram["hits"] > 0
        assert s["backing"]["reads"] == dram["misses"]
        ds.close()


def test_records_workers_read_are_held_in_the_daemons_locked_map(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # DRAM holds the whole store: the daemon locks its map whole, and a page is held only
    # once it is mapped in the daemon, which never read these records itself.
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=["--dram-bytes", "64MiB"]) as d:
        ds = LoaderdDataset(d.address, job="held", batch_size=8)
        ds.connect()  # its HELLO starts the workers
        wait_until(lambda: stats(d.address)["miss_workers"]["running"] == 2)
        assert sorted(check_epoch(ds, store[1])) == list(range(N))
        dram = admitted(d.address)
        if not dram["map_locked"]:
            pytest.skip("the daemon may not lock the store's map here (RLIMIT_MEMLOCK)")
        assert dram["items"] == N and stats(d.address)["miss_workers"]["batches"] > 0
        assert d.proc is not None
        assert _mapped_kib(d.proc.pid, store[0] / "data.mdb") * 1024 >= N * IMAGE
        ds.close()


def _mapped_kib(pid: int, path: Path) -> int:
    """KiB of ``path`` mapped in process ``pid`` (``Rss`` of its mappings)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split(" ", 1)[0]:  # a mapping's first line
            inside = line.endswith(str(path.resolve()))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_killed_miss_worker_is_replaced_and_no_sample_is_lost(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    extra = ["--dram-bytes", "256KiB", "--prefetch", "1"]
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d:
        ds = LoaderdDataset(d.address, job="kill", batch_size=8)
        assert sorted(check_epoch(ds, store[1])) == list(range(N))
        wait_until(lambda: stats(d.address)["miss_workers"]["running"] == 2)
        before = stats(d.address)["miss_workers"]
        assert before["pids"]
        for pid in before["pids"]:
            os.kill(pid, signal.SIGKILL)
        for _ in range(20):  # the daemon serves while new workers start
            assert sorted(check_epoch(ds, store[1])) == list(range(N))  # exactly once, exact
            after = stats(d.address)["miss_workers"]
            if after["started"] > before["started"] and after["batches"] > before["batches"]:
                break
        assert after["lost"] >= 1 and after["fallbacks"] >= 1 and after["enabled"]
        assert after["batches"] > before["batches"], "new workers took batches again"
        assert after["pids"] and not set(after["pids"]) & set(before["pids"])
        ds.close()


def test_miss_workers_exit_with_their_daemon(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    d = Daemon(db=store[0], state_dir=tmp_path / "st", extra=["--dram-bytes", "256KiB"])
    with d:
        ds = LoaderdDataset(d.address, job="exit", batch_size=8)
        check_epoch(ds, store[1])
        wait_until(lambda: stats(d.address)["miss_workers"]["running"] == 2)
        workers = stats(d.address)["miss_workers"]
        pids = [*workers["pids"], workers["forker"]]
        assert len(pids) == 3 and all(process_alive(pid) for pid in pids)
        ds.close()
        d.kill()  # SIGKILL: no shutdown code runs
        for pid in pids:
            wait_until(lambda pid=pid: not process_alive(pid), what=f"miss worker {pid} to exit")
