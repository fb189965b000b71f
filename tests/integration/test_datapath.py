"""The data path against a real daemon: the store's bytes on every path, the read-ahead's
budget and its stop when a trainer stops, and rings for jobs of different batch sizes."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.protocol import MsgType
from loaderd.client.shm import SHM_DIR
from loaderd.consumers import pid_namespace
from loaderd.stats import format_table, human_bytes
from loaderd.storage.records import Field, RecordCodec, Schema
from loaderd.storage.store_writer import StoreWriter
from tests.helpers import Daemon, evict, wait_until

pytestmark = pytest.mark.integration

N = 96
IMAGE = 20_000  # above the size whose DRAM copy is a locked view of the store's pages


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A store with a large fixed field, a label and a variable-length tag; its samples."""
    schema = Schema(
        (Field("image", "uint8", (IMAGE,)), Field("label", "int64"), Field("tag", "binary"))
    )
    codec = RecordCodec(schema)
    rng = np.random.default_rng(3)
    samples = [
        {
            "image": rng.integers(0, 256, IMAGE, dtype=np.uint8),
            "label": i * 7,
            "tag": rng.bytes(int(rng.integers(0, 300))),
        }
        for i in range(N)
    ]
    path = tmp_path_factory.mktemp("dp") / "s.db"
    with StoreWriter(path, schema) as w:
        w.append(codec.encode(s) for s in samples)
    return path, samples


def resident_bytes(db: Path) -> int:
    """Bytes of data.mdb in the page cache (mincore)."""
    path = db / "data.mdb"
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        addr = np.frombuffer(mm, np.uint8).ctypes.data
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        resident = sum(v & 1 for v in vec)
        del addr
    return resident * mmap.PAGESIZE


