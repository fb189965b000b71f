"""Where the server loop's time goes: how busy it is, and on what.

The server loop is one interpreter: on a machine of many cores it is what bounds a first
epoch (``docs/design.md``, "On a machine of many cores"), while the disk and the miss
workers wait. Whether that is so on a running daemon is read from here, in ``loaderd stats``:
the share of the last ``WINDOW_S`` seconds the loop spent outside its poll, how that time
splits between its phases, and how much of it the loop's thread ran on a core. Busy but off
a core, the loop waited for the GIL (held by the daemon's other threads: on a node of 16 cores
a 100 KB warm miss kept the loop busy 96 % of the time and on a core 60 %) or for a core.
Timed with ``perf_counter`` (no system call), a handful of times a turn; the thread's CPU
clock is read once a tick.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
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

    Args:
        now: the time it starts (``perf_counter`` seconds; tests pass their own).
        cpu: the CPU seconds of the loop's thread so far; by default the CPU clock of the
            thread that makes the clock (the loop's: ``serve`` makes it), which ``stats``
            may read from any thread.
    """

    def __init__(self, now: float | None = None, cpu: Callable[[], float] | None = None) -> None:
        self.turns = 0
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.waited_s = 0.0
        self._cpu = cpu if cpu is not None else _thread_cpu()
        self._cpu_start = self._cpu()
        self._last = time.perf_counter() if now is None else now
        self._samples: deque[tuple[float, float, dict[str, float], float]] = deque()
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
        samples.append((t, self.waited_s, dict(self.seconds), self._cpu()))
        while len(samples) > 2 and t - samples[1][0] >= WINDOW_S:
            samples.popleft()

    def stats(self, now: float | None = None) -> dict[str, Any]:
        """Totals since start, and the last window's shares: busy, on a core, per phase.

        ``busy_share``: the part of the window spent outside the poll (None before any
        time has passed); ``on_core_share``: the part the loop's thread ran on a core;
        ``shares``: each phase's part of the busy time.
        """
        t = time.perf_counter() if now is None else now
        cpu = self._cpu()
        t0, _, seconds0, cpu0 = self._samples[0]
        span = t - t0
        busy = {p: self.seconds[p] - seconds0[p] for p in PHASES}
        total = sum(busy.values())
        return {
            "turns": self.turns,
            "busy_s": round(sum(self.seconds.values()), 3),
            "waited_s": round(self.waited_s, 3),
            "cpu_s": round(cpu - self._cpu_start, 3),
            "window_s": round(span, 1),
            "busy_share": round(min(1.0, total / span), 3) if span > 0 else None,
            "on_core_share": round(min(1.0, (cpu - cpu0) / span), 3) if span > 0 else None,
            "shares": {p: round(busy[p] / total, 3) if total > 0 else 0.0 for p in PHASES},
        }


def _thread_cpu() -> Callable[[], float]:
    """A reader of the calling thread's CPU seconds that any thread may call.

    Once that thread has ended (a server stopped, its stats asked after), it gives the
    last figure it read.
    """
    if not hasattr(time, "pthread_getcpuclockid"):  # (not on every Unix): the caller's own
        return time.thread_time
    clock = time.pthread_getcpuclockid(threading.get_ident())
    last = [0.0]

    def read() -> float:
        with contextlib.suppress(OSError):  # the thread is gone
            last[0] = time.clock_gettime(clock)
        return last[0]

    return read
