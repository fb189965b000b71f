"""Knob controllers (seed 001) on a synthetic changing load, where the best setting is known.

Not the daemon: ``loaderd.autotune_sim.SyntheticLoad`` (trainers pulling batches, assembly
workers, read-ahead hiding jitter; see its docstring) stands in for it, so that every
controller can be scored against the best setting of each phase, found by trying them all.
The load changes twice: two trainers, then four (trainers join), then two again with assembly
half as fast (the dataset outgrew DRAM and batches come from LMDB). Each round is one
``step(observation)``; a real daemon would take one every few seconds.

Compared: ``fixed`` (read-ahead 4, 2 workers, never retuned: the simulation's units are not
the daemon's, so this is not the daemon's default, only a setting that suits no phase), the
``hill`` climber, Q-learning with the improvement reward (``q-improvement``, the default) and
with minus the cost (``q-cost``), each Q-learner over ``--seeds`` seeds; ``best`` is the
cheapest setting of each phase. Reported per phase: mean cost (the seed's weighting, w = 0.3),
its excess over the best, the stall fraction and memory share, and over all phases the rounds
spent at a setting within 5 % of the best cost.

    .venv/bin/python benchmarks/bench_autotune.py     # a few seconds

Results: ``benchmarks/results/autotune_synthetic.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import machine

from loaderd.autotune import HillClimber, QLearningTuner, Tuner, round_cost
from loaderd.autotune_sim import KNOBS, SyntheticLoad, best

RESULTS = Path(__file__).resolve().parent / "results"
W = 0.3
PHASES = (
    ("2 trainers", SyntheticLoad(trainers=2)),
    ("4 trainers", SyntheticLoad(trainers=4)),
    ("2, from LMDB", replace(SyntheticLoad(trainers=2), worker_batches_per_s=4.0)),
)
FIXED = {"read_ahead": 4.0, "workers": 2.0}


def run(make: Callable[[int], Tuner | None], seed: int, rounds: int) -> dict[str, Any]:
    """One controller through every phase; per-phase means of cost, stall and memory."""
    tuner = make(seed)
    settings = dict(FIXED)
    phases: list[dict[str, float]] = []
    near = 0
    for _, load in PHASES:
        _, best_cost = best(load, W)
        costs, stalls, mems = [], [], []
        for _ in range(rounds):
            if tuner is not None:
                settings = tuner.settings
            o = load.observe(**settings)
            cost = round_cost(o, W)
            costs.append(cost)
            stalls.append(o.stall_fraction)
            mems.append(o.memory_fraction)
            near += cost <= 1.05 * best_cost
            if tuner is not None:
                tuner.step(o)
        phases.append(
            {
                "cost": statistics.fmean(costs),
                "stall": statistics.fmean(stalls),
                "memory": statistics.fmean(mems),
            }
        )
    return {"phases": phases, "near_best": near / (rounds * len(PHASES))}


def main(args: argparse.Namespace) -> None:
    makers: dict[str, Callable[[int], Tuner | None]] = {
        "fixed": lambda s: None,
        "hill": lambda s: HillClimber(KNOBS, memory_weight=W),
        "q-improvement": lambda s: QLearningTuner(KNOBS, memory_weight=W, seed=s),
        "q-cost": lambda s: QLearningTuner(KNOBS, memory_weight=W, seed=s, reward="cost"),
    }
    best_rows = [best(load, W) for _, load in PHASES]
    rows: list[dict[str, Any]] = []
    for name, make in makers.items():
        seeds = range(args.seeds) if name.startswith("q-") else range(1)
        runs = [run(make, s, args.rounds) for s in seeds]
        row: dict[str, Any] = {"controller": name, "seeds": len(runs)}
        for i, (phase, _) in enumerate(PHASES):
            cost = statistics.fmean(r["phases"][i]["cost"] for r in runs)
            row[phase] = {
                "cost": round(cost, 4),
                "excess": round(cost / best_rows[i][1] - 1, 3),
                "stall": round(statistics.fmean(r["phases"][i]["stall"] for r in runs), 3),
                "memory": round(statistics.fmean(r["phases"][i]["memory"] for r in runs), 3),
            }
        row["near_best"] = round(statistics.fmean(r["near_best"] for r in runs), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    command = " ".join(["python", *sys.argv])
    out = {
        "command": command,
        "machine": machine(),
        "rounds_per_phase": args.rounds,
        "memory_weight": W,
        "best": [
            {"phase": p, "settings": b[0], "cost": round(b[1], 4)}
            for (p, _), b in zip(PHASES, best_rows, strict=True)
        ],
        "rows": rows,
    }
    (RESULTS / "autotune_synthetic.json").write_text(json.dumps(out, indent=1) + "\n")
    (RESULTS / "autotune_synthetic.md").write_text(markdown(out))
    print(f"wrote {RESULTS / 'autotune_synthetic.md'}")


def markdown(out: dict[str, Any]) -> str:
    phases = [p for p, _ in PHASES]
    lines = [
        "# Knob controllers on a synthetic changing load (seed 001)",
        "",
        f"`{out['command']}`: {out['rounds_per_phase']} rounds per phase, w = "
        f"{out['memory_weight']}; Q-learners averaged over their seeds. Cost = (1 - w)·stall "
        "+ w·memory/budget, lower is better; excess = cost / best cost - 1.",
        "",
        "Best settings (by trying all): "
        + "; ".join(
            f"{b['phase']}: read-ahead {b['settings']['read_ahead']:g}, "
            f"{b['settings']['workers']:g} workers, cost {b['cost']}"
            for b in out["best"]
        ),
        "",
        "| controller | "
        + " | ".join(f"{p}: cost (excess)" for p in phases)
        + " | rounds within 5 % of best |",
        "|---|" + "---|" * len(phases) + "---|",
    ]
    for r in out["rows"]:
        cells = [f"{r[p]['cost']:.4f} ({r[p]['excess']:+.0%})" for p in phases]
        lines.append(f"| {r['controller']} | " + " | ".join(cells) + f" | {r['near_best']:.0%} |")
    m = out["machine"]
    lines += [
        "",
        f"Machine: {m['cpu']}, {m['nproc']} cores, Python {m['python']} (a pure-Python "
        "simulation; the machine does not change the figures).",
        "",
    ]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=500, help="rounds per phase")
    p.add_argument("--seeds", type=int, default=10, help="seeds per Q-learner")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())
