"""Two jobs with different batch sizes on one daemon: do both get shared memory?

A store of 200 KB variable-length records (what encoded images are) that DRAM holds whole.
Job ``big`` reads batches of 128 (25 MB) through a DataLoader of two persistent workers; job
``small`` reads batches of 20 alongside it, three of its batches for each of ``big``'s. Reported per
epoch: the samples both jobs took per second, and the batches that went over the socket
instead of a ring slot (``shm.socket_fallbacks``), with the rings the daemon made.

    python benchmarks/bench_rings.py --out benchmarks/results/rings.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import machine

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.protocol import MsgType
from loaderd.launch import start_daemon, stop_daemon, wait_ready
from loaderd.storage.records import Field, RecordCodec, Schema
from loaderd.storage.store_writer import StoreWriter


def make_store(path: Path, n: int, nbytes: int) -> Path:
    """``n`` records of ``nbytes`` random bytes (a binary field) and a label, built once."""
    if not (path / "data.mdb").exists():
        codec = RecordCodec(Schema((Field("image", "binary"), Field("label", "int64"))))
        rng = np.random.default_rng(0)
        with StoreWriter(path, codec.schema) as w:
            w.append(codec.encode({"image": rng.bytes(nbytes), "label": i}) for i in range(n))
    return path


def shm_stats(address: str) -> dict[str, Any]:
    with Connection(address) as c:
        return dict(c.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta["shm"])


def run(db: Path, n: int, epochs: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        address = f"ipc://{tmp}/d.sock"
        proc = start_daemon(db, address, state_dir=Path(tmp) / "st", extra=["--dram-bytes", "1GiB"])
        try:
            wait_ready(address, timeout_s=60, proc=proc)
            big = LoaderdDataset(address, job="big", batch_size=128)
            small = LoaderdDataset(address, job="small", batch_size=20)
            loader = DataLoader(big, batch_size=None, num_workers=2, persistent_workers=True)
            for epoch in range(epochs):
                before = shm_stats(address)["socket_fallbacks"]
                t, took = time.perf_counter(), 0
                it = iter(small)
                for batch in loader:
                    took += len(batch["id"])
                    for _ in range(3):
                        got = next(it, None)
                        took += 0 if got is None else len(got["id"])
                took += sum(len(b["id"]) for b in it)
                seconds = time.perf_counter() - t
                s = shm_stats(address)
                assert took == 2 * n, f"epoch {epoch}: {took} samples, not {2 * n}"
                rows.append(
                    {
                        "epoch": epoch,
                        "samples_per_s": round(took / seconds),
                        "socket_fallbacks": s["socket_fallbacks"] - before,
                        "batches": -(-n // 128) + -(-n // 20),
                        "rings": [(r["slots"], r["slot_bytes"]) for r in s["rings"]],
                    }
                )
                print(rows[-1], flush=True)
            big.close()
            small.close()
        finally:
            stop_daemon(proc)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--record-bytes", type=int, default=200_000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--data-dir", type=Path, default=Path("/tmp/loaderd-bench-rings"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    db = make_store(
        args.data_dir / f"store-{args.record_bytes}-{args.n}.db", args.n, args.record_bytes
    )
    result = {
        "machine": machine(),
        "command": " ".join(sys.argv),
        "epochs": run(db, args.n, args.epochs),
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
