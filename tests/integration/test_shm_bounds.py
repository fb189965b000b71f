"""What one client can make the daemon's shared-memory delivery hold: consumer entries go with
their connections, and the rings stay within their cap whatever a HELLO asks for."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.protocol import MsgType
from loaderd.consumers import pid_namespace
from tests.helpers import Daemon, wait_until

pytestmark = pytest.mark.integration


def shm_stats(address: str) -> dict[str, Any]:
    with Connection(address, timeout_s=10.0) as conn:
        meta = conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta
    return dict(meta["shm"])


def test_short_lived_clients_leave_no_consumer_entries(daemon: Daemon) -> None:
    base = shm_stats(daemon.address)
    for _ in range(40):  # one live process, a new connection each time, each closed
        ds = LoaderdDataset(daemon.address, job="short", batch_size=16, timeout_s=10.0)
        it = iter(ds)
        next(it)
        it.close()
        ds.close()
    assert shm_stats(daemon.address)["delivered"] > 0, "the batches came through the ring"

    def settled() -> bool:
        s = shm_stats(daemon.address)
        return s["consumers"] == base["consumers"] and s["lent_to_consumers"] == 0

    wait_until(settled, timeout_s=30, what="the closed clients' shm entries to go")


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_pid_of_another_namespace_never_frees_a_held_slot(daemon: Daemon) -> None:
    """A pid from another pid namespace says nothing here; one from ours does."""

    def hello(conn: Connection, job: str, pid: int, pidns: str) -> None:
        meta = {"job": job, "rank": 0, "world_size": 1, "seed": 0, "batch_size": 16}
        meta |= {"options": {}, "pid": pid, "pidns": pidns, "shm": True}
        assert conn.request(MsgType.HELLO, meta, expect=MsgType.WELCOME).meta["shm"]["ring"]
        base = {"job": job, "rank": 0, "worker": 0, "phase": "train"}
        epoch = conn.request(MsgType.OPEN_PASS, base, expect=MsgType.PASS).meta["epoch"]
        batch = conn.request(
            MsgType.GET_BATCH, {**base, "epoch": epoch, "acks": []}, expect=MsgType.BATCH
        )
        assert "shm" in batch.meta, "the batch is held in a ring slot"

    foreign_ns = "pid:[1]" if pid_namespace() != "pid:[1]" else "pid:[2]"
    with (
        Connection(daemon.address, timeout_s=10.0) as foreign,
        Connection(daemon.address, timeout_s=10.0) as ours,
    ):
        hello(foreign, "ns-foreign", _dead_pid(), foreign_ns)
        hello(ours, "ns-ours", _dead_pid(), pid_namespace())
        # One sweep judges every entry: once ours is reclaimed, the foreign one was looked at.
        wait_until(lambda: shm_stats(daemon.address)["reclaimed"] >= 1, what="our dead pid")
        s = shm_stats(daemon.address)
        assert s["lent_to_consumers"] == 1, "the foreign trainer still holds its slot"
        assert s["consumers"] == 1
    wait_until(lambda: shm_stats(daemon.address)["consumers"] == 0, what="closed connection")
