"""Three real ``loaderd serve --cluster`` daemons, two trainer ranks on each, one killed mid-epoch.

Six trainer ranks (global ranks ``2n`` and ``2n + 1`` on node ``n``) run the ``importance``
sampler with re-scoring through warm-up and selecting epochs, as under torchrun. In the middle
of a selecting epoch's training pass node 2's daemon is killed with SIGKILL and started again
with the same command; its trainers reconnect and go on. Every epoch must still be exactly
what the plan promises: the training pass's shares disjoint, equal, and together exactly the
selection the nodes agreed on (re-score passes likewise), with every node holding the same
selection, decided from the same history.

Node 0 hosts the rendezvous store. Killed, the other daemons stay up: past
``--cluster-timeout`` they report the missing node in their log and stats and keep trying,
they go on serving the passes already decided, tell a trainer parked on an undecided pass
why it waits, and re-form the group with node 0's restarted daemon.
"""

from __future__ import annotations

import contextlib
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
from loaderd.stats import format_table
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, free_port, wait_until
from tests.integration.test_importance_e2e import KEEP, OPTIONS, rescore_pass, train_pass

pytestmark = pytest.mark.integration

NODES = 3
RANKS_PER_NODE = 2
EPOCHS = 4  # two warm-up epochs, then two selecting ones
VICTIM = 2  # the node whose daemon is killed (node 0, the store's host, has its own test)
KILL_AT = 2  # ... in the training pass of this (selecting) epoch

Epochs = list[tuple[list[int], list[int]]]  # per epoch: (re-scored ids, trained ids)


def start_nodes(db: Path, root: Path, timeout_s: int) -> list[Daemon]:
    address = f"tcp://127.0.0.1:{free_port()}"
    daemons = []
    for r in range(NODES):
        extra = ["--cluster", address, "--nodes", str(NODES), "--node-rank", str(r)]
        extra += ["--cluster-timeout", str(timeout_s)]
        daemons.append(Daemon(db=db, state_dir=root / f"node{r}", extra=extra))
    return daemons


