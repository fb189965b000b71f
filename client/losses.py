"""Losses a trainer sends back, gathered into fewer FEEDBACK requests.

A trainer sends a batch's losses after each step. One FEEDBACK per batch cost the daemon's
loop about 130 us a batch at 3 KB (its decoding, checks, journal write and the OK's send),
two thirds of what serving a cache hit costs there, and the trainer about 40 us; most of
it per request, not per sample. So losses are kept here until ``SAMPLES`` have gathered,
the oldest is ``AGE_S`` old, their kind changes, or the client needs the daemon to have
them: a pass's end (the daemon plans the next epoch from them) and the next one's start,
``flush`` and ``close``. Losses are a signal, not data: those a trainer that dies kept here
are lost, as were those it had not sent.

How many to gather: the request's own costs still showed at 512 (8 batches of 64). With
each batch's losses sent back, 3 KB hits ran 162k samples/s at 512 a request, 178k at 2048
and 4096 and 188k at 8192, against 200k with none sent; the daemon's CPU a batch went from
390 us to 339 (326 with none), the trainer's from 150 to 137
(``benchmarks/results/feedback_per_request.md``). Age, not count, bounds a slow trainer's
requests: at 20k samples/s a quarter of a second holds 5,000.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

SAMPLES = 8192  # losses kept before they go (128 batches of 64)
AGE_S = 0.25  # nor longer than this, when the trainer calls again


class LossBatcher:
    """Per-sample losses of one kind, kept until they are worth a request."""

    def __init__(
        self,
        samples: int = SAMPLES,
        age_s: float = AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.samples = samples
        self.age_s = age_s
        self._clock = clock
        self.kind = "train"
        self._ids: list[np.ndarray] = []
        self._losses: list[np.ndarray] = []
        self._count = 0
        self._since = 0.0

    def __len__(self) -> int:
        return self._count

    def add(self, ids: np.ndarray, losses: np.ndarray, kind: str) -> None:
        """Keep copies of ``ids`` and ``losses`` (1-D, aligned) of ``kind``.

        Copies: the caller's ``id`` tensor views the batch's shared-memory slot, which a
        view kept here would hold lent.

        Raises:
            ValueError: ``kind`` differs from what is kept (``take`` that first), or the
                arrays are not 1-D and aligned.
        """
        if ids.shape != losses.shape or ids.ndim != 1:
            raise ValueError(f"ids {ids.shape} and losses {losses.shape} must be 1-D and equal")
        if self._count and kind != self.kind:
            raise ValueError(f"losses of {self.kind!r} are kept: take them before {kind!r}")
        if not self._count:
            self.kind, self._since = kind, self._clock()
        self._ids.append(np.array(ids, np.int64))
        self._losses.append(np.array(losses, np.float32))
        self._count += len(ids)

    def due(self) -> bool:
        """Whether what is kept should go now: enough of it, or kept long enough."""
        return self._count >= self.samples or (
            self._count > 0 and self._clock() - self._since >= self.age_s
        )

    def take(self) -> tuple[str, np.ndarray, np.ndarray]:
        """Everything kept, as one request's kind, ids and losses; nothing is kept after."""
        ids, losses = np.concatenate(self._ids), np.concatenate(self._losses)
        self.drop()
        return self.kind, ids, losses

    def drop(self) -> None:
        """Forget what is kept (taken, or a forked child's copy: its parent sends it)."""
        self._ids, self._losses, self._count = [], [], 0
