"""A daemon that dies with requests unanswered: the client knows at once, not at its timeout.

Each test gives the client a timeout far longer than the test needs, so a client that waits
one out fails the test by its message or by the time it took.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from torch.utils.data import DataLoader

from loaderd.client import DaemonUnavailableError, LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.protocol import MsgType
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon

pytestmark = pytest.mark.integration

LONG_S = 120.0  # no test here may wait this long for a reply


def test_a_wait_ends_when_the_daemon_dies_with_the_request(daemon: Daemon) -> None:
    assert daemon.proc is not None
    with Connection(daemon.address, timeout_s=LONG_S) as conn:
        conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY)  # connected
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # it takes the request and never answers
        rid = conn.send(MsgType.STATS, {})
        threading.Timer(0.5, daemon.kill).start()
        with pytest.raises(DaemonUnavailableError, match="closed the connection before it replied"):
            conn.wait(rid)


def test_a_daemon_that_restarted_while_the_client_was_idle_answers_its_next_request(
    daemon: Daemon,
) -> None:
    with Connection(daemon.address, timeout_s=LONG_S) as conn:
        conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY)
        daemon.kill()
        daemon.start()
        # The old connection's close is news from before this request: it is not lost.
        reply = conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY)
        assert reply.meta["jobs"] is not None


def test_a_trainer_with_workers_goes_on_as_soon_as_the_daemon_is_back(daemon: Daemon) -> None:
    ds = LoaderdDataset(
        daemon.address, job="back", batch_size=20, timeout_s=LONG_S, reconnect_s=60.0
    )
    loader = DataLoader(ds, batch_size=None, num_workers=2, prefetch_factor=4)
    got: list[int] = []
    start = time.monotonic()
    for i, batch in enumerate(loader):
        got += batch["id"].tolist()
        ds.feedback(batch["id"], batch["label"].float())
        if i == 5:  # requests and the loop's acknowledgements are in flight right now
            daemon.kill()
            daemon.start()
    took = time.monotonic() - start
    ds.close()
    assert len(got) == len(set(got)), "no sample twice"
    assert sorted(got) == list(range(N_SAMPLES)), "every sample of the epoch"
    # A client that waited for a reply the dead daemon never sent took LONG_S at least.
    assert took < LONG_S, f"the epoch took {took:.0f} s: a wait ran into its timeout"
