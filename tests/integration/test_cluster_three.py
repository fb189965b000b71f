"""Three real ``loaderd serve --cluster`` daemons, two trainer ranks on each, one killed mid-epoch.

Six trainer ranks (global ranks ``2n`` and ``2n + 1`` on node ``n``) run the ``importance``
sampler with re-scoring through warm-up and selecting epochs, as under torchrun. In the middle
of a selecting epoch's training pass node 2's daemon is killed with SIGKILL and started again
with the same command; its trainers reconnect and go on. Every epoch must still be exactly
what the plan promises: the training pass's shares disjoint, equal, and together exactly the
selection the nodes agreed on (re-score passes likewise), with every node holding the same
selection, decided from the same history.
"""

from __future__ import annotations

import threading
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
from tests.integration.test_importance_e2e import KEEP, OPTIONS, rescore_pass, train_pass

pytestmark = pytest.mark.integration

NODES = 3
RANKS_PER_NODE = 2
WORLD = NODES * RANKS_PER_NODE
EPOCHS = 4  # two warm-up epochs, then two selecting ones
VICTIM = 2  # the node whose daemon is killed (node 0, the store's host, has its own test)
KILL_AT = 2  # ... in the training pass of this (selecting) epoch

Epochs = list[tuple[list[int], list[int]]]  # per epoch: (re-scored ids, trained ids)


def node_args(address: str, rank: int) -> list[str]:
    return [
        "--cluster",
        address,
        "--nodes",
        str(NODES),
        "--node-rank",
        str(rank),
        "--cluster-timeout",
        "120",
    ]


@pytest.fixture
def nodes(dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> Iterator[list[Daemon]]:
    address = f"tcp://127.0.0.1:{free_port()}"
    daemons = [
        Daemon(db=dataset[0], state_dir=tmp_path / f"node{r}", extra=node_args(address, r))
        for r in range(NODES)
    ]
    try:
        for d in daemons:
            d.start()
        yield daemons
    finally:
        for d in daemons:
            d.close()


class KillGate:
    """Holds one rank of the victim node after its first batch of epoch ``KILL_AT``'s
    training pass, until the test has killed and restarted the daemon."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.restarted = threading.Event()

    def train(self, ds: LoaderdDataset) -> list[int]:
        seen: list[int] = []
        for batch in ds:
            ids = batch["id"].numpy()
            seen += ids.tolist()
            ds.feedback(batch["id"], np.ones(len(ids), np.float32))
            if not self.reached.is_set():
                self.reached.set()
                assert self.restarted.wait(120), "the daemon was not restarted"
        ds.flush()
        return seen


def rank_epochs(daemon: Daemon, rank: int, gate: KillGate | None) -> Epochs:
    """One trainer rank on its node's daemon, every epoch (re-score, then train)."""
    ds = LoaderdDataset(
        daemon.address,
        job="three",
        batch_size=16,
        rank=rank,
        world_size=WORLD,
        sampler="importance",
        # A request in flight when its daemon is killed is lost; the client notices by this
        # timeout and reconnects. Parked requests get WAITING notes, so it ends no wait early.
        timeout_s=6,
        **OPTIONS,
    )
    try:
        out = []
        for epoch in range(EPOCHS):
            rescored = rescore_pass(ds)
            if gate is not None and epoch == KILL_AT:
                out.append((rescored, gate.train(ds)))
            else:
                out.append((rescored, train_pass(ds)))
        return out
    finally:
        ds.close()


def node_of(rank: int) -> int:
    return rank // RANKS_PER_NODE


def saved_pass(daemon: Daemon, epoch: int, phase: str) -> list[int]:
    path = daemon.state_dir / "cluster" / "jobs" / "three" / f"pass-{epoch}-{phase}.npz"
    with np.load(path) as z:
        return sorted(z["ids"].tolist())


def stats(daemon: Daemon) -> dict[str, Any]:
    with Connection(daemon.address, timeout_s=10) as conn:
        meta: dict[str, Any] = conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta
        return meta


def check_exactly_once(nodes: list[Daemon], per_rank: list[Epochs]) -> None:
    """Each epoch: every rank's share once, disjoint, equal, together exactly the plan."""
    everything = list(range(N_SAMPLES))
    for epoch in range(EPOCHS):
        rescored = [per_rank[r][epoch][0] for r in range(WORLD)]
        trained = [per_rank[r][epoch][1] for r in range(WORLD)]
        for r in range(WORLD):
            assert len(trained[r]) == len(set(trained[r])), f"epoch {epoch} rank {r}: repeats"
        assert len({len(t) for t in trained}) == 1, f"epoch {epoch}: unequal shares"
        all_trained = sorted(i for t in trained for i in t)
        all_rescored = sorted(i for r in rescored for i in r)
        if epoch < OPTIONS["warmup_epochs"]:
            assert all_trained == everything, f"epoch {epoch}"
            assert all_rescored == []
            continue
        # A selecting epoch: the plan is the selection the nodes agreed on (480 * KEEP
        # samples, a multiple of the world size, so no padding), and the re-score group.
        plans = [saved_pass(d, epoch, "train") for d in nodes]
        assert plans[0] == plans[1] == plans[2], f"epoch {epoch}: the nodes selected apart"
        assert len(plans[0]) == round(KEEP * N_SAMPLES) == len(set(plans[0]))
        assert all_trained == plans[0], f"epoch {epoch}: not exactly the selection"
        rescore_plans = [saved_pass(d, epoch, "rescore") for d in nodes]
        assert rescore_plans[0] == rescore_plans[1] == rescore_plans[2], f"epoch {epoch}"
        assert rescore_plans[0], f"epoch {epoch}: nothing re-scored"
        assert all_rescored == rescore_plans[0], f"epoch {epoch}: re-score pass not exact"


def test_three_daemons_six_ranks_one_killed_mid_epoch(nodes: list[Daemon]) -> None:
    gate = KillGate()
    victim_rank = VICTIM * RANKS_PER_NODE
    with ThreadPoolExecutor(WORLD) as pool:
        futures = [
            pool.submit(rank_epochs, nodes[node_of(r)], r, gate if r == victim_rank else None)
            for r in range(WORLD)
        ]
        assert gate.reached.wait(120), "the victim's rank never reached the selecting epoch"
        nodes[VICTIM].kill()  # SIGKILL in the middle of a selecting epoch's training pass
        nodes[VICTIM].start()  # the same command; it rejoins, its trainers reconnect
        gate.restarted.set()
        per_rank = [f.result(timeout=240) for f in futures]
    check_exactly_once(nodes, per_rank)

    def settled() -> bool:  # every node holds every round: the same history everywhere
        got = [stats(d)["cluster"] for d in nodes]
        return len({c["round"] for c in got}) == 1 and all(
            c["pending_entries"] == 0 and c["state"] == "formed" for c in got
        )

    wait_until(settled, timeout_s=60, what="the three nodes at the same round")
    for d in nodes:
        cluster = stats(d)["cluster"]
        assert cluster["jobs"]["three"]["problems"] == []
    assert stats(nodes[0])["cluster"]["generations"] >= 2  # the group re-formed after the kill
