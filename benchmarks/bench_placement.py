"""The importance policy's re-placement at a new epoch: how long it holds the tier stack's lock.

``ImportancePolicy.place`` runs on a background thread, but under the tier stack's lock and
holding the GIL for its Python steps, so the server loop waits on it. This fills a policy of
``--samples`` records with DRAM a quarter of them and the arena half, then places rankings
that drift from a fixed score by noise of a few sizes (0: the same ranking again; 1: nearly a
new one) and times each ``place``. With ``--base REV`` the policy module of that commit is
timed too, in turn, in the same run. Writes ``results/<--name>.json`` and ``.md``. Example:

    python benchmarks/bench_placement.py --samples 1281167 --base HEAD
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from types import ModuleType
from typing import Any

import numpy as np
from _timing import header, machine, write_results  # the script's folder is on sys.path

from loaderd.storage import policies

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RECORD = 16


def policies_at(rev: str, folder: Path) -> ModuleType:
    """``storage/policies.py`` as it was at ``rev``, imported under another name."""
    text = subprocess.run(
        ["git", "show", f"{rev}:storage/policies.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = folder / "policies_base.py"
    path.write_bytes(text)
    spec = importlib.util.spec_from_file_location("policies_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(module: ModuleType, n: int, noise: float, rounds: int) -> dict[str, Any]:
    """Each ``place`` of ``rounds`` drifting rankings, after one that fills the tiers."""
    rng = np.random.default_rng(0)
    base = rng.random(n)
    p = module.ImportancePolicy([n // 4 * RECORD, n // 2 * RECORD], n, RECORD)
    first = np.argsort(-base)
    p.place(first)
    p._add_many(first[: n // 4].tolist(), [RECORD] * (n // 4), module.DRAM)
    rest = first[n // 4 : 3 * n // 4]
    p._add_many(rest.tolist(), [RECORD] * len(rest), module.ARENA)
    ms, moves = [], []
    for _ in range(rounds):
        ranking = np.argsort(-(base + noise * rng.standard_normal(n)))
        t = time.perf_counter()
        moves.append(len(p.place(ranking)))
        ms.append(round(1e3 * (time.perf_counter() - t), 1))
    return {"ms": ms, "moves": moves}


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], command: str) -> str:
    lines = [
        *header("The importance policy's re-placement (`ImportancePolicy.place`)", info, command),
        f"A policy of {rows[0]['samples']:,} records of {RECORD} B, DRAM a quarter of them and "
        "the arena half, filled by a first ranking; then rankings drifting from its score by "
        "Gaussian noise of the size shown, each timed (ms: the median, then every one). Moves: "
        "the promotions, demotions and drops each returned.",
        "",
        "| noise | version | place, ms | moves |",
        "|---:|---|---|---|",
    ]
    for r in rows:
        ms = ", ".join(f"{x:,}" for x in r["ms"])
        moves = ", ".join(f"{x:,}" for x in r["moves"])
        lines.append(f"| {r['noise']} | {r['version']} | {median(r['ms']):,} ({ms}) | {moves} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    info = machine()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"working tree": policies}
        if args.base:
            versions = {args.base: policies_at(args.base, Path(tmp)), **versions}
        for noise in args.noise:
            for name, module in versions.items():
                r = timed(module, args.samples, noise, args.rounds)
                rows.append({"samples": args.samples, "noise": noise, "version": name, **r})
                print(rows[-1], flush=True)
    write_results(args.out, args.name, info, rows, lambda cmd: markdown(rows, info, cmd))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--samples", type=int, default=1_281_167)
    p.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.05, 0.2, 1.0])
    p.add_argument("--rounds", type=int, default=3, help="rankings placed at each noise")
    p.add_argument("--base", default="", help="a commit whose policy module is timed too")
    p.add_argument("--name", default="placement")
    p.add_argument("--out", default=str(HERE / "results"))
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
