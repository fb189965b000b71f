"""PyTorch's conventions: exact batch sizes, drop_last, equal batches per rank, len()."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from loaderd.client import LoaderdDataset
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon

pytestmark = pytest.mark.integration


def sizes(ds: LoaderdDataset) -> list[int]:
    return [len(b["id"]) for b in ds]


def test_batches_are_exactly_batch_size_but_the_last(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="exact", batch_size=64)
    assert len(ds) == 8 and len(DataLoader(ds, batch_size=None)) == 8
    assert sizes(ds) == [64] * 7 + [N_SAMPLES - 7 * 64]
    dropped = LoaderdDataset(daemon.address, job="exact-drop", batch_size=64, drop_last=True)
    assert len(dropped) == 7
    assert sizes(dropped) == [64] * 7


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_equal_batches_with_the_remainder_rule(daemon: Daemon, drop_last: bool) -> None:
    world = 7  # 480 = 7 * 68 + 4: padded to 7 * 69, or cut to 7 * 68
    ranks = [
        LoaderdDataset(
            daemon.address,
            job=f"rem{drop_last}",
            batch_size=32,
            rank=r,
            world_size=world,
            drop_last=drop_last,
        )
        for r in range(world)
    ]
    lens = [len(ds) for ds in ranks]
    got = [[b["id"].tolist() for b in ds] for ds in ranks]
    share = 68 if drop_last else 69
    want = [32, 32] if drop_last else [32, 32, 5]
    for r in range(world):
        assert [len(b) for b in got[r]] == want, f"rank {r}"
        assert lens[r] == len(want)
    ids = [i for g in got for b in g for i in b]
    assert len(ids) == world * (len(want) * 32 if drop_last else share)
    if drop_last:
        assert len(set(ids)) == len(ids), "nothing twice"
    else:
        assert set(ids) == set(range(N_SAMPLES)), "every sample, 3 of them twice"
        assert len(ids) - len(set(ids)) == 3


def test_len_counts_what_is_left_of_an_unfinished_pass(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="left", batch_size=40)
    assert len(ds) == 12
    it = iter(ds)
    for _ in range(5):
        next(it)
    del it  # a break: the loop received 5 batches
    assert len(ds) == 7
    assert len(sizes(ds)) == 7
    assert len(ds) == 12, "the next epoch"


def test_len_of_a_selecting_epoch_is_not_known_before_it_is_planned(daemon: Daemon) -> None:
    ds = LoaderdDataset(
        daemon.address, job="sel", batch_size=40, sampler="importance", warmup_epochs=0
    )
    with pytest.raises(TypeError, match="not known yet"):
        len(ds)
    n = len(sizes(ds))
    assert n < 12
