"""The importance engine (seed 002) and its selection kernels."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaderd.importance import RESCORE_COST, ImportanceConfig, ImportanceEngine
from loaderd.samplers import (
    draw_unbiased,
    learnable_score,
    loss_movement,
    loss_variance,
    select_infobatch,
    select_learnable,
    select_top,
    split_two_clusters,
)

# ---------------------------------------------------------------- helpers


def brute_force_cost(values: np.ndarray) -> float:
    """Least within-cluster SSE over every assignment of values to two non-empty clusters."""
    n = values.size
    best = float(((values - values.mean()) ** 2).sum())  # one cluster: the no-split answer
    for bits in itertools.product((False, True), repeat=n - 1):
        high = np.array((False, *bits))  # value 0 stays low: halves the symmetric search
        if not high.any():
            continue
        a, b = values[~high], values[high]
        best = min(best, float(((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum()))
    return best


def feed_classification(engine: ImportanceEngine, noisy: np.ndarray, seed: int = 0) -> np.ndarray:
    """Train through the K warm-up epochs: the `noisy` samples' losses swing, the others not."""
    rng = np.random.default_rng(seed)
    n = engine.num_samples
    base = rng.uniform(0.5, 1.0, n).astype(np.float32)
    for epoch in range(engine.config.warmup_epochs):
        ids, _ = engine.select(epoch, seed)
        swing = np.where(noisy, (-1.0) ** epoch * 0.4, 0.0).astype(np.float32)
        engine.record(ids, (base + swing)[ids], epoch)
    return base


def engine_with_history(
    sampler: str = "importance", n: int = 1000, **kw: object
) -> ImportanceEngine:
    kw.setdefault("warmup_epochs", 3)
    engine = ImportanceEngine(n, ImportanceConfig(sampler=sampler, **kw))  # type: ignore[arg-type]
    feed_classification(engine, np.arange(n) % 5 == 0)
    return engine


# ---------------------------------------------------------------- exact two-cluster split


def test_split_known_inputs() -> None:
    s = split_two_clusters(np.array([0.1, 0.2, 0.15, 5.0, 5.2, 0.12]))
    assert s.threshold == 5.0
    assert (s.low_size, s.high_size) == (4, 2)
    assert s.low_mean == pytest.approx(0.1425)
    assert s.high_mean == pytest.approx(5.1)

    # 0 and 1 against 10: the boundary goes where the between-cluster term is largest.
    s = split_two_clusters(np.array([10.0, 0.0, 1.0]))
    assert (s.threshold, s.low_size, s.high_size) == (10.0, 2, 1)
    assert s.cost == pytest.approx(0.5)


def test_split_degenerate_inputs() -> None:
    assert split_two_clusters(np.array([])).threshold == np.inf
    one = split_two_clusters(np.array([3.0]))
    assert (one.threshold, one.low_size, one.high_size) == (np.inf, 1, 0)
    same = split_two_clusters(np.full(5, 2.0))
    assert (same.threshold, same.low_size, same.high_size, same.cost) == (np.inf, 5, 0, 0.0)
    # Ties never straddle the boundary.
    tied = split_two_clusters(np.array([1.0, 1.0, 1.0, 2.0, 2.0, 9.0]))
    values = np.array([1.0, 1.0, 1.0, 2.0, 2.0, 9.0])
    assert tied.high_size == int((values >= tied.threshold).sum())
    with pytest.raises(ValueError, match="values"):
        split_two_clusters(np.array([1.0, np.nan]))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(st.integers(0, 4).map(float), st.floats(0, 100, allow_nan=False)),
        min_size=1,
        max_size=8,
    )
)
def test_split_matches_brute_force(raw: list[float]) -> None:
    values = np.array(raw)
    s = split_two_clusters(values)
    assert s.cost == pytest.approx(brute_force_cost(values), rel=1e-9, abs=1e-9)
    high = values >= s.threshold
    assert (int((~high).sum()), int(high.sum())) == (s.low_size, s.high_size)
    if s.high_size:
        assert values[high].mean() == pytest.approx(s.high_mean)
        assert s.high_mean > s.low_mean


