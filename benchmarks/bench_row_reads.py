"""A miss worker's reads: slices of its map of data.mdb, or ``preadv`` into the batch's rows.

A miss worker fills a batch by verifying each record and copying its fields into the slot's
rows. This times that work per record, for stores of 3 KB, 20 KB and 100 KB records, in the
two states the page cache holds a warm store in: read in file order (a copy, an ingest: large
folios) and read record by record in random order (a shuffled cold epoch: single pages).
Three ways, in alternating runs over records this process has not read before:

* map, first touch: slices of the store's map (``SampleStore.views_at``), as a worker's first
  pass: every page is mapped into the process as it is read;
* map, mapped: the same records again, their pages mapped already (a later pass);
* preadv into rows: ``SampleStore.read_rows`` (``storage/row_reads.py``), nothing mapped,
  its loop compiled (``storage/read_rows.c``) where the extension is built;
* preadv into rows, Python loop: the same with the library set aside;
* map copy into rows, first touch / mapped: the compiled loop copying from the store's own
  map of data.mdb instead of ``preadv`` (``read_rows(from_map=True)``), as a worker's first
  pass over a store larger than DRAM, then a later one.

Prints one JSON line per configuration and writes ``results/row_reads.{json,md}``.

    python benchmarks/bench_row_reads.py [--sizes 3000 20000 100000] [--store-mb 400]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from _baselines import evict, warm
from _timing import header, machine, make_store, write_results  # the script's folder is on sys.path

from loaderd.prefetch import BatchWriter, fresh
from loaderd.storage import row_reads
from loaderd.storage.store import SampleStore

HERE = Path(__file__).resolve().parent
BATCH = 64
RUNS = 3
WAYS = (
    "map, first touch",
    "map, mapped",
    "preadv into rows",
    "preadv into rows, Python loop",
    "map copy into rows, first touch",
    "map copy into rows, mapped",
)


def read_in_random_order(db: Path, store: SampleStore) -> None:
    """Bring the store into the page cache record by record, in random order."""
    index = store.value_index
    assert index is not None
    fd = os.open(db / "data.mdb", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # each record's pages, no more
    buf = bytearray(int(index.lengths.max()))
    try:
        for i in np.random.default_rng(1).permutation(store.num_samples).tolist():
            os.preadv(fd, [memoryview(buf)[: int(index.lengths[i])]], int(index.offsets[i]))
    finally:
        os.close(fd)


def per_record_us(store: SampleStore, ids: np.ndarray, way: str) -> float:
    """Microseconds of CPU per record to fill batches of ``ids`` one way."""
    writer = BatchWriter(store.schema)
    frames = fresh(writer.frame_sizes(BATCH)).frames  # touched once, reused: a ring slot
    weights = np.ones(BATCH, np.float32)
    for f in frames:
        np.frombuffer(f, np.uint8)[:] = 0
    compiled = row_reads._LIB
    if way.endswith("Python loop"):
        row_reads._LIB = None
    c0 = time.process_time()
    try:
        for lo in range(0, len(ids) - BATCH + 1, BATCH):
            batch = ids[lo : lo + BATCH]
            spans = store.sliceable_spans(batch)
            assert spans is not None
            if "into rows" in way:
                read = partial(store.read_rows, batch, *spans, from_map=way.startswith("map"))
                writer.fill_read(batch, weights, frames, read)
            else:
                with store.views_at(batch, *spans) as records:
                    writer.fill(batch, weights, records, [], frames)
        return (time.process_time() - c0) / (len(ids) // BATCH * BATCH) * 1e6
    finally:
        row_reads._LIB = compiled


def bench_size(root: Path, sample_bytes: int, store_mb: int) -> list[dict[str, Any]]:
    n = max(BATCH * 6 * RUNS, store_mb * 1_000_000 // sample_bytes)
    db = make_store(root, n, sample_bytes)
    rows = []
    order = np.random.default_rng(2).permutation(n)
    per_run = min(6400, n // (3 * RUNS)) // BATCH * BATCH
    for state in ("file order", "random order"):
        # A store opened afresh maps nothing: the eviction drops every page (a mapped one
        # stays cached), and a first touch is one.
        evict([db / "data.mdb"])
        with SampleStore(db) as store:
            assert store.value_index is not None
            if state == "file order":
                warm([db / "data.mdb"])
            else:
                read_in_random_order(db, store)
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            for r in range(RUNS):  # alternating, each on records not read before in this state
                mine, other, third = (
                    order[(3 * r + k) * per_run : (3 * r + k + 1) * per_run] for k in range(3)
                )
                times["map, first touch"].append(per_record_us(store, mine, "map"))
                times["map, mapped"].append(per_record_us(store, mine, "map"))
                for way in WAYS[2:4]:  # nothing mapped: the same records for both loops
                    times[way].append(per_record_us(store, other, way))
                for way in WAYS[4:]:  # the compiled loop only; mapped by the first
                    times[way].append(per_record_us(store, third, way))
        for way in WAYS:
            row = {
                "sample_bytes": sample_bytes,
                "page_cache": f"read in {state}",
                "way": way,
                "us_per_record": round(statistics.median(times[way]), 2),
                "runs_us": [round(t, 2) for t in times[way]],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def markdown(info: dict[str, Any], rows: list[dict[str, Any]]) -> Any:
    def render(command: str) -> str:
        lines = [
            *header("A miss worker's reads: map slices against preadv into rows", info, command),
            "CPU microseconds per record to verify it and copy its fields into a batch's rows "
            f"(batches of {BATCH}; median of {RUNS} alternating runs over records not read "
            "before in that state). Each set of records is read twice: map first touch then "
            "mapped, preadv then its Python loop, map copy first touch then mapped; the first "
            "read of a set also pays the kernel's first access to its pages.",
            "",
            "| record | page cache | way | us/record | runs |",
            "|---:|---|---|---:|---|",
        ]
        for r in rows:
            runs = ", ".join(f"{t:.1f}" for t in r["runs_us"])
            lines.append(
                f"| {r['sample_bytes']:,} B | {r['page_cache']} | {r['way']} | "
                f"{r['us_per_record']:.1f} | {runs} |"
            )
        return "\n".join(lines) + "\n"

    return render


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[3000, 20_000, 100_000])
    p.add_argument("--store-mb", type=int, default=400, help="about this much data per size")
    p.add_argument("--data-dir", default="/tmp/loaderd-bench")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args()
    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    info = machine()
    rows = [r for size in args.sizes for r in bench_size(root, size, args.store_mb)]
    write_results(args.out, "row_reads", info, rows, markdown(info, rows))


if __name__ == "__main__":
    main()
