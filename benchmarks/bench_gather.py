"""Where the cache-hit path's copy goes: ``gather_rows`` against memcpy, and variants of it.

A real store of 100 KB records is read through a real ``TierStack`` until DRAM holds every
record as the daemon does (a view of the store's locked pages, or a copy where locking is not
allowed). Batches of 64 random records are then gathered into a slot of a real shared-memory
ring, and each variant copies the same bytes another way: from other sources, into other
destinations, by other copy loops. Each is timed alone and next to a thread running Python
(as the daemon's server loop and second assembler do), with the gathering thread's CPU time.
Prints GB/s of record bytes.

    python benchmarks/bench_gather.py [--records 4000] [--bytes 100000] [--batch 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from loaderd import row_copy
from loaderd.prefetch import Assembler, Placed, gather_rows
from loaderd.shm_ring import LentRing
from loaderd.storage.records import Field, RecordCodec, Schema
from loaderd.storage.store import SampleStore
from loaderd.storage.store_writer import StoreWriter
from loaderd.storage.syscalls import address_of
from loaderd.storage.tiers import Record, TierStack

SLOTS = 32  # the daemon's ring: batches rotate over its slots while trainers hold some
Copy = Callable[[list[Record], memoryview], object]


def timed(fn: Callable[[int], object], nbytes: int, rounds: int) -> tuple[float, float]:
    """(GB/s by the wall clock, GB/s per second of this thread's CPU), best of three tries."""
    fn(0)
    wall = cpu = 0.0
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.thread_time()
        for r in range(rounds):
            fn(r)
        t1, c1 = time.perf_counter(), time.thread_time()
        wall = max(wall, nbytes * rounds / (t1 - t0) / 1e9)
        cpu = max(cpu, nbytes * rounds / max(c1 - c0, 1e-9) / 1e9)
    return wall, cpu


def beside_python(fn: Callable[[int], object], nbytes: int, rounds: int) -> tuple[float, float]:
    """``timed`` while another thread runs Python (and so wants the GIL)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(200))

    t = threading.Thread(target=spin)
    t.start()
    try:
        return timed(fn, nbytes, rounds)
    finally:
        stop.set()
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--records", type=int, default=4000)
    ap.add_argument("--bytes", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    n, size, b = args.records, args.bytes, args.batch

    schema = Schema((Field("image", "uint8", (size,)), Field("label", "int64")))
    codec = RecordCodec(schema)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store"
        with StoreWriter(path, schema) as w:
            for lo in range(0, n, 128):
                w.append(
                    [
                        codec.encode({"image": rng.integers(0, 256, size, np.uint8), "label": i})
                        for i in range(lo, min(n, lo + 128))
                    ]
                )
        store = SampleStore(path)
        stack = TierStack(store, n * (size + 64) * 2)
        ring = LentRing.create(SLOTS, b * (size + 64) + (1 << 16))
        try:
            for lo in range(0, n, b):  # admit every record into DRAM
                with stack.read(np.arange(lo, min(n, lo + b))):
                    pass
            print(
                f"{n} records of {size} B, batch {b}: {b * size / 1e6:.1f} MB a batch; DRAM "
                f"holds {len(stack.dram)} records, {stack.dram.pinned} as locked store pages"
            )
            batches = [rng.integers(0, n, b) for _ in range(args.rounds)]
            run(stack, schema, ring, batches)
        finally:
            ring.close()
            stack.close()
            store.close()


def run(stack: TierStack, schema: Schema, ring: LentRing, batches: list[np.ndarray]) -> None:
    image = schema.layout.fixed[0]
    offset, width = image.offset, image.nbytes
    rounds, nbytes = len(batches), len(batches[0]) * width
    slots = [s for s in (ring.acquire() for _ in range(SLOTS)) if s is not None]
    ring_views = [ring.view(s, 0, nbytes) for s in slots]
    held: list[list[Record]] = []
    for ids in batches:
        with stack.read(ids) as recs:  # DRAM hits: the records outlive the read
            held.append(list(recs))
    copies = [[bytes(r) for r in recs] for recs in held]
    heap = np.ones(nbytes, np.uint8)  # touched: faulted in
    fd = os.open(ring.path, os.O_RDWR)
    base = ring._data_offset + slots[0] * ring.slot_bytes

    def rows_numpy(recs: list[Record], out: memoryview) -> None:  # gather_rows before
        rows = np.frombuffer(out, np.uint8).reshape(len(recs), width)
        for i, rec in enumerate(recs):
            np.copyto(rows[i], np.frombuffer(rec, np.uint8, width, offset))

    def concat(recs: list[Record], out: memoryview) -> None:
        rows = [np.frombuffer(r, np.uint8, width, offset) for r in recs]
        np.concatenate(rows, out=np.frombuffer(out, np.uint8))

    def pwritev(recs: list[Record], _out: memoryview) -> None:
        os.pwritev(fd, [memoryview(r)[offset : offset + width] for r in recs], base)

    def gather(recs: list[Record], out: memoryview) -> None:
        gather_rows(recs, [(out, offset, width)])

    def python_rows(recs: list[Record], out: memoryview) -> None:  # without the compiled copy
        for i, rec in enumerate(recs):
            out[i * width : (i + 1) * width] = memoryview(rec)[offset : offset + width]

    def compiled(threads: int, stream: bool) -> Copy:
        def copy(recs: list[Record], out: memoryview) -> None:
            assert row_copy._LIB is not None
            sources = np.fromiter(map(address_of, recs), np.uint64, len(recs))
            table = np.array([(address_of(out), offset, width)], np.uint64)
            row_copy._LIB.loaderd_gather_rows(
                sources.ctypes.data, len(recs), table.ctypes.data, 1, threads, stream
            )

        return copy

    def case(
        copy: Copy, src: list[list[Record]], dst: Callable[[int], memoryview]
    ) -> Callable[[int], object]:
        return lambda r: copy(src[r], dst(r))

    one_slot = ring_views[0]
    in_turn = lambda r: ring_views[r % len(ring_views)]  # noqa: E731
    cases: list[tuple[str, Callable[[int], object]]] = [
        ("Python rows: DRAM records -> ring slots in turn", case(python_rows, held, in_turn)),
    ]
    if row_copy.AVAILABLE:
        cases += [
            (
                f"compiled, {t} thread(s), {'streaming' if st else 'ordinary'} stores: -> in turn",
                case(compiled(t, st), held, in_turn),
            )
            for t, st in ((1, False), (1, True), (2, False), (2, True))
        ]
    cases += [
        ("gather_rows: DRAM records -> ring slot", case(gather, held, lambda r: one_slot)),
        ("gather_rows: DRAM records -> ring slots in turn", case(gather, held, in_turn)),
        ("gather_rows: bytes copies -> ring slot", case(gather, copies, lambda r: one_slot)),
        ("gather_rows: DRAM records -> heap, touched", case(gather, held, lambda r: heap.data)),
        (
            "gather_rows: DRAM records -> np.empty each batch",
            case(gather, held, lambda r: np.empty(nbytes, np.uint8).data),
        ),
        ("rows by np.copyto (GIL let go per row)", case(rows_numpy, held, lambda r: one_slot)),
        ("one np.concatenate", case(concat, held, lambda r: one_slot)),
        ("one os.pwritev into the ring's file", case(pwritev, held, lambda r: one_slot)),
    ]
    big_src, big_dst = np.ones(256 << 20, np.uint8), np.ones(256 << 20, np.uint8)
    bound = timed(lambda r: np.copyto(big_dst, big_src), 256 << 20, 3)[0]
    flat = np.ones(nbytes, np.uint8)
    batch_copy = timed(lambda r: np.copyto(np.frombuffer(one_slot, np.uint8), flat), nbytes, 9)
    print(f"  {bound:6.2f} GB/s  memcpy bound: one np.copyto of 256 MB")
    print(f"  {batch_copy[0]:6.2f} GB/s  memcpy of one batch's bytes, heap -> ring slot (cached)")
    print("  alone: wall (cpu) GB/s | beside a Python thread: wall (cpu) GB/s")
    for name, fn in cases:
        alone, beside = timed(fn, nbytes, rounds), beside_python(fn, nbytes, rounds)
        print(f"  {alone[0]:6.2f} ({alone[1]:5.2f}) | {beside[0]:6.2f} ({beside[1]:5.2f})  {name}")
    os.close(fd)
    print(f"  {two_threads(held, ring_views[:2], gather):6.2f} GB/s  gather_rows, 2 threads")
    print(f"  {two_threads(held, ring_views[:2], rows_numpy):6.2f} GB/s  np.copyto, 2 threads")
    asm = Assembler(stack, schema)

    def assemble(r: int) -> None:
        ids = batches[r]
        asm.assemble(ids, np.ones(len(ids), np.float32), lambda s: place(ring, slots[0], s))

    alone = timed(assemble, nbytes, rounds)
    print(f"  {alone[0]:6.2f} ({alone[1]:5.2f})  Assembler.assemble: tier read + gather")


def place(ring: LentRing, slot: int, sizes: list[int]) -> Placed:
    desc = ring.layout(slot, sizes)
    return Placed([ring.view(slot, off, n) for off, n in desc.frames])


def two_threads(held: list[list[Record]], outs: list[memoryview], copy: Copy) -> float:
    """Aggregate GB/s of two threads gathering at once, each into its own slot."""
    rounds = len(held)

    def work(k: int) -> None:
        for r in range(rounds):
            copy(held[(r + k * rounds // 2) % rounds], outs[k])

    ts = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return 2 * rounds * outs[0].nbytes / (time.perf_counter() - t0) / 1e9


if __name__ == "__main__":
    main()
