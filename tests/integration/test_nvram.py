"""The NVRAM tier in a real daemon: warm restart, kill -9 under writes, corruption, durability,
full disks and snapshots. Every check of bytes compares against the arrays the store was
ingested from.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loaderd.client import LoaderdDataset
from loaderd.client.errors import RemoteError
from tests.helpers import Daemon, make_npz, wait_until

pytestmark = pytest.mark.integration

N = 480
Data = tuple[Path, dict[str, np.ndarray]]


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Data:
    """3 KB samples: 1.5 MB in all, more than a small arena holds."""
    return _ingested(tmp_path_factory, "big", (3, 32, 32), seed=3)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Data:
    """20 KB samples of fixed fields: read into a slot's rows (``row_reads.py``)."""
    return _ingested(tmp_path_factory, "wide", (5, 64, 64), seed=4)


def _ingested(
    factory: pytest.TempPathFactory, name: str, shape: tuple[int, ...], seed: int
) -> Data:
    from loaderd.storage.ingest import ingest

    root = factory.mktemp(name)
    arrays = make_npz(root / f"{name}.npz", N, shape=shape, seed=seed)
    ingest(root / f"{name}.npz", root / f"{name}.db", progress=False)
    return root / f"{name}.db", arrays


def nvram(path: Path, size: str = "8MiB", *more: str) -> list[str]:
    return ["--nvram-dir", str(path), "--nvram-bytes", size, *more]


def epoch(d: Daemon, arrays: dict[str, np.ndarray], job: str = "j", **kw: Any) -> int:
    """Read one pass; every sample's bytes must equal the source arrays."""
    ds = LoaderdDataset(d.address, job=job, batch_size=32, **{"shm": False, **kw})
    n = 0
    try:
        for b in ds:
            ids = b["id"].numpy()
            assert np.array_equal(b["image"].numpy(), arrays["image"][ids])
            assert np.array_equal(b["label"].numpy(), arrays["label"][ids])
            n += len(ids)
    finally:
        ds.close()
    return n


def stats(d: Daemon) -> dict[str, Any]:
    ds = LoaderdDataset(d.address, job="stats", batch_size=1, shm=False)
    try:
        return ds.stats()
    finally:
        ds.close()


def settled(d: Daemon, items: int | None = None) -> None:
    """Wait until the arena writer has nothing queued (and holds ``items`` records)."""

    def ok() -> bool:
        a = stats(d)["tiers"][1]
        return a["pending_writes"] == 0 and (items is None or a["items"] == items)

    wait_until(ok, timeout_s=15, what="arena writes")


def test_warm_restart_serves_from_the_arena(dataset: Data, tmp_path: Path) -> None:
    db, arrays = dataset
    d = Daemon(
        db=db, state_dir=tmp_path / "s", extra=[*nvram(tmp_path / "nv"), "--dram-bytes", "0"]
    )
    try:
        d.start()
        assert epoch(d, arrays) == N
        settled(d, items=N)
        assert stats(d)["backing"]["reads"] == N
        d.stop()
        d.start()
        s = stats(d)
        assert s["tiers"][1]["recovered_items"] == N and s["tiers"][1]["items"] == N
        assert epoch(d, arrays) == N
        s = stats(d)
        assert s["tiers"][1]["hits"] == N and s["backing"]["reads"] == 0
        assert s["cache"]["hit_rate"] == 1.0
    finally:
        d.close()


def test_kill9_during_heavy_arena_writes_then_every_record_is_right(
    big: Data, tmp_path: Path
) -> None:
    db, arrays = big
    # LRU with a tiny DRAM: every miss demotes a record into a 1 MiB arena that wraps.
    extra = [*nvram(tmp_path / "nv", "1MiB"), "--dram-bytes", "16KiB", "--cache-policy", "lru"]
    d = Daemon(db=db, state_dir=tmp_path / "s", extra=extra)
    try:
        for round_ in range(3):
            d.start()
            ds = LoaderdDataset(d.address, job="j", batch_size=16, shm=False, reconnect_s=0)
            it = iter(ds)
            for _ in range(5 + 4 * round_):
                b = next(it)
                ids = b["id"].numpy()
                assert np.array_equal(b["image"].numpy(), arrays["image"][ids])
            d.kill()  # in the middle of writes queued for the arena
            ds._conn.close()
        d.start()
        a = stats(d)["tiers"][1]
        assert a["recovered_items"] > 0
        for _ in range(2):
            assert epoch(d, arrays, job="check") == N
            settled(d)  # the writer lets go of the GIL on a flush: the reads may run ahead
        s = stats(d)
        assert s["tiers"][1]["hits"] > 0 and s["tiers"][1]["ring_evictions"] > 0
    finally:
        d.close()