def test_blocked_kernels_match_across_block_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    import loaderd.samplers

    rng = np.random.default_rng(5)
    history = rng.exponential(1.0, (3, 50)).astype(np.float32)
    history[rng.random((3, 50)) < 0.3] = np.nan
    whole = loss_variance(history)
    monkeypatch.setattr(loaderd.samplers, "_BLOCK", 3)
    blocked = loss_variance(history)
    np.testing.assert_array_equal(whole[1], blocked[1])
    np.testing.assert_allclose(whole[0], blocked[0], rtol=1e-6)
    for _ in range(20):
        values = rng.integers(0, 6, rng.integers(1, 10)).astype(np.float64)
        assert split_two_clusters(values).cost == pytest.approx(brute_force_cost(values), abs=1e-9)


def test_split_is_exact_on_large_tight_values() -> None:
    # Prefix sums of uncentred squares would cancel here; centring keeps the answer exact.
    values = 1e6 + np.array([0.0, 0.001, 0.002, 1.0, 1.001])
    s = split_two_clusters(values)
    assert (s.low_size, s.high_size) == (3, 2)


def test_loss_variance_ignores_missing_epochs() -> None:
    nan = np.nan
    history = np.array(
        [[1.0, 2.0, nan, nan], [3.0, 2.0, 5.0, nan], [nan, 2.0, nan, nan]], np.float32
    )
    var, seen = loss_variance(history)
    assert seen.tolist() == [2, 3, 1, 0]
    assert var[0] == pytest.approx(1.0)
    assert var[1] == 0.0
    assert np.isnan(var[2:]).all()


# ---------------------------------------------------------------- phases and grouping


def test_classify_then_select_at_epoch_k() -> None:
    n, k = 500, 3
    engine = ImportanceEngine(n, ImportanceConfig(sampler="importance", warmup_epochs=k))
    for epoch in range(k):
        assert engine.phase(epoch) == "classify"
        assert engine.rescore_ids(epoch).size == 0
        ids, weights = engine.select(epoch, seed=1)
        assert ids.tolist() == list(range(n))
        assert (weights == 1).all()
        engine.record(ids, np.random.default_rng(epoch).random(n), epoch)
    assert engine.phase(k) == "select"
    ids, weights = engine.select(k, seed=1)
    assert ids.size == round(0.7 * n)
    stats = engine.stats()
    assert stats["phase"] == "select" and stats["epoch"] == k
    assert json.loads(json.dumps(stats, allow_nan=False)) == stats  # plain JSON for `loaderd stats`


def test_epochs_of_every_sample_share_one_read_only_selection() -> None:
    engine = ImportanceEngine(50, ImportanceConfig(sampler="importance", warmup_epochs=2))
    first, second = engine.select(0, seed=1), engine.select(1, seed=1)
    assert first[0] is second[0] and first[1] is second[1]  # no fresh memory an epoch
    assert first[0].tolist() == list(range(50)) and (first[1] == 1).all()
    assert first[0].dtype == np.int64 and first[1].dtype == np.float32
    with pytest.raises(ValueError, match="read-only"):
        first[1][0] = 2.0  # shared by every such epoch: nobody may change it
    engine.record(first[0], np.linspace(0.1, 1.0, 50), 1)
    assert engine.select(2, seed=1)[0].size < 50  # a selecting epoch chooses as before


def test_rescore_ids_are_exactly_the_high_group() -> None:
    n = 1000
    noisy = np.arange(n) % 5 == 0
    engine = ImportanceEngine(n, ImportanceConfig(sampler="importance", warmup_epochs=3))
    feed_classification(engine, noisy)
    high = engine.rescore_ids(3)
    assert high.dtype == np.int64
    assert high.tolist() == np.flatnonzero(noisy).tolist()  # sorted, and only the swinging ones
    var = engine.variances()
    stats = engine.stats()
    assert stats["high_group"] == noisy.sum() and stats["low_group"] == n - noisy.sum()
    assert var[noisy].min() > var[~noisy].max()
    assert stats["high_mean_variance"] == pytest.approx(32 / 225, rel=1e-4)  # swings +-0.4


def test_samples_without_history_go_to_the_high_group() -> None:
    n = 100
    engine = ImportanceEngine(n, ImportanceConfig(sampler="importance"))
    for epoch in range(3):
        ids = np.arange(50)  # samples 50.. are never trained
        engine.record(ids, np.full(50, 1.0 + epoch * (ids % 2)), epoch)
    high = set(engine.rescore_ids(3).tolist())
    assert set(range(50, 100)) <= high
    assert set(range(1, 50, 2)) <= high  # the swinging half of the known ones
    assert not high & set(range(0, 50, 2))


