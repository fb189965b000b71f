"""A checkpoint some epochs old replays its epoch: the same samples in the same order.

A selecting sampler's epoch depends on the statistics when it was selected, so the daemon
keeps the newest ``--keep-selections`` epochs' selections (4 by default) and refuses, by name,
a rewind to an older selected epoch rather than training a recomputed one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from loaderd.client import LoaderdDataset, RemoteError
from tests.helpers import Daemon
from tests.integration.test_importance_e2e import dataset_for, rescore_pass, train_loss, train_pass

pytestmark = pytest.mark.integration


def _train_with_checkpoint(ds: LoaderdDataset) -> tuple[list[list[int]], dict[str, Any]]:
    """One training pass, checkpointed after its second batch: (its batches' ids, state)."""
    batches: list[list[int]] = []
    state: dict[str, Any] = {}
    for batch in ds:
        ids = batch["id"].numpy()
        batches.append(ids.tolist())
        ds.feedback(batch["id"], train_loss(ids, ds.epoch or 0))
        if len(batches) == 2:
            state = ds.state_dict()
    ds.flush()
    return batches, state


def test_checkpoint_epochs_old_replays_the_same_epoch(daemon: Daemon) -> None:
    ds = dataset_for(daemon, "replay")
    delivered: dict[int, list[list[int]]] = {}
    states: dict[int, dict[str, Any]] = {}
    for epoch in range(7):  # selecting from epoch 2 on (two warm-up epochs)
        rescore_pass(ds)
        if epoch in (2, 3):
            delivered[epoch], states[epoch] = _train_with_checkpoint(ds)
        else:
            train_pass(ds)
        assert ds.epoch == epoch
    ds.close()
    assert delivered[2] != delivered[3]
    stats = ds.stats()["jobs"]["replay"]
    assert stats["epoch"] == 6 and stats["importance"]["phase"] == "select"

    # Epoch 2 is five epochs back: its selection is gone, and the rewind says so.
    old = dataset_for(daemon, "replay")
    old.load_state_dict(states[2])
    with pytest.raises(RemoteError, match=r"cannot replay epoch 2 .*oldest kept is epoch 3"):
        next(iter(old))
    old.close()

    # Epoch 3 is three epochs back: the trainer restored from its checkpoint gets the rest of
    # epoch 3 exactly as it was first delivered.
    restored = dataset_for(daemon, "replay")
    restored.load_state_dict(states[3])
    replay = [batch["id"].tolist() for batch in restored]
    assert restored.epoch == 3
    assert replay == delivered[3][2:], "the same samples, in the same order"
    assert not np.array_equal(np.concatenate(replay), np.concatenate(delivered[2][2:]))
    restored.close()
