"""The importance engine through the real daemon: phases, re-scoring, plans, restarts, options.

Losses are made up so that the groups are known in advance: samples ``id % 3 == 0`` alternate
between losses 1 and 3 from epoch to epoch (variance 1), the others drift by 0.01 per epoch
(variance 2.5e-5). Every expectation is also checked against an in-process
:class:`ImportanceEngine` fed the same feedback, so the tests follow the engine's rule rather
than restating it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loaderd.client import LoaderdDataset, RemoteError
from loaderd.client.connection import Connection
from loaderd.client.protocol import MsgType
from loaderd.importance import ImportanceConfig, ImportanceEngine
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, wait_until

pytestmark = pytest.mark.integration

K = 2  # warmup_epochs
KEEP = 0.5
HIGH = np.flatnonzero(np.arange(N_SAMPLES) % 3 == 0)
OPTIONS: dict[str, Any] = {"warmup_epochs": K, "keep_fraction": KEEP}


def train_loss(ids: np.ndarray, epoch: int) -> np.ndarray:
    high = ids % 3 == 0
    low = 0.5 + (ids % 7) * 0.05 + 0.01 * epoch
    return np.where(high, 1.0 + 2.0 * (epoch % 2), low).astype(np.float32)


def rescore_loss(ids: np.ndarray, epoch: int) -> np.ndarray:
    # Half of the high group turns out important, half not: the ranking has to use these.
    return np.where((ids // 3 + epoch) % 2 == 0, 5.0, 0.1).astype(np.float32)


def random_loss(ids: np.ndarray, epoch: int) -> np.ndarray:
    # No pattern in id order (the unbiased draw is systematic along ids, so a periodic loss
    # aliases with its grid and makes one epoch's mean weight swing by +-0.3).
    table = np.random.default_rng(epoch).gamma(2.0, size=N_SAMPLES)
    return table[ids].astype(np.float32)


LossFn = Callable[[np.ndarray, int], np.ndarray]


@pytest.fixture
def second_daemon(dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> Iterator[Daemon]:
    with Daemon(db=dataset[0], state_dir=tmp_path / "state2") as d:
        yield d


def dataset_for(daemon: Daemon, job: str, **kw: Any) -> LoaderdDataset:
    options = {"sampler": "importance", **OPTIONS, **kw}
    return LoaderdDataset(daemon.address, job=job, batch_size=32, **options)


def rescore_pass(ds: LoaderdDataset, loss: LossFn = rescore_loss) -> list[int]:
    seen: list[int] = []
    with torch.no_grad():
        for batch in ds.rescore():
            ids = batch["id"].numpy()
            seen += ids.tolist()
            ds.feedback(batch["id"], loss(ids, ds.epoch or 0))
    ds.flush()
    return seen


def train_pass(
    ds: LoaderdDataset, weights: list[float] | None = None, loss: LossFn = train_loss
) -> list[int]:
    seen: list[int] = []
    for batch in ds:
        ids = batch["id"].numpy()
        seen += ids.tolist()
        if weights is not None:
            weights += batch["weight"].tolist()
        ds.feedback(batch["id"], loss(ids, ds.epoch or 0))
    ds.flush()
    return seen


class Mirror:
    """An in-process engine fed exactly what the daemon is fed."""

    def __init__(self, seed: int = 0, **kw: Any) -> None:
        self.seed = seed
        config = ImportanceConfig(**{"sampler": "importance", **OPTIONS, **kw})
        self.engine = ImportanceEngine(N_SAMPLES, config)

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids to re-score, selected ids) for epoch e, feeding the engine like the client."""
        high = self.engine.rescore_ids(e)
        if high.size:
            self.engine.record(high, rescore_loss(high, e), e, "rescore")
        ids, _ = self.engine.select(e, self.seed)
        self.engine.record(ids, train_loss(ids, e), e, "train")
        return high, ids


