"""A shared-memory batch keeps its ring slot until the trainer drops the batch's last tensor.

The tensors of a batch that came through shared memory view its slot in the daemon's ring.
Giving the slot back when the next batch is asked for is too early for any trainer that
fetches ahead: PyTorch Lightning asks for batch i+1 before it trains on batch i, and the slot
of batch i was then overwritten under its training step. So each frame is wrapped in an
array that holds one owner object per batch; when every array viewing the slot is gone, the
owner dies and a callback queues the slot for release with the consumer's next request.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class _Anchored(np.ndarray[Any, np.dtype[np.uint8]]):
    """A frame's bytes, keeping its batch's slot owner alive (arrays viewing it keep this)."""

    owner: object


class _SlotOwner:
    __slots__ = ("__weakref__",)


def hold_slot(frames: Sequence[memoryview], on_free: Callable[[], None]) -> list[memoryview]:
    """``frames`` as views that call ``on_free`` once nothing views any of them any more."""
    owner = _SlotOwner()
    out = []
    for frame in frames:
        anchored = np.frombuffer(frame, np.uint8).view(_Anchored)
        anchored.owner = owner
        out.append(anchored.data)  # a memoryview whose exporter is the anchored array
    weakref.finalize(owner, on_free)
    return out
