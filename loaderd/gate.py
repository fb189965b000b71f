"""A concurrency limit that can change while threads wait on it.

The prefetcher's pool cannot shrink, and growing it would leave threads behind when the limit
falls again; so the pool is sized for the most workers the daemon may use and each assembly
passes this gate first. ``serve --autotune`` moves the limit between rounds.
"""

from __future__ import annotations

import threading
from types import TracebackType


class Gate:
    """At most ``limit`` holders at once; ``set_limit`` lets waiters in at once when raised.

    Args:
        limit: how many may hold the gate at once (>= 1).
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a gate's limit must be >= 1, got {limit}")
        self._limit = limit
        self._inside = 0
        self.peak = 0  # the most holders seen at once
        self._cond = threading.Condition()

    @property
    def limit(self) -> int:
        """How many may hold the gate at once."""
        return self._limit

    @property
    def inside(self) -> int:
        """How many hold it now."""
        return self._inside

    def set_limit(self, limit: int) -> None:
        """Change the limit; holders above a lowered one finish, and no new one enters."""
        if limit < 1:
            raise ValueError(f"a gate's limit must be >= 1, got {limit}")
        with self._cond:
            self._limit = limit
            self._cond.notify_all()

    def reset_peak(self) -> int:
        """The peak since the last reset; starts counting again from those inside now."""
        with self._cond:
            peak, self.peak = self.peak, self._inside
            return peak

    def __enter__(self) -> Gate:
        with self._cond:
            self._cond.wait_for(lambda: self._inside < self._limit)
            self._inside += 1
            self.peak = max(self.peak, self._inside)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify()
