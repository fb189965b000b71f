"""loaderd through DataLoader workers, against no workers and a plain DataLoader, warm.

What a user gets who keeps ``DataLoader(ds, batch_size=None, num_workers=2)``, the README's
example and what frameworks advise: each batch handed from the worker to the loop's process
slot and all (``client/slot_handover.py``), with fresh and with persistent workers; with a
``transform`` that returns views of the batch (``(image, label, id)``, as torchvision users
write them) and one that makes a new tensor (the image as floats in [0, 1], 4x its bytes);
loaderd with ``num_workers=0``; loaderd over the socket (``--no-shm``, as from a daemon on
another host) with 0 and 2 workers; and a plain DataLoader (num_workers 0 and 2) reading the
same LMDB, best warm epoch, doing the same work per sample in its workers.

Each loaderd row is a fresh daemon (DRAM 1.5x the store, the page cache held warm) over
``--epochs`` epochs, each timed from its first batch: the first is a warm miss, the best of
the others a hit. Ratios are against the best plain DataLoader of the same run doing the same
work. Writes ``results/workers.json`` and ``results/workers.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _baselines import BATCH, dataloader, epochs_of, held_in_cache
from _timing import header, make_store  # the script's folder is on sys.path
from bench_sizes import MIN_BATCHES, sweep, sweep_args
from bench_throughput import Context

MAX_STORE_BYTES = 2_000_000_000  # 1 MB samples: 2,000 of them, 31 batches an epoch


def views(batch: dict[str, Any]) -> tuple[Any, ...]:
    """A transform that returns views of the batch: what lies in the slot crosses in place."""
    return batch["image"], batch["label"], batch["id"]


def scaled(batch: dict[str, Any]) -> dict[str, Any]:
    """A transform that makes a new tensor: it crosses through the worker's output pool."""
    return {"image": batch["image"].float().div_(255), "label": batch["label"], "id": batch["id"]}


def scaled_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """``scaled``'s work for one sample, for a plain DataLoader's workers."""
    return {"image": sample["image"].float().div_(255), "label": sample["label"]}


# Work in the workers: (loaderd's batch transform, the DataLoader's per-sample one).
WORK: dict[str, tuple[Callable[[dict[str, Any]], Any] | None, Any]] = {
    "none": (None, None),
    "views": (views, None),  # a plain DataLoader's samples are the same tensors
    "scaled": (scaled, scaled_sample),
}
# (label, num_workers, persistent_workers, work, the daemon's extra arguments)
SETUPS: list[tuple[str, int, bool, str, list[str]]] = [
    ("0 workers", 0, False, "none", []),
    ("2 workers, handed over", 2, False, "none", []),
    ("2 persistent workers, handed over", 2, True, "none", []),
    ("2 workers, a transform returning views", 2, False, "views", []),
    ("0 workers, a transform making floats", 0, False, "scaled", []),
    ("2 workers, a transform making floats", 2, False, "scaled", []),
    # No ring (a daemon on another host): the worker's batch crosses through its output pool.
    ("0 workers, over the socket (--no-shm)", 0, False, "none", ["--no-shm"]),
    ("2 workers, over the socket (--no-shm)", 2, False, "none", ["--no-shm"]),
]


def loaderd_epochs(
    ctx: Context,
    db: Path,
    epochs: int,
    workers: int,
    persistent: bool,
    work: str,
    extra: list[str] | None = None,
) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from loaderd.client import LoaderdDataset

    store_bytes = (db / "data.mdb").stat().st_size
    srv = ctx.serve(db, int(store_bytes * 1.5), extra or [])
    try:
        transform = WORK[work][0]
        ds = LoaderdDataset(
            srv.address, job="bench", batch_size=BATCH, prefetch=8, transform=transform
        )
        ds.connect()
        loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=persistent)
        rates = epochs_of(loader, epochs, 2 if work == "views" else "id")
        del loader
        shm = ds.stats()["shm"]
        ds.close()
        return {"rates": rates, "socket_fallbacks": shm["socket_fallbacks"]}
    finally:
        ctx.stop(srv)


def bench_one(ctx: Context, size: int, store_mb: int, epochs: int) -> dict[str, Any]:
    n = min(max(BATCH * MIN_BATCHES, store_mb * 1_000_000 // size), MAX_STORE_BYTES // size)
    db = make_store(ctx.root, n, size)
    dl = {
        kind: {w: dataloader(db, w, epochs, False, WORK[kind][1])["warm"] for w in (0, 2)}
        for kind in ("none", "scaled")
    }
    rows: dict[str, Any] = {}
    with held_in_cache([db / "data.mdb"]):
        for label, workers, persistent, work, extra in SETUPS:
            got = loaderd_epochs(ctx, db, epochs, workers, persistent, work, extra)
            rates = got["rates"]
            best = max(dl["scaled" if work == "scaled" else "none"].values())
            rows[label] = {
                "warm miss": round(rates[0]),
                "hit": round(max(rates[1:])),
                "vs_dataloader": {
                    "warm miss": round(rates[0] / best, 2),
                    "hit": round(max(rates[1:]) / best, 2),
                },
                "epochs": [round(r) for r in rates],
                "socket_fallbacks": got["socket_fallbacks"],
            }
    row = {
        "sample_bytes": size,
        "samples": n,
        "dataloader": {
            kind: {f"num_workers={w}": round(r) for w, r in rates.items()}
            for kind, rates in dl.items()
        },
        "loaderd": rows,
    }
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], command: str) -> str:
    lines = [
        *header("loaderd through DataLoader workers", info, command),
        "Samples/s, batch 64, the store held in the page cache. loaderd: a fresh daemon per "
        "row, its first epoch (warm miss) and best later epoch (hit); in brackets the ratio to "
        "the best plain DataLoader (num_workers 0 or 2) of the same run doing the same work: "
        "for the transform making floats, the same conversion of each sample in its workers.",
        "",
    ]
    for r in rows:
        dl = r["dataloader"]
        lines += [
            f"### {r['sample_bytes']:,} B samples ({r['samples']:,})",
            "",
            f"Plain DataLoader: {dl['none']['num_workers=0']:,} (0 workers), "
            f"{dl['none']['num_workers=2']:,} (2 workers); making floats of each sample: "
            f"{dl['scaled']['num_workers=0']:,} and {dl['scaled']['num_workers=2']:,}.",
            "",
            "| loaderd | warm miss | hit | epochs | over the socket |",
            "|---|---:|---:|---|---:|",
        ]
        for label, v in r["loaderd"].items():
            vs = v["vs_dataloader"]
            lines.append(
                f"| {label} | {v['warm miss']:,} ({vs['warm miss']}x) | {v['hit']:,} "
                f"({vs['hit']}x) | {', '.join(f'{e:,}' for e in v['epochs'])} | "
                f"{v['socket_fallbacks']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    return sweep(args, "workers", bench_one, markdown)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sizes = [100_000, 3_000, 1_000_000]
    return sweep_args(__doc__, sizes, "the first a warm miss, then hits", argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
