"""loaderd against a DataLoader over the same LMDB, warm, across sample sizes.

``bench_throughput.py`` holds the issue's two sizes (100 KB and 3 KB) to every state and
bound; this sweeps the sizes in between and above, the ones a user's data has, with the page
cache warm (held by a locking helper, as there) so that only the data path differs, on one
store of about ``--store-mb`` per size (batch 64; at least 200 batches an epoch, so larger
samples get more data). For each size:

* ``DataLoader`` (num_workers 0 and 2) reading the store the usual way, best warm epoch;
* loaderd over shared memory: a fresh daemon's first epoch (warm miss: DRAM empty), its best
  later epoch (hit), and the last of three epochs with ``--dram-bytes`` a quarter of the
  store (larger than DRAM, steady state).

Ratios are against the best DataLoader of the same run. Writes ``results/sizes.json`` and
``results/sizes.md``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from _baselines import dataloader
from _timing import header, machine, make_store, write_results  # the script's folder is on sys.path
from bench_throughput import Context, one_trainer

HERE = Path(__file__).resolve().parent


# An epoch is timed from its first batch: with fewer batches, those prefetched while the pass
# opened would count as delivered in no time.
MIN_BATCHES = 200


def bench_one(ctx: Context, size: int, store_mb: int, epochs: int) -> dict[str, Any]:
    n = max(64 * MIN_BATCHES, store_mb * 1_000_000 // size)
    db = make_store(ctx.root, n, size)
    store_bytes = (db / "data.mdb").stat().st_size
    best_dl = {w: dataloader(db, w, epochs, cold=False)["warm"] for w in (0, 2)}
    fits = one_trainer(db, ctx, int(store_bytes * 1.5), epochs + 1, cold=False, tag=f"{size}")
    big = one_trainer(db, ctx, store_bytes // 4, 3, cold=False, tag=f"{size}-big")
    base = max(best_dl.values())
    rates = {
        "warm miss": fits["rates"][0],
        "hit": max(fits["rates"][1:]),
        "larger than DRAM": big["rates"][-1],
    }
    row = {
        "sample_bytes": size,
        "samples": n,
        "dataloader": {f"num_workers={w}": round(r) for w, r in best_dl.items()},
        "loaderd": {k: round(r) for k, r in rates.items()},
        "vs_dataloader": {k: round(r / base, 2) for k, r in rates.items()},
        "shm_fallbacks": fits["shm_fallbacks"] + big["shm_fallbacks"],
    }
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], command: str) -> str:
    lines = [
        *header("Warm throughput across sample sizes", info, command),
        "Samples/s, batch 64, the store held in the page cache; in brackets the ratio to the "
        "best DataLoader (num_workers 0 or 2) of the same run. Warm miss: a fresh daemon's "
        "first epoch (DRAM empty); hit: its best later epoch; larger than DRAM: the last of "
        "three epochs with `--dram-bytes` a quarter of the store.",
        "",
        "| sample | samples | DataLoader nw=0 | nw=2 | warm miss | hit | larger than DRAM |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ld, vs = r["loaderd"], r["vs_dataloader"]
        cells = [f"{ld[k]:,} ({vs[k]}x)" for k in ("warm miss", "hit", "larger than DRAM")]
        dl = r["dataloader"]
        lines.append(
            f"| {r['sample_bytes']:,} B | {r['samples']:,} | {dl['num_workers=0']:,} | "
            f"{dl['num_workers=2']:,} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


BenchOne = Callable[[Context, int, int, int], dict[str, Any]]
Markdown = Callable[[list[dict[str, Any]], dict[str, Any], str], str]


def sweep(args: argparse.Namespace, name: str, bench_one: BenchOne, markdown: Markdown) -> int:
    """``bench_one(ctx, size, store_mb, epochs)`` for each of ``args.sizes``; results/<name>."""
    info = machine()
    with ExitStack() as stack:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        ctx = Context(args, stack)
        rows = [bench_one(ctx, size, args.store_mb, args.epochs) for size in args.sizes]
    write_results(args.out, name, info, rows, lambda cmd: markdown(rows, info, cmd))
    return 0


def sweep_args(
    doc: str | None, sizes: list[int], epochs: str, argv: list[str] | None
) -> argparse.Namespace:
    """The options of a sweep over sample sizes (``sweep``); ``epochs`` says what they are."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    p.add_argument("--sizes", type=int, nargs="+", default=sizes, help="sample sizes in bytes")
    p.add_argument("--store-mb", type=int, default=600, help="about this much data per size")
    p.add_argument("--epochs", type=int, default=3, help=epochs)
    p.add_argument("--shm-slots", type=int, default=0, help="0: the daemon sizes its rings")
    p.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "loaderd-bench"))
    p.add_argument("--out", default=str(HERE / "results"))
    p.set_defaults(profile=False)
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    return sweep(args, "sizes", bench_one, markdown)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sizes = [3_000, 10_000, 30_000, 100_000, 300_000]
    return sweep_args(__doc__, sizes, "warm epochs; the best counts", argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
