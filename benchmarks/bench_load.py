"""Load: 16 client processes (several jobs and ranks) against one daemon for a fixed time.

One generated store (20k samples of 3 KB + a label) and, per configuration, one fresh
``loaderd serve`` on an ipc socket. ``--jobs`` x ``--ranks`` x ``--procs`` client processes
(default 4 x 2 x 2 = 16, started with ``fork``) each play one consumer (worker id 0 or 1) of
one rank of one job (uniform sampler): they pull batches through ``LoaderdDataset`` and send
a loss per sample back with ``feedback``, epoch after epoch, until the run's time is up.

Checked and reported:

- errors: exceptions in any client, a client that does not stop, the daemon exiting, or
  ERROR lines in its log;
- exactly once: each client records the sample ids it received per epoch; the parent merges
  them per (job, rank). Every epoch the daemon reports complete for a rank must equal that
  rank's share of the deterministic plan (``loaderd.planner.plan_pass``) exactly once: no
  sample lost, none twice, none foreign; an epoch complete on every rank of a job must cover
  the whole store exactly once; the unfinished last epoch must hold no duplicate either.
  Wire duplicates the client dropped (``ds.delivery.duplicates``) are reported;
- per-batch latency p50/p99/max, timed in the client from asking for the next batch to
  holding it; batches/s and samples/s overall;
- the daemon's RSS over time (psutil, sampled every ``--sample-s``) and its peak;
- SIGSTOP: one client is stopped for ``--stop-s`` seconds in the middle of the run, then
  continued. The per-second throughput of the clients of *other* (job, rank) pairs before
  and while it is stopped shows whether it slows anyone down. Its sibling (the other consumer
  of the same rank) is reported apart: the rank's epoch cannot end while a live consumer holds
  some of its batches, so the sibling waits at the epoch boundary by design.

The clients are not DataLoader workers: each process passes ``worker=`` to ``LoaderdDataset``
and keeps its batches in the process (no copy into torch shared memory, as a DataLoader worker
makes). Every loop is bounded by
the run's deadline; requests time out after ``--timeout-s``.

Prints one JSON line per configuration (socket and shared-memory delivery by default) and
writes ``results/load.json`` and ``results/load.md``. About a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _timing import header, machine, make_store, write_results  # the script's folder is on sys.path

HERE = Path(__file__).resolve().parent
BATCH = 64
WARMUP_S = 2.0  # the first seconds (connections, cold cache) are left out of the SIGSTOP bins


# --- data ---------------------------------------------------------------------------------------


# --- one client process -------------------------------------------------------------------------


def _client(
    spec: dict[str, Any], out: str, start: Any, duration_s: float, opts: dict[str, Any]
) -> None:
    """Pull and send feedback until the deadline; write what was received to ``out`` (npz)."""
    from loaderd.client import LoaderdDataset

    ids: list[np.ndarray] = []
    id_epoch: list[np.ndarray] = []
    t_got: list[float] = []
    lat: list[float] = []
    sizes: list[int] = []
    meta: dict[str, Any] = {**spec, "errors": [], "passes": 0, "empty_passes": 0}
    stalls: list[tuple[float, float]] = []  # (start, end) of passes that got no batch
    rng = np.random.default_rng(spec["index"])
    ds = None
    try:
        ds = LoaderdDataset(
            opts["address"],
            job=spec["job"],
            batch_size=BATCH,
            rank=spec["rank"],
            world_size=opts["ranks"],
            seed=spec["seed"],
            sampler="uniform",
            prefetch=opts["prefetch"],
            timeout_s=opts["timeout_s"],
            reconnect_s=0,  # nothing restarts here: a lost daemon is an error
            shm=opts["shm"],
            worker=spec["worker"],
        )
        ds.connect()
        start.wait(60)
        deadline = time.monotonic() + duration_s
        step = opts["step_ms"] / 1000
        while time.monotonic() < deadline:
            t_pass = time.monotonic()
            it = iter(ds)
            got = 0
            try:
                while True:
                    t0 = time.perf_counter()
                    try:
                        batch = next(it)
                    except StopIteration:
                        break
                    t1 = time.perf_counter()
                    b_ids = batch["id"].numpy().copy()
                    ids.append(b_ids)
                    id_epoch.append(np.full(len(b_ids), ds.epoch, np.int32))
                    t_got.append(time.monotonic())
                    lat.append(t1 - t0)
                    sizes.append(len(b_ids))
                    got += 1
                    ds.feedback(batch["id"], rng.random(len(b_ids), dtype=np.float32))
                    if step:
                        time.sleep(step)
                    if time.monotonic() >= deadline:
                        break
            finally:
                it.close()  # left early: what was taken is acknowledged, the rest goes back
            meta["passes"] += 1
            if not got:
                # The rank's queue is empty but its sibling still holds batches of the epoch:
                # wait for the epoch to end (a DataLoader waits for its other workers too).
                meta["empty_passes"] += 1
                time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
                stalls.append((t_pass, time.monotonic()))
        ds.flush()
    except BaseException as e:  # reported by the parent, never swallowed
        meta["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    finally:
        if ds is not None:
            meta["duplicates_dropped"] = ds.delivery.duplicates
            meta["reconnects"] = ds.delivery.reconnects
            try:
                ds.close()
            except BaseException as e:
                meta["errors"].append(f"close: {type(e).__name__}: {e}")
        meta["boundary_wait_s"] = sum(b - a for a, b in stalls)
        meta["stalls"] = stalls
        np.savez(
            out,
            ids=np.concatenate(ids) if ids else np.zeros(0, np.int64),
            id_epoch=np.concatenate(id_epoch) if id_epoch else np.zeros(0, np.int32),
            t=np.array(t_got, np.float64),
            lat=np.array(lat, np.float64),
            n=np.array(sizes, np.int32),
            meta=np.array(json.dumps(meta)),
        )


# --- one configuration --------------------------------------------------------------------------


def _daemon_stats(address: str) -> dict[str, Any]:
    from loaderd.client.connection import Connection
    from loaderd.client.protocol import MsgType

    with Connection(address, timeout_s=10) as c:
        return dict(c.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta)


def check_delivery(
    clients: list[dict[str, Any]], stats: dict[str, Any], n: int, ranks: int
) -> dict[str, Any]:
    """Merge the clients' ids per (job, rank, epoch) and compare with the plan."""
    from loaderd.planner import plan_pass

    all_ids = np.arange(n, dtype=np.int64)
    ones = np.ones(n, np.float32)
    out: dict[str, Any] = {
        "complete_rank_epochs": 0,
        "complete_job_epochs": 0,
        "lost": 0,
        "duplicated": 0,
        "foreign": 0,
        "partial_duplicated": 0,
        "problems": [],
    }
    jobs = sorted({c["job"] for c in clients})
    for job in jobs:
        js = stats["jobs"][job]
        seed = int(js["seed"])
        per_rank_done: list[set[int]] = []
        delivered: dict[tuple[int, int], np.ndarray] = {}
        for rank in range(ranks):
            mine = [c for c in clients if c["job"] == job and c["rank"] == rank]
            ids = np.concatenate([c["ids"] for c in mine])
            eps = np.concatenate([c["id_epoch"] for c in mine])
            r = js["ranks"][rank]
            last = -1 if r is None else int(r["epoch"]) - (0 if r["acked"] == r["batches"] else 1)
            done = set(range(last + 1))
            per_rank_done.append(done)
            for e in sorted(set(eps.tolist()) | done):
                got = np.sort(ids[eps == e])
                delivered[(rank, e)] = got
                share = np.sort(
                    plan_pass(
                        all_ids,
                        ones,
                        seed=seed,
                        epoch=e,
                        phase="train",
                        world_size=ranks,
                        batch_size=BATCH,
                    )[rank].ids
                )
                twice = int(len(got) - len(np.unique(got)))
                foreign = int(np.count_nonzero(~np.isin(got, share)))
                out["foreign"] += foreign
                if e in done:
                    out["complete_rank_epochs"] += 1
                    lost = int(np.count_nonzero(~np.isin(share, got)))
                    out["lost"] += lost
                    out["duplicated"] += twice
                    bad = lost or twice or foreign
                else:
                    out["partial_duplicated"] += twice
                    bad = twice or foreign
                if bad:
                    out["problems"].append(
                        f"{job} rank {rank} epoch {e}: {len(got)} ids for a share of "
                        f"{len(share)}, {twice} twice, {foreign} foreign"
                        + ("" if e not in done else f", {lost} lost")
                    )
        for e in sorted(set.intersection(*per_rank_done)):
            union = np.sort(np.concatenate([delivered[(r, e)] for r in range(ranks)]))
            out["complete_job_epochs"] += 1
            if not np.array_equal(union, all_ids):
                out["problems"].append(f"{job} epoch {e}: ranks together do not cover the store")
    return out


