"""Shared benchmark helpers: warm-up and N timed runs (median, p95), the machine, a store."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


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


def machine() -> dict[str, Any]:
    """Where the numbers were measured: CPU model, cores, memory, Python, torch and kernel."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model
            )
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return {
        "cpu": model,
        "nproc": len(os.sched_getaffinity(0)),
        "ram_gib": round(ram / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch_version,
        "kernel": platform.release(),
        # Shared machines: a load above nproc means the figures include waiting for a core.
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def header(title: str, info: dict[str, Any], command: str) -> list[str]:
    """A results file's first lines: its title, the machine (from ``machine``) and the command."""
    return [
        f"# {title}",
        "",
        f"Machine: {info['nproc']} CPUs, {info['cpu']}, {info['ram_gib']} GiB RAM, "
        f"Python {info['python']}, torch {info['torch']}, Linux {info['kernel']}, "
        f"load average {info['loadavg_1m']} at the start.",
        "",
        f"Command: `{command}`",
        "",
    ]


def make_store(root: Path, n: int, sample_bytes: int) -> Path:
    """A store of ``n`` samples (``image``: uint8 [sample_bytes], ``label``), built once.

    Its file is read through once, so the page cache is warm: the benchmarks compare delivery
    paths, not disks.
    """
    from loaderd.storage.ingest import ingest

    db = root / f"store-{sample_bytes}-{n}.db"
    if not (db / "data.mdb").exists():
        rng = np.random.default_rng(0)
        npz = root / f"src-{sample_bytes}-{n}-{os.getpid()}.npz"
        np.savez(
            npz,
            image=rng.integers(0, 256, (n, sample_bytes), dtype=np.uint8),
            label=np.arange(n, dtype=np.int64) % 1000,
        )
        ingest(npz, db, progress=False, overwrite=True)
        npz.unlink()
    with open(db / "data.mdb", "rb") as f:
        while f.read(1 << 24):
            pass
    return db


def write_results(
    out: str | Path,
    name: str,
    info: dict[str, Any],
    rows: list[dict[str, Any]],
    markdown: Callable[[str], str],
) -> None:
    """``name``.json (machine, command, rows) and ``name``.md (``markdown(command)``) in ``out``.

    The command is this script's, as it was run from the project's root.
    """
    script = " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])
    command = f"python benchmarks/{script}"
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}.json").write_text(
        json.dumps({"machine": info, "command": command, "results": rows}, indent=1) + "\n"
    )
    (path / f"{name}.md").write_text(markdown(command))
