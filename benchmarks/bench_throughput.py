"""Delivery throughput: memcpy bound, PyTorch DataLoader over LMDB, loaderd socket and shm paths.

For each sample size, on one LMDB store with a warm page cache, this measures

1. the single-core memory-copy bound (``np.copyto`` into a pre-faulted buffer);
2. ``torch.utils.data.DataLoader`` over a map-style dataset reading the same LMDB (env opened
   lazily per worker, ``torch.frombuffer`` + clone, default collate), ``batch_size`` 64,
   ``num_workers`` 0/1/2 (its best counts);
3. loaderd through ``LoaderdDataset`` over the socket path and over shared memory, cache miss
   (first epoch of a fresh daemon) and cache hit (later epochs);
4. loaderd feeding 1, 2 and 4 trainer processes at once (each its own job, whole dataset);
5. ZeroMQ's own throughput for the same message size (DEALER/ROUTER over ipc, no loaderd).

Prints one JSON line per configuration and writes ``results/throughput.json`` and
``results/throughput.md``. ``make bench-throughput`` runs it with the defaults (sized for a
2-core machine); ``--n-100k 20000 --n-3k 200000`` is the full size of the issue.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _timing import machine, make_store  # the script's folder is on sys.path

HERE = Path(__file__).resolve().parent
BATCH = 64


# --- data ---------------------------------------------------------------------------------------


# --- (1) memcpy ---------------------------------------------------------------------------------


def memcpy_bound(nbytes: int = 256 << 20, runs: int = 5) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.ones(nbytes, np.uint8)  # pre-faulted: touched before timing
    best = 0.0
    for _ in range(runs):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, nbytes / (time.perf_counter() - t0))
    return best


# --- (2) DataLoader -----------------------------------------------------------------------------


class LmdbMapDataset:
    """The usual recipe: env opened lazily per worker, frombuffer + clone."""

    def __init__(self, db: Path) -> None:
        from loaderd.storage.records import RECORD_HEADER
        from loaderd.storage.store import SampleStore

        with SampleStore(db) as s:
            self.n = s.num_samples
            layout = s.schema.layout
            self.fields = [
                (f.name, f.dtype, f.shape, RECORD_HEADER.size + layout.offsets[f.name], f.nbytes)
                for f in s.schema.fields
            ]
        self.db = db
        self.env: Any = None
        self.txn: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        import lmdb
        import torch

        if self.env is None:  # opened in the worker, never across a fork
            self.env = lmdb.open(str(self.db), readonly=True, lock=False, max_dbs=2)
            self.sub = self.env.open_db(b"samples", create=False)
            self.txn = self.env.begin(db=self.sub, buffers=True)
        raw = self.txn.get(i.to_bytes(8, "big"))
        out: dict[str, Any] = {}
        for name, dtype, shape, off, nbytes in self.fields:
            # copy out of the LMDB page (valid only while the transaction lives)
            t = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=off).clone()
            t = t.view(getattr(torch, dtype)).reshape(shape)
            out[name] = t
        return out


def bench_dataloader(db: Path, workers: int, epochs: int) -> float:
    import warnings

    from torch.utils.data import DataLoader

    ds = LmdbMapDataset(db)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        loader = DataLoader(
            ds,
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
        )
        best = 0.0
        for _ in range(epochs + 1):  # the first epoch starts the workers: not timed
            t0 = time.perf_counter()
            n = sum(len(b["label"]) for b in loader)
            best = max(best, n / (time.perf_counter() - t0))
    return best


# --- (3) loaderd --------------------------------------------------------------------------------


class Served:
    """A fresh ``loaderd serve`` for one measurement."""

    def __init__(self, db: Path, root: Path, dram: int, extra: list[str]) -> None:
        from loaderd.launch import start_daemon, wait_ready

        self.dir = Path(tempfile.mkdtemp(prefix="ldb-", dir="/tmp"))
        self.address = f"ipc://{self.dir}/d.sock"
        args = ["--dram-bytes", str(dram), "--workers", "2", *extra]
        self.proc = start_daemon(
            db, self.address, state_dir=self.dir / "state", extra=args, log=root / "daemon.log"
        )
        wait_ready(self.address, timeout_s=60, proc=self.proc)
        self.ps = psutil.Process(self.proc.pid)

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def close(self) -> None:
        from loaderd.launch import stop_daemon

        stop_daemon(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def run_epoch(ds: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = 0
    for b in ds:
        n += len(b["id"])
    return n, time.perf_counter() - t0


def bench_loaderd(
    db: Path, root: Path, dram: int, shm: bool, epochs: int, extra: list[str]
) -> dict[str, Any]:
    from loaderd.client import LoaderdDataset

    srv = Served(db, root, dram, extra)
    try:
        ds = LoaderdDataset(srv.address, job="bench", batch_size=BATCH, shm=shm, prefetch=8)
        n, dt = run_epoch(ds)  # fresh daemon: every read misses the cache
        miss = n / dt
        hit = max(n / d for n, d in (run_epoch(ds) for _ in range(epochs)))
        stats = ds.stats()
        out = {
            "miss": miss,
            "hit": hit,
            "daemon_rss": srv.rss(),
            "client_rss": psutil.Process().memory_info().rss,
            "shm_delivered": stats["shm"]["delivered"],
            "shm_fallbacks": stats["shm"]["socket_fallbacks"],
            "cache_bytes": stats["tiers"][0]["used_bytes"],
        }
        ds.close()
        return out
    finally:
        srv.close()


def _trainer(address: str, job: str, epochs: int, start: Any, out: Any) -> None:
    from loaderd.client import LoaderdDataset

    ds = LoaderdDataset(address, job=job, batch_size=BATCH, prefetch=8)
    run_epoch(ds)  # warm-up epoch (fills the shared cache)
    start.wait()
    t0 = time.perf_counter()
    n = sum(run_epoch(ds)[0] for _ in range(epochs))
    out.put((n, t0, time.perf_counter(), psutil.Process().memory_info().rss))
    ds.close()


def bench_trainers(
    db: Path, root: Path, dram: int, trainers: int, epochs: int, extra: list[str]
) -> dict[str, Any]:
    srv = Served(db, root, dram, extra)
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(trainers + 1), ctx.Queue()
    try:
        procs = [
            ctx.Process(target=_trainer, args=(srv.address, f"t{i}", epochs, start, out))
            for i in range(trainers)
        ]
        for p in procs:
            p.start()
        start.wait()
        peak_rss = 0
        results = []
        while len(results) < trainers:
            peak_rss = max(peak_rss, srv.rss())
            try:
                results.append(out.get(timeout=0.05))
            except Exception:
                continue
        for p in procs:
            p.join()
        n = sum(r[0] for r in results)
        wall = max(r[2] for r in results) - min(r[1] for r in results)
        from loaderd.client.connection import Connection
        from loaderd.client.protocol import MsgType

        with Connection(srv.address) as c:
            stats = c.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta
        return {
            "hit": n / wall,
            "daemon_rss": peak_rss,
            "client_rss": max(r[3] for r in results),
            "cache_bytes": stats["tiers"][0]["used_bytes"],
            "shm_bytes": stats["shm"]["bytes"],
        }
    finally:
        srv.close()


# --- (5) raw ZeroMQ -----------------------------------------------------------------------------


def _zmq_server(address: str, nbytes: int, ready: Any) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(address)
    payload = np.ones(nbytes, np.uint8)  # pre-faulted, sent without a copy
    ready.set()
    while True:
        ident, req = s.recv_multipart()
        if req == b"stop":
            break
        s.send_multipart([ident, b"h", payload], copy=False)
    s.close(linger=0)
    ctx.term()


def bench_zmq(nbytes: int, messages: int, window: int = 8) -> float:
    import zmq

    d = Path(tempfile.mkdtemp(prefix="ldz-", dir="/tmp"))
    address = f"ipc://{d}/z.sock"
    ctx_mp = mp.get_context("fork")
    ready = ctx_mp.Event()
    srv = ctx_mp.Process(target=_zmq_server, args=(address, nbytes, ready))
    srv.start()
    ready.wait(10)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(address)
    try:
        for _ in range(window):
            s.send(b"g")
        for _ in range(window):  # warm-up round
            s.recv_multipart(copy=False)
            s.send(b"g")
        t0 = time.perf_counter()
        for _ in range(messages):
            s.recv_multipart(copy=False)
            s.send(b"g")
        rate = messages / (time.perf_counter() - t0)
        for _ in range(window):
            s.recv_multipart(copy=False)
        s.send(b"stop")
    finally:
        srv.join(10)
        s.close(linger=0)
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)
    return rate * nbytes


# --- driver -------------------------------------------------------------------------------------


def emit(rows: list[dict[str, Any]], row: dict[str, Any]) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def bench_size(args: argparse.Namespace, label: str, n: int, sample_bytes: int) -> list[dict]:
    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    db = make_store(root, n, sample_bytes)
    per_sample = sample_bytes + 8  # image + label, as delivered
    dram = max(64 << 20, int(n * (sample_bytes + 64) * 1.5))
    extra = ["--shm-slots", str(args.shm_slots)]
    rows: list[dict[str, Any]] = []
    mem = memcpy_bound()
    dl = {w: bench_dataloader(db, w, args.epochs) for w in args.workers}
    dl_best = max(dl.values())

    def row(config: str, sps: float, **more: Any) -> dict[str, Any]:
        gbs = sps * per_sample / 1e9
        return {
            "size": label,
            "samples": n,
            "sample_bytes": sample_bytes,
            "config": config,
            "samples_per_s": round(sps, 1),
            "gb_per_s": round(gbs, 3),
            "vs_memcpy": round(gbs / (mem / 1e9), 3),
            "vs_dataloader": round(sps / dl_best, 3),
            **more,
        }

    emit(rows, row("memcpy bound (np.copyto, 1 core)", mem / per_sample))
    for w, sps in dl.items():
        emit(rows, row(f"DataLoader num_workers={w}", sps))
    for name, shm in (("socket", False), ("shm", True)):
        r = bench_loaderd(db, root, dram, shm, args.epochs, extra)
        mb = {"daemon_rss_mb": round(r["daemon_rss"] / 2**20), "client_rss_mb": None}
        mb["client_rss_mb"] = round(r["client_rss"] / 2**20)
        emit(rows, row(f"loaderd {name}, cache miss", r["miss"], **mb))
        emit(rows, row(f"loaderd {name}, cache hit", r["hit"], **mb))
    for t in args.trainers:
        r = bench_trainers(db, root, dram, t, args.epochs, extra)
        emit(
            rows,
            row(
                f"loaderd shm, {t} trainers (aggregate, hit)",
                r["hit"],
                daemon_rss_mb=round(r["daemon_rss"] / 2**20),
                client_rss_mb=round(r["client_rss"] / 2**20),
                cache_mb=round(r["cache_bytes"] / 2**20),
                ring_mb=round(r["shm_bytes"] / 2**20),
            ),
        )
    msg = BATCH * per_sample
    z = bench_zmq(msg, messages=max(50, min(2000, (2 << 30) // msg)))
    emit(rows, row(f"raw ZeroMQ DEALER/ROUTER ipc, {msg // 1024} KiB messages", z / per_sample))
    return rows


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], command: str) -> str:
    out = [
        "# Delivery throughput",
        "",
        f"Machine: {info['nproc']} CPUs, {info['cpu']}, {info['ram_gib']} GiB RAM, "
        f"Python {info['python']}, Linux {info['kernel']}.",
        "",
        f"Command: `{command}`",
        "",
        f"Batch size {BATCH}. GB/s counts the image and label bytes delivered. "
        "'vs memcpy' is the ratio to the single-core copy bound, 'vs DataLoader' to the best "
        "DataLoader configuration of the same size. RSS: peak resident memory (the daemon's "
        "includes the ring pages it touched; a trainer's includes the ring pages it mapped).",
        "",
    ]
    for size in dict.fromkeys(r["size"] for r in rows):
        sub = [r for r in rows if r["size"] == size]
        out += [
            f"## {size}: {sub[0]['samples']:,} samples of {sub[0]['sample_bytes']:,} bytes",
            "",
            "| configuration | samples/s | GB/s | vs memcpy | vs DataLoader | daemon RSS MiB "
            "| client RSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sub:
            out.append(
                f"| {r['config']} | {r['samples_per_s']:,.0f} | {r['gb_per_s']:.3f} "
                f"| {r['vs_memcpy']:.2f} | {r['vs_dataloader']:.2f} "
                f"| {r.get('daemon_rss_mb') or ''} | {r.get('client_rss_mb') or ''} |"
            )
        out.append("")
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    info = machine()
    print(json.dumps({"machine": info}), flush=True)
    rows: list[dict[str, Any]] = []
    sizes = {"100k": (args.n_100k, 100_000), "3k": (args.n_3k, 3_000)}
    for label in args.sizes:
        n, b = sizes[label]
        rows += bench_size(args, label, n, b)
    command = " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])
    command = f"python benchmarks/{command}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(
        json.dumps({"machine": info, "command": command, "results": rows}, indent=1) + "\n"
    )
    (out / "throughput.md").write_text(markdown(rows, info, command))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", nargs="+", default=["100k", "3k"], choices=["100k", "3k"])
    p.add_argument("--n-100k", type=int, default=2000, help="samples of 100 KB (issue: 20000)")
    p.add_argument("--n-3k", type=int, default=20000, help="samples of 3 KB (issue: 200000)")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs; the best counts")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--trainers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--shm-slots", type=int, default=64)
    p.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "loaderd-bench"))
    p.add_argument("--out", default=str(HERE / "results"))
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