def test_rescore_replaces_importance_and_drives_selection() -> None:
    n = 1000
    engine = engine_with_history(n=n)
    high = engine.rescore_ids(3)
    engine.record(high, np.full(high.size, 10.0, np.float32), 3, kind="rescore")
    ids, _ = engine.select(3, seed=0)
    assert np.isin(high, ids).all()  # re-scored as most important, so all kept
    assert engine.stats()["rescored"] == high.size
    assert engine.importance()[high].tolist() == [10.0] * high.size


def test_reclassify_every_k_epochs() -> None:
    n = 400
    engine = ImportanceEngine(n, ImportanceConfig(sampler="importance", warmup_epochs=2))
    first = np.arange(n) < 100
    second = np.arange(n) >= 300
    for epoch in range(6):
        swing = first if epoch < 2 else second
        loss = np.where(swing, 1.0 + (epoch % 2), 1.0)
        engine.record(np.arange(n), loss, epoch)
        if epoch >= 2:  # feedback of a re-classification epoch regroups first
            assert engine.stats()["groups_epoch"] == epoch - epoch % 2
        if epoch == 2:
            assert engine.rescore_ids(2).tolist() == np.flatnonzero(first).tolist()
    assert engine.rescore_ids(4).tolist() == np.flatnonzero(second).tolist()
    assert engine.stats()["groups_epoch"] == 4


def test_rescore_empty_when_not_needed() -> None:
    assert engine_with_history("uniform").rescore_ids(3).size == 0
    assert engine_with_history(rescore=False).rescore_ids(3).size == 0
    assert engine_with_history(anneal_epochs=2, epochs=10).rescore_ids(8).size == 0
    assert engine_with_history(anneal_epochs=2, epochs=10).rescore_ids(7).size > 0


def test_warmup_zero_and_one_put_everyone_in_the_high_group() -> None:
    for k in (0, 1):
        engine = ImportanceEngine(50, ImportanceConfig(sampler="importance", warmup_epochs=k))
        assert engine.phase(k) == "select"
        engine.record(np.arange(50), np.arange(50, dtype=np.float32), k)
        assert engine.rescore_ids(k + 1).size == 50
        ids, _ = engine.select(k + 1, seed=0)
        assert ids.tolist() == list(range(15, 50))  # the 35 largest losses


# ---------------------------------------------------------------- selection


@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.7, 1.0])
def test_kept_fraction(fraction: float) -> None:
    engine = engine_with_history(keep_fraction=fraction)
    ids, weights = engine.select(3, seed=2)
    assert ids.size == round(fraction * 1000)
    assert np.unique(ids).size == ids.size and (np.diff(ids) > 0).all()
    assert weights.dtype == np.float32 and (weights == 1).all()
    assert engine.stats()["kept_fraction"] == pytest.approx(ids.size / 1000)
    if fraction < 1:  # the kept ones are the most important
        imp = engine.importance()
        dropped = np.setdiff1d(np.arange(1000), ids)
        assert imp[ids].min() >= imp[dropped].max()


def test_top_k_breaks_ties_at_random_and_ranks_unknown_first() -> None:
    imp = np.array([np.nan, 1.0, 1.0, 1.0, 1.0, 0.5], np.float32)
    picks = set()
    for s in range(20):
        mask, cut = select_top(imp, 3, np.random.default_rng(s))
        assert mask.sum() == 3 and mask[0] and not mask[5] and cut == 1.0
        picks.add(tuple(np.flatnonzero(mask)))
    assert len(picks) > 1


@pytest.mark.parametrize("sampler", ["uniform", "learnable", "importance", "unbiased", "infobatch"])
def test_selection_is_deterministic_in_seed_epoch_and_state(sampler: str) -> None:
    a, b = engine_with_history(sampler), engine_with_history(sampler)
    ids_a, w_a = a.select(4, seed=9)
    ids_b, w_b = b.select(4, seed=9)
    assert np.array_equal(ids_a, ids_b) and np.array_equal(w_a, w_b)
    again = a.select(4, seed=9)
    assert np.array_equal(ids_a, again[0]) and np.array_equal(w_a, again[1])
    if sampler in ("learnable", "unbiased", "infobatch"):  # the draw depends on seed and epoch
        assert not np.array_equal(ids_a, a.select(4, seed=10)[0])
        assert not np.array_equal(ids_a, a.select(5, seed=9)[0])


