"""Framework epochs line up with loaderd's passes, whatever way the framework iterates.

Frameworks make an iterator ahead of the epoch and fetch one batch ahead to detect its end
(PyTorch Lightning does both); each rank's epoch must still be exactly its share, distinct,
disjoint from the other ranks', and the batches it holds must keep their bytes. The daemon
here has 4 shared-memory slots, so a slot given back too early is reused at once.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from loaderd.client import LoaderdDataset
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon

pytestmark = pytest.mark.integration

EPOCHS = 3


@pytest.fixture
def small_ring(dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> Iterator[Daemon]:
    with Daemon(db=dataset[0], state_dir=tmp_path / "state", extra=["--shm-slots", "4"]) as d:
        yield d


def one_ahead(loader: DataLoader[Any]) -> Iterator[tuple[dict[str, Any], bool]]:
    """Lightning's fetcher: the iterator is made and a batch fetched before the epoch runs,
    and batch i+1 is fetched before batch i is trained on, to know which one is last."""
    it = iter(loader)
    ahead = next(it, None)
    while ahead is not None:
        batch, ahead = ahead, next(it, None)
        yield batch, ahead is None


@pytest.mark.parametrize("workers", [0, 2])
def test_fetch_ahead_ranks_in_lockstep_get_exact_epochs(
    small_ring: Daemon, dataset: tuple[Path, dict[str, np.ndarray]], workers: int
) -> None:
    arrays = dataset[1]
    loaders = [
        DataLoader(
            LoaderdDataset(
                small_ring.address, job=f"ahead{workers}", batch_size=25, rank=r, world_size=2
            ),
            batch_size=None,
            num_workers=workers,
        )
        for r in range(2)
    ]
    batches = N_SAMPLES // 2 // 25 + 1  # 240 per rank: 9 batches of 25 and one of 15
    for _ in range(EPOCHS):
        epoch: list[list[int]] = [[], []]
        # DDP: every rank takes its step together, each through its own fetcher
        for steps in zip(*(one_ahead(ld) for ld in loaders), strict=True):
            for r, (batch, _) in enumerate(steps):
                ids = batch["id"].numpy()
                np.testing.assert_array_equal(batch["image"].numpy(), arrays["image"][ids])
                epoch[r] += ids.tolist()
            assert steps[0][1] == steps[1][1], "the ranks see the end of the epoch together"
        for r in range(2):
            assert len(epoch[r]) == len(set(epoch[r])) == N_SAMPLES // 2
        assert not set(epoch[0]) & set(epoch[1])
        assert sorted(epoch[0] + epoch[1]) == list(range(N_SAMPLES))
        assert len(epoch[0]) == len(epoch[1]) == N_SAMPLES // 2 != batches * 25


def test_an_iterator_made_ahead_begins_the_next_epoch(small_ring: Daemon) -> None:
    ds = LoaderdDataset(small_ring.address, job="made-ahead", batch_size=40)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    it = iter(loader)  # workers start and open the pass now, before the loop asks
    first = [i for b in it for i in b["id"].tolist()]
    nxt = iter(loader)
    second = [i for b in nxt for i in b["id"].tolist()]
    assert sorted(first) == sorted(second) == list(range(N_SAMPLES))
    assert first != second, "two epochs, two shuffles"
    assert ds.stats()["jobs"]["made-ahead"]["epoch"] == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loop_that_stops_at_len_begins_the_next_epoch(small_ring: Daemon, workers: int) -> None:
    """A framework that knows len(loader) takes that many batches and never sees the end."""
    ds = LoaderdDataset(small_ring.address, job=f"bylen{workers}", batch_size=50)
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    for epoch in range(3):
        n = len(loader)
        it = iter(loader)
        ids = [i for _, b in zip(range(n), it, strict=False) for i in b["id"].tolist()]
        del it
        assert n == 10 and sorted(ids) == list(range(N_SAMPLES)), f"epoch {epoch}"
        state = ds.state_dict()["progress"]["train"]
        assert state == {"epoch": epoch + 1, "delivered": []}, "the next epoch, nothing yet"
    assert ds.stats()["jobs"][f"bylen{workers}"]["epoch"] == 2


def read_epochs(path: Path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        epoch, *ids = map(int, line.split())
        out.setdefault(epoch, []).extend(ids)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_ddp_epochs_are_exact(small_ring: Daemon, tmp_path: Path, workers: int) -> None:
    pytest.importorskip("lightning")
    argv = [sys.executable, "-m", "tests.integration.lightning_trainer", small_ring.address]
    run = subprocess.run(
        [*argv, f"ltn{workers}", str(workers), str(EPOCHS), str(tmp_path)],
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [read_epochs(tmp_path / f"rank{r}.txt") for r in range(2)]
    for e in range(EPOCHS):
        a, b = ranks[0][e], ranks[1][e]
        assert len(a) == len(set(a)) == N_SAMPLES // 2, f"rank 0 epoch {e}"
        assert len(b) == len(set(b)) == N_SAMPLES // 2, f"rank 1 epoch {e}"
        assert not set(a) & set(b), f"epoch {e}: the ranks overlap"
        assert sorted(a + b) == list(range(N_SAMPLES))
