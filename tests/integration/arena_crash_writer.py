"""Writes into an arena until it is killed; run by test_arena_crash.py.

python -m tests.integration.arena_crash_writer log PATH FIRST_K
    puts record k = FIRST_K, FIRST_K + 1, ... (sample id k % N_IDS) in batches of 1..16,
    printing "k" after each batch is committed.
python -m tests.integration.arena_crash_writer snapshot PATH FIRST_STEP
    writes snapshots of job "crash" at steps FIRST_STEP, FIRST_STEP + 1, ..., printing each
    step once it is written.
Both print "open <recovered_items>" first.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from loaderd.storage.arena import Arena

FP = b"crash-test-store"
CAPACITY = 8 << 20
SNAPSHOT_BYTES = 4 << 20  # two 2 MiB slots
N_IDS = 500


def record(k: int) -> tuple[int, bytes]:
    """Sample id and payload of the k-th put: the first 8 bytes say k."""
    rng = random.Random(k)
    size = rng.choice((8, 56, 57, 64, 4096)) if k % 7 == 0 else rng.randrange(8, 65_536)
    return k % N_IDS, k.to_bytes(8, "little") + rng.randbytes(size - 8)


def snapshot(step: int) -> bytes:
    rng = random.Random(-step)
    return step.to_bytes(8, "little") + rng.randbytes(rng.randrange(100_000, 1_900_000))


def main(argv: list[str]) -> None:
    mode, path, first = argv[0], Path(argv[1]), int(argv[2])
    with Arena(path, CAPACITY, FP, snapshot_bytes=SNAPSHOT_BYTES) as arena:
        print("open", arena.recovered_items, flush=True)
        rng = random.Random(first)
        k = first
        while True:
            if mode == "log":
                n = rng.randint(1, 16)
                if n == 1:
                    arena.put(*record(k))
                else:
                    arena.put_many(record(i) for i in range(k, k + n))
                k += n
                print(k - 1, flush=True)
            else:
                arena.write_snapshot("crash", k, snapshot(k))
                print(k, flush=True)
                k += 1


if __name__ == "__main__":
    main(sys.argv[1:])