def test_uniform_trains_everything_and_tracks_stats() -> None:
    engine = engine_with_history("uniform")
    ids, weights = engine.select(5, seed=0)
    assert ids.size == 1000 and (weights == 1).all()
    stats = engine.stats()
    assert stats["high_group"] == 200 and stats["feedback_samples"] == 3000


def test_unbiased_weights_average_to_one_and_preserve_the_mean_loss() -> None:
    n = 2000
    rng = np.random.default_rng(0)
    loss = rng.exponential(1.0, n).astype(np.float32)
    imp = loss.copy()
    imp[:10] = np.nan  # never scored
    mean_w, estimates = [], []
    for s in range(300):
        ids, w = draw_unbiased(imp, 600, 0.3, np.random.default_rng(s))
        assert ids.size == 600 and (np.diff(ids) >= 0).all() and w.max() <= 1 / 0.3 + 1e-4
        mean_w.append(w.mean())
        estimates.append(float((w * loss[ids]).mean()))
    assert np.mean(mean_w) == pytest.approx(1.0, abs=0.01)
    assert np.mean(estimates) == pytest.approx(float(loss.mean()), rel=0.01)


def test_unbiased_draw_prefers_important_samples_with_replacement() -> None:
    imp = np.array([100.0] + [1.0] * 99, np.float32)
    ids, w = draw_unbiased(imp, 50, 0.0, np.random.default_rng(0))
    assert (ids == 0).sum() >= 25  # p_0 ≈ 0.5: drawn about 25 times, up to rounding
    assert w[ids == 0][0] == pytest.approx(1 / (100 * 100 / 199), rel=1e-5)
    flat, _ = draw_unbiased(np.zeros(10, np.float32), 10, 0.0, np.random.default_rng(0))
    assert flat.tolist() == list(range(10))  # nothing to prefer: uniform


