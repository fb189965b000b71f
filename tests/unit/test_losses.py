"""Losses kept by the client until they are worth a FEEDBACK (client/losses.py)."""

from __future__ import annotations

import numpy as np
import pytest

from loaderd.client.losses import LossBatcher


def test_losses_go_together_once_enough_are_kept() -> None:
    kept = LossBatcher(samples=8, age_s=60)
    assert not kept.due() and len(kept) == 0
    ids = np.arange(4)
    losses = np.ones(4, np.float32)
    kept.add(ids, losses, "train")
    ids[:] = 99  # the caller's arrays may change (or view a slot): copies are kept
    losses[:] = 7
    assert not kept.due()
    kept.add(np.arange(4, 8), np.full(4, 2.0), "train")
    assert kept.due() and len(kept) == 8
    kind, got_ids, got_losses = kept.take()
    assert kind == "train" and got_ids.dtype == np.int64 and got_losses.dtype == np.float32
    np.testing.assert_array_equal(got_ids, np.arange(8))
    np.testing.assert_array_equal(got_losses, [1, 1, 1, 1, 2, 2, 2, 2])
    assert len(kept) == 0 and not kept.due()


def test_losses_go_once_the_oldest_is_old_enough() -> None:
    now = [100.0]  # a clock of the test's own: a busy CI machine can stall a real one
    kept = LossBatcher(samples=1000, age_s=0.25, clock=lambda: now[0])
    kept.add(np.arange(2), np.zeros(2), "rescore")
    now[0] += 0.2
    kept.add(np.arange(2, 4), np.zeros(2), "rescore")  # the oldest's age counts, not this one's
    assert not kept.due()
    now[0] += 0.05
    assert kept.due()
    assert kept.take()[0] == "rescore"
    assert not kept.due()


def test_one_kind_at_a_time_and_shapes_checked() -> None:
    kept = LossBatcher()
    kept.add(np.arange(2), np.zeros(2), "train")
    with pytest.raises(ValueError, match="take them before 'rescore'"):
        kept.add(np.arange(2), np.zeros(2), "rescore")
    with pytest.raises(ValueError, match="1-D and equal"):
        kept.add(np.arange(3), np.zeros(2), "train")
    assert len(kept) == 2  # refused adds keep nothing
    kept.drop()
    assert len(kept) == 0
    kept.add(np.arange(2), np.zeros(2), "rescore")  # nothing kept: any kind
    assert kept.kind == "rescore"
