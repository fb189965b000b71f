"""The importance benchmark, end to end at a tiny budget through a real daemon.

Its claim rests on one thing: the budget-matched uniform baselines and the samplers are trained
by the same code, through the same daemon, and charged the same way. This runs the real script
(one small family, one seed) and checks exactly that.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_tiny_budget_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_importance

    calls: Counter[str] = Counter()
    real = bench_importance.train_run

    def counted(address: str, task: Any, job: str, options: dict[str, Any], *a: Any) -> Any:
        calls[options["sampler"]] += 1
        return real(address, task, job, options, *a)

    monkeypatch.setattr(bench_importance, "train_run", counted)
    argv = ["--families", "noisy10", "--seeds", "1", "--epochs", "8", "--budgets", "0.5"]
    argv += ["--samplers", "learnable", "importance", "--scale", "0.05", "--out", str(tmp_path)]
    assert bench_importance.main(bench_importance.parse_args(argv)) == 0

    report = json.loads((tmp_path / "importance.json").read_text())
    runs = {(r["arm"], r["budget"]): r for r in report["runs"]}
    assert set(runs) == {
        ("uniform", 1.0),
        ("uniform", 0.5),
        ("learnable", 0.5),
        ("importance", 0.5),
    }
    assert calls == {"uniform": 2, "learnable": 1, "importance": 1}  # one training function
    n = runs["uniform", 1.0]["train_samples"]
    for r in runs.values():  # the daemon served every step and every re-score forward
        assert r["served"] == r["train_steps"] + r["rescore_forwards"]
        assert r["sampler"] == r["options"]["sampler"]
    assert runs["uniform", 1.0]["train_steps"] == 8 * n
    assert (runs["uniform", 0.5]["epochs"], runs["uniform", 0.5]["train_steps"]) == (4, 4 * n)
    for name in ("learnable", "importance"):
        r = runs[name, 0.5]
        assert r["epochs"] == 8 and r["options"] == {"sampler": name, "budget": 0.5, "epochs": 8}
        assert 3.95 * n <= r["train_steps"] + r["rescore_forwards"] / 3 <= 4.02 * n
    assert runs["importance", 0.5]["rescore_forwards"] > 0  # the seed's method re-scores

    rows = {(r["arm"], r["budget"]): r for r in report["summary"]}
    for name in ("learnable", "importance"):  # the gain is against the same-seed uniform at 50%
        expected = runs[name, 0.5]["acc"] - runs["uniform", 0.5]["acc"]
        assert rows[name, 0.5]["gain"] == pytest.approx(expected, abs=0.01)
    assert report["goals"][0]["family"] == "noisy10"
    assert "budget-matched" in (tmp_path / "importance.md").read_text()
    assert (tmp_path / "importance.png").stat().st_size > 10_000
