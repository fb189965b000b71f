"""Two real ``loaderd serve --cluster`` daemons as two nodes, one trainer rank on each.

The trainers change nothing but their daemon: global ranks 0 and 1 of ``world_size=2``, each
talking to its own node's daemon. The daemons form a real gloo group on 127.0.0.1. Through the
selecting epochs of the ``importance`` sampler (re-score, then train) both nodes must plan the
same passes, the ranks' shares must be disjoint and together exactly the selection an engine
fed the whole job's feedback makes, and nobody may hang at the re-score barrier.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.protocol import MsgType
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, free_port, wait_until
from tests.integration.test_importance_e2e import (
    KEEP,
    OPTIONS,
    Mirror,
    rescore_pass,
    train_pass,
)

pytestmark = pytest.mark.integration

NODES = 2
EPOCHS = 4  # two warm-up epochs, then two selecting ones


@pytest.fixture
def nodes(dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> Iterator[list[Daemon]]:
    address = f"tcp://127.0.0.1:{free_port()}"
    daemons = [
        Daemon(
            db=dataset[0],
            state_dir=tmp_path / f"node{r}",
            extra=[
                "--cluster",
                address,
                "--nodes",
                str(NODES),
                "--node-rank",
                str(r),
                "--cluster-timeout",
                "60",
            ],
        )
        for r in range(NODES)
    ]
    try:
        for d in daemons:
            d.start()
        yield daemons
    finally:
        for d in daemons:
            d.close()


def rank_epochs(daemon: Daemon, rank: int, epochs: int) -> list[tuple[list[int], list[int]]]:
    """One trainer rank on its node's daemon: (re-scored, trained) ids of ``epochs`` epochs."""
    ds = LoaderdDataset(
        daemon.address,
        job="multi",
        batch_size=32,
        rank=rank,
        world_size=NODES,
        sampler="importance",
        **OPTIONS,
    )
    try:
        return [(rescore_pass(ds), train_pass(ds)) for _ in range(epochs)]
    finally:
        ds.close()


def run_ranks(nodes: list[Daemon], epochs: int) -> list[list[tuple[list[int], list[int]]]]:
    """Both ranks at once, as under torchrun (the re-score barrier needs both)."""
    with ThreadPoolExecutor(NODES) as pool:
        futures = [pool.submit(rank_epochs, d, r, epochs) for r, d in enumerate(nodes)]
        return [f.result(timeout=240) for f in futures]


def check_epochs(per_rank: list[list[tuple[list[int], list[int]]]]) -> int:
    """Each epoch: disjoint, equal shares that are exactly the whole job's selection.

    Returns:
        How many training losses the trainers fed back in all.
    """
    mirror = Mirror()  # one engine fed the whole job's feedback, both nodes' shares
    for epoch in range(EPOCHS):
        want_rescore, want_train = mirror.epoch(epoch)
        (r0, t0), (r1, t1) = per_rank[0][epoch], per_rank[1][epoch]
        assert not set(t0) & set(t1), f"epoch {epoch}: the ranks' shares overlap"
        assert len(t0) == len(set(t0)) and len(t1) == len(set(t1))
        assert sorted(t0 + t1) == want_train.tolist(), f"epoch {epoch}"
        assert len(t0) == len(t1)
        assert sorted(r0 + r1) == want_rescore.tolist(), f"epoch {epoch}"
        if epoch >= OPTIONS["warmup_epochs"]:
            assert want_rescore.size and len(want_train) == round(KEEP * N_SAMPLES)
    return sum(len(t) for rank in per_rank for _, t in rank)


def check_nodes_agree(nodes: list[Daemon], total: int) -> None:
    """Both nodes decided the same passes from the same history, each written down apart."""
    for epoch in range(OPTIONS["warmup_epochs"], EPOCHS):  # the last epochs' passes are kept
        for phase in ("rescore", "train"):
            saved = []
            for d in nodes:
                path = d.state_dir / "cluster" / "jobs" / "multi" / f"pass-{epoch}-{phase}.npz"
                with np.load(path) as z:
                    saved.append((z["ids"].tolist(), z["weights"].tolist()))
            assert saved[0] == saved[1], f"epoch {epoch} {phase}"

    def stats() -> list[dict[str, Any]]:
        out = []
        for d in nodes:
            with Connection(d.address, timeout_s=10) as conn:
                out.append(conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta)
        return out

    def settled() -> bool:  # the last feedback was acknowledged before a round carried it
        got = stats()
        feedback = {s["jobs"]["multi"]["importance"]["feedback_samples"] for s in got}
        return len(feedback) == 1 and all(s["cluster"]["pending_entries"] == 0 for s in got)

    wait_until(settled, timeout_s=30, what="both nodes holding the whole job's feedback")
    for rank, st in enumerate(stats()):
        cluster = st["cluster"]
        assert (cluster["node_rank"], cluster["nodes"], cluster["state"]) == (rank, NODES, "formed")
        assert cluster["jobs"]["multi"]["problems"] == []
        # Each node's engine holds the whole job's feedback, not only its own rank's.
        assert st["jobs"]["multi"]["importance"]["feedback_samples"] == total


def test_two_daemons_plan_every_selecting_epoch_alike(nodes: list[Daemon]) -> None:
    check_nodes_agree(nodes, check_epochs(run_ranks(nodes, EPOCHS)))


def test_a_node_killed_and_restarted_rejoins_and_the_plans_stay_exact(
    nodes: list[Daemon],
) -> None:
    first = run_ranks(nodes, OPTIONS["warmup_epochs"] + 1)  # through the first selecting epoch
    nodes[1].kill()  # SIGKILL: no snapshot, no goodbye; the round log and outbox must do
    nodes[1].start()  # the same command
    rest = run_ranks(nodes, EPOCHS - len(first[0]))
    check_nodes_agree(nodes, check_epochs([first[r] + rest[r] for r in range(NODES)]))
