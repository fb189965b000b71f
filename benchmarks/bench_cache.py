"""Cache tiers: hit rates of the placement policies on real epoch traces, against Belady.

Traces are the epochs the daemon would plan (``loaderd.planner.plan_pass`` over the selections
of ``loaderd.importance.ImportanceEngine``, re-score passes included) for the ``uniform`` and
``importance`` samplers, fed with synthetic per-sample losses. Each trace is replayed through
the real policy classes of ``storage/policies.py`` (ids only: every record counts as one unit
of capacity), with ``place()`` called where the daemon calls it (when an epoch's selection is
computed, with ``loaderd.tiering.ranking``). Belady's MIN on the same trace, with the same
total capacity, is the physical limit. A second part times a warm restart of a real daemon
(records served from the NVRAM arena) against a cold one.

    python benchmarks/bench_cache.py            # about 2-4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import heapq
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._timing import machine  # noqa: E402
from loaderd.importance import ImportanceConfig, ImportanceEngine  # noqa: E402
from loaderd.planner import plan_pass  # noqa: E402
from loaderd.storage.policies import make_policy  # noqa: E402
from loaderd.tiering import ranking  # noqa: E402

Segment = tuple[str, Any]


def make_trace(sampler: str, n: int, epochs: int, seed: int) -> tuple[list[Segment], int]:
    """The access trace of ``epochs`` epochs: ("access", ids) and ("place", ranking) segments."""
    rng = np.random.default_rng(seed)
    engine = ImportanceEngine(n, ImportanceConfig(sampler=sampler))
    difficulty = rng.lognormal(0.0, 1.0, n).astype(np.float32)
    noisy = rng.random(n) < 0.2  # label noise: these fluctuate a lot
    trained = np.zeros(n, np.int32)

    def losses(ids: np.ndarray) -> np.ndarray:
        base = difficulty[ids] * np.exp(-0.1 * trained[ids])
        sd = np.where(noisy[ids], 0.8, 0.1)
        return (base * np.exp(rng.normal(0.0, sd))).astype(np.float32)

    segments: list[Segment] = []
    accesses = 0
    for e in range(epochs):
        rescore = engine.rescore_ids(e)
        if len(rescore):
            plan = plan_pass(
                rescore,
                np.ones(len(rescore), np.float32),
                seed=seed,
                epoch=e,
                phase="rescore",
                world_size=1,
                batch_size=256,
            )[0]
            segments.append(("access", plan.ids))
            accesses += len(plan.ids)
            engine.record(plan.ids, losses(plan.ids), e, "rescore")
        ids, weights = engine.select(e, seed)
        segments.append(("place", ranking(engine.importance(), ids, engine.rescore_ids(e))))
        plan = plan_pass(
            ids, weights, seed=seed, epoch=e, phase="train", world_size=1, batch_size=256
        )[0]
        segments.append(("access", plan.ids))
        accesses += len(plan.ids)
        engine.record(plan.ids, losses(plan.ids), e, "train")
        trained[plan.ids] += 1
    return segments, accesses


def replay(policy_name: str, segments: list[Segment], n: int, caps: list[int]) -> dict[str, Any]:
    """Replay a trace through a policy; per-tier hits and store reads."""
    policy = make_policy(policy_name, caps, n, 1)
    t0 = time.perf_counter()
    access = policy.access
    for kind, arg in segments:
        if kind == "place":
            policy.place(arg)
            continue
        for i in arg.tolist():
            access(i, 1)
    accesses = sum(len(a) for k, a in segments if k == "access")
    hits = policy.hits
    return {
        "hit_rate": sum(hits) / accesses,
        "dram_hit_rate": hits[0] / accesses,
        "nvram_hit_rate": hits[1] / accesses,
        "store_reads": accesses - sum(hits),
        "promotions": policy.promotions[0],
        "demotions": policy.demotions[1],
        "evictions": sum(policy.evictions),
        "replay_s": round(time.perf_counter() - t0, 2),
    }


def belady(trace: np.ndarray, capacity: int) -> float:
    """Belady's MIN hit rate: on a miss with a full cache, evict the farthest next use."""
    n = len(trace)
    nxt = np.empty(n, np.int64)
    last: dict[int, int] = {}
    ids = trace.tolist()
    for k in range(n - 1, -1, -1):
        nxt[k] = last.get(ids[k], n + k)  # never again: farther than anything (and distinct)
        last[ids[k]] = k
    nxt_l = nxt.tolist()
    cached: dict[int, int] = {}  # id -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, id), lazily cleaned
    hits = 0
    for k, i in enumerate(ids):
        if i in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        if capacity:
            cached[i] = nxt_l[k]
            heapq.heappush(heap, (-nxt_l[k], i))
    return hits / n


