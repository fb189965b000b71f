"""A shared-memory batch keeps its ring slot until the trainer drops the batch's last tensor.

The tensors of a batch that came through shared memory view its slot in the daemon's ring.
Giving the slot back when the next batch is asked for is too early for any trainer that
fetches ahead: PyTorch Lightning asks for batch i+1 before it trains on batch i, and the slot
of batch i was then overwritten under its training step. So the frames are handed out as
views of one array over the slot (every array viewing a frame keeps it); when that array
dies, a callback queues the slot for release with the consumer's next request.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import numpy as np


def hold_slot(
    slot: memoryview, spans: Sequence[tuple[int, int]], on_free: Callable[[], None]
) -> list[memoryview]:
    """The frames at ``spans`` (offset, nbytes) of ``slot``, calling ``on_free`` once unused.

    One anchor per batch, not one per frame: each frame is a slice of the anchor's buffer,
    and every array or tensor made from a frame keeps the anchor alive.
    """
    anchor = np.frombuffer(slot, np.uint8)
    weakref.finalize(anchor, on_free)
    whole = anchor.data
    return [whole[off : off + n] for off, n in spans]
