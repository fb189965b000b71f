"""Batches that miss DRAM, assembled by worker processes: the store's bytes, DRAM admission
behind them, a worker killed mid-epoch, and workers that never outlive their daemon."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.pids import pid_alive
from loaderd.client.protocol import PROTOCOL_VERSION, MsgType
from loaderd.config import default_miss_procs
from loaderd.launch import as_ordinary_user
from loaderd.miss_workers import PIPELINE
from loaderd.storage.records import Field, RecordCodec, Schema
from loaderd.storage.store_writer import StoreWriter
from tests.helpers import Daemon, mapped_kib, wait_until
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
            # By the last epoch LMDB has returned every record: workers slice them.
            assert workers["sliced"] > 0
        else:
            assert workers["batches"] == workers["started"] == workers["running"] == 0
        # The records the workers read were admitted into DRAM, and hit there later.
        assert dram["items"] > 0 and dram["hits"] > 0
        assert s["backing"]["reads"] == dram["misses"]
        # The loop's clock saw those turns: its phases share what it was busy with.
        loop = s["loop"]
        assert loop["turns"] > 0 and loop["busy_s"] > 0 and 0 < loop["busy_share"] <= 1
        assert loop["cpu_s"] > 0 and 0 < loop["on_core_share"] <= 1
        assert loop["shares"]["requests"] > 0 and loop["shares"]["assembled"] > 0
        assert sum(loop["shares"].values()) == pytest.approx(1, abs=0.01)
        ds.close()


def test_records_workers_read_are_held_in_the_daemons_locked_map(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # DRAM holds the whole store: the daemon locks its map whole, and a page is held only
    # once it is mapped in the daemon, which never read these records itself (the store is
    # not brought in whole at start here, which would map every page: ``--no-dram-load``).
    extra = ["--dram-bytes", "64MiB", "--no-dram-load"]
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d:
        ds = with_workers(d, "held", 8)
        assert sorted(check_epoch(ds, store[1])) == list(range(N))
        dram = admitted(d.address)
        if not dram["map_locked"]:
            pytest.skip("the daemon may not lock the store's map here (RLIMIT_MEMLOCK)")
        assert dram["items"] == N and stats(d.address)["miss_workers"]["batches"] > 0
        assert d.proc is not None
        assert mapped_kib(store[0] / "data.mdb", "Rss", pid=d.proc.pid)[0] << 10 >= N * IMAGE
        assert "map_load" not in dram
        ds.close()


def test_a_store_dram_can_hold_is_brought_in_whole_at_start(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # Before any trainer asks, the daemon maps and locks every page of the store.
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=["--dram-bytes", "64MiB"]) as d:
        dram = stats(d.address)["tiers"][0]
        if not dram["map_locked"]:
            pytest.skip("the daemon may not lock the store's map here (RLIMIT_MEMLOCK)")

        def loaded() -> bool:
            load = stats(d.address)["tiers"][0]["map_load"]
            return bool(load["loaded_bytes"] == load["total_bytes"])

        wait_until(loaded, what="the whole store mapped")
        assert d.proc is not None
        size = (store[0] / "data.mdb").stat().st_size
        assert mapped_kib(store[0] / "data.mdb", "Rss", pid=d.proc.pid)[0] << 10 >= size
        ds = with_workers(d, "whole", 8)
        for _ in range(2):  # and every epoch is still the store's bytes
            assert sorted(check_epoch(ds, store[1])) == list(range(N))
        # All of it in RAM and locked: the read-ahead had nothing to ask the disk for.
        assert stats(d.address)["readahead"]["advised_records"] == 0
        ds.close()


def test_a_daemon_that_may_not_lock_holds_a_store_dram_can_hold_as_its_own_copy(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # An ordinary user's daemon: the store copied whole into its memory at start, in the
    # map's place; the misses its workers read are held there, and every epoch is the
    # store's bytes.
    under = as_ordinary_user(64 << 10)  # less than the store: its map cannot be locked
    if under is None:
        pytest.skip("prlimit or setpriv is missing")
    extra = ["--dram-bytes", "64MiB"]
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra, under=under) as d:
        dram = stats(d.address)["tiers"][0]
        assert dram["map_owned"] and not dram["map_locked"]
        wait_until(lambda: _loaded(stats(d.address)["tiers"][0]["map_load"]), what="the copy")
        assert d.proc is not None
        size = (store[0] / "data.mdb").stat().st_size
        rss, own = mapped_kib(store[0] / "data.mdb", "Rss", "Anonymous", pid=d.proc.pid)
        assert own == rss and own << 10 >= size
        ds = with_workers(d, "owned", 8)
        for _ in range(2):
            assert sorted(check_epoch(ds, store[1])) == list(range(N))
        dram = admitted(d.address)
        assert dram["pinned"] == dram["items"] == N  # held as views of the copy, not copied
        assert stats(d.address)["readahead"]["advised_records"] == 0
        ds.close()


def with_workers(d: Daemon, job: str, batch_size: int, procs: int = 0) -> LoaderdDataset:
    """A dataset of ``job`` that said HELLO (which starts the workers), once all run.

    ``procs``: the daemon's ``--miss-procs``; 0: its default.
    """
    ds = LoaderdDataset(d.address, job=job, batch_size=batch_size)
    ds.connect()
    procs = procs or default_miss_procs()
    wait_until(lambda: stats(d.address)["miss_workers"]["running"] == procs)
    return ds


def _loaded(load: dict[str, Any]) -> bool:
    return bool(load["loaded_bytes"] == load["total_bytes"])


def test_a_killed_miss_worker_is_replaced_and_no_sample_is_lost(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    extra = ["--dram-bytes", "256KiB", "--prefetch", "1"]
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d:
        ds = LoaderdDataset(d.address, job="kill", batch_size=8)
        assert sorted(check_epoch(ds, store[1])) == list(range(N))
        wait_until(lambda: stats(d.address)["miss_workers"]["running"] == default_miss_procs())
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
        wait_until(lambda: stats(d.address)["miss_workers"]["running"] == default_miss_procs())
        workers = stats(d.address)["miss_workers"]
        pids = [*workers["pids"], workers["forker"]]
        assert len(pids) == default_miss_procs() + 1 and all(pid_alive(p) for p in pids)
        ds.close()
        d.kill()  # SIGKILL: no shutdown code runs
        for pid in pids:
            wait_until(lambda pid=pid: not pid_alive(pid), what=f"miss worker {pid} to exit")


def test_batches_a_stopped_worker_holds_are_served_when_it_is_killed(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # Each worker holds up to two batches (one it assembles, one waiting in its socket).
    # Both workers stopped, the first batches of a pass go to them and wait; killed, every
    # batch they held is assembled by the daemon, and the pass is still exactly once.
    extra = ["--dram-bytes", "256KiB", "--miss-procs", "2"]
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d:
        ds = with_workers(d, "stop", 8, procs=2)
        pids = stats(d.address)["miss_workers"]["pids"]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        seen: list[int] = []
        errors: list[BaseException] = []

        def epoch() -> None:
            try:
                seen.extend(check_epoch(ds, store[1]))
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=epoch)
        t.start()
        time.sleep(1.0)
        assert not seen, "nothing is served while the workers hold the first batches"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        t.join(timeout=30)
        assert not t.is_alive() and not errors
        assert sorted(seen) == list(range(N))
        after = stats(d.address)["miss_workers"]
        assert after["lost"] == 2 and after["fallbacks"] == 2 * PIPELINE
        assert after["enabled"]
        ds.close()


def test_batches_dropped_while_workers_hold_them_give_their_slots_back(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # The workers are stopped while they hold the batches a pass assembles ahead, and the
    # job is reset meanwhile: the batches are dropped under way. Once the workers answer,
    # their slots must come back (a ring that leaked them would run dry).
    extra = ["--dram-bytes", "256KiB", "--miss-procs", "2"]
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d:
        with Connection(d.address) as conn:
            hello = {
                "job": "drop",
                "rank": 0,
                "world_size": 1,
                "seed": 0,
                "batch_size": 8,
                "options": {},
            }
            conn.request(
                MsgType.HELLO,
                {**hello, "version": PROTOCOL_VERSION, "pid": os.getpid(), "shm": True},
                expect=MsgType.WELCOME,
            )
            wait_until(lambda: stats(d.address)["miss_workers"]["running"] == 2)
            pids = stats(d.address)["miss_workers"]["pids"]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            base = {"job": "drop", "rank": 0, "worker": 0, "phase": "train"}
            conn.request(MsgType.OPEN_PASS, base, expect=MsgType.PASS)  # assembles ahead
            wait_until(lambda: stats(d.address)["shm"]["lent"] == 2 * PIPELINE)
            conn.request(MsgType.JOB_RESET, {"job": "drop", "force": True}, expect=MsgType.OK)
        assert stats(d.address)["shm"]["lent"] == 2 * PIPELINE  # still under way
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: stats(d.address)["shm"]["lent"] == 0, what="their slots given back")
        workers = stats(d.address)["miss_workers"]
        assert workers["lost"] == workers["fallbacks"] == 0


def test_hits_stay_with_the_daemon(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # A worker would read the store's pages again (from the disk, where they are not cached;
    # and where they are, each page is first touched in its map): hits are the daemon's, and
    # a batch of hits of 1.3 MB is copied on the server loop itself (``INLINE_BYTES``).
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=["--dram-bytes", "64MiB"]) as d:
        ds = with_workers(d, "hits", 64)
        assert sorted(check_epoch(ds, store[1])) == list(range(N))
        assert admitted(d.address)["items"] == N
        before = stats(d.address)
        assert sorted(check_epoch(ds, store[1])) == list(range(N))
        after = stats(d.address)
        assert after["miss_workers"]["batches"] == before["miss_workers"]["batches"]
        inline = after["daemon"]["assembled_inline"] - before["daemon"]["assembled_inline"]
        assert inline == 2  # 64 and 32 records
        ds.close()


def test_a_batch_larger_than_every_slot_is_not_read_by_a_worker_only_to_be_read_again(
    store: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # Slots of 64 KiB, batches of ~200 KB: every batch goes over the socket. Once the value
    # index knows the records' lengths, the daemon keeps such a batch instead of sending it
    # to a worker that would read and verify it only to answer that it does not fit.
    extra = ["--dram-bytes", "1MiB", "--shm-slot-bytes", "64KiB"]
    with Daemon(db=store[0], state_dir=tmp_path / "st", extra=extra) as d:
        ds = with_workers(d, "big", 10)
        assert sorted(check_epoch(ds, store[1])) == list(range(N))
        wait_until(lambda: stats(d.address)["readahead"]["indexed"], what="the value index")
        before = stats(d.address)
        for _ in range(2):
            assert sorted(check_epoch(ds, store[1])) == list(range(N))
        s = stats(d.address)
        shm = s["shm"]
        assert shm["too_big"] > 0 and shm["ring_full"] == 0, "the ring was never full"
        assert shm["socket_fallbacks"] == shm["too_big"] and shm["delivered"] == 0
        workers = s["miss_workers"]
        assert workers["fallbacks"] == before["miss_workers"]["fallbacks"]
        assert workers["batches"] == before["miss_workers"]["batches"]
        ds.close()


@pytest.mark.parametrize("dram", ["3MiB", "64MiB"])
def test_large_records_of_fixed_fields_are_read_from_the_file_into_their_slots(
    tmp_path: Path, dram: str
) -> None:
    # No variable-length field and records of 70 KB: a worker reads each into its slot and
    # verifies it there (``storage/row_reads.py``). Where DRAM holds about half, every pass
    # misses: workers copy the records from a map of the file of their own, which pays from
    # the second read on. Where it holds the whole store (and its map is loaded), only the
    # first pass misses: workers read with preadv, mapping none of data.mdb.
    image = 70_000
    schema = Schema((Field("image", "uint8", (image,)), Field("label", "int64")))
    codec = RecordCodec(schema)
    rng = np.random.default_rng(8)
    images = rng.integers(0, 256, (N, image), dtype=np.uint8)
    db = tmp_path / "fixed.db"
    with StoreWriter(db, schema) as w:
        w.append(codec.encode({"image": images[i], "label": i * 5}) for i in range(N))
    with Daemon(db=db, state_dir=tmp_path / "st", extra=["--dram-bytes", dram]) as d:
        whole = dram == "64MiB"
        if whole:
            load = stats(d.address)["tiers"][0].get("map_load")
            if load is None:
                pytest.skip("this daemon may not lock the store's map (RLIMIT_MEMLOCK)")
            wait_until(lambda: _loaded(stats(d.address)["tiers"][0]["map_load"]), what="load")
        ds = with_workers(d, "rows", 10)
        for _ in range(1 if whole else 3):
            seen = []
            for batch in ds:
                for row, sid in enumerate(batch["id"].tolist()):
                    np.testing.assert_array_equal(batch["image"][row].numpy(), images[sid])
                    assert int(batch["label"][row]) == sid * 5
                seen += batch["id"].tolist()
            assert sorted(seen) == list(range(N))
        workers = stats(d.address)["miss_workers"]
        assert workers["read"] > 0 and workers["fallbacks"] == 0 and workers["lost"] == 0
        assert workers["copied"] == (0 if whole else workers["read"])
        mapped = sum(
            mapped_kib(db / "data.mdb", "Rss", pid=pid)[0] << 10 for pid in workers["pids"]
        )
        assert (mapped < N * image // 4) == whole
        ds.close()
