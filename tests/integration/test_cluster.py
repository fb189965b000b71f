"""Three nodes on 127.0.0.1 as a real gloo group: agreement, restarts, refusals, timeouts.

Each node is a ``tests.integration.cluster_node`` process: a ClusterNode driven by a stand-in
for the epoch planner, with the real ImportanceEngine and planner, one job per sampler.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from loaderd.cluster import ClusterError, ClusterNode
from loaderd.cluster_wire import JobStatus, RankStatus, Round
from loaderd.config import ClusterConfig
from loaderd.journal import read_json
from tests.helpers import free_port, make_npz, wait_until

pytestmark = pytest.mark.integration

NODES = 3


@dataclass
class Cluster:
    """``cluster_node`` processes, one per node, with their logs and results under ``root``."""

    root: Path
    db: Path
    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def cmd(self, rank: int, db: Path | None = None) -> list[str]:
        return [
            sys.executable,
            "-m",
            "tests.integration.cluster_node",
            "--cluster",
            f"tcp://127.0.0.1:{self.port}",
            "--nodes",
            str(NODES),
            "--node-rank",
            str(rank),
            "--db",
            str(db or self.db),
            "--state",
            str(self.root / f"state{rank}"),
            "--out",
            str(self.out(rank)),
            *self.extra,
        ]

    def out(self, rank: int) -> Path:
        return self.root / f"result{rank}.json"

    def log(self, rank: int) -> Path:
        return self.root / f"node{rank}.log"

    def start(self, rank: int, db: Path | None = None) -> None:
        with open(self.log(rank), "ab") as log:
            self.procs[rank] = subprocess.Popen(
                self.cmd(rank, db), stdout=log, stderr=subprocess.STDOUT
            )

    def kill(self, rank: int) -> None:
        proc = self.procs[rank]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def wait(self, rank: int, timeout_s: float = 90) -> int:
        return self.procs[rank].wait(timeout_s)

    def progress(self, rank: int) -> int:
        """The lowest epoch any job's ranks on the node has reached (-1: nothing saved yet)."""
        saved = read_json(self.root / f"state{rank}" / "progress.json") or {}
        epochs = [s["epoch"] for job in saved.values() for s in job.values()]
        return min(epochs, default=-1)

    def error_line(self, rank: int) -> str:
        """The node's last ``loaderd: error:`` line (a warning of its shutdown may follow)."""
        lines = self.log(rank).read_text().strip().splitlines()
        return next((ln for ln in reversed(lines) if ln.startswith("loaderd: error:")), "")

    def results(self) -> list[dict[str, object]]:
        return [json.loads(self.out(r).read_text()) for r in range(NODES)]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for rank in self.procs:
            if self.log(rank).exists():
                print(f"--- node {rank}\n{self.log(rank).read_text()[-3000:]}")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two stores of the same shape and size but different content."""
    from loaderd.storage.ingest import ingest

    root = tmp_path_factory.mktemp("cluster-data")
    for name, seed in (("a", 0), ("b", 1)):
        make_npz(root / f"{name}.npz", 480, seed=seed)
        ingest(root / f"{name}.npz", root / f"{name}.db", progress=False)
    return root / "a.db", root / "b.db"


@pytest.fixture
def cluster(stores: tuple[Path, Path], tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, stores[0])
    try:
        yield c
    finally:
        c.close()


def check_agreement(results: list[dict[str, object]], exact: bool) -> None:
    """Every node decided the same passes and holds the same engine state; no entry lost."""
    first = results[0]["jobs"]
    assert isinstance(first, dict)
    for other in results[1:]:
        assert other["jobs"] == first
    for name, job in first.items():
        trained = sum(n for key, (n, _) in job["passes"].items() if key.endswith(":train"))
        rescored = sum(n for key, (n, _) in job["passes"].items() if key.endswith(":rescore"))
        # Each node's ranks fed back only their own share: the counts are the cluster's total.
        if exact:
            assert (job["feedback"], job["rescore_feedback"]) == (trained, rescored), name
        else:  # a killed node re-sends the batches it had not saved as done
            assert job["feedback"] >= trained and job["rescore_feedback"] >= rescored, name


def test_three_nodes_agree_for_every_sampler(cluster: Cluster) -> None:
    cluster.extra = ["--epochs", "5", "--timeout", "60"]
    for rank in range(NODES):
        cluster.start(rank)
    assert [cluster.wait(r) for r in range(NODES)] == [0] * NODES
    results = cluster.results()
    check_agreement(results, exact=True)
    jobs = results[0]["jobs"]
    assert isinstance(jobs, dict)
    assert jobs["job-uniform"]["passes"]["4:train"][0] == 480
    for sampler in ("importance", "unbiased"):
        assert jobs[f"job-{sampler}"]["passes"]["4:train"][0] == 240  # keep_fraction 0.5
    for sampler in ("importance", "unbiased", "infobatch"):
        assert jobs[f"job-{sampler}"]["passes"]["2:rescore"][0] > 0
        assert jobs[f"job-{sampler}"]["rescore_feedback"] > 0


def test_killed_nodes_rejoin_and_the_cluster_agrees(cluster: Cluster) -> None:
    """kill -9 of node 2, restarted from an older copy of its state; then of node 0 (the
    rendezvous store's host), restarted as it was. The others wait, the job goes on."""
    cluster.extra = ["--epochs", "7", "--pace", "0.02", "--timeout", "60"]
    for rank in range(NODES):
        cluster.start(rank)
    state2, old2 = cluster.root / "state2", cluster.root / "old2"
    wait_until(lambda: cluster.progress(2) >= 1, 60, "node 2 at epoch 1")
    shutil.copytree(state2, old2)  # while it runs: files may be torn
    for victim, epoch in ((2, 3), (0, 5)):
        wait_until(lambda v=victim, e=epoch: cluster.progress(v) >= e, 60, f"node {victim}")
        assert cluster.procs[victim].poll() is None, "the run ended before the kill"
        cluster.kill(victim)
        if victim == 2:
            shutil.rmtree(state2)
            old2.rename(state2)
        cluster.start(victim)
    assert [cluster.wait(r) for r in range(NODES)] == [0] * NODES
    results = cluster.results()
    check_agreement(results, exact=False)
    survivor, restored = results[1]["cluster"], results[2]["cluster"]
    assert isinstance(survivor, dict) and isinstance(restored, dict)
    assert survivor["generations"] >= 3  # node 1 lived through both deaths
    assert restored["caught_up"] > 0  # the rounds its old state lacked came from the others


def test_different_stores_are_refused_naming_both_nodes(
    cluster: Cluster, stores: tuple[Path, Path]
) -> None:
    cluster.extra = ["--timeout", "60"]
    for rank in range(NODES):
        cluster.start(rank, db=stores[1] if rank == 1 else None)
    assert [cluster.wait(r, 60) for r in range(NODES)] == [1] * NODES
    host = socket.gethostname()
    for rank in range(NODES):
        line = cluster.error_line(rank)
        assert line.startswith("loaderd: error: "), line
        assert f"node 1 ({host}) serves store" in line and f"node 0 ({host}) serves" in line
        assert "every node must open the same store" in line
    assert not any(cluster.out(r).exists() for r in range(NODES))


def test_a_node_that_never_comes_is_named_after_the_timeout(cluster: Cluster) -> None:
    cluster.extra = ["--timeout", "6"]
    for rank in (0, 1):
        cluster.start(rank)
    assert [cluster.wait(r, 60) for r in (0, 1)] == [1, 1]
    for rank in (0, 1):
        line = cluster.error_line(rank)
        assert line.startswith("loaderd: error: "), line
        # the first node to time out publishes the failure; the other says the same
        assert "node 2 never joined within 6 s" in line, line
        assert f"at tcp://127.0.0.1:{cluster.port}, seen from node " in line, line


def test_a_node_late_past_the_timeout_stalls_the_others_until_it_comes(
    cluster: Cluster,
) -> None:
    """Past the timeout the others report node 2 and try again in a fresh generation; once
    it comes the cluster forms and the job runs to its end on every node."""
    cluster.extra = ["--epochs", "3", "--timeout", "3", "--keep-trying"]
    for rank in (0, 1):
        cluster.start(rank)
    for rank in (0, 1):
        wait_until(
            lambda r=rank: "node 2 never joined within 3 s" in cluster.log(r).read_text(),
            60,
            f"node {rank} reporting node 2",
        )
    cluster.start(2)
    assert [cluster.wait(r) for r in range(NODES)] == [0] * NODES
    check_agreement(cluster.results(), exact=True)
    for rank in (0, 1):
        assert "cluster: recovered: generation" in cluster.log(rank).read_text()


def test_the_rendezvous_node_gone_for_good_is_named(cluster: Cluster) -> None:
    """Node 0 hosts the store: killed and not restarted, the others fail naming it."""
    cluster.extra = ["--epochs", "50", "--pace", "0.02", "--timeout", "8"]
    for rank in range(NODES):
        cluster.start(rank)
    wait_until(lambda: min(cluster.progress(r) for r in range(NODES)) >= 1, 60, "all nodes")
    cluster.kill(0)
    assert [cluster.wait(r, 60) for r in (1, 2)] == [1, 1]  # not killed by an abort at exit
    host = socket.gethostname()
    for rank in (1, 2):
        line = cluster.error_line(rank)
        assert line.startswith(f"loaderd: error: node 0 ({host}), which hosts the rendezvous"), line
        assert f"tcp://127.0.0.1:{cluster.port}" in line and "within 8 s" in line


def test_one_node_keeps_its_history_across_restarts(tmp_path: Path) -> None:
    """In process, a cluster of one: rounds are logged before they are handed out, handed
    out again after a restart, compacted on request; the outbox re-sends what no round held."""
    config = ClusterConfig(
        address=f"tcp://127.0.0.1:{free_port()}", nodes=1, timeout_s=20, round_interval_s=0.02
    )
    status = JobStatus({"name": "j"}, {0: RankStatus(0, "train", False)})

    def collect(node: ClusterNode, entries: int) -> list[Round]:
        got: list[Round] = []
        wait_until(
            lambda: bool(got.extend(node.rounds())) or sum(r.num_entries for r in got) >= entries,
            20,
            f"{entries} entries",
        )
        assert node.failure is None
        return got

    with ClusterNode(config, b"store", tmp_path) as node:
        node.start()
        node.set_status("j", status)
        for i in range(3):
            node.submit("j", 0, "train", np.arange(10 * i, 10 * i + 10), np.full(10, i))
            collect(node, 10)  # one round each
        assert node.stats()["round"] >= 3
    with ClusterNode(config, b"store", tmp_path, applied_round=1) as node:
        replayed = node.rounds()  # before start: straight from the log
        assert [r.number for r in replayed] == [2, 3]
        assert sum(r.num_entries for r in replayed) == 20
        assert [b.losses[0] for r in replayed for b in r.entries()] == [1.0, 2.0]
        node.submit("j", 1, "rescore", np.array([7, 8]), np.array([0.5, 0.25]))
        node.sync()  # acknowledged, then the daemon stops before any round holds it
    with ClusterNode(config, b"store", tmp_path, applied_round=3) as node:
        assert node.rounds() == [] and node.stats()["pending_entries"] == 2
        node.start()
        (rnd,) = [r for r in collect(node, 2) if r.num_entries]
        (block,) = rnd.entries()
        assert (block.epoch, block.kind, block.ids.tolist()) == (1, "rescore", [7, 8])
        node.compact(rnd.number)
        wait_until(lambda: not (tmp_path / "cluster" / "rounds-000000000001.log").exists(), 10)
    with pytest.raises(ClusterError, match="the caller's state is at round 0"):
        ClusterNode(config, b"store", tmp_path)
    with ClusterNode(config, b"store", tmp_path, applied_round=50) as node:  # log lost
        assert node.stats()["round"] == 50 and node.rounds() == []
    other = ClusterConfig(address=config.address, nodes=2, node_rank=1)
    with pytest.raises(ClusterError, match="holds the state of node 0 of 1, not of node 1 of 2"):
        ClusterNode(other, b"store", tmp_path)
