"""What the boundary exchange costs: one round carrying a whole epoch's feedback, on loopback.

Goal (issue 11): under 1 s for 10 M samples. ``--nodes`` real processes form a real gloo group
over 127.0.0.1 (``loaderd.cluster_group``). Each holds its ranks' share of one epoch's
feedback (a random permutation of the samples split over the nodes, float32 losses, submitted
in FEEDBACK-sized batches), and all run one round as the cluster thread does: encode (coalesce
and the bitmap coding), the collectives (header and contributions allgather) with the decode
of every node's contribution, then apart, persisting the round (log append and fsync). The
baseline is the naive exchange: an allgather of 12 bytes per sample (int64 id, float32 loss).
A configuration's time is the slowest node's, per run. Writes ``results/cluster.json`` and
``results/cluster.md`` with the command and the machine.

    .venv/bin/python benchmarks/bench_cluster.py                      # 1M and 10M, 3 nodes
    .venv/bin/python benchmarks/bench_cluster.py --samples 1000000 --nodes 2 4 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import machine

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_S = 1.0
PHASES = (
    "encode_s",
    "exchange_s",
    "persist_s",
    "round_s",
    "round_cpu_s",
    "naive_allgather_s",
    "encode_cpu_s",
    "exchange_cpu_s",
    "persist_cpu_s",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(args: argparse.Namespace) -> None:
    """One node: its share of an epoch's feedback, then ``runs`` timed rounds."""
    from loaderd.cluster_group import Rendezvous
    from loaderd.cluster_log import RoundLog
    from loaderd.cluster_rounds import exchange
    from loaderd.cluster_wire import (
        Entries,
        JobStatus,
        Pending,
        RankStatus,
        coalesce,
        encode_contribution,
        round_parts,
    )
    from loaderd.config import ClusterConfig

    n, nodes, me = args.samples, args.nodes_, args.node_rank
    rng = np.random.default_rng(0)  # the same permutation on every node: disjoint shares
    share = np.array_split(rng.permutation(n).astype(np.int64), nodes)[me]
    losses = np.random.default_rng(me + 1).exponential(1.0, len(share)).astype(np.float32)
    pending = [
        Pending(
            i + 1,
            Entries("job", 7, "train", share[lo : lo + args.batch], losses[lo : lo + args.batch]),
        )
        for i, lo in enumerate(range(0, len(share), args.batch))
    ]
    status = {"job": JobStatus({"name": "job"}, {me: RankStatus(7, "train", True, (8, "rescore"))})}
    config = ClusterConfig(address=args.address, nodes=nodes, node_rank=me, timeout_s=120)
    group = Rendezvous(config, b"bench-store").join(threading.Event())
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp, RoundLog(Path(tmp)) as log:
        for run in range(args.warmup + args.runs):
            group.allgather(np.zeros(1, np.int64))  # start together
            c0, t0 = time.process_time(), time.perf_counter()
            payload = encode_contribution(0, len(pending), status, coalesce(pending))
            t1, c1 = time.perf_counter(), time.process_time()
            got = exchange(group, run, payload, True)
            t2, c2 = time.perf_counter(), time.process_time()
            assert got is not None
            rnd, blobs = got
            assert rnd.num_entries == n
            log.append(run + 1, round_parts(run + 1, blobs))
            t3, c3 = time.perf_counter(), time.process_time()
            naive = np.zeros(12 * len(np.array_split(np.arange(n), nodes)[0]), np.uint8)
            group.allgather(np.zeros(1, np.int64))
            t4 = time.perf_counter()
            group.allgather(naive)
            t5 = time.perf_counter()
            if run >= args.warmup:
                mine = [t1 - t0, t2 - t1, t3 - t2, t3 - t0, c3 - c0, t5 - t4]
                mine += [c1 - c0, c2 - c1, c3 - c2]
                slowest = np.max(np.stack(group.allgather(np.array(mine))), axis=0)
                rows.append(dict(zip(PHASES, slowest.tolist(), strict=True)))
                rows[-1]["bytes_per_node"] = float(len(payload))
    if me == 0:
        Path(args.out).write_text(json.dumps(rows))
    group.close()


