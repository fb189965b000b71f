"""The ``loaderd`` command: serve, ingest, stats, demo. The only place that reads argv.

Every failure a user can cause ends in one line on stderr, ``loaderd: error: ...``, and a
non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from loaderd import __version__
from loaderd.config import CacheConfig, DaemonConfig, PrefetchConfig, ShmConfig, parse_size

logger = logging.getLogger("loaderd")


def default_socket() -> str:
    """``$LOADERD_SOCKET``, else a per-user path under /tmp."""
    return os.environ.get("LOADERD_SOCKET") or f"ipc:///tmp/loaderd-{os.getuid()}/loaderd.sock"


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
        "--socket", default=default_socket(), help="endpoint to bind (default: %(default)s)"
    )
    s.add_argument("--state-dir", type=Path, help="job state (default: DB.state beside the store)")
    s.add_argument(
        "--dram-bytes",
        type=_size,
        default=CacheConfig().dram_bytes,
        help="DRAM cache size, e.g. 2GiB",
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
    s.add_argument("--workers", type=int, default=PrefetchConfig().workers, help="assembly threads")
    s.add_argument(
        "--shm-slots",
        type=int,
        help="slots of the shared-memory ring for same-host trainers (default: automatic)",
    )
    s.add_argument(
        "--shm-slot-bytes",
        type=_size,
        help="bytes per ring slot, e.g. 8MiB (default: one batch of the first job)",
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
        "--consumer-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="silence after which a consumer's batches go back to its rank (default: %(default)s)",
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
    i.add_argument("--overwrite", action="store_true", help="replace an existing store")
    i.add_argument("--no-progress", action="store_true", help="no progress bar")

    t = sub.add_parser("stats", help="show what the daemon is doing")
    t.add_argument("--socket", default=default_socket())
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until ^C")
    t.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    t.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw each job's loss-variance and importance histograms (needs matplotlib)",
    )

    k = sub.add_parser("keys", help="CURVE keys for serving over TCP")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    kg = ksub.add_parser("generate", help="write a server and a client keypair into DIR")
    kg.add_argument("dir", type=Path)

    n = sub.add_parser("snapshot", help="parameter snapshots kept in the daemon's NVRAM arena")
    n_sub = n.add_subparsers(dest="action", required=True)
    g = n_sub.add_parser("get", help="write a job's newest whole snapshot to a file")
    g.add_argument("--job", required=True)
    g.add_argument("--out", required=True, type=Path, help="file to write (torch.save bytes)")
    g.add_argument("--socket", default=default_socket())
    g.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon")

    d = sub.add_parser("demo", help="generate a dataset, serve it, train on it, show the stats")
    d.add_argument("--dir", type=Path, default=Path("demo-data"), help="where to put the data")
    d.add_argument("--epochs", type=int, default=6)
    d.add_argument("--samples", type=int, default=8192)
    d.add_argument(
        "--sampler", default="infobatch", help="uniform, importance, unbiased, infobatch"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from loaderd.client.errors import LoaderdError
    from loaderd.server import DaemonLockedError
    from loaderd.storage.errors import StorageError

    try:
        return int(_COMMANDS[args.command](args))
    except (LoaderdError, StorageError, DaemonLockedError, ValueError, OSError) as e:
        print(f"loaderd: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


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
        socket=args.socket,
        state_dir=args.state_dir or args.db.with_name(args.db.name + ".state"),
        cache=CacheConfig(
            dram_bytes=args.dram_bytes,
            nvram_dir=args.nvram_dir,
            nvram_bytes=args.nvram_bytes,
            snapshot_bytes=args.snapshot_bytes,
            policy=args.cache_policy,
        ),
        prefetch=PrefetchConfig(depth=args.prefetch, workers=args.workers),
        shm=ShmConfig(
            enabled=not args.no_shm, slots=args.shm_slots, slot_bytes=args.shm_slot_bytes
        ),
        importance=ImportanceConfig.from_options(job_defaults, ImportanceConfig()),
        consumer_timeout_s=args.consumer_timeout,
        tcp=args.tcp,
        curve_dir=args.curve_dir,
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
    server.serve(stop)
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    """``loaderd ingest SOURCE --out DB``."""
    from loaderd.storage.ingest import ingest

    s = ingest(args.source, args.out, overwrite=args.overwrite, progress=not args.no_progress)
    print(
        f"ingested {s.samples:,} samples ({s.bytes / 1e6:.1f} MB) from {s.source} into "
        f"{s.out} in {s.seconds:.1f} s"
    )
    return 0


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

    return run_demo(args.dir, epochs=args.epochs, samples=args.samples, sampler=args.sampler)


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


_COMMANDS = {
    "snapshot": cmd_snapshot,
    "keys": cmd_keys,
    "serve": cmd_serve,
    "ingest": cmd_ingest,
    "stats": cmd_stats,
    "demo": cmd_demo,
}
