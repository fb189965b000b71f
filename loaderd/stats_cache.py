"""A job's STATS figures that scan every sample, computed at most once a second.

A STATS reply runs on the serving thread. Part of a job's summary scans every sample (loss
quantiles, group sizes, how many were seen), so a client sending STATS in a loop would
stall every trainer's deliveries by O(samples) per job per request. Those figures are
cached per job and recomputed at most every ``max_age_s``, or at once when the engine
moves to another epoch, regrouping or selection. Every O(1) figure (counters, epochs) is
read fresh on each request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from loaderd.importance import ImportanceEngine

MAX_AGE_S = 1.0


class EngineStats:
    """The engine's ``stats()``, its per-sample scans reused while fresh.

    Args:
        engine: the job's importance engine.
        max_age_s: the oldest a scanned figure may be.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        engine: ImportanceEngine,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.max_age_s = max_age_s
        self.clock = clock
        self.scans = 0  # how many times the samples were scanned for a summary
        self._scanned: tuple[tuple[object, ...], float, dict[str, object]] | None = None
        self._detail: tuple[tuple[object, ...], float, dict[str, Any]] | None = None

    def get(self) -> dict[str, object]:
        """``engine.stats()``: O(1) figures fresh, scanned ones at most ``max_age_s`` old."""
        out = self.engine.stats(scan=False)
        version, now = self._version(out), self.clock()
        if not self._fresh(self._scanned, version, now):
            self._scanned = (version, now, self.engine.scan_stats())
            self.scans += 1
        assert self._scanned is not None
        out.update(self._scanned[2])
        return out

    def detail(self, compute: Callable[[ImportanceEngine], dict[str, Any]]) -> dict[str, Any]:
        """``compute(engine)`` (histograms of every sample), reused like the scanned figures."""
        version, now = self._version(self.engine.stats(scan=False)), self.clock()
        if not self._fresh(self._detail, version, now):
            self._detail = (version, now, compute(self.engine))
        assert self._detail is not None
        return self._detail[2]

    @staticmethod
    def _version(summary: dict[str, object]) -> tuple[object, ...]:
        return tuple(summary[k] for k in ("epoch", "groups_epoch", "selected_epoch"))

    def _fresh(
        self,
        cached: tuple[tuple[object, ...], float, Any] | None,
        version: tuple[object, ...],
        now: float,
    ) -> bool:
        return cached is not None and cached[0] == version and now - cached[1] < self.max_age_s