def flip_in_file(path: Path, needle: bytes, at: int) -> None:
    raw = path.read_bytes()
    off = raw.find(needle)
    assert off > 0, "the record's bytes are not in the arena file"
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, off + at)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), off + at)
    finally:
        os.close(fd)


def test_corrupt_arena_records_are_dropped_counted_and_read_from_the_store(
    big: Data, tmp_path: Path
) -> None:
    db, arrays = big
    arena = tmp_path / "nv" / "loaderd.arena"
    d = Daemon(
        db=db, state_dir=tmp_path / "s", extra=[*nvram(tmp_path / "nv"), "--dram-bytes", "0"]
    )
    try:
        d.start()
        assert epoch(d, arrays) == N
        settled(d, items=N)
        d.stop()
        # Stopped daemon: the recovery scan finds the bad payload and drops it.
        flip_in_file(arena, arrays["image"][7].tobytes(), 100)
        d.start()
        a = stats(d)["tiers"][1]
        assert a["recovery_dropped"] == 1 and a["items"] == N - 1
        assert epoch(d, arrays) == N
        assert stats(d)["backing"]["reads"] == 1  # sample 7, from the store
        settled(d, items=N)
        # Running daemon: the bytes change under the mapping; the read-time check drops it.
        flip_in_file(arena, arrays["image"][11].tobytes(), 5)
        assert epoch(d, arrays) == N
        s = stats(d)
        assert s["tiers"][1]["corrupt_dropped"] == 1 and s["cache"]["corrupt_dropped"] == 1
        assert s["backing"]["reads"] == 2
    finally:
        d.close()


@pytest.mark.parametrize("data", ["big", "wide"])
def test_miss_workers_copy_arena_records_and_a_bad_one_is_read_from_the_store(
    data: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Every record lives in the arena after the first pass (no DRAM): the workers copy the
    # next passes from the arena file, lent to them, and verify each record themselves;
    # 20 KB records of fixed fields straight into their rows of the slot.
    db, arrays = request.getfixturevalue(data)
    arena = tmp_path / "nv" / "loaderd.arena"
    extra = [*nvram(tmp_path / "nv", "32MiB"), "--dram-bytes", "0", "--miss-procs", "2"]
    d = Daemon(db=db, state_dir=tmp_path / "s", extra=extra)
    try:
        d.start()
        assert epoch(d, arrays, shm=True) == N
        wait_until(lambda: stats(d)["miss_workers"]["running"] == 2, what="miss workers")
        settled(d, items=N)
        assert epoch(d, arrays, shm=True) == N
        s = stats(d)
        workers, nv = s["miss_workers"], s["tiers"][1]
        assert workers["from_arena"] > 0 and workers["fallbacks"] == 0
        # 20 KB: every batch a worker took was read into its rows, those lent arena records too.
        assert workers["read"] == (workers["batches"] if data == "wide" else 0)
        assert nv["hits"] == N
        assert s["backing"]["reads"] == N  # the daemon read none of them again
        # A record whose bytes change in the file: the worker's check fails it, the daemon
        # reads the batch itself, drops the record from the arena and serves the store's.
        flip_in_file(arena, arrays["image"][11].tobytes(), 5)
        assert epoch(d, arrays, shm=True) == N
        s = stats(d)
        assert s["miss_workers"]["fallbacks"] >= 1
        assert s["tiers"][1]["corrupt_dropped"] == 1 and s["backing"]["reads"] == N + 1
        assert s["tiers"][1]["lent"] == 0  # every loan came back
    finally:
        d.close()


def stats_cli(d: Daemon) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "loaderd", "stats", "--json", "--socket", d.address],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return dict(json.loads(out.stdout))


@pytest.mark.parametrize("where", ["/dev/shm", "tmp"])
def test_durability_is_reported_honestly_by_loaderd_stats(
    dataset: Data, tmp_path: Path, where: str
) -> None:
    base = Path(where) if where != "tmp" else tmp_path
    if where == "/dev/shm" and not os.access(where, os.W_OK):
        pytest.skip("no writable /dev/shm")
    nv = base / f"ld-nv-{os.getpid()}-{time.monotonic_ns()}"
    d = Daemon(db=dataset[0], state_dir=tmp_path / "s", extra=nvram(nv, "2MiB"))
    try:
        d.start()
        tier = stats_cli(d)["tiers"][1]
        if where == "/dev/shm":
            assert tier["durability"] == "volatile"
        else:
            assert tier["durability"] != "pmem-sync"  # no DAX here: never claimed
            assert tier["durability"] in ("file-msync", "volatile")
    finally:
        d.close()
        if nv.exists():
            for f in nv.iterdir():
                f.unlink()
            nv.rmdir()


