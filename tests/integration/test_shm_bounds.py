"""What one client can make the daemon's shared-memory delivery hold: consumer entries go with
their connections, and the rings stay within their cap whatever a HELLO asks for."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.protocol import MsgType
from loaderd.client.shm import SHM_DIR
from loaderd.config import parse_size
from loaderd.consumers import pid_namespace
from loaderd.stats import human_bytes
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, daemon_shm, wait_until

pytestmark = pytest.mark.integration


def _hello(conn: Connection, job: str, pid: int, pidns: str) -> None:
    meta = {"job": job, "rank": 0, "world_size": 1, "seed": 0, "batch_size": 16}
    meta |= {"options": {}, "pid": pid, "pidns": pidns, "shm": True}
    assert conn.request(MsgType.HELLO, meta, expect=MsgType.WELCOME).meta["shm"]["ring"]


def _hold_a_batch(conn: Connection, job: str) -> tuple[dict[str, Any], int]:
    """Take one batch of ``job`` into a ring slot and keep it: (the request meta, its index)."""
    base = {"job": job, "rank": 0, "worker": 0, "phase": "train"}
    epoch = conn.request(MsgType.OPEN_PASS, base, expect=MsgType.PASS).meta["epoch"]
    req = {**base, "epoch": epoch}
    batch = conn.request(MsgType.GET_BATCH, {**req, "acks": []}, expect=MsgType.BATCH)
    assert "shm" in batch.meta, "the batch is held in a ring slot"
    return req, int(batch.meta["index"])


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


FOREIGN_NS = "pid:[1]" if pid_namespace() != "pid:[1]" else "pid:[2]"


def test_short_lived_clients_leave_no_consumer_entries(daemon: Daemon) -> None:
    base = daemon_shm(daemon.address)
    for n in range(40):  # one live process; half say a pid the daemon cannot check
        with Connection(daemon.address, timeout_s=10.0) as conn:
            _hello(conn, "short", os.getpid(), pid_namespace() if n % 2 else FOREIGN_NS)
            req, index = _hold_a_batch(conn, "short")
            conn.request(MsgType.ACK, {**req, "acks": [index]}, expect=MsgType.OK)
    ds = LoaderdDataset(daemon.address, job="short-ds", batch_size=16, timeout_s=10.0)
    assert sum(1 for _ in ds) > 0
    ds.close()
    assert daemon_shm(daemon.address)["delivered"] >= 40, "the batches came through the ring"

    def settled() -> bool:
        s = daemon_shm(daemon.address)
        return s["consumers"] <= base["consumers"] + 1

    wait_until(settled, timeout_s=30, what="the closed clients' shm entries to go")
    s = daemon_shm(daemon.address)
    assert s["lent_to_consumers"] <= 1, "only the dataset's last batch may still be lent"


def test_a_closed_connection_keeps_its_slots_until_its_process_dies(daemon: Daemon) -> None:
    """Its trainer may still read them; the pid says when it cannot any more, and only a pid
    of the daemon's own namespace: one from another namespace never frees a held slot."""
    with subprocess.Popen(["sleep", "600"]) as trainer:
        with (
            Connection(daemon.address, timeout_s=10.0) as ours,
            Connection(daemon.address, timeout_s=10.0) as foreign,
        ):
            _hello(ours, "held", trainer.pid, pid_namespace())
            _hold_a_batch(ours, "held")
            _hello(foreign, "held-foreign", _dead_pid(), FOREIGN_NS)
            _hold_a_batch(foreign, "held-foreign")
        with Connection(daemon.address, timeout_s=10.0) as idle:  # closed, holding nothing
            _hello(idle, "held-idle", os.getpid(), pid_namespace())
        # One sweep judges every entry: once the idle one is gone, the others were judged.
        wait_until(lambda: daemon_shm(daemon.address)["consumers"] == 2, what="the idle entry")
        s = daemon_shm(daemon.address)
        assert s["lent_to_consumers"] == 2 and s["reclaimed"] == 0
        trainer.kill()
        trainer.wait()
        wait_until(lambda: daemon_shm(daemon.address)["reclaimed"] == 1, what="the dead pid")
        s = daemon_shm(daemon.address)
        assert s["lent_to_consumers"] == 1, "the foreign trainer still holds its slot"
        assert s["consumers"] == 1


def _read_all(
    address: str, arrays: dict[str, np.ndarray], job: str, batch_size: int
) -> tuple[dict[str, Any], list[int]]:
    """One epoch of ``job`` checked against the stored bytes; (its WELCOME's shm, ids)."""
    ds = LoaderdDataset(address, job=job, batch_size=batch_size, timeout_s=20.0)
    ids: list[int] = []
    for batch in ds:
        i = batch["id"].numpy()
        np.testing.assert_array_equal(batch["image"].numpy(), arrays["image"][i])
        np.testing.assert_array_equal(batch["label"].numpy(), arrays["label"][i])
        ids += i.tolist()
    with Connection(address, timeout_s=10.0) as conn:
        meta = {"job": job, "rank": 0, "world_size": 1, "seed": 0, "batch_size": batch_size}
        meta |= {"options": {}, "shm": True}
        welcome = conn.request(MsgType.HELLO, meta, expect=MsgType.WELCOME).meta
    ds.close()
    return dict(welcome.get("shm") or {}), ids


def _ring_files_bytes(stats: dict[str, Any]) -> int:
    return sum((SHM_DIR / r["name"]).stat().st_size for r in stats["rings"])


