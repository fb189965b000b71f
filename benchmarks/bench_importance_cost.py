"""What the importance engine costs the daemon: feedback ingestion and per-epoch selection.

Bars (issue 3): ``record()`` ingests >= 1 million (id, loss) pairs per second in batches of 256
and of 65536, and one epoch's re-grouping + ranking + selection for 10 million samples takes
about a second. Prints one JSON line per configuration and writes
``benchmarks/results/importance_cost.json`` with the command and the machine.

    .venv/bin/python benchmarks/bench_importance_cost.py            # 10M samples, ~2 minutes
    .venv/bin/python benchmarks/bench_importance_cost.py --quick    # 1M samples, a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import machine, time_runs

from loaderd.importance import SAMPLERS, ImportanceConfig, ImportanceEngine

RESULTS = Path(__file__).resolve().parent / "results" / "importance_cost.json"
RECORD_BAR_PAIRS_S = 1e6
EPOCH_BAR_S = 1.0


def emit(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def bench_record(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Random ids over the whole dataset (a shuffled epoch's feedback), float32 losses."""
    rng = np.random.default_rng(0)
    engine = ImportanceEngine(args.n, ImportanceConfig(sampler="importance"))
    for batch in args.batches:
        count = max(1, args.record_pairs // batch)
        ids = rng.integers(0, args.n, (count, batch), dtype=np.int64)
        losses = rng.exponential(1.0, (count, batch)).astype(np.float32)
        epochs = itertools.count()  # a new epoch per run, so each run also pays the row reset

        def run(
            ids: np.ndarray = ids, losses: np.ndarray = losses, epochs: Iterator[int] = epochs
        ) -> None:
            e = next(epochs)
            for i in range(len(ids)):
                engine.record(ids[i], losses[i], e)

        t = time_runs(run, runs=args.runs, warmup=1)
        pairs = count * batch
        emit(
            {
                "bench": "record",
                "n": args.n,
                "batch": batch,
                "pairs": pairs,
                **t,
                "pairs_per_s": pairs / t["median_s"],
                "pairs_per_cpu_s": pairs / t["cpu_median_s"],
                "bar_pairs_per_s": RECORD_BAR_PAIRS_S,
                "meets_bar": pairs / t["median_s"] >= RECORD_BAR_PAIRS_S,
            },
            rows,
        )


def history_state(n: int, k: int) -> dict[str, np.ndarray]:
    """State after K warm-up epochs: 20% of samples swing, the rest drift slowly."""
    rng = np.random.default_rng(1)
    engine = ImportanceEngine(n, ImportanceConfig(sampler="importance", warmup_epochs=k, window=k))
    base = rng.exponential(1.0, n).astype(np.float32)
    noisy = rng.random(n) < 0.2
    ids = np.arange(n, dtype=np.int64)
    for epoch in range(k):
        noise = rng.normal(0.0, 1.0, n).astype(np.float32)
        engine.record(ids, base + np.where(noisy, noise, 0.01 * noise) ** 2, epoch)
    return engine.state_dict()


def bench_epoch(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The daemon's work at a re-classification epoch: regroup (rescore_ids), then select."""
    k = 3
    t0 = time.perf_counter()
    state = history_state(args.n, k)
    print(f"# built {args.n} samples of history in {time.perf_counter() - t0:.1f}s", flush=True)
    for sampler in SAMPLERS:
        engine = ImportanceEngine(
            args.n, ImportanceConfig(sampler=sampler, warmup_epochs=k, window=k)
        )

        def fresh(engine: ImportanceEngine = engine) -> None:
            engine.load_state_dict(state)  # untimed: undo the regrouping the last run did

        def regroup(engine: ImportanceEngine = engine) -> None:
            engine.rescore_ids(k)

        def select(engine: ImportanceEngine = engine) -> None:
            engine.select(k, seed=0)

        def epoch(engine: ImportanceEngine = engine) -> None:
            engine.rescore_ids(k)
            engine.select(k, seed=0)

        parts: dict[str, dict[str, float]] = {}
        if sampler != "uniform":  # uniform re-scores nothing; its select() does the regrouping
            parts["regroup"] = time_runs(regroup, runs=args.runs, setup=fresh)
            parts["select"] = time_runs(select, runs=args.runs)  # groups made by the warm-up
        parts["epoch"] = time_runs(epoch, runs=args.runs, setup=fresh)
        for part, t in parts.items():
            row: dict[str, Any] = {"bench": part, "sampler": sampler, "n": args.n, **t}
            if part == "epoch":
                row |= {
                    "bar_s": EPOCH_BAR_S,
                    "meets_bar": t["median_s"] <= EPOCH_BAR_S * 1.2,
                    "meets_bar_cpu": t["cpu_median_s"] <= EPOCH_BAR_S * 1.2,
                }
            emit(row, rows)
        del engine


def main(args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    bench_record(args, rows)
    bench_epoch(args, rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine(),
            "numpy": np.__version__,
            "note": "epoch = rescore_ids (variance + exact 2-means) + select at a "
            "re-classification epoch; 'about a second' is judged as median <= 1.2 s, on wall "
            "time and on this process's CPU time (wall time includes waiting for a core when "
            "loadavg_1m exceeds nproc)",
            "results": rows,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"# wrote {args.out}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=10_000_000, help="dataset size")
    p.add_argument("--batches", type=int, nargs="+", default=[256, 65536], help="record() sizes")
    p.add_argument("--record-pairs", type=int, default=2_000_000, help="pairs per timed run")
    p.add_argument("--runs", type=int, default=5, help="timed runs per configuration")
    p.add_argument("--out", default=str(RESULTS), help="results JSON ('' to skip)")
    p.add_argument("--quick", action="store_true", help="1M samples, 3 runs, no results file")
    args = p.parse_args(argv)
    args.out = Path(args.out) if args.out else None
    if args.quick:
        args.n, args.runs, args.record_pairs, args.out = 1_000_000, 3, 500_000, None
    return args


if __name__ == "__main__":
    main(parse_args())