def run_config(args: argparse.Namespace, samples: int, nodes: int) -> dict[str, Any]:
    out = Path(args.tmp) / f"bench-cluster-{os.getpid()}.json"
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--address",
                address,
                "--nodes-",
                str(nodes),
                "--node-rank",
                str(r),
                "--samples",
                str(samples),
                "--runs",
                str(args.runs),
                "--warmup",
                str(args.warmup),
                "--batch",
                str(args.batch),
                "--tmp",
                args.tmp,
                "--out",
                str(out),
            ]
        )
        for r in range(nodes)
    ]
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"a worker of the {samples}-sample, {nodes}-node run failed")
    runs = json.loads(out.read_text())
    out.unlink()
    row: dict[str, Any] = {"samples": samples, "nodes": nodes, "runs": len(runs)}
    for phase in PHASES:
        values = sorted(r[phase] for r in runs)
        row[phase.replace("_s", "_median_s")] = statistics.median(values)
        row[phase.replace("_s", "_max_s")] = values[-1]
    row["bytes_per_node"] = runs[0]["bytes_per_node"]
    row["bytes_per_sample"] = row["bytes_per_node"] * nodes / samples
    row["goal_s"] = GOAL_S
    row["meets_goal"] = row["round_median_s"] < GOAL_S
    return row


def write(rows: list[dict[str, Any]], command: str) -> None:
    info = machine()
    (RESULTS / "cluster.json").write_text(
        json.dumps({"command": command, "machine": info, "results": rows}, indent=2) + "\n"
    )
    lines = [
        "# Cluster boundary exchange",
        "",
        "One round carrying a whole epoch's feedback (every sample once), real gloo on "
        "127.0.0.1, one process per node; the slowest node per run, median of "
        f"{rows[0]['runs']} runs (max in brackets). `round` = encode + exchange + persist; "
        "`round CPU` is the slowest node's CPU time for it (gloo's threads included), what a "
        "node on its own machine would pay.",
        "",
        f"Command: `{command}`  ",
        f"Machine: {info['cpu']}, {info['nproc']} cores, {info['ram_gib']} GiB, torch "
        f"{info['torch']}, load average {info['loadavg_1m']} at the end, niceness {os.nice(0)}",
        "",
        "| samples | nodes | bytes/sample | encode s | exchange + decode s | persist (fsync) s "
        "| round s | round CPU s | CPU encode / exchange / persist s "
        "| naive 12 B/sample allgather s | under 1 s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        cells = [f"{r['samples']:,}", str(r["nodes"]), f"{r['bytes_per_sample']:.2f}"]
        cells += [
            f"{r[phase + '_median_s']:.3f} ({r[phase + '_max_s']:.3f})"
            for phase in ("encode", "exchange", "persist", "round", "round_cpu")
        ]
        cells.append(
            " / ".join(f"{r[p + '_cpu_median_s']:.3f}" for p in ("encode", "exchange", "persist"))
        )
        cells.append(f"{r['naive_allgather_median_s']:.3f} ({r['naive_allgather_max_s']:.3f})")
        cells.append("yes" if r["meets_goal"] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    (RESULTS / "cluster.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--nodes", type=int, nargs="+", default=[3])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=512, help="samples per FEEDBACK")
    p.add_argument("--tmp", default=tempfile.gettempdir(), help="where the round log goes")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--nodes-", dest="nodes_", type=int, help=argparse.SUPPRESS)
    p.add_argument("--node-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.samples = args.samples[0]
        worker(args)
        return
    rows = []
    for samples in args.samples:
        for nodes in args.nodes:
            row = run_config(args, samples, nodes)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if not args.no_write:
        write(rows, "python benchmarks/bench_cluster.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
