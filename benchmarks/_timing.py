"""Shared timing helpers for the benchmarks: warm-up, N timed runs, median and p95; the machine."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable


def time_runs(
    fn: Callable[[], object],
    *,
    runs: int = 7,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Call ``fn`` ``warmup`` times untimed, then ``runs`` times; wall and CPU seconds per call.

    ``setup`` runs untimed before every call (e.g. to restore state the call consumes).
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times, cpu = [], []
    for _ in range(runs):
        if setup is not None:
            setup()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    times.sort()
    # Nearest-rank p95: with few runs this is the slowest one, which is the honest answer.
    p95 = times[min(len(times) - 1, max(0, round(0.95 * len(times) + 0.5) - 1))]
    return {
        "median_s": statistics.median(times),
        "p95_s": p95,
        "min_s": times[0],
        # CPU seconds of this process: on a shared machine, wall time also counts waiting.
        "cpu_median_s": statistics.median(cpu),
        "runs": float(runs),
    }


def machine() -> dict[str, object]:
    """Where the numbers were measured: CPU model, core count, Python and platform."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "nproc": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        # Shared machines: a load above nproc means the figures include waiting for a core.
        "loadavg_1m": os.getloadavg()[0],
    }