@pytest.fixture
def dbroot(dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> tuple[Path, Path]:
    return dataset[0], tmp_path


@contextlib.contextmanager
def running(daemons: list[Daemon]) -> Iterator[list[Daemon]]:
    try:
        with ThreadPoolExecutor(len(daemons)) as pool:  # each start waits for its daemon
            for started in [pool.submit(d.start) for d in daemons]:
                started.result()
        yield daemons
    finally:
        with ThreadPoolExecutor(len(daemons)) as pool:
            list(pool.map(Daemon.close, daemons))


@pytest.fixture
def nodes(dbroot: tuple[Path, Path]) -> Iterator[list[Daemon]]:
    with running(start_nodes(*dbroot, timeout_s=120)) as daemons:
        yield daemons


class Gate:
    """Holds one rank after its first batch of epoch ``at``'s training pass until the test
    opens it again (having killed a daemon)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.reached = threading.Event()
        self.opened = threading.Event()
        self.trained = threading.Event()  # the rank finished that training pass

    def train(self, ds: LoaderdDataset) -> list[int]:
        seen: list[int] = []
        for batch in ds:
            ids = batch["id"].numpy()
            seen += ids.tolist()
            ds.feedback(batch["id"], np.ones(len(ids), np.float32))
            if not self.reached.is_set():
                self.reached.set()
                assert self.opened.wait(120), "the test never opened the gate"
        ds.flush()
        self.trained.set()
        return seen


def rank_epochs(daemon: Daemon, rank: int, world: int, epochs: int, gate: Gate | None) -> Epochs:
    """One trainer rank on its node's daemon, every epoch (re-score, then train)."""
    ds = LoaderdDataset(
        daemon.address,
        job="three",
        batch_size=16,
        rank=rank,
        world_size=world,
        sampler="importance",
        # A request in flight when its daemon is killed is lost; the client notices by this
        # timeout and reconnects. Parked requests get WAITING notes, so it ends no wait early.
        timeout_s=6,
        **OPTIONS,
    )
    try:
        out = []
        for epoch in range(epochs):
            rescored = rescore_pass(ds)
            if gate is not None and epoch == gate.at:
                out.append((rescored, gate.train(ds)))
            else:
                out.append((rescored, train_pass(ds)))
        return out
    finally:
        ds.close()


def run_ranks(nodes: list[Daemon], per_node: int, epochs: int, gates: dict[int, Gate]) -> Any:
    """Every rank in a thread of its own, as under torchrun; the futures of their epochs."""
    world = NODES * per_node
    pool = ThreadPoolExecutor(world)
    futures = [
        pool.submit(rank_epochs, nodes[r // per_node], r, world, epochs, gates.get(r))
        for r in range(world)
    ]
    pool.shutdown(wait=False)
    return futures


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
    world = len(per_rank)
    for epoch in range(len(per_rank[0])):
        rescored = [per_rank[r][epoch][0] for r in range(world)]
        trained = [per_rank[r][epoch][1] for r in range(world)]
        for r in range(world):
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


def settle(nodes: list[Daemon]) -> list[dict[str, Any]]:
    """Wait until every node holds every round (the same history everywhere); their stats."""

    def settled() -> bool:
        got = [stats(d)["cluster"] for d in nodes]
        return len({c["round"] for c in got}) == 1 and all(
            c["pending_entries"] == 0 and c["state"] == "formed" for c in got
        )

    wait_until(settled, timeout_s=60, what="the three nodes at the same round")
    out = [stats(d)["cluster"] for d in nodes]
    for cluster in out:
        assert cluster["jobs"]["three"]["problems"] == []
        assert cluster["error"] is None
    return out


def test_three_daemons_six_ranks_one_killed_mid_epoch(nodes: list[Daemon]) -> None:
    gate = Gate(KILL_AT)
    futures = run_ranks(nodes, RANKS_PER_NODE, EPOCHS, {VICTIM * RANKS_PER_NODE: gate})
    assert gate.reached.wait(120), "the victim's rank never reached the selecting epoch"
    nodes[VICTIM].kill()  # SIGKILL in the middle of a selecting epoch's training pass
    nodes[VICTIM].start()  # the same command; it rejoins, its trainers reconnect
    gate.opened.set()
    check_exactly_once(nodes, [f.result(timeout=240) for f in futures])
    assert settle(nodes)[0]["generations"] >= 2  # the group re-formed after the kill
    check_global_progress(nodes)


def check_global_progress(nodes: list[Daemon]) -> None:
    """Every node's stats show the whole cluster: who joined, the agreed pass, every node's
    ranks where the last round saw them (here: all done with the last epoch)."""
    last = f"{EPOCHS - 1}:train"

    def views() -> list[dict[str, Any]]:
        return [stats(d)["cluster"]["jobs"]["three"] for d in nodes]

    def all_done() -> bool:
        progress = [v["progress"] for v in views()]
        return all(
            p is not None and all(n["complete"] == RANKS_PER_NODE for n in p["nodes"].values())
            for p in progress
        )

    wait_until(all_done, timeout_s=60, what="every node's view showing every rank done")
    got = views()
    for view in got:
        assert view["agreed"] == last
        assert view["progress"] == got[0]["progress"]  # one view, whichever node is asked
    progress = got[0]["progress"]
    assert (progress["epoch"], progress["ranks_reporting"]) == (EPOCHS - 1, NODES * 2)
    assert progress["nodes"] == {
        str(n): {"ranks": [2 * n, 2 * n + 1], "at": last, "complete": 2, "waiting": 0}
        for n in range(NODES)
    }
    for rank, d in enumerate(nodes):
        full = stats(d)
        assert len(full["cluster"]["joined"]) == NODES
        table = format_table(full).splitlines()
        head = f"cluster (node {rank} of {NODES}, formed, generation "
        assert any(line.startswith(head) for line in table), table
        assert any(f"agreed {last}, 6 of 6 ranks in round" in line for line in table), table
        node2 = f"ranks 4,5 at {last}, 2 done, 0 waiting"
        assert any(line.strip().startswith("node 2") and node2 in line for line in table)


def test_the_rendezvous_node_killed_the_others_report_it_and_recover(
    dbroot: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Node 0 (the store's host) killed mid-epoch and restarted only after the others have
    given up waiting: they stay up, say so, serve the pass already decided, then re-form."""
    with running(start_nodes(*dbroot, timeout_s=4)) as nodes:
        gate = Gate(1)  # node 1's rank, in the second warm-up epoch's training pass
        futures = run_ranks(nodes, 1, 3, {1: gate})
        assert gate.reached.wait(120), "node 1's rank never reached epoch 1"
        nodes[0].kill()

        def reported() -> bool:
            return all(stats(d)["cluster"]["state"] == "stalled" for d in nodes[1:])

        wait_until(reported, timeout_s=60, what="nodes 1 and 2 reporting node 0 missing")
        for d in nodes[1:]:
            cluster = stats(d)["cluster"]
            assert cluster["error"].startswith("node 0 ("), cluster["error"]
            assert "which hosts the rendezvous store at tcp://127.0.0.1:" in cluster["error"]
            assert "within 4 s" in cluster["error"]
            assert "which hosts the rendezvous store" in d.log.read_text()
            table = format_table(stats(d))
            assert f"cluster (node {nodes.index(d)} of {NODES}, stalled, round " in table
            assert any(
                line.startswith("  error ") and line.endswith(cluster["error"])
                for line in table.splitlines()
            ), table
        # The pass decided before node 0 died needs no agreement: node 1 serves all of it.
        gate.opened.set()
        assert gate.trained.wait(120), "node 1 did not serve its decided pass without node 0"
        assert all(d.proc is not None and d.proc.poll() is None for d in nodes[1:])

        def told() -> bool:  # the next pass needs agreement: the trainer is told why it waits
            return any("the cluster is stalled: node 0 (" in r.getMessage() for r in caplog.records)

        wait_until(told, timeout_s=60, what="a parked trainer told about the stall")
        nodes[0].start()  # the same command: a fresh store, the others rejoin it
        check_exactly_once(nodes, [f.result(timeout=240) for f in futures])
        after = settle(nodes)
        assert all(c["generations"] >= 2 for c in after[1:])
        assert "cluster: recovered: generation" in nodes[1].log.read_text()
