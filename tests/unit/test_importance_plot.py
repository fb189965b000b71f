"""What `loaderd stats --plot` bins in the daemon, and that it draws."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loaderd.importance import ImportanceConfig, ImportanceEngine
from loaderd.importance_plot import _skewed, histograms, plot


def engine_with_a_noisy_tail() -> ImportanceEngine:
    """200 samples being learned, 600 easy ones, and 200 mislabelled (high, steady loss)."""
    cfg = ImportanceConfig(sampler="learnable", keep_fraction=0.25, explore=0.0)
    engine = ImportanceEngine(1000, cfg)
    rng = np.random.default_rng(0)
    learning = np.linspace(0.8, 2.0, 200)
    easy = rng.exponential(0.02, 600)
    noisy = 4.0 + rng.normal(0, 0.2, 200)
    ids = np.arange(1000)
    engine.record(ids, np.concatenate([learning + 0.7, easy * 1.2, noisy]), 0)
    engine.record(ids, np.concatenate([learning, easy, noisy + 0.01]), 1)
    engine.select(2, seed=0)
    return engine


def test_the_noisy_tail_is_its_own_corner_of_the_loss_movement_map() -> None:
    h = histograms(engine_with_a_noisy_tail())["loss_movement"]
    counts = np.asarray(h["counts"])
    assert counts.sum() == 1000 and h["unknown"] == 0
    x_top = np.asarray(h["x_edges"])[1:]  # bins' upper edges
    y_top = np.asarray(h["y_edges"])[1:]
    corner = counts[np.ix_(x_top > 2.5, y_top <= 0.01)].sum()  # loss past 2.5, fit steady
    assert corner == 200
    assert h["rule"] == "learnable" and h["cut"] > 0 and h["reference"] > 0


def test_importance_axis_goes_logarithmic_when_skewed() -> None:
    rng = np.random.default_rng(1)
    assert _skewed(rng.exponential(1.0, 10_000) ** 3)
    assert not _skewed(rng.uniform(1.0, 2.0, 10_000))
    assert not _skewed(np.array([-1.0, 0.0, 1.0]))  # not all positive: linear
    h = histograms(engine_with_a_noisy_tail())["importance"]
    kept = sum(h["high"])
    assert 245 <= kept <= 255 and h["threshold"] is not None  # the keep threshold is there


def test_plot_draws_every_job(tmp_path: Path) -> None:
    engine = engine_with_a_noisy_tail()
    job = {"importance": engine.stats(), "importance_detail": histograms(engine)}
    empty = ImportanceEngine(10, ImportanceConfig())  # no history yet: panels say so
    jobs = {"a": job, "b": {"importance": empty.stats(), "importance_detail": histograms(empty)}}
    out = tmp_path / "imp.png"
    assert plot({"jobs": jobs}, out) == 2
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
