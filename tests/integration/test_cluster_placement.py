"""Node-local placement: each node's tiers and read-ahead hold only what its own ranks read.

Two real ``loaderd serve --cluster`` daemons on 127.0.0.1, two trainer ranks on each (global
ranks ``2n`` and ``2n + 1`` on node ``n``), the ``importance`` sampler through warm-up epochs
and a selecting one. Every node knows the whole job's plan; after each epoch's training pass
its DRAM and NVRAM placement must target exactly the samples its own two ranks trained (the
ranks' shares are disjoint, so nothing of the other node's), and its read-ahead must have
followed only its own ranks' passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.protocol import MsgType
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, free_port, wait_until
from tests.integration.test_importance_e2e import OPTIONS, rescore_pass, train_pass

pytestmark = pytest.mark.integration

NODES = 2
PER_NODE = 2
WORLD = NODES * PER_NODE
EPOCHS = OPTIONS["warmup_epochs"] + 1  # warm-up epochs (every sample), then a selecting one


@pytest.fixture
def nodes(dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> Iterator[list[Daemon]]:
    address = f"tcp://127.0.0.1:{free_port()}"
    daemons = []
    for r in range(NODES):
        extra = ["--cluster", address, "--nodes", str(NODES), "--node-rank", str(r)]
        extra += ["--cluster-timeout", "60"]
        # DRAM for a few dozen records, the arena for the rest: both tiers get targets.
        extra += ["--dram-bytes", "16KiB", "--nvram-dir", str(tmp_path / f"nv{r}")]
        extra += ["--nvram-bytes", "4MiB"]
        daemons.append(Daemon(db=dataset[0], state_dir=tmp_path / f"node{r}", extra=extra))
    try:
        with ThreadPoolExecutor(NODES) as pool:  # each start waits for its daemon
            for started in [pool.submit(d.start) for d in daemons]:
                started.result()
        yield daemons
    finally:
        for d in daemons:
            d.close()


def stats(daemon: Daemon) -> dict[str, Any]:
    with Connection(daemon.address, timeout_s=10) as conn:
        meta: dict[str, Any] = conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta
        return meta


def rank_epochs(daemon: Daemon, rank: int) -> list[list[int]]:
    """One trainer rank on its node's daemon: the ids it trained, epoch by epoch."""
    ds = LoaderdDataset(
        daemon.address,
        job="local",
        batch_size=16,
        rank=rank,
        world_size=WORLD,
        sampler="importance",
        **OPTIONS,
    )
    try:
        trained = []
        for _ in range(EPOCHS):
            rescore_pass(ds)
            trained.append(train_pass(ds))
        return trained
    finally:
        ds.close()


def digest(ids: set[int]) -> str:
    return xxhash.xxh3_64(np.array(sorted(ids), np.int64).tobytes()).hexdigest()


def test_each_node_places_and_reads_ahead_only_its_own_ranks_share(nodes: list[Daemon]) -> None:
    with ThreadPoolExecutor(WORLD) as pool:
        futures = [pool.submit(rank_epochs, nodes[r // PER_NODE], r) for r in range(WORLD)]
        per_rank = [f.result(timeout=240) for f in futures]
    last = EPOCHS - 1
    shares = []
    for n, daemon in enumerate(nodes):
        ranks = list(range(n * PER_NODE, (n + 1) * PER_NODE))
        share = {i for r in ranks for i in per_rank[r][last]}
        shares.append(share)

        def placed(daemon: Daemon = daemon, ranks: list[int] = ranks) -> bool:
            p = stats(daemon)["placement"]
            return (p["job"], p["epoch"], p["ranks"]) == ("local", last, ranks)

        # The tiers place on their own thread, after the last rank of the node opened its pass.
        wait_until(placed, timeout_s=60, what=f"node {n} placed for epoch {last}")
        st = stats(daemon)
        p = st["placement"]
        assert p["node_local"] is True
        assert p["share_samples"] == len(share)
        assert p["outside_share"] == 0, f"node {n} targets samples its ranks do not read"
        assert p["targeted"]["dram"] > 0 and p["targeted"]["nvram"] > 0, p["targeted"]
        # The share fits in the two tiers: exactly the node's own samples are targeted.
        assert p["targeted"]["dram"] + p["targeted"]["nvram"] == len(share)
        assert p["target_digest"] == digest(share)
        assert st["readahead"]["ranks"] == {"local": ranks}, f"node {n} read ahead for others"
    # The nodes' shares are disjoint and the selecting epoch trains half the samples.
    assert not shares[0] & shares[1]
    assert len(shares[0] | shares[1]) == round(OPTIONS["keep_fraction"] * N_SAMPLES)
