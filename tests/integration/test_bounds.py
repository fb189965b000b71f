"""One client must not take the daemon down or starve the others: what a connection may hold.

Raw requests where the client library would never misbehave: a connection that asks for
batch after batch and acknowledges none, OPEN_PASS requests parked by the thousand.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from loaderd.client import LoaderdDataset, RemoteError
from loaderd.client.connection import Connection
from loaderd.client.errors import ErrorCode
from loaderd.client.protocol import PROTOCOL_VERSION, MsgType
from loaderd.config import LimitsConfig
from loaderd.stats_cache import MAX_AGE_S
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon

pytestmark = pytest.mark.integration


def hello(conn: Connection, job: str, batch_size: int = 1, **options: Any) -> None:
    meta = {
        "job": job,
        "rank": 0,
        "world_size": 1,
        "seed": 0,
        "batch_size": batch_size,
        "options": options,
        "version": PROTOCOL_VERSION,
        "shm": False,
    }
    conn.request(MsgType.HELLO, meta, expect=MsgType.WELCOME)


def test_a_connection_that_never_acknowledges_is_held_to_its_bound(daemon: Daemon) -> None:
    limit = LimitsConfig().max_outstanding_batches
    assert limit + 44 <= N_SAMPLES, "one batch per sample: more batches than the bound"
    base = {"job": "greedy", "rank": 0, "worker": 0, "phase": "train"}
    with Connection(daemon.address, timeout_s=60.0) as conn:
        hello(conn, "greedy")
        epoch = conn.request(MsgType.OPEN_PASS, base, expect=MsgType.PASS).meta["epoch"]
        ask = {**base, "epoch": epoch, "acks": []}
        rids = [conn.send(MsgType.GET_BATCH, ask) for _ in range(limit + 44)]
        got: list[int] = []
        refused: list[RemoteError] = []
        for rid in rids:
            try:
                got.append(int(conn.wait(rid).meta["index"]))
            except RemoteError as e:
                refused.append(e)
        assert len(got) == limit and len(refused) == 44
        assert all(e.code == ErrorCode.BAD_ARGUMENT for e in refused)
        assert "max_outstanding_batches" in str(refused[0]) and "\n" not in str(refused[0])
        # Acknowledging makes room again: the connection is bounded, not banned.
        more = conn.request(MsgType.GET_BATCH, {**ask, "acks": got}, expect=MsgType.BATCH)
        assert int(more.meta["index"]) not in got
    # The daemon serves on, and another client is not affected.
    ds = LoaderdDataset(daemon.address, job="polite", batch_size=32, timeout_s=30.0)
    assert sum(len(b["id"]) for b in ds) == N_SAMPLES


def test_parked_open_pass_requests_are_bounded_and_follow_their_group(daemon: Daemon) -> None:
    from tests.integration.test_importance_e2e import K, dataset_for, rescore_pass, train_pass

    ranks = [dataset_for(daemon, "parked", rank=r, world_size=2) for r in range(2)]
    for _ in range(K):  # classification epochs: nothing to re-score
        for ds in ranks:
            rescore_pass(ds)
            train_pass(ds)
    rescore_pass(ranks[0])  # rank 0's next train pass now waits for rank 1's re-scores
    limit = LimitsConfig().max_parked_opens_per_client
    meta = {"job": "parked", "rank": 0, "worker": 7, "phase": "train"}
    with Connection(daemon.address, timeout_s=60.0) as conn:
        rids = [conn.send(MsgType.OPEN_PASS, meta) for _ in range(limit + 1)]
        with pytest.raises(RemoteError, match="max_parked_opens_per_client") as e:
            conn.wait(rids[-1])
        assert e.value.code == ErrorCode.BAD_ARGUMENT and "\n" not in str(e.value)
        # Another connection still parks: the bound is per connection.
        with Connection(daemon.address, timeout_s=60.0) as other:
            waiting = other.send(MsgType.OPEN_PASS, {**meta, "worker": 8})
            rescore_pass(ranks[1])  # the barrier lifts: every parked request opens the pass
            assert other.wait(waiting).meta["epoch"] == K
        opened = [conn.wait(rid, timeout_s=60.0) for rid in rids[:-1]]
    assert {(m.type, m.meta["epoch"]) for m in opened} == {(MsgType.PASS, K)}
    assert len(train_pass(ranks[1])) > 0  # and the job goes on


def test_a_flood_of_stats_scans_each_job_at_most_once_a_second(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="scanned", batch_size=32, timeout_s=30.0)
    for batch in ds:
        ds.feedback(batch["id"], batch["id"].float())
    ds.flush()

    def scans(reply: Any) -> int:
        return int(reply.meta["jobs"]["scanned"]["stats_scans"])

    with Connection(daemon.address, timeout_s=60.0) as conn:
        t0 = time.monotonic()
        first = conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY)
        rids = [conn.send(MsgType.STATS, {"detail": i % 2 == 0}) for i in range(300)]
        replies = [conn.wait(rid) for rid in rids]
        elapsed = time.monotonic() - t0
    # Every reply has the whole summary, but the samples were scanned once per MAX_AGE_S.
    assert all(r.meta["jobs"]["scanned"]["importance"]["loss_p50"] is not None for r in replies)
    assert all("importance_detail" in r.meta["jobs"]["scanned"] for r in replies[::2])
    assert scans(replies[-1]) - scans(first) <= elapsed / MAX_AGE_S + 1
    assert replies[-1].meta["jobs"]["scanned"]["feedback_samples"] == N_SAMPLES  # fresh
