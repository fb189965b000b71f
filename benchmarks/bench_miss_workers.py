"""How far the miss path's own work scales: threads of one interpreter against processes.

The work a warm miss cannot avoid, for every record of a batch: LMDB's ``get`` (a view of
the store's map), its checksum, and the copy of its body into a shared-memory slot. This runs
it over a real store for three passes in random order, by 1 and 2 threads of this process
(one store, one map, as the daemon's assembler threads) and by 1 and 2 spawned processes
(each its own store and map), with the page cache warm. Prints records/s, timed inside the
workers (process start-up excluded).

    python benchmarks/bench_miss_workers.py [--samples 20000] [--bytes 100000]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _timing import make_store  # the script's folder is on sys.path

from loaderd.storage.records import RECORD_HEADER, verify
from loaderd.storage.store import SampleStore

BATCH = 64
SLOTS = 8
PASSES = 3


def work(db: Path, slot_file: str, part: int, parts: int, width: int, out: Any) -> None:
    """Read, check and copy every ``parts``-th batch of three passes; puts (start, end)."""
    store = _stores.get(db) or SampleStore(db, check_damaged=False)
    n = store.num_samples
    order = np.concatenate([np.random.default_rng(e).permutation(n) for e in range(PASSES)])
    fd = os.open(slot_file, os.O_RDWR)
    ring = mmap.mmap(fd, SLOTS * BATCH * width)
    os.close(fd)
    rows = memoryview(ring)
    head = RECORD_HEADER.size
    start = time.perf_counter()
    for b in range(part, len(order) // BATCH, parts):
        ids = order[b * BATCH : (b + 1) * BATCH].tolist()
        base = (b % SLOTS) * BATCH * width
        with store.views(ids, verified=False) as views:
            for i, (sid, view) in enumerate(zip(ids, views, strict=True)):
                verify(view, sid, "bench")
                rows[base + i * width : base + (i + 1) * width] = view[head : head + width]
    out.put((start, time.perf_counter()))
    rows.release()
    ring.close()


_stores: dict[Path, SampleStore] = {}  # the threads' one store (LMDB opens a file once)


def run(db: Path, width: int, how: str, count: int) -> float:
    slot_file = f"/dev/shm/loaderd-bench-{os.getpid()}"
    fd = os.open(slot_file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, SLOTS * BATCH * width)
    os.close(fd)
    try:
        spawn = mp.get_context("spawn")
        out: Any = queue.Queue() if how == "threads" else spawn.Queue()
        args = [(db, slot_file, k, count, width, out) for k in range(count)]
        if how == "threads":
            _stores[db] = SampleStore(db, check_damaged=False)
            workers: list[Any] = [threading.Thread(target=work, args=a) for a in args]
        else:
            workers = [spawn.Process(target=work, args=a) for a in args]
        for w in workers:
            w.start()
        spans = [out.get(timeout=600) for _ in workers]
        for w in workers:
            w.join()
        if how == "threads":
            _stores.pop(db).close()
        n = SampleStore(db)
        total = PASSES * (n.num_samples // BATCH) * BATCH
        n.close()
        return total / (max(e for _, e in spans) - min(s for s, _ in spans))
    finally:
        os.unlink(slot_file)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--bytes", type=int, default=100_000)
    p.add_argument("--data-dir", default="/tmp/bench-data")
    args = p.parse_args()
    db = make_store(Path(args.data_dir), args.samples, args.bytes)
    with open(db / "data.mdb", "rb") as f:  # warm: the page cache holds the store
        while f.read(1 << 24):
            pass
    print(f"{args.samples} records of {args.bytes} B, batch {BATCH}, {PASSES} passes, warm")
    for how in ("threads", "processes"):
        for count in (1, 2):
            rate = run(db, args.bytes, how, count)
            print(f"{rate:10,.0f} records/s  {count} {how}")


if __name__ == "__main__":
    main()
