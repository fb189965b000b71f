"""What sending losses back costs a cache hit: none sent, and FEEDBACKs of several sizes.

Fresh daemons over one warm store, DRAM holding it whole, one after another in turn (the
order reversed every other round). Each daemon serves one trainer: a first epoch (warm
misses), then ``--epochs`` hit epochs of which the best counts. With feedback, each batch's
losses go back through ``ds.feedback`` as a training loop sends them; the client gathers them
into one FEEDBACK of ``--per-request`` samples (``client/losses.py``; set here on the
dataset's batcher). Also the daemon's and the trainer's CPU a batch (its ``psutil`` times,
and this process's ``process_time``). Writes ``results/<--name>.json`` and ``.md``. Example:

    python benchmarks/bench_feedback.py --sizes 3000 --samples 100000 --per-request 512 4096
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median
from typing import Any

import torch
from _baselines import BATCH, held_in_cache
from _timing import header, machine, make_store, write_results  # the script's folder is on sys.path
from bench_throughput import Context, Served, context_args


def one_daemon(ctx: Context, db: Path, epochs: int, per_request: int) -> dict[str, float]:
    """The best hit epoch of a fresh daemon; ``per_request`` 0: no losses sent back."""
    from loaderd.client import LoaderdDataset
    from loaderd.client.losses import LossBatcher

    srv: Served = ctx.serve(db, int((db / "data.mdb").stat().st_size * 1.5))
    try:
        ds = LoaderdDataset(srv.address, job="fb", batch_size=BATCH, prefetch=8)
        ds.connect()
        if per_request:
            ds._losses = LossBatcher(samples=per_request)
        best: dict[str, float] = {}
        for epoch in range(epochs + 1):
            d0, t0, w0 = sum(srv.ps.cpu_times()[:2]), time.process_time(), time.perf_counter()
            n = batches = 0
            for b in ds:
                n += len(b["id"])
                batches += 1
                if per_request:
                    ds.feedback(b["id"], torch.ones(len(b["id"])))
            d1, t1, w1 = sum(srv.ps.cpu_times()[:2]), time.process_time(), time.perf_counter()
            rate = n / (w1 - w0)
            if epoch and rate > best.get("hit", 0):  # the first epoch is the warm misses
                best = {
                    "hit": round(rate),
                    "daemon_us": round(1e6 * (d1 - d0) / batches),
                    "trainer_us": round(1e6 * (t1 - t0) / batches),
                }
        ds.close()
    finally:
        ctx.stop(srv)
    return best


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], command: str) -> str:
    lines = [
        *header("Sending losses back: 3 KB cache hits with and without feedback", info, command),
        "Fresh daemons over one warm store held in DRAM, in turn (ABBA). Hit: a daemon's best "
        "epoch after its first, samples/s, batch 64; the daemon's CPU (all its threads) and the "
        "trainer's, microseconds a batch, in that epoch. Each cell: the median, then every "
        "run in order. Per request: the losses one FEEDBACK carries (none: no feedback).",
        "",
        "| sample | per request | hit | daemon CPU us a batch | trainer CPU us a batch |",
        "|---:|---|---|---|---|",
    ]
    for r in rows:
        for k, runs in r["runs"].items():
            cells = [
                f"{median(x[f] for x in runs):,.0f} ({', '.join(f'{x[f]:,}' for x in runs)})"
                for f in ("hit", "daemon_us", "trainer_us")
            ]
            per = "none" if k == "0" else k
            lines.append(f"| {r['sample_bytes']:,} B | {per} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    info = machine()
    rows = []
    with ExitStack() as stack:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        ctx = Context(args, stack)
        for size in args.sizes:
            db = make_store(ctx.root, args.samples, size)
            runs: dict[str, list[dict[str, float]]] = {}
            modes = [0, *args.per_request]
            with held_in_cache([db / "data.mdb"]):
                for k in range(args.rounds):
                    for per in modes if k % 2 == 0 else modes[::-1]:
                        runs.setdefault(str(per), []).append(one_daemon(ctx, db, args.epochs, per))
                        print(size, per, runs[str(per)][-1], flush=True)
            rows.append({"sample_bytes": size, "samples": args.samples, "runs": runs})
    write_results(args.out, args.name, info, rows, lambda cmd: markdown(rows, info, cmd))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", type=int, nargs="+", default=[3_000])
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--per-request", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--rounds", type=int, default=4, help="daemons of each kind")
    p.add_argument("--epochs", type=int, default=3, help="hit epochs a daemon; the best counts")
    context_args(p, "feedback")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