@pytest.mark.parametrize("block", [7, 1 << 16])
def test_unbiased_draw_is_systematic(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    import loaderd.samplers

    monkeypatch.setattr(loaderd.samplers, "_BLOCK", block)  # blocks must not change the draw
    rng = np.random.default_rng(3)
    imp = rng.exponential(1.0, 500).astype(np.float32)
    imp[:50] = 0.0
    ids, w = draw_unbiased(imp, 400, 0.0, np.random.default_rng(1))
    p = imp.astype(np.float64) / imp.astype(np.float64).sum()
    hits = np.bincount(ids, minlength=500)
    assert hits.sum() == 400 and (hits[:50] == 0).all()  # zero probability: never drawn
    assert (hits >= np.floor(400 * p) - 1e-9).all() and (hits <= np.ceil(400 * p) + 1e-9).all()
    np.testing.assert_allclose(w, 1 / (500 * p[ids]), rtol=1e-5)


def test_engine_unbiased_sampler() -> None:
    engine = engine_with_history("unbiased", mix=0.5)
    ids, w = engine.select(3, seed=0)
    assert ids.size == 700 and w.max() <= 2.0 + 1e-5
    assert w.mean() == pytest.approx(1.0, abs=0.1)


def test_infobatch_keeps_an_upweighted_share_of_the_pruned() -> None:
    imp = np.arange(1000, dtype=np.float32)
    ids, w, cut = select_infobatch(imp, 700, 0.5, np.random.default_rng(0))
    top = ids >= 300
    assert top.sum() == 700 and (w[top] == 1).all() and cut == 300.0
    assert 100 < (~top).sum() < 200 and (w[~top] == 2.0).all()  # each pruned kept w.p. 0.5
    assert set(ids[~top]) <= set(range(300))
    assert (np.diff(ids) > 0).all()


def test_annealing_trains_on_everything_in_the_last_epochs() -> None:
    engine = engine_with_history("infobatch", anneal_epochs=2, epochs=10)
    assert 800 < engine.select(7, seed=0)[0].size < 900  # 700 + about half of the other 300
    for epoch in (8, 9):
        ids, w = engine.select(epoch, seed=0)
        assert ids.size == 1000 and (w == 1).all()


# ---------------------------------------------------------------- learnable, budget


def crafted_histories(engine: ImportanceEngine, per_kind: int = 100) -> dict[str, np.ndarray]:
    """Two epochs of three kinds of sample (ids in blocks of ``per_kind``).

    ``noisy``: a wrong label, high loss that stays put (4.0, 4.1); ``learnable``: a loss that
    moves as the model learns it (1.6, then 0.9); ``easy``: already learned (0.02, 0.015).
    """
    kinds = {
        "noisy": (4.0, 4.1),
        "learnable": (1.6, 0.9),
        "easy": (0.02, 0.015),
    }
    ids = {}
    for i, (name, losses) in enumerate(kinds.items()):
        ids[name] = np.arange(i * per_kind, (i + 1) * per_kind)
        for epoch, loss in enumerate(losses):
            jitter = np.linspace(0.0, 0.01, per_kind, dtype=np.float32)  # no ties at the cut
            engine.record(ids[name], loss + jitter, epoch)
    return ids


def test_learnable_keeps_the_learnable_samples_and_drops_noisy_and_easy_ones() -> None:
    cfg = ImportanceConfig(sampler="learnable", warmup_epochs=2, keep_fraction=1 / 3, explore=0)
    engine = ImportanceEngine(300, cfg)
    kind = crafted_histories(engine)
    ids, weights = engine.select(2, seed=0)
    assert ids.tolist() == kind["learnable"].tolist()
    assert (weights == 1).all()
    # The seed's top-k of the latest loss keeps the mislabelled ones instead.
    top = ImportanceEngine(300, dataclasses.replace(cfg, sampler="importance"))
    crafted_histories(top)
    assert top.select(2, seed=0)[0].tolist() == kind["noisy"].tolist()
    score = engine.importance()  # what the plot and the cache tiers rank by
    assert score[kind["learnable"]].min() > score[kind["noisy"]].max() > score[kind["easy"]].max()


def test_loss_movement_is_the_spread_of_the_label_probability() -> None:
    nan = np.nan
    history = np.array([[0.0, 2.0, nan], [np.log(2), 2.0, 1.0]], np.float32)
    move = loss_movement(history)
    assert move[0] == pytest.approx(0.25)  # exp(-loss) went 1 -> 0.5: std 0.25
    assert move[1] == 0.0
    assert np.isnan(move[2])  # one epoch: unknown


def test_learnable_score_discounts_steady_samples_and_keeps_the_unknown() -> None:
    loss = np.array([2.0, 2.0, 2.0, 3.0, np.nan], np.float32)
    move = np.array([0.1, 0.3, 0.0, np.nan, np.nan], np.float32)  # median of the known: 0.1
    score = learnable_score(loss, move)
    assert score[0] == pytest.approx(2.0 * 0.25)  # as mobile as the median: a quarter
    assert score[1] == pytest.approx(2.0 * 0.75**2)
    assert score[2] == 0.0  # high and steady: nothing left
    assert score[3] == 3.0  # no movement known yet: the loss stands
    assert np.isnan(score[4])  # never scored: select_top ranks it first


def test_select_learnable_explores_at_random_with_weight_one() -> None:
    score = np.arange(10_000, dtype=np.float32)
    ids, w, cut = select_learnable(score, 2000, 0.3, np.random.default_rng(0))
    assert ids.size == 2000 and np.unique(ids).size == 2000 and (np.diff(ids) > 0).all()
    assert (w == 1).all()
    below = ids < cut
    # About 30% drawn at random, of which about 84% fall below the cut (the rest are top).
    assert 0.2 < below.mean() < 0.3
    assert np.array_equal(
        select_learnable(score, 2000, 0.0, np.random.default_rng(0))[0], np.arange(8000, 10_000)
    )
    assert select_learnable(score[:3], 3, 1.0, np.random.default_rng(0))[0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("sampler", ["learnable", "importance", "infobatch", "unbiased"])
def test_budget_spreads_what_warmup_and_annealing_leave_over_the_other_epochs(
    sampler: str,
) -> None:
    n, epochs = 4000, 20
    cfg = ImportanceConfig(
        sampler=sampler, budget=0.5, epochs=epochs, warmup_epochs=2, anneal_epochs=1
    )
    engine = ImportanceEngine(n, cfg)
    rng = np.random.default_rng(0)
    cost = 0.0
    rescored = 0
    for epoch in range(epochs):
        high = engine.rescore_ids(epoch)
        if high.size:
            engine.record(high, rng.exponential(1.0, high.size), epoch, kind="rescore")
        ids, _ = engine.select(epoch, seed=0)
        engine.record(np.unique(ids), rng.exponential(1.0, np.unique(ids).size), epoch)
        cost += ids.size + RESCORE_COST * high.size
        rescored += high.size
        if 2 <= epoch < 19 and sampler != "infobatch":  # (0.5 * 20 - 3) / 17, less re-scores
            assert ids.size == round(7 / 17 * n - RESCORE_COST * high.size)
    # The seed's sampler re-scores (and pays for it), learnable explores instead.
    assert (rescored > 0) == (sampler != "learnable")
    # infobatch's random share is drawn by coin flips: its cost is right on average.
    assert cost == pytest.approx(0.5 * epochs * n, rel=0.01 if sampler == "infobatch" else 0.001)


def test_budget_needs_epochs_and_room_beyond_warmup() -> None:
    with pytest.raises(ValueError, match="`budget` needs `epochs`"):
        ImportanceConfig(sampler="learnable", budget=0.5)
    with pytest.raises(ValueError, match=r"`budget` 0.1 of 10 epochs is 1 epochs of data, but"):
        ImportanceConfig(sampler="learnable", budget=0.1, epochs=10, warmup_epochs=2)
    with pytest.raises(ValueError, match="re-scores every sample every epoch"):
        ImportanceConfig(sampler="importance", budget=0.5, epochs=10, warmup_epochs=1)
    assert ImportanceConfig(budget=1, epochs=3).budget == 1.0


def test_each_sampler_has_its_own_defaults() -> None:
    learnable = ImportanceConfig(sampler="learnable")
    assert (learnable.warmup, learnable.history, learnable.rescoring) == (0, 2, False)
    seed = ImportanceConfig(sampler="importance")
    assert (seed.warmup, seed.history, seed.rescoring) == (3, 3, True)
    assert ImportanceConfig(sampler="importance", warmup_epochs=10**6).history == 64  # [64, N]
    mine = ImportanceConfig(sampler="learnable", warmup_epochs=1, window=4, rescore=True)
    assert (mine.warmup, mine.history, mine.rescoring) == (1, 4, True)
    # A daemon's defaults leave them open, so a job that picks a sampler gets its defaults.
    job = ImportanceConfig.from_options({"sampler": "learnable"}, ImportanceConfig())
    assert job.warmup == 0


def test_the_default_trains_everything() -> None:
    cfg = ImportanceConfig()
    assert cfg.sampler == "uniform"
    engine = ImportanceEngine(50, cfg)
    for epoch in range(5):
        ids, w = engine.select(epoch, seed=0)
        assert ids.tolist() == list(range(50)) and (w == 1).all()
        engine.record(ids, np.full(50, 1.0 / (epoch + 1)), epoch)
    assert engine.rescore_ids(4).size == 0
    assert engine.stats()["feedback_samples"] == 250  # statistics are kept all the same


# ---------------------------------------------------------------- record() validation


def test_record_refuses_bad_ids_and_losses() -> None:
    engine = ImportanceEngine(10, ImportanceConfig())
    with pytest.raises(ValueError, match=r"`ids\[2\]` = 10 is outside \[0, 10\)"):
        engine.record(np.array([0, 1, 10, -1]), np.ones(4), 0)
    with pytest.raises(ValueError, match=r"`ids\[1\]` = -1"):
        engine.record(np.array([0, -1]), np.ones(2), 0)
    with pytest.raises(ValueError, match=r"`losses\[1\]` = nan \(id 4\)"):
        engine.record(np.array([3, 4, 5]), np.array([1.0, np.nan, np.inf]), 0)
    with pytest.raises(ValueError, match=r"`losses\[0\]` = 1e\+39"):
        engine.record(np.array([3]), np.array([1e39]), 0)  # finite, but not in float32
    with pytest.raises(ValueError, match="`ids` must be integers"):
        engine.record(np.array([1.0]), np.ones(1), 0)
    with pytest.raises(ValueError, match="aligned"):
        engine.record(np.array([1, 2]), np.ones(3), 0)
    with pytest.raises(ValueError, match="`kind`"):
        engine.record(np.array([1]), np.ones(1), 0, kind="eval")
    with pytest.raises(ValueError, match="`epoch`"):
        engine.record(np.array([1]), np.ones(1), -1)
    with pytest.raises(ValueError, match="`seed`"):
        engine.select(0, seed=-3)
    assert engine.stats()["feedback_samples"] == 0  # nothing half-recorded


def test_record_counts_repeats_and_ignores_stale_epochs() -> None:
    engine = ImportanceEngine(10, ImportanceConfig())
    engine.record(np.array([1, 1, 2], np.uint32), np.array([1.0, 2.0, 3.0]), 1)
    engine.record(np.array([2]), np.array([9.0]), 0)  # older than its epoch-1 loss
    assert engine.importance()[[1, 2]].tolist() == [2.0, 3.0]
    assert engine.state_dict()["count"][[1, 2]].tolist() == [2, 2]
    assert engine.stats()["seen_samples"] == 2


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"keep_fraction": 0.0}, "keep_fraction"),
        ({"keep_fraction": 1.5}, "keep_fraction"),
        ({"keep_fraction": float("nan")}, "keep_fraction"),
        ({"keep_fraction": "0.5"}, "keep_fraction"),
        ({"sampler": "random"}, "sampler"),
        ({"warmup_epochs": -1}, "warmup_epochs"),
        ({"warmup_epochs": True}, "warmup_epochs"),
        ({"warmup_epochs": 2.0}, "warmup_epochs"),
        ({"rescore": 1}, "rescore"),
        ({"mix": -0.1}, "mix"),
        ({"prune_keep_prob": 0.0}, "prune_keep_prob"),
        ({"anneal_epochs": 2}, "anneal_epochs"),
        ({"anneal_epochs": 5, "epochs": 3}, "anneal_epochs"),
        ({"epochs": 0}, "epochs"),
        ({"explore": 1.5}, "explore"),
        ({"budget": 0.0, "epochs": 5}, "budget"),
        ({"budget": 2, "epochs": 5}, "budget"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"`{field}`"):
        ImportanceConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"`{field}`"):
        ImportanceConfig.from_options(kwargs, ImportanceConfig())


