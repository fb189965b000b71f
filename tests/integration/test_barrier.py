"""Waiting at the barriers of a selecting epoch: the waiting rank is told why, is not timed out,
and the plan is made from every rank's losses."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers import Daemon, wait_until
from tests.integration.test_importance_e2e import (
    K,
    Mirror,
    dataset_for,
    rescore_pass,
    train_loss,
    train_pass,
)


def test_a_rank_at_the_barrier_is_told_whom_it_waits_for(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    # The waiting rank would give up after 0.5 s of silence and never reconnect.
    fast = {"timeout_s": 0.5, "reconnect_s": 0}
    ranks = [dataset_for(daemon, "barrier", rank=r, world_size=2) for r in range(2)]
    for _ in range(K):  # classification epochs: nothing to re-score
        for ds in ranks:
            assert rescore_pass(ds) == []
            train_pass(ds)
    waiting = dataset_for(daemon, "barrier", rank=0, world_size=2, **fast)
    rescore_pass(waiting)
    caplog.set_level(logging.WARNING, logger="loaderd.client.connection")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(train_pass, waiting)
        wait_until(lambda: "waiting for rank(s) 1 to finish" in caplog.text, what="a WAITING note")
        assert "job 'barrier' epoch 2" in caplog.text
        # The barrier outlasts the waiting rank's timeout several times over.
        threading.Event().wait(4 * fast["timeout_s"])
        assert not first.done()
        rescore_pass(ranks[1])
        trained = train_pass(ranks[1]) + first.result(timeout=30)
    assert len(trained) == len(set(trained)) > 0


def test_a_classifying_pass_waits_for_every_ranks_last_losses(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    # Rank 1 has every batch of the last warm-up epoch acknowledged but its last losses not yet
    # sent when rank 0 asks for the first selecting epoch. Classifying then would see those
    # samples without history: the plan would depend on whose feedback came first.
    ranks = [dataset_for(daemon, "late", rank=r, world_size=2) for r in range(2)]
    mirror = Mirror()
    for epoch in range(K - 1):
        for ds in ranks:
            rescore_pass(ds)
        for ds in ranks:
            train_pass(ds)
        mirror.epoch(epoch)
    for ds in ranks:
        rescore_pass(ds)
    batches = -(-len(train_pass(ranks[0])) // 32)  # the ranks' shares are equal
    it = iter(ranks[1])
    for _ in range(batches - 1):
        ids = next(it)["id"].numpy()
        ranks[1].feedback(torch.from_numpy(ids), train_loss(ids, K - 1))
    last = next(it)["id"].numpy()  # every batch acknowledged; the step on the last one runs
    ranks[1].flush()
    mirror.epoch(K - 1)
    caplog.set_level(logging.WARNING, logger="loaderd.client.connection")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(rescore_pass, ranks[0])
        wait_until(
            lambda: "losses of epoch 1: waiting for rank(s) 1" in caplog.text,
            what="rank 0 waiting for rank 1's last losses",
        )
        ranks[1].feedback(torch.from_numpy(last), train_loss(last, K - 1))
        assert next(it, None) is None  # the loop ends: its losses are in, the pass is left
        rescored = rescore_pass(ranks[1]) + first.result(timeout=30)
    want_high, want_ids = mirror.epoch(K)
    assert sorted(rescored) == want_high.tolist()  # classified from every rank's losses
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(train_pass, ranks[0])
        trained = train_pass(ranks[1]) + other.result(timeout=30)
    assert sorted(trained) == want_ids.tolist()
