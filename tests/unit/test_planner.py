"""loaderd/planner.py: deterministic, complete and even plans."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaderd.planner import ShuffleAhead, num_batches, plan_pass, rng_for, shuffle


def plan(
    n: int,
    *,
    seed: int = 1,
    epoch: int = 0,
    phase: str = "train",
    ws: int = 2,
    bs: int = 4,
    drop_last: bool = False,
):
    ids = np.arange(n, dtype=np.int64)
    weights = (ids * 0.5).astype(np.float32)
    return plan_pass(
        ids,
        weights,
        seed=seed,
        epoch=epoch,
        phase=phase,
        world_size=ws,
        batch_size=bs,
        drop_last=drop_last,
    )


def batches(plans) -> list[list[np.ndarray]]:
    return [[p.batch(i)[0] for i in range(p.num_batches)] for p in plans]


def flat_ids(plans) -> np.ndarray:
    return np.concatenate([p.ids for p in plans])


def test_same_inputs_same_plan() -> None:
    a, b = plan(1000, seed=5, epoch=3), plan(1000, seed=5, epoch=3)
    for pa, pb in zip(a, b, strict=True):
        np.testing.assert_array_equal(pa.ids, pb.ids)
        np.testing.assert_array_equal(pa.weights, pb.weights)
        np.testing.assert_array_equal(pa.bounds, pb.bounds)


@pytest.mark.parametrize(
    "change", [{"epoch": 4}, {"seed": 6}, {"phase": "rescore"}], ids=["epoch", "seed", "phase"]
)
def test_each_input_changes_the_order(change: dict) -> None:
    base = dict(seed=5, epoch=3, phase="train")
    a = flat_ids(plan(1000, **base))
    b = flat_ids(plan(1000, **{**base, **change}))
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(np.sort(a), np.sort(b))


def test_plan_is_shuffled() -> None:
    ids = flat_ids(plan(1000, ws=1))
    assert not np.array_equal(ids, np.arange(1000))


def test_weights_follow_their_ids() -> None:
    for p in plan(257, ws=3, bs=10):
        np.testing.assert_array_equal(p.weights, (p.ids * 0.5).astype(np.float32))
        for i in range(p.num_batches):
            ids, w = p.batch(i)
            np.testing.assert_array_equal(w, (ids * 0.5).astype(np.float32))


def test_repeated_ids_are_kept() -> None:
    ids = np.array([3, 3, 3, 1], np.int64)
    plans = plan_pass(
        ids, np.ones(4, np.float32), seed=0, epoch=0, phase="train", world_size=2, batch_size=1
    )
    assert sorted(flat_ids(plans).tolist()) == [1, 3, 3, 3]


@pytest.mark.parametrize(
    "weights, order, match",
    [(4, None, "5 ids but 4 weights"), (5, 4, "a shuffle of 4 entries for a pass of 5")],
    ids=["weights", "shuffle"],
)
def test_inputs_of_another_length_are_refused(weights: int, order: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_pass(
            np.arange(5),
            np.ones(weights, np.float32),
            seed=0,
            epoch=0,
            phase="train",
            world_size=1,
            batch_size=2,
            order=None if order is None else np.arange(order),
        )


def test_a_shuffle_drawn_ahead_is_the_one_drawn_at_the_start() -> None:
    ahead = ShuffleAhead(seed=5)
    ahead.draw(3, "train", 1000)
    ahead.draw(4, "train", 1000)
    ahead.draw(3, "train", 999)  # drawn for a size the epoch turns out not to have
    np.testing.assert_array_equal(ahead.take(3, "train", 1000), shuffle(5, 3, "train", 1000))
    np.testing.assert_array_equal(ahead.take(3, "rescore", 7), shuffle(5, 3, "rescore", 7))
    np.testing.assert_array_equal(ahead.take(4, "train", 1001), shuffle(5, 4, "train", 1001))
    ids = np.arange(1000, dtype=np.int64)
    spec = dict(seed=5, epoch=4, phase="train", world_size=3, batch_size=7)
    ahead.draw(4, "train", 1000)
    drawn = plan_pass(ids, ids * 0.5, order=ahead.take(4, "train", 1000), **spec)
    for a, b in zip(drawn, plan_pass(ids, ids * 0.5, **spec), strict=True):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.bounds, b.bounds)


def test_empty_selection() -> None:
    plans = plan(0, ws=3)
    assert [p.num_batches for p in plans] == [0, 0, 0]


def test_known_split() -> None:
    plans = plan(10, ws=2, bs=4)
    assert [[len(b) for b in bs] for bs in batches(plans)] == [[4, 1], [4, 1]]
    plans = plan(10, ws=2, bs=4, drop_last=True)
    assert [[len(b) for b in bs] for bs in batches(plans)] == [[4], [4]]
    plans = plan(7, ws=2, bs=4)  # padded to 8 with the shuffle's first sample
    assert [[len(b) for b in bs] for bs in batches(plans)] == [[4], [4]]
    ids = flat_ids(plans)
    assert sorted(set(ids.tolist())) == list(range(7)) and ids[-1] == ids[0]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 2000),
    ws=st.integers(1, 17),
    bs=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 1000),
    drop_last=st.booleans(),
)
def test_pytorch_conventions(
    n: int, ws: int, bs: int, seed: int, epoch: int, drop_last: bool
) -> None:
    plans = plan(n, seed=seed, epoch=epoch, ws=ws, bs=bs, drop_last=drop_last)
    assert len(plans) == ws
    # every rank the same number of batches, the one num_batches() predicts
    counts = {p.num_batches for p in plans}
    assert counts == {num_batches(n, ws, bs, drop_last)}
    ids = flat_ids(plans)
    if drop_last:
        # distinct, and only what does not fill a rank's share or a batch is left out
        assert len(set(ids.tolist())) == len(ids)
        assert n - len(ids) < ws + ws * bs
    else:
        # every id at least once; padding repeats fewer than world_size of them
        assert set(ids.tolist()) == set(range(n))
        assert len(ids) - n < ws
    for p, bs_of_rank in zip(plans, batches(plans), strict=True):
        lens = [len(b) for b in bs_of_rank]
        assert sum(lens) == len(p.ids)
        # exactly batch_size, except each rank's last (never with drop_last)
        assert all(x == bs for x in lens[:-1])
        if lens:
            assert 1 <= lens[-1] <= bs and (lens[-1] == bs or not drop_last)
        assert p.bounds[0] == 0 and p.bounds[-1] == len(p.ids)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 2000), ws=st.integers(1, 17), bs=st.integers(1, 300))
def test_rescore_passes_take_every_sample_once(n: int, ws: int, bs: int) -> None:
    plans = plan(n, phase="rescore", ws=ws, bs=bs)
    np.testing.assert_array_equal(np.sort(flat_ids(plans)), np.arange(n))
    assert len({p.num_batches for p in plans}) == 1
    sizes = [len(p.ids) for p in plans]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    "ids, weights",
    [
        (np.arange(37), np.ones(37, np.float32)),  # every sample, equal weights: no gather
        (np.arange(37), np.linspace(0.1, 2, 37, dtype=np.float32)),
        (np.arange(1, 38), np.ones(37, np.float32)),  # increasing, but not from 0
        (np.array([0, 2, 3, 5, 36]), np.full(5, 0.5, np.float32)),  # a selection
        (np.array([0, 1, 1, 2, 36]), np.ones(5, np.float32)),  # repeated by a draw
        (np.full(6, 4), np.array([1, 2, 1, 2, 1, 2], np.float32)),
    ],
)
@pytest.mark.parametrize("ws, drop_last", [(1, False), (3, False), (4, True)])
def test_a_plan_is_its_inputs_gathered_in_the_shuffled_order(
    ids: np.ndarray, weights: np.ndarray, ws: int, drop_last: bool
) -> None:
    # The order is the shuffle, padded or cut to the ranks; each rank's ids and weights are
    # the inputs at those positions, however the planner avoids gathering them.
    ids = ids.astype(np.int64)
    plans = plan_pass(
        ids, weights, seed=2, epoch=5, phase="train", world_size=ws, batch_size=4,
        drop_last=drop_last,
    )  # fmt: skip
    order = rng_for(2, 5, "train").permutation(len(ids))
    share = len(ids) // ws if drop_last else -(-len(ids) // ws)
    order = np.resize(order, share * ws)  # padded with its own first entries, or cut
    for r, p in enumerate(plans):
        at = order[r * share : r * share + len(p.ids)]
        np.testing.assert_array_equal(p.ids, ids[at])
        np.testing.assert_array_equal(p.weights, weights[at])
        assert p.ids.dtype == np.int64 and p.weights.dtype == np.float32
