"""Loss feedback reaches the daemon, shows in stats, and survives a restart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loaderd.client import LoaderdDataset, RemoteError
from loaderd.client.errors import ErrorCode
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon

pytestmark = pytest.mark.integration


def train_epoch(ds: LoaderdDataset) -> None:
    for batch in ds:
        ds.feedback(batch["id"], batch["id"].float() / N_SAMPLES)


def test_feedback_in_stats_and_after_restart(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="fb", batch_size=64)
    train_epoch(ds)
    train_epoch(ds)
    ds.flush()
    job = ds.stats()["jobs"]["fb"]
    assert job["feedback_samples"] == 2 * N_SAMPLES
    assert job["importance"]["feedback_samples"] == 2 * N_SAMPLES

    daemon.stop()
    daemon.start()
    job = LoaderdDataset(daemon.address, job="fb", batch_size=64).stats()["jobs"]["fb"]
    assert job["feedback_samples"] == 2 * N_SAMPLES
    assert job["importance"]["feedback_samples"] == 2 * N_SAMPLES
    assert job["epoch"] == 1


def test_feedback_survives_kill_9(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="k9", batch_size=64)
    train_epoch(ds)
    ds.flush()  # feedback is acknowledged only once it is fsynced
    daemon.kill()
    daemon.start()
    stats = LoaderdDataset(daemon.address, job="k9", batch_size=64).stats()["jobs"]["k9"]
    assert stats["importance"]["feedback_samples"] == N_SAMPLES


def test_bad_feedback_is_refused_and_daemon_stays_up(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="badfb", batch_size=64)
    next(iter(ds))
    ds.feedback(torch.tensor([N_SAMPLES + 5]), torch.tensor([1.0]))
    with pytest.raises(RemoteError, match=f"sample {N_SAMPLES + 5}") as e:
        ds.flush()
    assert e.value.code == ErrorCode.BAD_ARGUMENT
    ds.feedback(np.array([1, 2]), np.array([np.nan, 1.0]))
    with pytest.raises(RemoteError, match="non-finite"):
        ds.flush()
    assert ds.stats()["jobs"]["badfb"]["feedback_samples"] == 0


def test_losses_sent_after_a_pass_reach_the_daemon_before_the_next_opens(daemon: Daemon) -> None:
    """A trainer that fetches ahead (Lightning) sends the last batch's losses after the pass
    ended: the client keeps losses to send several together, and sends them before the next
    pass opens, as it does at each pass's end; a change of kind sends what was kept."""
    ds = LoaderdDataset(daemon.address, job="late", batch_size=64)
    last = None
    for batch in ds:
        if last is not None:
            ds.feedback(last, torch.ones(len(last)))
        last = batch["id"]
    assert last is not None
    assert ds.stats()["jobs"]["late"]["feedback_samples"] == N_SAMPLES - len(last)
    ds.feedback(last, torch.ones(len(last)))  # the pass is over: kept, not sent yet
    ds.feedback(torch.arange(3), torch.ones(3), kind="rescore")
    next(iter(ds))
    job = ds.stats()["jobs"]["late"]
    assert job["feedback_samples"] == N_SAMPLES
    assert job["importance"]["rescore_samples"] == 3
    ds.close()
