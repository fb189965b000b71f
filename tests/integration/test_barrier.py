"""Waiting at the re-score barrier: the waiting rank is told why, and is not timed out."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import Daemon, wait_until
from tests.integration.test_importance_e2e import K, dataset_for, rescore_pass, train_pass


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