def _rate_bins(clients: list[dict[str, Any]], t0: float, t1: float) -> np.ndarray:
    """Samples received per 1-second bin in [t0, t1)."""
    edges = np.arange(t0, t1 + 1e-9, 1.0)
    if len(edges) < 2:
        return np.zeros(0)
    t = np.concatenate([c["t"] for c in clients]) if clients else np.zeros(0)
    w = np.concatenate([c["n"] for c in clients]) if clients else np.zeros(0)
    return np.histogram(t, bins=edges, weights=w)[0]


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


def run_config(args: argparse.Namespace, db: Path, n: int, shm: bool) -> dict[str, Any]:
    from loaderd.launch import start_daemon, stop_daemon, wait_ready

    if args.start_method != "spawn":
        import loaderd.client.dataset  # noqa: F401  (torch imported once, before the fork)

    t_begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="ldl-", dir="/tmp"))  # ipc paths stay short
    address = f"ipc://{work}/d.sock"
    log = work / "daemon.log"
    extra = ["--dram-bytes", str(args.dram_mib << 20), "--workers", str(args.daemon_workers)]
    extra += ["--shm-slots", str(args.shm_slots)] if shm else ["--no-shm"]
    proc = start_daemon(db, address, state_dir=work / "state", extra=extra, log=log)
    procs: list[Any] = []
    errors: list[str] = []
    try:
        wait_ready(address, timeout_s=60, proc=proc)
        daemon = psutil.Process(proc.pid)
        specs = [
            {
                "index": i,
                "job": f"job{j}",
                "seed": j,
                "rank": r,
                "worker": w,
            }
            for i, (j, r, w) in enumerate(
                (j, r, w)
                for j in range(args.jobs)
                for r in range(args.ranks)
                for w in range(args.procs)
            )
        ]
        opts = {
            "address": address,
            "ranks": args.ranks,
            "procs": args.procs,
            "prefetch": args.prefetch,
            "timeout_s": args.timeout_s,
            "step_ms": args.step_ms,
            "shm": shm,
        }
        ctx = mp.get_context(args.start_method)
        start = ctx.Barrier(len(specs) + 1)
        outs = [str(work / f"client-{s['index']}.npz") for s in specs]
        procs = [
            ctx.Process(target=_client, args=(s, o, start, args.duration_s, opts), daemon=True)
            for s, o in zip(specs, outs, strict=True)
        ]
        for p in procs:
            p.start()
        start.wait(120)  # every client has said HELLO
        t0 = time.monotonic()
        cpu0 = daemon.cpu_times()
        victim = procs[args.stop_client] if args.stop_s > 0 else None
        t_stop = t0 + args.stop_at * args.duration_s
        t_cont = t_stop + args.stop_s
        stopped = continued = False
        rss: list[tuple[float, int]] = []
        hard_end = t0 + args.duration_s + args.timeout_s + 30
        while any(p.is_alive() for p in procs) and time.monotonic() < hard_end:
            now = time.monotonic()
            if victim is not None and not stopped and now >= t_stop:
                os.kill(victim.pid, signal.SIGSTOP)
                t_stop, stopped = time.monotonic(), True
            if victim is not None and stopped and not continued and now >= t_cont:
                os.kill(victim.pid, signal.SIGCONT)
                t_cont, continued = time.monotonic(), True
            try:
                rss.append((now - t0, daemon.memory_info().rss))
            except psutil.Error:
                errors.append("daemon exited during the run")
                break
            time.sleep(args.sample_s)
        if victim is not None and stopped and not continued:
            os.kill(victim.pid, signal.SIGCONT)
        for p in procs:
            p.join(max(0.1, hard_end - time.monotonic()))
            if p.is_alive():
                errors.append(f"client pid {p.pid} did not stop by itself")
                p.kill()
                p.join()
            elif p.exitcode:
                errors.append(f"client pid {p.pid} exited with {p.exitcode}")
        t_joined = time.monotonic()
        cpu1 = daemon.cpu_times()
        stats = _daemon_stats(address)
        if proc.poll() is not None:
            errors.append(f"daemon exited with {proc.returncode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        code = stop_daemon(proc)
    if code not in (0, -signal.SIGTERM):
        errors.append(f"daemon exit status {code} after SIGTERM")
    log_text = log.read_text(errors="replace") if log.exists() else ""
    errors += [ln for ln in log_text.splitlines() if " ERROR " in ln or "Traceback" in ln][:20]

    clients = []
    for s, o in zip(specs, outs, strict=True):
        if not Path(o).exists():
            errors.append(f"client {s['index']} wrote no results")
            continue
        with np.load(o) as z:
            c = {k: z[k] for k in ("ids", "id_epoch", "t", "lat", "n")}
            c.update(json.loads(str(z["meta"])))
        errors += [f"client {c['index']} ({c['job']} rank {c['rank']}): {e}" for e in c["errors"]]
        clients.append(c)
    shutil.rmtree(work, ignore_errors=True)

    check = check_delivery(clients, stats, n, args.ranks)
    wall = max((float(c["t"][-1]) for c in clients if len(c["t"])), default=t0) - t0
    wall = max(wall, 1e-9)
    batches = sum(len(c["t"]) for c in clients)
    samples = int(sum(int(c["n"].sum()) for c in clients))
    lat = np.concatenate([c["lat"] for c in clients])
    stop_index = args.stop_client if args.stop_s > 0 else -1
    lat_un = np.concatenate([c["lat"] for c in clients if c["index"] != stop_index])
    row: dict[str, Any] = {
        "config": f"{'shm' if shm else 'socket'}: {args.jobs} jobs x {args.ranks} ranks x "
        f"{args.procs} processes",
        "delivery": "shm" if shm else "socket",
        "clients": len(specs),
        "duration_s": round(wall, 2),
        "errors": len(errors),
        "error_list": errors[:20],
        "batches": batches,
        "samples": samples,
        "batches_per_s": round(batches / wall, 1),
        "samples_per_s": round(samples / wall, 1),
        "latency_ms": {
            "p50": round(_pct(lat, 50) * 1e3, 2),
            "p99": round(_pct(lat, 99) * 1e3, 2),
            "max": round(float(lat.max()) * 1e3 if len(lat) else float("nan"), 1),
            # the stopped client's wait for the batch it asked for when stopped is left out
            "max_unstopped": round(float(lat_un.max()) * 1e3 if len(lat_un) else float("nan"), 1),
        },
        **{k: v for k, v in check.items() if k != "problems"},
        "delivery_problems": check["problems"][:20],
        "wire_duplicates_dropped": sum(int(c.get("duplicates_dropped", 0)) for c in clients),
        "daemon_duplicate_acks": sum(int(j["duplicate_acks"]) for j in stats["jobs"].values()),
        "feedback_samples": sum(int(j["feedback_samples"]) for j in stats["jobs"].values()),
        "daemon_rss_mb": {
            "start": round(rss[0][1] / 2**20, 1) if rss else None,
            "peak": round(max(r for _, r in rss) / 2**20, 1) if rss else None,
            "end": round(rss[-1][1] / 2**20, 1) if rss else None,
            "series": [
                [round(t, 1), round(r / 2**20, 1)]
                for t, r in rss[:: max(1, int(1 / args.sample_s))]
            ],
        },
        "daemon_cpu_s": round((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system), 2),
        "shm": stats.get("shm", {}),
        "consumers": stats.get("consumers", {}),
        "epoch_boundary_wait_s": round(sum(c["boundary_wait_s"] for c in clients), 2),
        "setup_s": round(t0 - t_begin, 1),  # daemon start, client processes, HELLOs
        "stop_s": round(t_joined - t0 - args.duration_s, 1),  # clients flushing and exiting
    }
    if victim is not None:
        row["sigstop"] = sigstop_report(
            clients, specs[args.stop_client], t0, t_stop, t_cont, t0 + args.duration_s
        )
    return row


def sigstop_report(
    clients: list[dict[str, Any]],
    victim: dict[str, Any],
    t0: float,
    t_stop: float,
    t_cont: float,
    t_end: float,
) -> dict[str, Any]:
    """Per-second samples/s of the other clients before, while and after one is stopped."""
    same_rank = [
        c
        for c in clients
        if (c["job"], c["rank"]) == (victim["job"], victim["rank"])
        and c["index"] != victim["index"]
    ]
    others = [c for c in clients if (c["job"], c["rank"]) != (victim["job"], victim["rank"])]
    stopped = [c for c in clients if c["index"] == victim["index"]]
    # whole seconds only: bins fully before, inside and after the stop
    n_in = int(t_cont - t_stop)
    before = _rate_bins(others, t0 + WARMUP_S, t_stop)[-max(n_in, 1) * 2 :]
    during = _rate_bins(others, t_stop, t_stop + n_in)
    after = _rate_bins(others, t_cont, t_end)

    def lat_in(cs: list[dict[str, Any]], a: float, b: float) -> np.ndarray:
        parts = [c["lat"][(c["t"] >= a) & (c["t"] < b)] for c in cs]
        return np.concatenate(parts) if parts else np.zeros(0)

    lat_before, lat_during = lat_in(others, t0 + WARMUP_S, t_stop), lat_in(others, t_stop, t_cont)
    during_mean = float(during.mean()) if len(during) else float("nan")
    before_mean = float(before.mean()) if len(before) else float("nan")
    return {
        "stopped_client": f"{victim['job']} rank {victim['rank']} worker {victim['worker']}",
        "stopped_at_s": round(t_stop - t0, 2),
        "stopped_for_s": round(t_cont - t_stop, 2),
        "others": len(others),
        "others_samples_per_s_before": [int(x) for x in before],
        "others_samples_per_s_during": [int(x) for x in during],
        "others_samples_per_s_after": [int(x) for x in after],
        "others_mean_before": round(before_mean, 1),
        "others_mean_during": round(during_mean, 1),
        "others_min_during": int(during.min()) if len(during) else None,
        "during_over_before": round(during_mean / before_mean, 3) if before_mean else None,
        "others_p99_ms_before": round(_pct(lat_before, 99) * 1e3, 2),
        "others_p99_ms_during": round(_pct(lat_during, 99) * 1e3, 2),
        "sibling_samples_before": int(_rate_bins(same_rank, t0 + WARMUP_S, t_stop).sum()),
        "sibling_samples_during": int(_rate_bins(same_rank, t_stop, t_cont).sum()),
        # time the sibling spent at the epoch boundary, waiting for the stopped one's batches
        "sibling_stalled_during_s": round(
            sum(
                max(0.0, min(b, t_cont) - max(a, t_stop)) for c in same_rank for a, b in c["stalls"]
            ),
            2,
        ),
        "sibling_stalled_total_s": round(sum(c["boundary_wait_s"] for c in same_rank), 2),
        "stopped_samples_during": int(_rate_bins(stopped, t_stop + 0.05, t_cont).sum()),
        "stopped_samples_after": int(_rate_bins(stopped, t_cont, t_end).sum()),
    }


# --- driver -------------------------------------------------------------------------------------


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], command: str, n: int) -> str:
    out = [
        *header("Load: 16 clients against one daemon", info, command),
        f"{n:,} samples of 3,000 bytes + an int64 label, batch size {BATCH}, uniform sampler. "
        "Each client process is one consumer (worker) of one rank of one job and sends one "
        "loss per sample back. Latency: from asking for the next batch to holding it, timed in "
        "the client. Lost/duplicated: over every epoch the daemon reports complete for a rank "
        "(compared with that rank's planned share) and every epoch complete on all ranks of a "
        "job (compared with the whole store); the unfinished last epoch is checked for "
        "duplicates only.",
        "",
        "| configuration | clients | s | batches/s | samples/s | p50 ms | p99 ms | max ms "
        "| max ms, stopped client left out | errors | rank-epochs checked | job-epochs checked "
        "| lost | duplicated "
        "| daemon RSS MiB start / peak / end |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lat, m = r["latency_ms"], r["daemon_rss_mb"]
        out.append(
            f"| {r['config']} | {r['clients']} | {r['duration_s']:.1f} "
            f"| {r['batches_per_s']:,.0f} | {r['samples_per_s']:,.0f} | {lat['p50']:.1f} "
            f"| {lat['p99']:.1f} | {lat['max']:,.0f} | {lat['max_unstopped']:,.0f} "
            f"| {r['errors']} "
            f"| {r['complete_rank_epochs']} | {r['complete_job_epochs']} | {r['lost']} "
            f"| {r['duplicated'] + r['partial_duplicated']} "
            f"| {m['start']} / {m['peak']} / {m['end']} |"
        )
    out += [
        "",
        "'max ms' includes the batch the SIGSTOPped client had asked for when it was stopped; "
        "the next column leaves that client out.",
        "",
        "## SIGSTOP",
        "",
        "One client is stopped with SIGSTOP, then continued with SIGCONT. 'Others' are the "
        "clients of every other (job, rank); samples/s per whole second, summed over them. The "
        "stopped client's sibling (the other consumer of its rank) is listed apart: the rank's "
        "epoch cannot end while the stopped consumer holds some of its batches, so the sibling "
        "finishes the epoch's queue and then waits at the boundary.",
        "",
        "| configuration | stopped | for s | others mean samples/s before | during | "
        "during / before | others min 1-s during | others p99 ms before / during "
        "| sibling samples during | sibling stalled at the epoch boundary s "
        "| stopped client's samples after SIGCONT |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        s = r.get("sigstop")
        if not s:
            continue
        out.append(
            f"| {r['config']} | {s['stopped_client']} | {s['stopped_for_s']:.1f} "
            f"| {s['others_mean_before']:,.0f} | {s['others_mean_during']:,.0f} "
            f"| {s['during_over_before']:.2f} | {s['others_min_during']:,} "
            f"| {s['others_p99_ms_before']:.1f} / {s['others_p99_ms_during']:.1f} "
            f"| {s['sibling_samples_during']:,} | {s['sibling_stalled_during_s']:.1f} "
            f"| {s['stopped_samples_after']:,} |"
        )
    out += ["", "Per-second samples/s of the others (before | during | after):", ""]
    for r in rows:
        s = r.get("sigstop")
        if s:
            out.append(
                f"- {r['delivery']}: {s['others_samples_per_s_before']} | "
                f"{s['others_samples_per_s_during']} | {s['others_samples_per_s_after']}"
            )
    out += ["", "## Daemon RSS over time (MiB, every second)", ""]
    for r in rows:
        series = ", ".join(f"{v:g}" for _, v in r["daemon_rss_mb"]["series"])
        out.append(f"- {r['delivery']}: {series}")
    out.append("")
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    if not 0 <= args.stop_client < args.jobs * args.ranks * args.procs:
        raise SystemExit(
            f"--stop-client must name one of the {args.jobs * args.ranks * args.procs}"
        )
    if args.stop_s > 0 and args.stop_at * args.duration_s + args.stop_s >= args.duration_s:
        raise SystemExit("the SIGSTOP phase must end before the run does")
    info = machine()
    print(json.dumps({"machine": info}), flush=True)
    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    db = make_store(root, args.samples, args.sample_bytes)
    rows = []
    for delivery in args.delivery:
        row = run_config(args, db, args.samples, delivery == "shm")
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_results(args.out, "load", info, rows, lambda cmd: markdown(rows, info, cmd, args.samples))
    bad = sum(r["errors"] + r["lost"] + r["duplicated"] + r["partial_duplicated"] for r in rows)
    bad += sum(r["foreign"] + len(r["delivery_problems"]) for r in rows)
    return 1 if bad else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--sample-bytes", type=int, default=3_000)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="ranks per job")
    p.add_argument("--procs", type=int, default=2, help="client processes (workers) per rank")
    p.add_argument("--duration-s", type=float, default=20.0, help="pulling time per configuration")
    p.add_argument("--delivery", nargs="+", default=["socket", "shm"], choices=["socket", "shm"])
    p.add_argument("--prefetch", type=int, default=4, help="requests in flight per client")
    p.add_argument("--step-ms", type=float, default=0.0, help="simulated training step per batch")
    p.add_argument("--stop-client", type=int, default=0, help="index of the client to SIGSTOP")
    p.add_argument("--stop-at", type=float, default=0.4, help="when, as a share of the run")
    p.add_argument("--stop-s", type=float, default=5.0, help="how long; 0: no SIGSTOP phase")
    p.add_argument("--timeout-s", type=float, default=15.0, help="client request timeout")
    p.add_argument("--sample-s", type=float, default=0.25, help="daemon RSS sampling period")
    p.add_argument("--dram-mib", type=int, default=128, help="daemon DRAM cache")
    p.add_argument("--daemon-workers", type=int, default=2, help="daemon assembly threads")
    p.add_argument("--shm-slots", type=int, default=128)
    p.add_argument("--start-method", default="fork", choices=["fork", "spawn", "forkserver"])
    p.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "loaderd-bench"))
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    if args.duration_s <= 0 or args.duration_s > 600:
        p.error("--duration-s must be in (0, 600]")
    return args


if __name__ == "__main__":
    sys.exit(main(parse_args()))