@pytest.mark.parametrize(
    "extra",
    [["--shm-bytes", "2MiB"], ["--shm-bytes", "2MiB", "--shm-slots", "16"]],
    ids=["automatic-slots", "fixed-slots"],
)
def test_a_huge_batch_size_cannot_take_shm_past_the_cap(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, extra: list[str]
) -> None:
    arrays = dataset[1]
    cap = parse_size(extra[1])
    with Daemon(db=dataset[0], state_dir=tmp_path / "state", extra=extra) as d:
        small, ids = _read_all(d.address, arrays, "small", 16)
        assert small["ring"] and sorted(ids) == list(range(N_SAMPLES))
        huge, ids = _read_all(d.address, arrays, "huge", 8192)  # slots of ~1.7 MiB: past the cap
        assert not huge, "no ring for the huge job: its batches came over the socket"
        assert sorted(ids) == list(range(N_SAMPLES)), "and they are the right bytes"
        s = daemon_shm(d.address)
        assert "--shm-bytes" in s["socket_jobs"]["huge"]
        assert "job huge goes over the socket" in d.log.read_text()
        # The huge job fixed nothing: a later job with another slot size gets its own ring.
        mid, ids = _read_all(d.address, arrays, "mid", 64)
        assert mid["ring"] and mid["ring"] != small["ring"]
        assert mid["slot_bytes"] > small["slot_bytes"]
        assert sorted(ids) == list(range(N_SAMPLES))
        s = daemon_shm(d.address)
        assert set(s["socket_jobs"]) == {"huge"}
        assert len(s["rings"]) == 2
        assert _ring_files_bytes(s) <= cap, "every ring's file together stays within the cap"


def test_a_fixed_slot_count_the_cap_cannot_hold_gets_as_many_slots_as_fit(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    # 64 slots of ~200 KiB take ~13 MiB; the cap holds a few: shared memory with fewer slots,
    # not the socket (several times slower for large batches).
    extra = ["--shm-bytes", "2MiB", "--shm-slots", "64"]
    with Daemon(db=dataset[0], state_dir=tmp_path / "state", extra=extra) as d:
        shm, ids = _read_all(d.address, dataset[1], "wide", 1024)
        assert shm["ring"] and sorted(ids) == list(range(N_SAMPLES))
        s = daemon_shm(d.address)
        ring = s["rings"][0]
        assert 4 <= ring["slots"] < 64 and not s["socket_jobs"]
        assert s["delivered"] >= 1 and s["socket_fallbacks"] == 0
        assert _ring_files_bytes(s) <= 2 << 20
        assert (
            f"slots of {human_bytes(ring['slot_bytes'])}, not 64 (--shm-slots)" in d.log.read_text()
        )


def _hello_ring(conn: Connection, job: str, batch_size: int, pid: int) -> dict[str, Any]:
    """HELLO as a consumer of ``job`` that would take shared memory: WELCOME's ``shm``."""
    meta = {"job": job, "rank": 0, "world_size": 1, "seed": 0, "batch_size": batch_size}
    meta |= {"options": {}, "pid": pid, "pidns": pid_namespace(), "shm": True}
    return dict(conn.request(MsgType.HELLO, meta, expect=MsgType.WELCOME).meta.get("shm") or {})


def test_a_ring_no_consumer_uses_is_removed_and_a_later_job_gets_one(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """A job with huge batches takes most of the cap; once its consumers are gone and its
    slots are back, its ring is removed and a job refused a ring before gets one. A ring whose
    slot a live trainer still holds stays."""
    arrays = dataset[1]
    with (
        Daemon(db=dataset[0], state_dir=tmp_path / "state", extra=["--shm-bytes", "6MiB"]) as d,
        subprocess.Popen(["sleep", "600"]) as trainer,
    ):
        with Connection(d.address, timeout_s=20.0) as wide:  # ~1.3 MB slots: most of the cap
            ring = _hello_ring(wide, "wide", 6000, trainer.pid)["ring"]
            _hold_a_batch(wide, "wide")  # held by the trainer's process when this closes
        with Connection(d.address, timeout_s=20.0) as narrow:
            assert not _hello_ring(narrow, "narrow", 2000, os.getpid()), "no room left"
        assert "--shm-bytes" in daemon_shm(d.address)["socket_jobs"]["narrow"]
        with Connection(d.address, timeout_s=20.0) as small:  # small slots: room for those
            small_ring = _hello_ring(small, "small", 16, os.getpid())["ring"]
            req, index = _hold_a_batch(small, "small")
            small.request(MsgType.ACK, {**req, "acks": [index]}, expect=MsgType.OK)
        # The small ring is removed once unused; the wide one, unused as long but with a slot
        # lent to a live process, stays (the same sweeps judged both).
        wait_until(
            lambda: [r["name"] for r in daemon_shm(d.address)["rings"]] == [ring],
            timeout_s=60,
            what="the unused small ring to go",
        )
        assert not (SHM_DIR / small_ring).exists() and (SHM_DIR / ring).exists()
        trainer.kill()  # its slot comes back: nothing holds the wide ring now
        trainer.wait()
        wait_until(lambda: not daemon_shm(d.address)["rings"], timeout_s=60, what="the wide ring")
        assert not (SHM_DIR / ring).exists()
        assert daemon_shm(d.address)["rings_removed"] == 2
        welcome, ids = _read_all(d.address, arrays, "narrow", 2000)
        assert welcome["ring"] and sorted(ids) == list(range(N_SAMPLES))
        s = daemon_shm(d.address)
        assert s["delivered"] >= 3 and "narrow" not in s["socket_jobs"]
        assert "removed shm ring" in d.log.read_text()
