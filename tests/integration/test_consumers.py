"""Consumers that die, stop, or restart from a checkpoint in the middle of an epoch."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest

from loaderd.client import LoaderdDataset
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, wait_until

pytestmark = pytest.mark.integration


def rank_stats(ds: LoaderdDataset, job: str, rank: int = 0) -> dict[str, Any]:
    return ds.stats()["jobs"][job]["ranks"][rank]


def hold_batches(address: str, job: str, world: int, n: int, out: mp.Queue) -> None:
    """Take n batches of rank 0, report their ids, then wait to be killed or stopped."""
    ds = LoaderdDataset(address, job=job, batch_size=16, world_size=world, rank=0, timeout_s=2.0)
    it = iter(ds)
    ids = [i for _ in range(n) for i in next(it)["id"].tolist()]
    out.put(ids)
    for batch in it:  # a slow trainer: one batch per second
        out.put(batch["id"].tolist())
        time.sleep(1.0)


def test_killed_client_batches_go_back_to_its_rank(daemon: Daemon) -> None:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    p = ctx.Process(target=hold_batches, args=(daemon.address, "dead", 1, 3, out))
    p.start()
    taken = out.get(timeout=20)
    watcher = LoaderdDataset(daemon.address, job="dead", batch_size=16, timeout_s=2.0)
    assert rank_stats(watcher, "dead")["inflight"] > 0
    time.sleep(0.3)  # let its loop take one more batch, which it then sleeps on
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    while not out.empty():  # every batch its loop received before the kill
        taken += out.get(timeout=5)
    wait_until(lambda: rank_stats(watcher, "dead")["inflight"] == 0, 5, "requeue of the dead")
    assert watcher.stats()["consumers"]["gone"] >= 1
    # A new client of the same job and rank (same worker id) resumes the epoch.
    rest = [i for b in watcher for i in b["id"].tolist()]
    assert len(rest) == len(set(rest))
    assert set(taken) | set(rest) == set(range(N_SAMPLES))
    # What its loop received never comes again; what it prefetched does.
    assert not set(taken) & set(rest)


def test_stopped_client_does_not_slow_the_others(daemon: Daemon) -> None:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    p = ctx.Process(target=hold_batches, args=(daemon.address, "stop", 2, 2, out))
    p.start()
    try:
        out.get(timeout=20)
        os.kill(p.pid, signal.SIGSTOP)
        other = LoaderdDataset(
            daemon.address, job="stop", batch_size=16, world_size=2, rank=1, timeout_s=2.0
        )
        t0 = time.monotonic()
        ids = [i for b in other for i in b["id"].tolist()]
        assert time.monotonic() - t0 < 5, "rank 1's epoch does not wait for the stopped rank 0"
        assert len(ids) == N_SAMPLES // 2
        held = rank_stats(other, "stop")["inflight"]
        assert held > 0, "a stopped consumer is alive: it keeps what it holds"
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.join()


def test_state_dict_resumes_exactly_at_the_checkpoint(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="ckpt", batch_size=32, timeout_s=2.0)
    it = iter(ds)
    before = [i for _ in range(4) for i in next(it)["id"].tolist()]
    state = ds.state_dict()
    lost = [i for _ in range(3) for i in next(it)["id"].tolist()]  # after the checkpoint
    it.close()
    ds.close()
    # The trainer crashes and restarts from its checkpoint; the daemon has moved on since.
    ds2 = LoaderdDataset(daemon.address, job="ckpt", batch_size=32, timeout_s=2.0)
    ds2.load_state_dict(state)
    after = [i for b in ds2 for i in b["id"].tolist()]
    assert sorted(before + after) == list(range(N_SAMPLES))
    assert set(lost) <= set(after), "batches taken after the checkpoint come again"
    with pytest.raises(ValueError, match="does not fit"):
        LoaderdDataset(daemon.address, job="other", batch_size=32).load_state_dict(state)