def mapped_bytes(d: Daemon, db: Path) -> int:
    """Bytes of data.mdb mapped into the daemon (its map's Rss in ``/proc/<pid>/smaps``)."""
    assert d.proc is not None
    rss, ours = 0, False
    with open(f"/proc/{d.proc.pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                ours = line.rstrip().endswith(str((db / "data.mdb").resolve()))
            elif ours and line.startswith("Rss:"):
                rss += int(head[1]) << 10
    return rss


def check_epoch(ds: LoaderdDataset, samples: list[dict[str, Any]]) -> list[int]:
    """Iterate one pass, comparing every sample with what was stored; returns the ids."""
    seen: list[int] = []
    for batch in ds:
        for row, sid in enumerate(batch["id"].tolist()):
            want = samples[sid]
            np.testing.assert_array_equal(batch["image"][row].numpy(), want["image"])
            assert int(batch["label"][row]) == want["label"]
            assert batch["tag"][row] == want["tag"]
        seen += batch["id"].tolist()
    return seen


def stats(address: str) -> dict[str, Any]:
    with Connection(address) as c:
        return dict(c.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta)


def admitted(address: str) -> dict[str, Any]:
    """Wait until the daemon's DRAM admission queue is empty; its DRAM tier's stats."""
    wait_until(
        lambda: stats(address)["tiers"][0].get("admit_queue_bytes", 0) == 0,
        what="the DRAM admissions queued behind the serving path",
    )
    return dict(stats(address)["tiers"][0])


@pytest.fixture
def served(store: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> Iterator[Daemon]:
    evict(store[0])  # the first epoch is a cold one, read ahead of the trainer: DRAM holds
    # the whole store, which is not brought in at start here (``--no-dram-load``)
    extra = ["--dram-bytes", "8MiB", "--no-dram-load"]
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d:
        yield d


def test_store_bytes_cold_hit_socket_and_shm(
    served: Daemon, store: tuple[Path, list[dict[str, Any]]]
) -> None:
    samples = store[1]
    ds = LoaderdDataset(served.address, job="exact", batch_size=10)
    assert sorted(check_epoch(ds, samples)) == list(range(N))  # cold: read ahead, then read
    admitted(served.address)  # DRAM admission runs behind the serving path
    inline = stats(served.address)["daemon"]["assembled_inline"]
    assert sorted(check_epoch(ds, samples)) == list(range(N))  # hits: DRAM (locked views)
    s = ds.stats()
    # Every batch of the hit epoch (200 KB, all in DRAM) was assembled on the server loop,
    # its 20 KB rows by the compiled copy.
    assert s["daemon"]["assembled_inline"] - inline >= N // 10
    assert s["daemon"]["row_copy"] == "compiled"
    ra = s["readahead"]
    assert ra["advised_records"] > 0 and ra["indexed"]
    assert ra["advise_calls"] <= ra["advised_records"]  # neighbours share a call
    # The read-ahead advised, or found the pages cached already: a batch the serving path
    # reached first was advised by the read itself (``advise_known``) and is resident by then.
    assert ra["advise_calls"] + ra["advice_skipped"] > 0
    assert s["shm"]["delivered"] > 0 and s["shm"]["socket_fallbacks"] == 0
    assert s["tiers"][0]["hits"] >= N
    ds.close()
    sock = LoaderdDataset(served.address, job="exact-socket", batch_size=7, shm=False)
    assert sorted(check_epoch(sock, samples)) == list(range(N))
    assert sock.stats()["daemon"]["assembled_inline"] - s["daemon"]["assembled_inline"] >= N // 7
    sock.close()


def test_store_bytes_through_the_arena(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    extra = [
        "--dram-bytes", "200KiB", "--nvram-dir", str(tmp_path / "nv"), "--nvram-bytes", "8MiB",
        "--cache-policy", "lru",
    ]  # fmt: skip
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d:
        ds = LoaderdDataset(d.address, job="arena", batch_size=12)
        for _ in range(3):
            assert sorted(check_epoch(ds, store[1])) == list(range(N))
        arena = ds.stats()["tiers"][1]
        assert arena["hits"] > 0, arena
        ds.close()


def test_readahead_budget_and_a_trainer_that_stops(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    db = store[0]
    budget = 128 << 10  # about 6 records
    # No miss workers: the daemon reads this pass itself, so its window is mapped ahead too
    # (a pass miss workers read is advised only: ``test_readahead.py``).
    extra = [
        "--dram-bytes", "0", "--readahead-bytes", str(budget), "--prefetch", "1",
        "--miss-procs", "0",
    ]  # fmt: skip
    evict(db)
    with Daemon(db=db, state_dir=tmp_path / "st", extra=extra) as d:
        wait_until(lambda: stats(d.address)["readahead"]["indexed"], what="the value index")
        opened = resident_bytes(db)  # what opening the store read (meta and tree pages)
        mapped = mapped_bytes(d, db)  # and what it mapped
        ds = LoaderdDataset(d.address, job="stop", batch_size=2, prefetch=1)
        it = iter(ds)
        for _ in range(3):
            next(it)  # the trainer takes three batches, then stops without a word

        # Settled: idle with a window, and unchanged for half a second. One idle instant is not
        # enough: the daemon may yet assemble its batch ahead, which moves the pass's head and
        # frees room in the window for one more batch.
        last: dict[str, Any] = {}

        def settled() -> bool:
            s = stats(d.address)
            ra = s["readahead"]
            now = (ra["advised_bytes"], ra["window_bytes"], s["jobs"]["stop"]["batches_served"])
            if ra["busy"] or not ra["window_bytes"] or last.get("state") != now:
                last.update(state=now, since=time.monotonic())
                return False
            return bool(time.monotonic() - last["since"] >= 0.5)

        wait_until(settled, what="the read-ahead to fill its window and stop")
        s = stats(d.address)
        ra = s["readahead"]
        assert ra["peak_window_bytes"] <= budget
        # What was read ahead: the batches handed out or being assembled, plus the window.
        batch_bytes = 2 * (IMAGE + 512)  # records of at most 20 KB + label + tag (< 300 B)
        handed = (3 + 1 + 1 + 1) * batch_bytes  # taken, in flight, assembled ahead, current
        assert ra["advised_bytes"] <= handed + budget
        total = (db / "data.mdb").stat().st_size
        # Records take whole pages: up to 4 KiB more each than their bytes.
        slack = (handed + budget) // (IMAGE // 4096)
        assert resident_bytes(db) - opened <= handed + budget + slack < total // 2
        # The window is mapped into the daemon ahead of its reader, within the same bound.
        # Only advised records are mapped, and only pages the page cache holds (bounded above);
        # a reader's fault may also map cached neighbours of its record (fault-around), so
        # the mapping is bounded by what is resident rather than by the records alone.
        assert 0 < ra["prefaulted_records"] <= ra["advised_records"] and ra["prefault_calls"] > 0
        assert 0 < mapped_bytes(d, db) - mapped <= resident_bytes(db)
        # Nothing runs for a pass nobody reads: a second later the same bytes are advised.
        wait_until(lambda: stats(d.address)["uptime_s"] > s["uptime_s"] + 1.0, what="a second")
        again = stats(d.address)["readahead"]
        assert again["advised_bytes"] == ra["advised_bytes"] and not again["busy"]
        assert again["prefaulted_records"] == ra["prefaulted_records"]
        it.close()
        ds.close()


def test_jobs_of_different_batch_sizes_both_use_shared_memory(
    served: Daemon, store: tuple[Path, list[dict[str, Any]]]
) -> None:
    small = LoaderdDataset(served.address, job="small", batch_size=2)
    assert len(check_epoch(small, store[1])) == N  # the first job sizes the first ring
    big = LoaderdDataset(served.address, job="big", batch_size=48)
    assert len(check_epoch(big, store[1])) == N
    s = big.stats()["shm"]
    assert s["socket_fallbacks"] == 0 and s["delivered"] == N // 2 + N // 48
    assert len(s["rings"]) == 2 and s["rings"][1]["slot_bytes"] >= 48 * IMAGE
    small.close()
    big.close()


def test_the_first_ring_leaves_room_for_a_later_job_with_bigger_batches(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """32 slots for the first job would take nearly all of the cap; it takes about half, and
    a later job whose batches are three times as large still gets shared memory."""
    cap = 24 << 20
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=["--shm-bytes", str(cap)]) as d:
        first = LoaderdDataset(d.address, job="first", batch_size=12)
        assert sorted(check_epoch(first, store[1])) == list(range(N))
        ring = stats(d.address)["shm"]["rings"][0]
        assert 32 * ring["slot_bytes"] > cap * 0.9, "the cap is tight for 32 of its slots"
        assert ring["slots"] * ring["slot_bytes"] <= cap // 2 + ring["slot_bytes"]
        later = LoaderdDataset(d.address, job="later", batch_size=36)
        assert sorted(check_epoch(later, store[1])) == list(range(N))
        s = stats(d.address)["shm"]
        assert not s["socket_jobs"] and s["socket_fallbacks"] == 0
        assert len(s["rings"]) == 2 and s["rings"][1]["slot_bytes"] >= 36 * IMAGE
        assert sum((SHM_DIR / r["name"]).stat().st_size for r in s["rings"]) <= cap
        table = format_table(stats(d.address))  # `loaderd stats`: each ring as it is
        print("TABLE", s["rings"], table)
        for r in s["rings"]:
            assert f"{r['slots']} slots of {human_bytes(r['slot_bytes'])}" in table
        first.close()
        later.close()


def test_a_full_ring_borrows_free_slots_of_a_larger_one(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Rings of four slots and three batches read ahead: a job's own ring cannot hold what it
    has in flight, and the batches past it go into free slots of another job's larger ring,
    not over the socket."""
    extra = ["--shm-slots", "4", "--prefetch", "3"]
    with (
        Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d,
        Connection(d.address) as wide,
    ):
        hello = {"job": "wide", "rank": 0, "world_size": 1, "seed": 0, "batch_size": 24}
        hello |= {"options": {}, "pid": os.getpid(), "pidns": pid_namespace(), "shm": True}
        wide.request(MsgType.HELLO, hello, expect=MsgType.WELCOME)  # a ring, nothing read yet
        narrow = LoaderdDataset(d.address, job="narrow", batch_size=4, prefetch=1)
        for _ in range(2):
            assert sorted(check_epoch(narrow, store[1])) == list(range(N))
        s = stats(d.address)["shm"]
        assert [r["slots"] for r in s["rings"]] == [4, 4]
        assert s["rings"][0]["slot_bytes"] > s["rings"][1]["slot_bytes"]
        assert s["socket_fallbacks"] == 0 and s["ring_full"] == 0
        assert s["delivered"] == 2 * N // 4
        narrow.close()


@pytest.mark.parametrize("queue", ["1", "0"])
def test_dram_admission_behind_serving_or_inline(
    queue: str, store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # "1": a queue smaller than one record, so a batch's admissions but one are dropped (the
    # serving path never waits for it); "0": admission during the read, as a fallback. Not
    # loaded whole at start: records of a map all mapped are admitted by the read, not queued.
    db, samples = store
    with open(db / "data.mdb", "rb") as f:  # a warm miss: page cache warm, DRAM empty
        while f.read(1 << 20):
            pass
    extra = ["--dram-bytes", "8MiB", "--dram-admit-queue", queue, "--no-dram-load"]
    with Daemon(db=db, state_dir=tmp_path / "st", extra=extra) as d:
        ds = LoaderdDataset(d.address, job="admit", batch_size=8)
        assert sorted(check_epoch(ds, samples)) == list(range(N))
        dram = admitted(d.address)
        if queue == "0":
            assert "admit_dropped" not in dram and dram["items"] == N
        else:
            assert dram["admit_dropped"] > 0 and dram["admitted_late"] > 0
            assert dram["items"] == dram["admitted_late"] == N - dram["admit_dropped"]
        hits = dram["hits"]
        for _ in range(3):  # the store's bytes whether a sample is in DRAM yet or not
            assert sorted(check_epoch(ds, samples)) == list(range(N))
            dram = admitted(d.address)
        assert dram["hits"] > hits and dram["items"] > 0
        ds.close()


@pytest.mark.parametrize("lock", [True, False])
def test_dram_holds_the_stores_locked_pages_or_copies(
    lock: bool, store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    db, samples = store
    flag = "--dram-lock-pages" if lock else "--no-dram-lock-pages"
    with Daemon(db=db, state_dir=tmp_path / "st", extra=["--dram-bytes", "8MiB", flag]) as d:
        ds = LoaderdDataset(d.address, job="lock", batch_size=8)
        assert sorted(check_epoch(ds, samples)) == list(range(N))
        dram = admitted(d.address)
        if lock and not dram["pinned"]:
            pytest.skip("this daemon may not lock pages (RLIMIT_MEMLOCK)")
        assert dram["items"] == N and (dram["pinned"] == N if lock else dram["pinned"] == 0)
        assert sorted(check_epoch(ds, samples)) == list(range(N))  # hits: the stored bytes
        assert admitted(d.address)["hits"] >= N
        ds.close()


def restart_under_queued_requests(d: Daemon, ds: LoaderdDataset) -> list[int]:
    """One pass of ``ds`` (prefetch 2), the daemon killed and started again once it has
    answered every request it got: the next ones wait in ZeroMQ's queue, which hands them to
    the new daemon by itself. The ids the pass delivered."""
    seen: list[int] = []
    for i, batch in enumerate(ds):
        seen += batch["id"].tolist()
        if i == 2:  # three batches taken, two more asked for ahead
            wait_until(
                lambda: stats(d.address)["jobs"][ds.job]["batches_served"] == 5,
                what="the batches asked for ahead",
            )
            d.kill()
            d.start()
    return seen


def test_a_trainer_takes_shared_memory_again_from_a_restarted_daemon(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The trainer must see the daemon's restart under its queued requests and say HELLO
    again, or every later batch comes over the socket."""
    with Daemon(db=store[0], state_dir=tmp_path / "st") as d:
        ds = LoaderdDataset(d.address, job="again", batch_size=8, prefetch=2)
        assert sorted(restart_under_queued_requests(d, ds)) == list(range(N))
        before = stats(d.address)["shm"]
        assert sorted(check_epoch(ds, store[1])) == list(range(N))
        shm = stats(d.address)["shm"]
        assert shm["consumers"] == 1
        assert shm["delivered"] - before["delivered"] == N // 8  # the whole next epoch
        assert shm["socket_fallbacks"] == before["socket_fallbacks"]
        ds.close()


def test_a_restarted_daemon_places_the_tiers_for_the_pass_it_resumes(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The tiers are placed when a training pass opens. A daemon restarted under queued
    requests resumes the pass without an OPEN_PASS, and must place them all the same."""
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=["--dram-bytes", "1MiB"]) as d:
        ds = LoaderdDataset(d.address, job="placed", batch_size=8, prefetch=2)
        assert sorted(restart_under_queued_requests(d, ds)) == list(range(N))
        wait_until(lambda: stats(d.address)["placement"]["job"] == "placed", what="a placement")
        assert stats(d.address)["placement"]["epoch"] == 0
        ds.close()


_TAKE_TWO = """
import sys
import time
from loaderd.client import LoaderdDataset
ds = LoaderdDataset(sys.argv[1], job="quit", batch_size=8)
for i, _ in enumerate(ds):
    if i == 1:
        break
"""


def test_a_trainer_that_quit_gives_back_the_slots_its_batches_took_ahead(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """A process that stops early leaves batches the daemon assembled ahead in ring slots.
    Once no consumer of that rank is left they give the slots back: kept, they held them for
    as long as another job used the ring, and its batches went over the socket."""
    extra = ["--prefetch", "4", "--shm-slots", "12", "--dram-bytes", "64MiB"]  # enough for one
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d:
        ds = LoaderdDataset(d.address, job="stays", batch_size=8)
        ds.connect()  # a consumer of the ring all along
        subprocess.run([sys.executable, "-c", _TAKE_TWO, d.address], check=True, timeout=60)
        wait_until(lambda: stats(d.address)["consumers"]["gone"] >= 1, what="the quitter gone")
        assert sorted(check_epoch(ds, store[1])) == list(range(N))
        shm = stats(d.address)["shm"]
        assert shm["socket_fallbacks"] == 0 and shm["ring_full"] == 0, shm
        ds.close()


def test_datasets_closed_one_after_another_give_back_their_last_batchs_slot(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The last batch of a pass is still the trainer's when the pass ends. Dropped after
    that, its slot goes back when the dataset closes, not when the process exits: a process
    that makes many datasets does not fill the ring and fall back to the socket."""
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=["--dram-bytes", "64MiB"]) as d:
        for k in range(3):
            ds = LoaderdDataset(d.address, job=f"one{k}", batch_size=8)
            assert sorted(check_epoch(ds, store[1])) == list(range(N))
            ds.close()  # check_epoch's batches are dropped by now
            shm = stats(d.address)["shm"]
            assert shm["lent_to_consumers"] == 0, f"dataset {k} kept a slot: {shm}"