def test_a_full_disk_is_a_clear_error_and_a_full_arena_only_evicts(
    dataset: Data, tmp_path: Path
) -> None:
    db, arrays = dataset
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=False
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip("cannot mount a 1 MiB tmpfs (needs root)")
    try:
        d = Daemon(db=db, state_dir=tmp_path / "s", extra=nvram(mnt, "4MiB"))
        with pytest.raises(Exception, match="exited with 1"):
            d.start()
        log = d.log.read_text()
        assert "loaderd: error: no room for the 4194304-byte arena" in log
        assert "Traceback" not in log
        d.close()
        # An arena that fits the 1 MiB file system works; the store is bigger than its log.
        d = Daemon(db=db, state_dir=tmp_path / "s2", extra=nvram(mnt, "512KiB"))
        try:
            d.start()
            for _ in range(2):
                assert epoch(d, arrays) == N
        finally:
            d.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_snapshots_refused_without_an_arena(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="j", batch_size=8, shm=False)
    try:
        with pytest.raises(RemoteError, match="--nvram-dir"):
            ds.save_snapshot({"w": torch.zeros(3)}, step=1)
    finally:
        ds.close()


def test_snapshot_round_trip_cli_and_too_large(dataset: Data, tmp_path: Path) -> None:
    d = Daemon(db=dataset[0], state_dir=tmp_path / "s", extra=nvram(tmp_path / "nv", "2MiB"))
    try:
        d.start()
        assert LoaderdDataset.load_snapshot(d.address, "j") is None
        ds = LoaderdDataset(d.address, job="j", batch_size=8, shm=False)
        ds.save_snapshot({"w": torch.arange(10), "step": 3}, step=3)
        with pytest.raises(RemoteError, match="snapshot slots hold"):
            ds.save_snapshot({"w": torch.zeros(1 << 20)}, step=4)  # 4 MB > a 256 KiB slot
        ds.close()
        wait_until(lambda: stats(d)["snapshots"]["newest"] is not None, what="snapshot")
        snap = stats(d)["snapshots"]
        assert snap["newest"]["step"] == 3 and snap["durability"] in ("file-msync", "volatile")
        got = LoaderdDataset.load_snapshot(d.address, "j")
        assert got["step"] == 3 and torch.equal(got["w"], torch.arange(10))
        out = tmp_path / "snap.pt"
        cmd = [sys.executable, "-m", "loaderd", "snapshot", "get", "--job", "j", "--out", str(out)]
        r = subprocess.run(
            [*cmd, "--socket", d.address], capture_output=True, text=True, timeout=30
        )
        assert r.returncode == 0 and "step 3" in r.stdout
        assert torch.equal(torch.load(out)["w"], torch.arange(10))
        cmd[6] = "nobody"
        r = subprocess.run(
            [*cmd, "--socket", d.address], capture_output=True, text=True, timeout=30
        )
        assert r.returncode == 1 and "no snapshot of job 'nobody'" in r.stderr
    finally:
        d.close()


def test_snapshot_is_whole_after_kill9_during_its_write(dataset: Data, tmp_path: Path) -> None:
    extra = nvram(tmp_path / "nv", "80MiB", "--snapshot-bytes", "64MiB")
    d = Daemon(db=dataset[0], state_dir=tmp_path / "s", extra=extra)
    rng = random.Random(0)
    try:
        d.start()
        step = 1
        ds = LoaderdDataset(d.address, job="j", batch_size=8, shm=False)
        ds.save_snapshot(
            {"step": step, "w": torch.full((6 << 20,), step, dtype=torch.int32)}, step=step
        )
        ds.close()
        wait_until(lambda: stats(d)["snapshots"]["written"] == 1, what="first snapshot")
        seen = set()
        for _ in range(4):
            ds = LoaderdDataset(d.address, job="j", batch_size=8, shm=False)
            ds.save_snapshot(
                {"step": step + 1, "w": torch.full((6 << 20,), step + 1, dtype=torch.int32)},
                step + 1,
            )
            time.sleep(rng.uniform(0.0, 0.06))  # the 24 MB write is under way, or about to be
            d.kill()
            ds._conn.close()
            d.start()
            got = LoaderdDataset.load_snapshot(d.address, "j")
            assert got is not None and got["step"] in (step, step + 1)
            assert torch.all(got["w"] == got["step"])  # whole: never a mix of the two
            seen.add(got["step"] - step)
            step = got["step"]
        print("new snapshot survived the kill in", sum(seen), "of the rounds' outcomes", seen)
    finally:
        d.close()