def test_classify_then_select_with_exact_rescore_group(daemon: Daemon) -> None:
    ds = dataset_for(daemon, "phases")
    mirror = Mirror()
    for epoch in range(K + 2):
        rescored = rescore_pass(ds)
        trained = train_pass(ds)
        assert ds.epoch == epoch
        want_high, want_ids = mirror.epoch(epoch)
        stats = ds.stats()["jobs"]["phases"]["importance"]
        if epoch < K:
            assert rescored == []
            assert sorted(trained) == list(range(N_SAMPLES))  # everything, exactly once
            assert stats["phase"] == "classify"
        else:
            assert stats["phase"] == "select"
            assert len(rescored) == len(set(rescored))
            assert sorted(rescored) == HIGH.tolist() == want_high.tolist()
            assert len(trained) == len(set(trained)) == round(KEEP * N_SAMPLES)
            assert sorted(trained) == want_ids.tolist()
            # The re-scored losses decide: every high sample re-scored at 5.0 is kept, none at 0.1.
            hot = HIGH[rescore_loss(HIGH, epoch) == 5.0]
            cold = HIGH[rescore_loss(HIGH, epoch) == 0.1]
            assert set(hot.tolist()) <= set(trained)
            assert not set(cold.tolist()) & set(trained)
            assert stats["high_group"] == HIGH.size
            assert stats["low_group"] == N_SAMPLES - HIGH.size
            assert stats["rescored"] == HIGH.size
            assert stats["kept_fraction"] == pytest.approx(KEEP)


def test_two_ranks_split_evenly(daemon: Daemon) -> None:
    ranks = [dataset_for(daemon, "ddp", rank=r, world_size=2) for r in range(2)]
    mirror = Mirror()
    for epoch in range(K + 1):
        # Like DDP: every rank re-scores, then every rank trains (the daemon waits for all).
        rescored = [rescore_pass(ds) for ds in ranks]
        trained = [train_pass(ds) for ds in ranks]
        want_high, want_ids = mirror.epoch(epoch)
        both = trained[0] + trained[1]
        assert len(both) == len(set(both))
        assert sorted(both) == want_ids.tolist()
        assert len(trained[0]) == len(trained[1]) == len(want_ids) // 2
        assert sorted(rescored[0] + rescored[1]) == want_high.tolist()
        if want_high.size:
            assert abs(len(rescored[0]) - len(rescored[1])) <= 1
    assert len(want_ids) == round(KEEP * N_SAMPLES)

    # A rank that finishes re-scoring first must not plan the epoch without the others'
    # re-scores: its train pass waits until every rank has re-scored.
    epoch = K + 1
    want_high, want_ids = mirror.epoch(epoch)
    rescored = [rescore_pass(ranks[0])]
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(train_pass, ranks[0])
        rescored.append(rescore_pass(ranks[1]))
        trained = [train_pass(ranks[1]), first.result(timeout=20)]
    assert sorted(rescored[0] + rescored[1]) == want_high.tolist()
    assert sorted(trained[0] + trained[1]) == want_ids.tolist()


def run_epochs(ds: LoaderdDataset, epochs: int) -> list[list[int]]:
    plans = []
    for _ in range(epochs):
        rescore_pass(ds)
        plans.append(train_pass(ds))
    return plans