def restart_bench(samples: int, sample_bytes: int) -> list[dict[str, Any]]:
    """Time a cold start and epoch against a warm restart, with a real daemon and arena."""
    from loaderd.client import LoaderdDataset
    from loaderd.launch import start_daemon, stop_daemon, wait_ready
    from loaderd.storage.ingest import ingest

    root = Path(tempfile.mkdtemp(prefix="ld-bench-cache-", dir="/tmp"))
    rows = []
    try:
        side = int(np.sqrt(sample_bytes // 3))
        rng = np.random.default_rng(0)
        np.savez(
            root / "d.npz",
            image=rng.integers(0, 256, (samples, 3, side, side), dtype=np.uint8),
            label=np.arange(samples, dtype=np.int64),
        )
        ingest(root / "d.npz", root / "d.db", progress=False)
        size = sum(f.stat().st_size for f in (root / "d.db").iterdir())
        sock = f"ipc://{root}/d.sock"
        extra = ["--nvram-dir", str(root / "nv"), "--nvram-bytes", str(4 * size + (16 << 20))]
        extra += ["--dram-bytes", "0", "--no-shm"]
        dropped = drop_caches()
        for label in ("cold", "warm"):
            if label == "cold":
                shutil.rmtree(root / "nv", ignore_errors=True)
            dropped = drop_caches() and dropped
            t0 = time.perf_counter()
            proc = start_daemon(root / "d.db", sock, state_dir=root / f"s-{label}", extra=extra)
            wait_ready(sock, timeout_s=60, proc=proc)
            ready = time.perf_counter() - t0
            ds = LoaderdDataset(sock, job=f"j-{label}", batch_size=256, shm=False)
            t1 = time.perf_counter()
            n = sum(len(b["id"]) for b in ds)
            epoch_s = time.perf_counter() - t1
            s = ds.stats()
            ds.close()
            if label == "cold":  # let the arena writer finish before the restart
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    ds = LoaderdDataset(sock, job="probe", batch_size=1, shm=False)
                    pending = ds.stats()["tiers"][1]["pending_writes"]
                    ds.close()
                    if pending == 0:
                        break
                    time.sleep(0.1)
            stop_daemon(proc)
            rows.append(
                {
                    "part": "restart",
                    "start": label,
                    "samples": n,
                    "sample_bytes": sample_bytes,
                    "ready_s": round(ready, 3),
                    "epoch_s": round(epoch_s, 3),
                    "samples_per_s": round(n / epoch_s),
                    "arena_hits": s["tiers"][1]["hits"],
                    "recovered_items": s["tiers"][1]["recovered_items"],
                    "backing_reads": s["backing"]["reads"],
                    "durability": s["tiers"][1]["durability"],
                    "page_cache_dropped": dropped,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _rate(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.3f}" if key in row else ""


def write_markdown(path: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    m = machine()
    out = [
        "# Cache tiers: placement policies against Belady, and warm restarts",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in m.items() if k != "loadavg_1m"),
        "",
        "Command: `python benchmarks/bench_cache.py` (`make bench-cache`)",
        "",
        f"Traces: {args.samples:,} samples, {args.epochs} epochs planned by the daemon's planner "
        "over the importance engine's selections (default options: K = 3 warm-up epochs, "
        "keep 70 %, re-score passes of the high-fluctuation group included), synthetic losses "
        "(log-normal difficulty, 20 % noisy samples). Capacity = share of the dataset held by "
        f"DRAM + NVRAM together, {args.dram_share:.0%} of it in DRAM. Hit rate = accesses "
        "served by a tier / all accesses; 'store reads' = accesses that went to LMDB "
        "(x record size = bytes). Belady = MIN with the same total capacity, the limit for any "
        "cache.",
        "",
        "| sampler | capacity | policy | hit rate | DRAM | NVRAM | store reads | vs Belady "
        "| vs LRU |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    sims = [r for r in rows if r["part"] == "policy"]
    for r in sims:
        lru = next(
            x["hit_rate"]
            for x in sims
            if x["sampler"] == r["sampler"]
            and x["capacity"] == r["capacity"]
            and x["policy"] == "lru"
        )
        vs_lru = f"{r['hit_rate'] / lru:.2f}x" if lru else "inf"
        vs_b = f"{r['hit_rate'] / r['belady']:.1%}" if r["belady"] else ""
        if r["policy"] == "belady":
            vs_b, vs_lru = "", f"{r['hit_rate'] / lru:.2f}x" if lru else ""
        out.append(
            f"| {r['sampler']} | {r['capacity']:.0%} | {r['policy']} | {r['hit_rate']:.3f} "
            f"| {_rate(r, 'dram_hit_rate')} | {_rate(r, 'nvram_hit_rate')} "
            f"| {r['store_reads']:,} | {vs_b} | {vs_lru} |"
        )
    restart = [r for r in rows if r["part"] == "restart"]
    if restart:
        out += [
            "",
            "## Warm restart against cold start (real daemon, real arena, DRAM tier off)",
            "",
            "| start | ready s | epoch s | samples/s | arena hits | LMDB reads | durability |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in restart:
            out.append(
                f"| {r['start']} | {r['ready_s']} | {r['epoch_s']} | {r['samples_per_s']:,} "
                f"| {r['arena_hits']:,} | {r['backing_reads']:,} | {r['durability']} |"
            )
        out.append("")
        out.append(
            f"{restart[0]['samples']:,} samples of {restart[0]['sample_bytes']:,} bytes; "
            f"page cache dropped before each start: {restart[0]['page_cache_dropped']}."
        )
    goals = [r for r in rows if r["part"] == "goals"]
    if goals:
        out += ["", "## Goals (importance sampler, 25 % capacity)", ""]
        for g in goals:
            out.append(f"- {g['goal']}: {g['value']} — **{'met' if g['met'] else 'missed'}**")
    path.write_text("\n".join(out) + "\n")


def main(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    n = args.samples
    for sampler in args.samplers.split(","):
        segments, accesses = make_trace(sampler, n, args.epochs, args.seed)
        trace = np.concatenate([a for k, a in segments if k == "access"])
        for frac in (float(c) for c in args.capacities.split(",")):
            total = int(frac * n)
            dram = int(total * args.dram_share)
            caps = [dram, total - dram]
            b = belady(trace, total)
            base = {"part": "policy", "sampler": sampler, "capacity": frac, "accesses": accesses}
            rows.append(
                {
                    **base,
                    "policy": "belady",
                    "hit_rate": b,
                    "belady": b,
                    "store_reads": round(accesses * (1 - b)),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            for policy in ("importance", "lru", "static"):
                r = replay(policy, segments, n, caps)
                rows.append({**base, "policy": policy, "belady": b, **r})
                print(json.dumps(rows[-1]), flush=True)
    sims = {(r["sampler"], r["capacity"], r["policy"]): r for r in rows}
    key = ("importance", 0.25)
    if (*key, "importance") in sims:
        imp, lru = sims[(*key, "importance")], sims[(*key, "lru")]
        ratio_b = imp["hit_rate"] / imp["belady"]
        ratio_l = imp["hit_rate"] / lru["hit_rate"] if lru["hit_rate"] else float("inf")
        for goal, value, met in (
            ("importance >= 90% of Belady", f"{ratio_b:.1%}", ratio_b >= 0.9),
            ("importance >= 1.5x LRU", f"{ratio_l:.2f}x", ratio_l >= 1.5),
        ):
            rows.append({"part": "goals", "goal": goal, "value": value, "met": met})
            print(json.dumps(rows[-1]), flush=True)
    if args.restart_samples:
        rows += restart_bench(args.restart_samples, args.restart_bytes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache.json").write_text(
        json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=1) + "\n"
    )
    write_markdown(out / "cache.md", rows, args)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--samplers", default="uniform,importance")
    p.add_argument("--capacities", default="0.1,0.25,0.5")
    p.add_argument("--dram-share", type=float, default=0.2, help="share of capacity in DRAM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart-samples", type=int, default=20_000, help="0: skip the restart part")
    p.add_argument("--restart-bytes", type=int, default=3072)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
