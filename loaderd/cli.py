"""The ``loaderd`` command: serve, ingest, stats, demo. The only place that reads argv.

Every failure a user can cause ends in one line on stderr, ``loaderd: error: ...``, and a
non-zero exit status.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from loaderd import __version__
from loaderd.client.address import check_address, default_address
from loaderd.config import (
    KEEP_SELECTIONS,
    AutotuneConfig,
    CacheConfig,
    ClusterConfig,
    DaemonConfig,
    PrefetchConfig,
    ShmConfig,
    parse_size,
)
from loaderd.job_admin import DEFAULT_RETENTION_DAYS

logger = logging.getLogger("loaderd")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(
        prog="loaderd", description=__doc__.splitlines()[0] if __doc__ else None
    )
    p.add_argument("--version", action="version", version=f"loaderd {__version__}")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon in the foreground")
    s.add_argument("--db", required=True, type=Path, help="the store written by `loaderd ingest`")
    s.add_argument(
        "--socket", default=default_address(), help="endpoint to bind (default: %(default)s)"
    )
    s.add_argument("--state-dir", type=Path, help="job state (default: DB.state beside the store)")
    s.add_argument(
        "--dram-bytes",
        type=_size,
        default=CacheConfig().dram_bytes,
        help="DRAM cache size, e.g. 2GiB; lowered, with a warning, to what the memory "
        "available at start holds beside the rings (the machine's, or a memory cgroup's "
        "where less)",
    )
    s.add_argument(
        "--dram-admit-queue",
        type=_size,
        default=CacheConfig().admit_queue_bytes,
        help="record bytes waiting to enter DRAM behind the serving path; a full queue drops "
        "admissions (default: 256MiB; 0: admit while serving)",
    )
    s.add_argument(
        "--dram-lock-pages",
        action=argparse.BooleanOptionalAction,
        default=CacheConfig().lock_pages,
        help="hold large records in DRAM as the store's pages locked in RAM (mlock) rather "
        "than as copies (default: on; where RLIMIT_MEMLOCK refuses, a DRAM that holds the "
        "whole store holds a copy of it made at start, else records are copied; off: copies)",
    )
    s.add_argument(
        "--dram-load",
        action=argparse.BooleanOptionalAction,
        default=CacheConfig().load_map,
        help="where DRAM can hold the whole store (and its pages may be locked), read it into "
        "RAM at start, in file order, at the disk's sequential rate (default: on; off: as "
        "records are read)",
    )
    s.add_argument(
        "--nvram-dir",
        type=Path,
        help="directory of the NVRAM arena file (a DAX mount, /dev/shm or any disk); "
        "also enables parameter snapshots",
    )
    s.add_argument(
        "--nvram-bytes",
        type=_size,
        default=CacheConfig().nvram_bytes,
        help="arena file size, snapshot region included (default: 8GiB)",
    )
    s.add_argument(
        "--snapshot-bytes",
        type=_size,
        help="arena bytes for the two snapshot slots (default: a quarter of --nvram-bytes)",
    )
    s.add_argument(
        "--cache-policy",
        default=CacheConfig().policy,
        choices=["importance", "lru", "static"],
        help="placement in DRAM and NVRAM (default: %(default)s)",
    )
    s.add_argument(
        "--prefetch",
        type=int,
        default=PrefetchConfig().depth,
        help="batches assembled ahead of demand per rank (default: %(default)s)",
    )
    s.add_argument(
        "--readahead-bytes",
        type=parse_size,
        default=PrefetchConfig().readahead_bytes,
        help="store bytes read ahead of the trainers, over all passes (e.g. 256MiB; 0: off)",
    )
    s.add_argument("--workers", type=int, default=PrefetchConfig().workers, help="assembly threads")
    s.add_argument(
        "--miss-procs",
        type=int,
        default=PrefetchConfig().miss_procs,
        help="worker processes that assemble batches missing DRAM into shared memory "
        "(default: one per core, 2 to 4; 0: none)",
    )
    s.add_argument(
        "--shm-slots",
        type=int,
        help="slots of the shared-memory ring for same-host trainers (default: automatic)",
    )
    s.add_argument(
        "--shm-slot-bytes",
        type=_size,
        help="bytes per ring slot, e.g. 8MiB (default: one batch of each job, a ring per size)",
    )
    s.add_argument(
        "--shm-bytes",
        type=_size,
        default=ShmConfig().max_bytes,
        help="the most of /dev/shm all rings together take, e.g. 256MiB (default 1GiB, or a "
        "quarter of the memory available at start where less); a job whose ring would not "
        "fit is served over the socket",
    )
    s.add_argument(
        "--no-shm", action="store_true", help="send every batch over the socket, never via /dev/shm"
    )
    s.add_argument(
        "--tcp", metavar="tcp://HOST:PORT", help="also serve other hosts here (needs --curve-dir)"
    )
    s.add_argument(
        "--curve-dir",
        type=Path,
        help="CURVE keys for --tcp: server.key_secret and authorized/*.key (`loaderd keys`)",
    )
    s.add_argument(
        "--keep-selections",
        type=int,
        default=KEEP_SELECTIONS,
        metavar="K",
        help="epochs whose selections each job keeps, so a checkpoint up to K epochs old "
        "replays its epoch exactly (default: %(default)s)",
    )
    s.add_argument(
        "--consumer-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="silence after which a consumer's batches go back to its rank (default: %(default)s)",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics (the numbers of `loaderd stats`) at :PORT/metrics",
    )
    s.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address for --metrics-port (default: %(default)s)",
    )
    s.add_argument(
        "--cluster",
        metavar="tcp://HOST:PORT",
        help="one daemon per node: node 0's rendezvous address, the same on every node "
        "(env LOADERD_CLUSTER; default: a cluster of one)",
    )
    s.add_argument("--nodes", type=int, help="how many nodes (env LOADERD_NODES)")
    s.add_argument(
        "--node-rank", type=int, help="this node's rank, 0..nodes-1 (env LOADERD_NODE_RANK)"
    )
    s.add_argument(
        "--cluster-timeout",
        type=float,
        metavar="SECONDS",
        help="how long the nodes wait for a missing node before reporting it (then retrying) "
        f"(env LOADERD_CLUSTER_TIMEOUT; default {ClusterConfig().timeout_s:g})",
    )
    s.add_argument(
        "--autotune",
        nargs="?",
        const="q",
        metavar="q|hill",
        help="move read-ahead, prefetch depth and assembly workers while serving: "
        "Q-learning (q, the default) or hill-climbing (hill); off unless given",
    )
    s.add_argument(
        "--autotune-interval",
        metavar="SECONDS",
        help=f"seconds per controller round (default {AutotuneConfig().interval_s:g})",
    )
    s.add_argument(
        "--autotune-budget",
        metavar="SIZE",
        help="daemon memory the controller weighs against (default: --dram-bytes "
        "plus --readahead-bytes)",
    )
    s.add_argument(
        "--job-retention-days",
        type=float,
        default=DEFAULT_RETENTION_DAYS,
        metavar="DAYS",
        help="jobs idle longer are removed when the daemon starts; 0 keeps all (default: 30)",
    )
    s.add_argument("--sampler", help="default sampler for jobs that do not choose one")
    s.add_argument("--warmup-epochs", type=int, help="default classification epochs (K)")
    s.add_argument("--keep-fraction", type=float, help="default share of samples trained per epoch")

    i = sub.add_parser("ingest", help="turn a dataset into a loaderd store")
    i.add_argument(
        "source",
        help="Parquet file/folder, Arrow/Feather file, .npz, ImageFolder or WebDataset tars",
    )
    i.add_argument("--out", required=True, type=Path, help="the store directory to create")
    i.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing store (once the new one is complete; only a loaderd store)",
    )
    i.add_argument(
        "--restart",
        action="store_true",
        help="drop an interrupted ingest's partial store instead of continuing it",
    )
    i.add_argument("--no-progress", action="store_true", help="no progress bar")
    i.add_argument(
        "--columns",
        type=_names,
        default=(),
        metavar="A,B",
        help="ingest only these fields (a struct's name takes all its parent.child fields)",
    )
    i.add_argument("--exclude", type=_names, default=(), metavar="C,D", help="skip these fields")

    t = sub.add_parser("stats", help="show what the daemon is doing")
    t.add_argument("--socket", default=default_address())
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until ^C")
    t.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    t.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw each job's loss-variance and importance histograms (needs matplotlib)",
    )

    j = sub.add_parser("jobs", help="list the daemon's jobs, or forget one (`jobs reset NAME`)")
    _jobs_options(j)
    j_sub = j.add_subparsers(dest="jobs_command")
    r = j_sub.add_parser("reset", help="forget a job: its epochs, cursors, losses, importance")
    r.add_argument("name")
    r.add_argument("--force", action="store_true", help="even while its trainers are connected")
    _jobs_options(r, argparse.SUPPRESS)  # also after `reset NAME`, without resetting them

    k = sub.add_parser("keys", help="CURVE keys for serving over TCP")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    kg = ksub.add_parser("generate", help="write a server and a client keypair into DIR")
    kg.add_argument("dir", type=Path)

    n = sub.add_parser("snapshot", help="parameter snapshots kept in the daemon's NVRAM arena")
    n_sub = n.add_subparsers(dest="action", required=True)
    g = n_sub.add_parser("get", help="write a job's newest whole snapshot to a file")
    g.add_argument("--job", required=True)
    g.add_argument("--out", required=True, type=Path, help="file to write (torch.save bytes)")
    g.add_argument("--socket", default=default_address())
    g.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon")

    d = sub.add_parser("demo", help="generate a dataset, serve it, train on it, show the stats")
    d.add_argument("--dir", type=Path, default=Path("demo-data"), help="where to put the data")
    d.add_argument("--epochs", type=int, default=6)
    d.add_argument("--samples", type=int, default=8192)
    d.add_argument("--sampler", default="learnable", help="learnable, uniform, importance, ...")
    d.add_argument(
        "--budget", type=float, default=0.5, help="share of the full epochs' sample-steps to spend"
    )
    return p


def _jobs_options(p: argparse.ArgumentParser, default: Any = None) -> None:
    """Options of ``loaderd jobs``; ``default=SUPPRESS`` keeps a value given before ``reset``."""

    def d(value: Any) -> Any:
        return value if default is None else default

    p.add_argument("--socket", default=d(default_address()))
    p.add_argument(
        "--state-dir",
        type=Path,
        default=d(None),
        help="read (or reset) the jobs saved here instead of asking a daemon; refused while "
        "a daemon serves the directory",
    )
    p.add_argument("--json", action="store_true", default=d(False), help="print JSON")
    p.add_argument("--timeout", type=float, default=d(5.0), help="seconds to wait for the daemon")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from loaderd.client.errors import LoaderdError
    from loaderd.storage.errors import StorageError
    from loaderd.storage.safe_files import DaemonLockedError

    try:
        return int(_COMMANDS[args.command](args))
    except (
        LoaderdError,
        StorageError,
        DaemonLockedError,
        ValueError,
        OSError,
        _cluster_error(),
    ) as e:
        print(f"loaderd: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _cluster_error() -> type[Exception]:
    """ClusterError if the cluster was loaded (it imports torch: only daemons of a cluster)."""
    module = sys.modules.get("loaderd.cluster_group")
    return getattr(module, "ClusterError", ValueError)


def cmd_serve(args: argparse.Namespace) -> int:
    """``loaderd serve``: run until SIGTERM or SIGINT."""
    from loaderd.importance import ImportanceConfig
    from loaderd.server import Server

    job_defaults = {
        k: v
        for k, v in (
            ("sampler", args.sampler),
            ("warmup_epochs", args.warmup_epochs),
            ("keep_fraction", args.keep_fraction),
        )
        if v is not None
    }
    config = DaemonConfig(
        db=args.db,
        socket=check_address(args.socket),
        state_dir=args.state_dir or args.db.with_name(args.db.name + ".state"),
        cache=CacheConfig(
            dram_bytes=args.dram_bytes,
            nvram_dir=args.nvram_dir,
            nvram_bytes=args.nvram_bytes,
            snapshot_bytes=args.snapshot_bytes,
            policy=args.cache_policy,
            admit_queue_bytes=args.dram_admit_queue,
            lock_pages=args.dram_lock_pages,
            load_map=args.dram_load,
        ),
        prefetch=PrefetchConfig(
            depth=args.prefetch,
            workers=args.workers,
            miss_procs=args.miss_procs,
            readahead_bytes=args.readahead_bytes,
        ),
        shm=ShmConfig(
            enabled=not args.no_shm,
            slots=args.shm_slots,
            slot_bytes=args.shm_slot_bytes,
            max_bytes=args.shm_bytes,
        ),
        importance=ImportanceConfig.from_options(job_defaults, ImportanceConfig()),
        consumer_timeout_s=args.consumer_timeout,
        keep_selections=args.keep_selections,
        tcp=args.tcp,
        curve_dir=args.curve_dir,
        cluster=cluster_config(args, os.environ),
        autotune=autotune_config(args),
        job_retention_s=args.job_retention_days * 86400.0,
    )
    from loaderd import crashpoints

    crashpoints.arm(os.environ.get("LOADERD_CRASH_AT"))  # tests only: die at a named point
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = Server(config)
    metrics = None
    if args.metrics_port is not None:
        from loaderd.metrics import MetricsServer

        metrics = MetricsServer(config.socket, args.metrics_port, args.metrics_host)
    # The full collection that startup's objects make due is run here, not in the first pass
    # (it held a warm miss's serving loop 17 ms: benchmarks/results/gc_freeze.md), and what
    # startup built (modules, the store's index, the jobs' state), alive as long as the
    # daemon, is frozen: no later full collection walks it.
    gc.collect()
    gc.freeze()
    try:
        server.serve(stop)
    finally:
        if metrics is not None:
            metrics.close()
    return 0


def autotune_config(args: argparse.Namespace) -> AutotuneConfig:
    """``--autotune [q|hill]``, ``--autotune-interval``, ``--autotune-budget``.

    Parsed here rather than by argparse, so a bad value is one ``loaderd: error:`` line.

    Raises:
        ValueError: a value that is not a number or size, or one AutotuneConfig refuses.
    """
    given: dict[str, Any] = {"mode": args.autotune}
    if args.autotune_interval is not None:
        try:
            given["interval_s"] = float(args.autotune_interval)
        except ValueError:
            raise ValueError(
                f"`--autotune-interval` must be a number of seconds, got {args.autotune_interval!r}"
            ) from None
    if args.autotune_budget is not None:
        try:
            given["memory_budget_bytes"] = parse_size(args.autotune_budget)
        except ValueError as e:
            raise ValueError(f"`--autotune-budget`: {e}") from None
    if args.autotune is None and len(given) > 1:
        raise ValueError("`--autotune-interval` and `--autotune-budget` need `--autotune`")
    return AutotuneConfig(**given)


def cluster_config(args: argparse.Namespace, env: Mapping[str, str]) -> ClusterConfig:
    """``--cluster/--nodes/--node-rank/--cluster-timeout``, else ``LOADERD_*``; flags win.

    Raises:
        ValueError: a value that is not a number, or a configuration ClusterConfig refuses.
    """
    given: dict[str, Any] = {}
    for field, flag, name, kind in (
        ("address", args.cluster, "LOADERD_CLUSTER", str),
        ("nodes", args.nodes, "LOADERD_NODES", int),
        ("node_rank", args.node_rank, "LOADERD_NODE_RANK", int),
        ("timeout_s", args.cluster_timeout, "LOADERD_CLUSTER_TIMEOUT", float),
    ):
        if flag is not None:
            given[field] = flag
            continue
        text = env.get(name, "").strip()
        if text:
            try:
                given[field] = kind(text)
            except ValueError:
                raise ValueError(f"{name} must be a number, got {text!r}") from None
    return ClusterConfig(**given)


def cmd_ingest(args: argparse.Namespace) -> int:
    """``loaderd ingest SOURCE --out DB``: a progress bar, then one summary line."""
    from loaderd.stats import human_bytes
    from loaderd.storage.ingest import ingest

    s = ingest(
        args.source,
        args.out,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        columns=args.columns,
        exclude=args.exclude,
        resume=not args.restart,
    )
    rate = s.bytes / s.seconds if s.seconds > 0 else 0.0
    kept = f", continuing an interrupted ingest at sample {s.resumed_at:,}" if s.resumed_at else ""
    print(
        f"ingested {s.samples:,} samples ({human_bytes(s.bytes)}) from {s.kind} {s.source} "
        f"into {s.out} in {s.seconds:.1f} s ({human_bytes(rate)}/s){kept}\nfields: {s.fields}"
    )
    return 0


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected field names separated by commas, got {text!r}")
    return names


def cmd_stats(args: argparse.Namespace) -> int:
    """``loaderd stats``: a table, JSON, or a live view."""
    from loaderd.client.connection import Connection
    from loaderd.client.protocol import MsgType
    from loaderd.stats import format_table

    with Connection(args.socket, timeout_s=args.timeout) as conn:
        if args.plot is not None:
            from loaderd.importance_plot import plot

            meta = {"detail": True}
            stats = conn.request(MsgType.STATS, meta, expect=MsgType.STATS_REPLY).meta
            print(f"wrote {args.plot} ({plot(stats, args.plot)} jobs)")
            return 0
        while True:
            stats = conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta
            text = json.dumps(stats, indent=2) if args.json else format_table(stats)
            if args.watch is None:
                print(text)
                return 0
            print("\x1b[2J\x1b[H" + text, flush=True)  # clear the screen, then redraw
            time.sleep(args.watch)


def cmd_demo(args: argparse.Namespace) -> int:
    """``loaderd demo``: the whole path on a generated dataset."""
    from loaderd.demo import run_demo

    return run_demo(
        args.dir, epochs=args.epochs, samples=args.samples, sampler=args.sampler, budget=args.budget
    )


def cmd_keys(args: argparse.Namespace) -> int:
    """``loaderd keys generate DIR``."""
    from loaderd.auth import generate_keys

    paths = generate_keys(args.dir)
    print(f"server public key: {paths['server']} (give it to clients)")
    print(f"server secret key: {paths['server_secret']} (stays here)")
    print(f"client keypair:    {paths['client_secret']} (authorized in {paths['authorized']})")
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    """``loaderd snapshot get --job J --out FILE``."""
    from loaderd.client.snapshot import fetch_snapshot
    from loaderd.journal import write_atomic

    got = fetch_snapshot(args.socket, args.job, timeout_s=args.timeout)
    if got is None:
        print(f"loaderd: error: no snapshot of job {args.job!r} in the daemon", file=sys.stderr)
        return 1
    step, payload = got
    write_atomic(args.out, payload)
    print(f"wrote {args.out} (job {args.job}, step {step}, {len(payload):,} bytes)")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    """``loaderd jobs [reset NAME]``: through the daemon, or in ``--state-dir`` without one."""
    from loaderd import job_admin
    from loaderd.stats import format_jobs

    if args.state_dir is not None:
        if job_admin.daemon_holds(args.state_dir):
            raise ValueError(
                f"a daemon serves {args.state_dir}: leave out --state-dir to ask it (--socket)"
            )
        if args.jobs_command == "reset":
            path = job_admin.remove_job_dir(args.state_dir, args.name)
            print(f"job {args.name} reset: removed {path}")
            return 0
        rows = [j.row() for j in job_admin.list_saved(args.state_dir)]
    else:
        from loaderd.client.connection import Connection
        from loaderd.client.protocol import MsgType

        with Connection(args.socket, timeout_s=args.timeout) as conn:
            if args.jobs_command == "reset":
                meta = {"job": args.name, "force": args.force}
                reply = conn.request(MsgType.JOB_RESET, meta, expect=MsgType.OK).meta
                where = f": removed {reply['removed']}" if reply.get("removed") else ""
                print(f"job {args.name} reset{where}")
                return 0
            stats = conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta
        rows = [job_row(name, job) for name, job in stats["jobs"].items()]
    print(json.dumps(rows, indent=2) if args.json else format_jobs(rows))
    return 0


def job_row(name: str, job: dict[str, Any]) -> dict[str, Any]:
    """One job of the daemon's statistics as a ``loaderd jobs`` row."""
    ranks = [r for r in job.get("ranks", []) if r is not None]
    return {
        "name": name,
        "epoch": job["epoch"],
        "world_size": job["world_size"],
        "batch_size": job["batch_size"],
        "sampler": job.get("sampler", "?"),
        "last_active": job.get("last_active", 0.0),
        "store": job.get("store", ""),
        "acked": sum(r["acked"] for r in ranks),
        "batches": sum(r["batches"] for r in ranks),
    }


_COMMANDS = {
    "jobs": cmd_jobs,
    "snapshot": cmd_snapshot,
    "keys": cmd_keys,
    "serve": cmd_serve,
    "ingest": cmd_ingest,
    "stats": cmd_stats,
    "demo": cmd_demo,
}