def test_plan_is_deterministic_and_survives_kill_9(daemon: Daemon, second_daemon: Daemon) -> None:
    a = dataset_for(daemon, "det")
    b = dataset_for(second_daemon, "det")
    plans_a, plans_b = run_epochs(a, K + 1), run_epochs(b, K + 1)
    assert plans_a == plans_b  # same seed, epoch and statistics: the same batches in order
    other = dataset_for(daemon, "det-seed1", seed=1)
    assert run_epochs(other, K + 1)[K] != plans_a[K]  # the seed matters

    before = a.stats()["jobs"]["det"]
    a.close()
    # Statistics are what this test is about; wait for the cursor (saved within a tick) too.
    job_json = daemon.state_dir / "jobs" / "det" / "job.json"
    batches = -(-round(KEEP * N_SAMPLES) // 32)

    def cursor_saved() -> bool:
        rank = json.loads(job_json.read_text())["ranks"][0]
        return (rank["epoch"], rank["phase"], len(rank["acked"])) == (K, "train", batches)

    wait_until(cursor_saved, what="the cursor of epoch K on disk")
    daemon.kill()  # SIGKILL: no chance to flush anything
    daemon.start()
    a = dataset_for(daemon, "det")
    after = a.stats()["jobs"]["det"]
    assert after["importance"] == before["importance"]
    assert after["epoch"] == before["epoch"] == K
    # The next epoch (re-score, rank, select) matches the daemon that was never killed.
    assert run_epochs(a, 1) == run_epochs(b, 1)
    assert a.stats()["jobs"]["det"]["importance"] == b.stats()["jobs"]["det"]["importance"]


def test_unbiased_weights_average_one(daemon: Daemon) -> None:
    ds = dataset_for(daemon, "unb", sampler="unbiased", warmup_epochs=1)
    config = ImportanceConfig(**{**OPTIONS, "sampler": "unbiased", "warmup_epochs": 1})
    engine = ImportanceEngine(N_SAMPLES, config)
    means = []
    for epoch in range(4):
        rescored = rescore_pass(ds, random_loss)
        weights: list[float] = []
        trained = train_pass(ds, weights, random_loss)
        if rescored:
            engine.record(
                np.array(rescored), random_loss(np.array(rescored), epoch), epoch, "rescore"
            )
        want_ids, want_w = engine.select(epoch, 0)
        engine.record(want_ids, random_loss(want_ids, epoch), epoch)
        order = np.argsort(trained, kind="stable")
        assert np.array(trained)[order].tolist() == want_ids.tolist()
        if epoch == 0:
            assert weights == [1.0] * N_SAMPLES  # classification: everything, weight 1
            continue
        w = np.array(weights)
        np.testing.assert_allclose(np.sort(w), np.sort(want_w))
        assert len(w) == round(KEEP * N_SAMPLES)
        assert not np.allclose(w, 1.0)
        # Drawn in proportion to the loss: the heavier a sample's loss, the lower its weight.
        loss = random_loss(np.array(trained), epoch)
        assert np.corrcoef(loss, w)[0, 1] < -0.5
        means.append(w.mean())
    assert np.mean(means) == pytest.approx(1.0, abs=0.05)


def test_infobatch_keeps_an_upweighted_share(daemon: Daemon) -> None:
    ds = dataset_for(daemon, "ib", sampler="infobatch", prune_keep_prob=0.5)
    run_epochs(ds, K)
    rescore_pass(ds)
    weights: list[float] = []
    trained = train_pass(ds, weights)
    top = round(KEEP * N_SAMPLES)
    assert sorted(set(weights)) == [1.0, 2.0]
    assert weights.count(1.0) == top
    # About half of the pruned rest comes back at weight 2 (binomial: 120 +- 3 sigma).
    assert abs(weights.count(2.0) - (N_SAMPLES - top) / 2) < 3 * np.sqrt(N_SAMPLES - top) / 2
    assert len(trained) == len(set(trained))


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"keep_fraction": 0}, "keep_fraction"),
        ({"keep_fraction": 1.5}, "keep_fraction"),
        ({"sampler": "bogus"}, "sampler"),
        ({"warmup_epochs": -1}, "warmup_epochs"),
        ({"keep_fractoin": 0.5}, "keep_fractoin"),
    ],
)
def test_bad_options_refused_at_hello(daemon: Daemon, options: dict[str, Any], name: str) -> None:
    ds = LoaderdDataset(daemon.address, job=f"bad-{name}", batch_size=32, **options)
    with pytest.raises(RemoteError, match=name):
        next(iter(ds))
    assert f"bad-{name}" not in ds.stats()["jobs"]  # nothing half-created


@pytest.mark.parametrize(
    "flags", [["--sampler", "bogus"], ["--warmup-epochs", "-1"], ["--keep-fraction", "0"]]
)
def test_serve_refuses_bad_defaults(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, flags: list[str]
) -> None:
    cmd = [sys.executable, "-m", "loaderd", "serve", "--db", str(dataset[0])]
    cmd += [
        "--socket",
        "ipc:///tmp/ld-never-bound/x.sock",
        "--state-dir",
        str(tmp_path / "s"),
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("loaderd: error:")
    assert flags[0][2:].replace("-", "_") in lines[0]


def test_stats_plot(daemon: Daemon, tmp_path: Path) -> None:
    ds = dataset_for(daemon, "plot")
    run_epochs(ds, K + 1)
    with Connection(daemon.address, timeout_s=10) as conn:
        detail = conn.request(MsgType.STATS, {"detail": True}, expect=MsgType.STATS_REPLY).meta
    hist = detail["jobs"]["plot"]["importance_detail"]
    assert sum(hist["variance"]["high"]) == HIGH.size  # the split, binned, no raw floats
    assert sum(hist["variance"]["low"]) + hist["variance"]["zeros"] == N_SAMPLES - HIGH.size
    assert len(hist["importance"]["edges"]) <= 101
    out = tmp_path / "imp.png"
    cmd = [sys.executable, "-m", "loaderd", "stats", "--socket", daemon.address, "--plot", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Without matplotlib: one clear line, non-zero exit.
    hide = "import sys; sys.modules['matplotlib'] = None; from loaderd.cli import main; "
    argv = ["stats", "--socket", daemon.address, "--plot", str(tmp_path / "no.png")]
    proc = subprocess.run(
        [sys.executable, "-c", hide + f"sys.exit(main({argv!r}))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "loaderd: error: --plot needs matplotlib: pip install 'loaderd[plot]' (or matplotlib)"
    ]
