"""Two ranks, each with a two-worker DataLoader, for two epochs: every id exactly once."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from loaderd.client import LoaderdDataset
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon

pytestmark = pytest.mark.integration


def run_rank(address: str, rank: int, epochs: int, out: mp.Queue) -> None:
    ds = LoaderdDataset(address, job="ddp", batch_size=32, rank=rank, world_size=2, seed=3)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    result = []
    for _ in range(epochs):
        ids: list[int] = []
        batches = 0
        for batch in loader:
            ids += batch["id"].tolist()
            batches += 1
        result.append((ids, batches))
    out.put((rank, result))


def test_two_ranks_two_workers_two_epochs(daemon: Daemon) -> None:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(daemon.address, r, 2, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for epoch in range(2):
        ids0, n0 = results[0][epoch]
        ids1, n1 = results[1][epoch]
        assert n0 == n1, "every rank gets the same number of batches"
        assert len(ids0) == len(set(ids0)) and len(ids1) == len(set(ids1))
        assert not set(ids0) & set(ids1), "ranks are disjoint"
        assert sorted(ids0 + ids1) == list(range(N_SAMPLES))
    assert results[0][0][0] != results[0][1][0]


def test_workers_split_a_rank_in_process(
    daemon: Daemon, dataset: tuple[Path, dict[str, np.ndarray]]
) -> None:
    ds = LoaderdDataset(daemon.address, job="w2", batch_size=40)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    for _ in range(2):
        ids = [i for b in loader for i in b["id"].tolist()]
        assert sorted(ids) == list(range(N_SAMPLES))
    stats = ds.stats()["jobs"]["w2"]
    assert stats["epoch"] == 1
    assert stats["samples_served"] == 2 * N_SAMPLES