def test_from_options_overrides_defaults_and_refuses_unknown_keys() -> None:
    defaults = ImportanceConfig(sampler="importance", warmup_epochs=2)
    cfg = ImportanceConfig.from_options(json.loads('{"keep_fraction": 1, "mix": 0}'), defaults)
    assert cfg.sampler == "importance" and cfg.warmup_epochs == 2
    assert cfg.keep_fraction == 1.0 and isinstance(cfg.keep_fraction, float)
    assert ImportanceConfig.from_options({}, defaults) == defaults
    with pytest.raises(ValueError, match="keepfraction, zzz"):
        ImportanceConfig.from_options({"zzz": 1, "keepfraction": 0.5}, defaults)


def test_engine_refuses_bad_size() -> None:
    with pytest.raises(ValueError, match="`num_samples`"):
        ImportanceEngine(0, ImportanceConfig())


# ---------------------------------------------------------------- persistence


@pytest.mark.parametrize("sampler", ["importance", "unbiased", "infobatch"])
def test_state_dict_round_trip_through_npz(sampler: str) -> None:
    engine = engine_with_history(sampler)
    high = engine.rescore_ids(3)
    engine.record(high, np.full(high.size, 3.0), 3, kind="rescore")
    expected = engine.select(3, seed=5)
    buf = io.BytesIO()
    np.savez(buf, **engine.state_dict())
    buf.seek(0)
    restored = ImportanceEngine(1000, ImportanceConfig(sampler=sampler, warmup_epochs=3))
    with np.load(buf) as z:
        restored.load_state_dict({k: z[k] for k in z.files})
    assert restored.stats() == engine.stats()
    assert np.array_equal(restored.rescore_ids(3), high)
    got = restored.select(3, seed=5)
    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    for name, value in engine.state_dict().items():
        np.testing.assert_array_equal(restored.state_dict()[name], value, err_msg=name)


def test_load_state_dict_refuses_other_sizes_and_bad_arrays() -> None:
    state = engine_with_history().state_dict()
    with pytest.raises(ValueError, match="1000 samples, this engine has 999"):
        ImportanceEngine(999, ImportanceConfig()).load_state_dict(state)
    with pytest.raises(ValueError, match="`ring`"):
        ImportanceEngine(1000, ImportanceConfig(warmup_epochs=4)).load_state_dict(state)
    target = ImportanceEngine(1000, ImportanceConfig(warmup_epochs=3))
    with pytest.raises(ValueError, match="`last_loss`"):
        target.load_state_dict({**state, "last_loss": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match="missing"):
        target.load_state_dict({k: v for k, v in state.items() if k != "high"})
    with pytest.raises(ValueError, match="unknown"):
        target.load_state_dict({**state, "extra": np.zeros(1)})
    assert target.stats()["epoch"] == -1  # refused loads change nothing
