"""A/B of the daemon's files against a commit: fresh daemons, the two versions in turn.

On a shared machine only same-run ratios mean anything, and a run of ``bench_throughput.py``
takes most of an hour. This measures one change in minutes: the named files of the working
tree and of ``--base`` are swapped in, one version after the other (ABBA order), each time
under a fresh daemon over the same store, with the page cache held warm. Per daemon: its
first epoch (warm miss: DRAM empty), the best of ``--epochs`` later ones (hits), the median
wait for those epochs' first batches (the epoch's start) and its peak RSS; a DataLoader
(num_workers=0) over the same store at the start and the end.

The working tree's versions of the files are put back whatever happens (an error, Ctrl-C,
SIGTERM). Writes ``results/<--name>.json`` and ``.md``. Example:

    python benchmarks/bench_ab.py --base HEAD --files storage/dram.py storage/tiers.py \\
        --sizes 3000 100000 --name my_change
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from statistics import median
from typing import Any

from _baselines import BATCH, dataloader, evict_all, held_in_cache
from _timing import header, machine, make_store, write_results  # the script's folder is on sys.path
from bench_throughput import Context, context_args, ordinary_user, run_epoch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIDES = ("base", "change")


def swapper(base: str, files: list[str], stack: ExitStack) -> dict[str, Path]:
    """A folder of each side's files; the working tree's are put back when ``stack`` closes."""
    keep = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ab-")))
    sides = {side: keep / side for side in SIDES}
    for f in files:
        for side in SIDES:
            (sides[side] / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, sides["change"] / f)
        old = subprocess.run(
            ["git", "show", f"{base}:{f}"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        (sides["base"] / f).write_bytes(old)
    stack.callback(put, sides["change"], files)  # runs before the folder is removed
    return sides


def put(side: Path, files: list[str]) -> None:
    for f in files:
        shutil.copy2(side / f, ROOT / f)


# ``--sampler importance``: every epoch after the first selects half, and losses go back.
SELECTING = {"warmup_epochs": 1, "keep_fraction": 0.5, "rescore": False}


def one_daemon(
    ctx: Context,
    db: Path,
    epochs: int,
    dram_fraction: float,
    sampler: str = "uniform",
    nvram_fraction: float = 0.0,
    under: Sequence[str] = (),
    cold: bool = False,
) -> dict[str, float]:
    from loaderd.client import LoaderdDataset

    size = (db / "data.mdb").stat().st_size
    if cold:
        evict_all(db / "data.mdb")
    extra: list[str] = []
    nvram = None
    if nvram_fraction > 0:  # a fresh arena each daemon: none starts warm from the last one's
        shm = Path("/dev/shm")
        nvram = Path(
            tempfile.mkdtemp(prefix="loaderd-ab-nvram-", dir=shm if shm.is_dir() else None)
        )
        extra = ["--nvram-dir", str(nvram), "--nvram-bytes", str(int(size * nvram_fraction))]
    srv = ctx.serve(db, int(size * dram_fraction), extra, under)
    try:
        fed = sampler != "uniform"  # a selecting job: its losses go back
        options = SELECTING if fed else {}
        ds = LoaderdDataset(
            srv.address, job="ab", batch_size=BATCH, prefetch=8, sampler=sampler, **options
        )
        ds.connect()
        miss = run_epoch(ds, srv, fed)
        starts: list[float] = []
        hit = max(run_epoch(ds, srv, fed, starts=starts) for _ in range(epochs))
        ds.close()
    finally:
        ctx.stop(srv)
        if nvram is not None:
            shutil.rmtree(nvram, ignore_errors=True)
    return {
        "warm miss": round(miss),
        "hit": round(hit),
        "start_ms": round(1e3 * median(starts), 1),
        "rss_mib": srv.peak_rss >> 20,
    }


def bench_size(
    ctx: Context, sides: dict[str, Path], files: list[str], size: int, args: argparse.Namespace
) -> dict[str, Any]:
    n = args.samples or max(64 * 200, args.store_mb * 1_000_000 // size)
    db = make_store(ctx.root, n, size)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    loaders = []
    state = "cold" if args.cold else "warm"
    with ExitStack() as held:
        if not args.cold:
            held.enter_context(held_in_cache([db / "data.mdb"]))
        loaders.append(round(dataloader(db, 0, args.epochs, cold=args.cold)[state]))
        for k in range(args.pairs):
            for side in SIDES if k % 2 == 0 else SIDES[::-1]:
                put(sides[side], files)
                runs[side].append(
                    one_daemon(
                        ctx,
                        db,
                        args.epochs,
                        args.dram_fraction,
                        args.sampler,
                        args.nvram_fraction,
                        ordinary_user() if args.ordinary_user else (),
                        args.cold,
                    )
                )
                print(json.dumps({"size": size, "side": side, **runs[side][-1]}), flush=True)
        put(sides["change"], files)
        loaders.append(round(dataloader(db, 0, args.epochs, cold=args.cold)[state]))
    return {"sample_bytes": size, "samples": n, "dataloader_nw0": loaders, **runs}


def markdown(
    rows: list[dict[str, Any]], info: dict[str, Any], command: str, args: argparse.Namespace
) -> str:
    lines = [
        *header(f"A/B: {', '.join(args.files)} against {args.base}", info, command),
        f"Fresh daemons over one {'cold' if args.cold else 'warm'} store, the two versions of "
        "the files in turn (ABBA). "
        "Warm miss: a daemon's first epoch; hit: its best later epoch; samples/s, batch 64; "
        "epoch start: the median wait from `iter` to the first batch of the later epochs; "
        "RSS: the daemon's peak. Each cell: the median, then every run in order. "
        f"Sampler: {args.sampler}"
        + (
            " (half of each epoch after the first selected, losses sent back). "
            if args.sampler != "uniform"
            else ". "
        )
        + f"DRAM: {args.dram_fraction}x the store"
        + (
            " (larger than DRAM: 'hit' is the best steady-state epoch)."
            if args.dram_fraction < 1
            else "."
        )
        + (
            f" NVRAM arena: {args.nvram_fraction}x the store, fresh each daemon, in /dev/shm."
            if args.nvram_fraction > 0
            else ""
        )
        + (
            " Daemons run as an ordinary user may (8 MiB of pages locked at most)."
            if args.ordinary_user
            else ""
        )
        + (
            " Cold: the store evicted from the page cache before each daemon ('warm miss' is"
            " its cold first epoch) and before the DataLoader's (its first epoch)."
            if args.cold
            else ""
        ),
        "",
        "| sample | side | warm miss | hit | epoch start, ms | daemon RSS MiB |",
        "|---:|---|---|---|---|---|",
    ]
    for r in rows:
        for side in SIDES:
            cells = []
            for k, d in (("warm miss", 0), ("hit", 0), ("start_ms", 1), ("rss_mib", 0)):
                runs = ", ".join(f"{x[k]:,}" for x in r[side])
                cells.append(f"{median(x[k] for x in r[side]):,.{d}f} ({runs})")
            lines.append(f"| {r['sample_bytes']:,} B | {side} | " + " | ".join(cells) + " |")
        lines.append(
            f"| | DataLoader nw=0 | {', '.join(f'{x:,}' for x in r['dataloader_nw0'])} | | | |"
        )
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    info = machine()
    with ExitStack() as stack:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        sides = swapper(args.base, args.files, stack)
        ctx = Context(args, stack)
        rows = [bench_size(ctx, sides, args.files, size, args) for size in args.sizes]
    write_results(args.out, args.name, info, rows, lambda cmd: markdown(rows, info, cmd, args))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--base", required=True, help="the commit the change is measured against")
    p.add_argument("--files", nargs="+", required=True, help="the files swapped, from the root")
    p.add_argument("--sizes", type=int, nargs="+", default=[3_000, 100_000])
    p.add_argument("--samples", type=int, default=0, help="0: about --store-mb of data")
    p.add_argument("--store-mb", type=int, default=300)
    p.add_argument("--pairs", type=int, default=3, help="daemons of each side")
    p.add_argument("--epochs", type=int, default=3, help="hit epochs a daemon; the best counts")
    p.add_argument(
        "--dram-fraction",
        type=float,
        default=1.5,
        help="--dram-bytes as a fraction of data.mdb (0.25: a store four times larger than DRAM)",
    )
    p.add_argument(
        "--nvram-fraction",
        type=float,
        default=0.0,
        help="--nvram-bytes as a fraction of data.mdb, in /dev/shm (0: no NVRAM tier)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="evict the store before each daemon: its first epoch is a cold one",
    )
    p.add_argument(
        "--ordinary-user",
        action="store_true",
        help="daemons that may lock no more pages than an ordinary user (as root: setpriv)",
    )
    p.add_argument(
        "--sampler",
        default="uniform",
        help="the job's sampler; any other than uniform selects half of each epoch after the "
        "first (warm-up 1, no re-score) and each batch's losses are sent back",
    )
    context_args(p, "ab")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
