"""Where the server loop's time goes: how busy it is, and on what.

The server loop is one interpreter: on a machine of many cores it is what bounds a first
epoch (``docs/design.md``, "On a machine of many cores"), while the disk and the miss
workers wait. Whether that is so on a running daemon is read from here, in ``loaderd stats``:
the share of the last ``WINDOW_S`` seconds the loop spent outside its poll, and how that
time splits between its phases. Timed with ``perf_counter`` (no system call), a handful of
times a turn.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

# The phases of a turn, in the order the loop runs them.
PHASES = ("requests", "assembled", "other")
WINDOW_S = 10.0  # the span ``busy_share`` is taken over


class LoopClock:
    """Seconds the loop spent in each phase, and waiting in its poll.

    ``mark(phase)`` closes the span since the previous mark (or the poll's return) and
    books it to ``phase``; ``polled()`` closes the wait in the poll. Counters only grow:
    a monitoring system takes their rates. ``sample`` keeps the totals at a point in time
    (called on the loop's tick), so that ``stats`` can give the last ``WINDOW_S`` seconds.
    """

    def __init__(self, now: float | None = None) -> None:
        self.turns = 0
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.waited_s = 0.0
        self._last = time.perf_counter() if now is None else now
        self._samples: deque[tuple[float, float, dict[str, float]]] = deque()
        self.sample(self._last)

    def polling(self, now: float | None = None) -> None:
        """The loop is about to wait in its poll: what ran since the last mark was ``other``."""
        self.mark("other", now)

    def polled(self, now: float | None = None) -> None:
        """The poll returned: its wait is booked, a turn begins."""
        t = time.perf_counter() if now is None else now
        self.waited_s += t - self._last
        self._last = t
        self.turns += 1

    def mark(self, phase: str, now: float | None = None) -> None:
        """Book the time since the previous mark to ``phase``."""
        t = time.perf_counter() if now is None else now
        self.seconds[phase] += t - self._last
        self._last = t

    def sample(self, now: float | None = None) -> None:
        """Keep the totals now; those older than the window are let go."""
        t = time.perf_counter() if now is None else now
        samples = self._samples
        samples.append((t, self.waited_s, dict(self.seconds)))
        while len(samples) > 2 and t - samples[1][0] >= WINDOW_S:
            samples.popleft()

    def stats(self, now: float | None = None) -> dict[str, Any]:
        """Totals since start, and ``busy_share`` and ``shares`` of the last window.

        ``busy_share``: the part of the window spent outside the poll (None before any
        time has passed); ``shares``: each phase's part of that busy time.
        """
        t = time.perf_counter() if now is None else now
        t0, _, seconds0 = self._samples[0]
        span = t - t0
        busy = {p: self.seconds[p] - seconds0[p] for p in PHASES}
        total = sum(busy.values())
        return {
            "turns": self.turns,
            "busy_s": round(sum(self.seconds.values()), 3),
            "waited_s": round(self.waited_s, 3),
            "window_s": round(span, 1),
            "busy_share": round(min(1.0, total / span), 3) if span > 0 else None,
            "shares": {p: round(busy[p] / total, 3) if total > 0 else 0.0 for p in PHASES},
        }
