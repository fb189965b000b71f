"""What a machine's cores change: DataLoader workers against loaderd's miss workers.

``bench_throughput.py`` measures the issue's rows on the development VM, which has two
cores. A node of a training cluster has many: a DataLoader's workers then read in parallel,
while loaderd's server loop stays one interpreter. This runs, on one store per sample size,
with the page cache held warm throughout:

* ``torch.utils.data.DataLoader`` over the same LMDB (``num_workers`` 0, 2, 8 and as many as
  this process may use cores): the best of its epochs after the first;
* loaderd with ``--miss-procs`` 2 and each further count given, ``--repeats`` times in turn
  (fresh daemons alternate, so drift of a shared host spreads over all counts): a fresh
  daemon's first epoch (warm miss: DRAM empty), then its hits (the best later epoch), and a
  daemon whose store is four times ``--dram-bytes`` (larger than DRAM: the best epoch after
  the first).

Writes ``results/cores.json`` and ``results/cores.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from _baselines import BATCH, dataloader, held_in_cache
from _timing import header, machine, make_store, write_results
from bench_throughput import Context, one_trainer

HERE = Path(__file__).resolve().parent


def loaderd_rates(db: Path, ctx: Context, procs: int) -> dict[str, Any]:
    """Warm miss, hit and larger-than-DRAM rates of fresh daemons with ``procs`` miss workers."""
    store_bytes = (db / "data.mdb").stat().st_size
    epochs, extra = ctx.args.epochs + 1, ["--miss-procs", str(procs)]
    fits = one_trainer(db, ctx, store_bytes * 3 // 2, epochs, cold=False, tag="fit", extra=extra)
    big = one_trainer(db, ctx, store_bytes // 4, epochs, cold=False, tag="big", extra=extra)
    steady = max(range(1, epochs), key=lambda e: big["rates"][e])
    return {
        "warm miss": (fits["rates"][0], fits["cores"][0]),
        "hit": (max(fits["rates"][1:]), None),
        "larger than DRAM": (big["rates"][steady], big["cores"][steady]),
    }


def bench_size(ctx: Context, n: int, sample_bytes: int) -> list[dict[str, Any]]:
    args = ctx.args
    db = make_store(ctx.root, n, sample_bytes)
    rows: list[dict[str, Any]] = []

    def row(config: str, rates: list[float], **more: Any) -> None:
        r = {
            "sample_bytes": sample_bytes,
            "samples": n,
            "config": config,
            "samples_per_s": round(statistics.median(rates)),
            "runs": [round(x) for x in rates],
            **more,
        }
        rows.append(r)
        print(json.dumps(r), flush=True)

    cores = len(os.sched_getaffinity(0))
    best = 0.0
    for w in sorted({0, 2, 8, cores}):
        rate = dataloader(db, w, args.epochs, cold=False)["warm"]
        best = max(best, rate)
        row(f"DataLoader num_workers={w}, warm", [rate])
    procs = sorted({2, *args.miss_procs})
    runs: dict[tuple[int, str], list[tuple[float, Any]]] = {}
    with held_in_cache([db / "data.mdb"]):
        for _ in range(args.repeats):
            for p in procs:
                for what, got in loaderd_rates(db, ctx, p).items():
                    runs.setdefault((p, what), []).append(got)
    for (p, what), got in runs.items():
        rates = [rate for rate, _ in got]
        busy = [c for _, c in got if c is not None]
        row(
            f"loaderd, {p} miss workers, {what}",
            rates,
            vs_dataloader=round(statistics.median(rates) / best, 2),
            cores=busy[len(busy) // 2] if busy else None,
        )
    return rows


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], command: str) -> str:
    out = [
        *header("What a machine's cores change", info, command),
        f"Batch size {BATCH}; the page cache held warm; samples/s timed from each epoch's first "
        "batch. A loaderd row is the median of its fresh daemons (each one's under runs), "
        "'vs DataLoader' against the best DataLoader of this run at that size.",
        "",
    ]
    for size in dict.fromkeys(r["sample_bytes"] for r in rows):
        sub = [r for r in rows if r["sample_bytes"] == size]
        out += [
            f"## {sub[0]['samples']:,} samples of {size:,} bytes",
            "",
            "| configuration | samples/s | vs DataLoader | runs | busy cores: daemon, trainer "
            "| server loop: busy, on a core |",
            "|---|---:|---:|---|---|---|",
        ]
        for r in sub:
            c = r.get("cores")
            busy = f"{c['daemon']}, {c['trainer']}" if c else ""
            loop = f"{c['loop']}, {c['loop_cpu']}" if c and "loop" in c else ""
            runs = ", ".join(f"{x:,}" for x in r["runs"]) if len(r["runs"]) > 1 else ""
            ratio = r.get("vs_dataloader") or ""
            out.append(
                f"| {r['config']} | {r['samples_per_s']:,} | {ratio} | {runs} | {busy} | {loop} |"
            )
        out.append("")
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    info = machine()
    print(json.dumps({"machine": info}), flush=True)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        ctx = Context(args, stack)
        for n, sample_bytes in ((args.n_100k, 100_000), (args.n_3k, 3_000)):
            if n:
                rows += bench_size(ctx, n, sample_bytes)
    write_results(args.out, "cores", info, rows, lambda cmd: markdown(rows, info, cmd))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--n-100k", type=int, default=20000, help="samples of 100 KB (0: none)")
    p.add_argument("--n-3k", type=int, default=100000, help="samples of 3 KB (0: none)")
    p.add_argument("--epochs", type=int, default=2, help="epochs after the first")
    p.add_argument("--miss-procs", type=int, nargs="+", default=[4, 8], help="besides 2")
    p.add_argument("--repeats", type=int, default=3, help="fresh daemons per miss-worker count")
    p.add_argument("--shm-slots", type=int, default=64)
    p.add_argument("--data-dir", default="/tmp/loaderd-bench")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    args.profile = False  # bench_throughput's py-spy: not here
    return args


if __name__ == "__main__":
    sys.exit(main(parse_args()))
