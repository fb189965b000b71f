"""``serve --autotune`` against the fixed defaults on a changing load, through a real daemon.

The synthetic benchmark (``bench_autotune.py``) knows each setting's cost; this one asks
whether the controllers earn their place where the costs are not known: a real ``loaderd
serve`` with the default knobs, then with ``--autotune hill``, then ``--autotune q``, each
given the same load in the same run:

1. ``1 trainer``: one trainer; the store is in the page cache;
2. ``4 trainers``: three more join;
3. ``2 trainers, store > RAM``: two leave, and the store outgrows memory: every
   ``--pressure-s`` the benchmark pages out the daemon's map of the store and drops the
   file's cached pages (``process_madvise(MADV_PAGEOUT)`` and ``POSIX_FADV_DONTNEED``), as
   memory pressure does once a store is larger than RAM. Records the DRAM tier holds
   (locked) stay; what read-ahead brought in too early is lost again.

A trainer is a process with its own job reading epochs through ``LoaderdDataset`` (batch 64,
shared memory) and sleeping ``--step-ms`` per batch (its GPU step). Per phase: the trainers'
samples/s (counted in the trainers), the daemon's RSS (mean and peak, every 0.5 s), and for
the controllers their knobs at the phase's end and their rounds. Each daemon runs
``--repeat`` times in ABC CBA order (the machine's other load drifts). Everything runs niced;
about ``3 x repeat x (3 x --phase-s + 10)`` seconds. Writes
``results/autotune_daemon.{json,md}``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from _timing import machine, make_store

from loaderd.client import LoaderdDataset
from loaderd.launch import start_daemon, stop_daemon, wait_ready

RESULTS = Path(__file__).parent / "results"
TRAINERS = 4
PHASES = (("1 trainer", 1, False), ("4 trainers", 4, False), ("2 trainers, store > RAM", 2, True))
MODES = ("fixed", "hill", "q")
_libc = ctypes.CDLL(None, use_errno=True)
_SYS_PROCESS_MADVISE = 440  # x86_64 and aarch64 alike
_MADV_PAGEOUT = 21


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def trainer(
    address: str, job: str, step_s: float, ready: Any, go: Any, stop: Any, counter: Any
) -> None:
    """One trainer: says ``ready``, waits for ``go``, trains until ``stop`` (mid-epoch)."""
    os.nice(19)
    ds = LoaderdDataset(address, job=job, batch_size=64, sampler="uniform", timeout_s=120.0)
    ready.set()
    go.wait()
    while not stop.is_set():
        for batch in ds:
            time.sleep(step_s)
            with counter.get_lock():
                counter.value += len(batch["id"])
            if stop.is_set():
                break
    ds.close()


class Pressure:
    """Makes the page cache forget the store every ``period_s`` (see the module docstring)."""

    def __init__(self, pid: int, data: Path, period_s: float) -> None:
        self.pid, self.data, self.period_s = pid, data, period_s
        self.on = threading.Event()
        self._stop = threading.Event()
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _page_out(self) -> None:
        spans = []
        with open(f"/proc/{self.pid}/maps", encoding="utf-8") as f:
            for line in f:
                if line.rstrip().endswith(str(self.data)):
                    a, b = (int(x, 16) for x in line.split()[0].split("-"))
                    spans.append((a, b - a))
        if spans:
            iov = (_Iovec * len(spans))(*(_Iovec(a, n) for a, n in spans))
            pidfd = os.pidfd_open(self.pid)
            try:
                if (
                    _libc.syscall(_SYS_PROCESS_MADVISE, pidfd, iov, len(spans), _MADV_PAGEOUT, 0)
                    < 0
                ):
                    raise OSError(ctypes.get_errno(), "process_madvise")
            finally:
                os.close(pidfd)
        fd = os.open(self.data, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.on.is_set() and self.failed is None:
                try:
                    self._page_out()
                except OSError as e:
                    self.failed = str(e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_mode(mode: str, db: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One daemon under ``mode``, the three phases; the figures per phase."""
    root = Path(tempfile.mkdtemp(prefix="ldat-", dir="/tmp"))
    address = f"ipc://{root}/d.sock"
    extra = ["--dram-bytes", args.dram]
    if mode != "fixed":
        extra += ["--autotune", mode, "--autotune-interval", str(args.interval)]
    with open(db / "data.mdb", "rb") as f:  # phase 1 starts with the store in the page cache
        while f.read(1 << 24):
            pass
    proc = start_daemon(db, address, state_dir=root / "state", extra=extra, log=root / "d.log")
    ctx = mp.get_context("spawn")
    stop_all = ctx.Event()
    gos = [ctx.Event() for _ in range(TRAINERS)]
    readies = [ctx.Event() for _ in range(TRAINERS)]
    stops = [ctx.Event() for _ in range(TRAINERS)]
    counters = [ctx.Value("q", 0) for _ in range(TRAINERS)]
    procs: list[Any] = []
    pressure: Pressure | None = None
    try:
        wait_ready(address, timeout_s=60, proc=proc)
        psutil.Process(proc.pid).nice(19)
        pressure = Pressure(proc.pid, (db / "data.mdb").resolve(), args.pressure_s)
        for i in range(TRAINERS):
            step_s = args.step_ms / 1000
            events = (readies[i], gos[i], stops[i])
            p = ctx.Process(target=trainer, args=(address, f"t{i}", step_s, *events, counters[i]))
            p.start()
            procs.append(p)
        for ev in readies:  # the trainers import torch before the clock starts
            if not ev.wait(timeout=120):
                raise RuntimeError("a trainer did not start within 120 s")
        probe = LoaderdDataset(address, job="probe", batch_size=64)
        daemon = psutil.Process(proc.pid)
        phases = []
        for name, n, outgrown in PHASES:
            for i in range(TRAINERS):
                if i < n:
                    gos[i].set()
                elif gos[i].is_set():  # it trained: it leaves now
                    stops[i].set()
            if outgrown:
                pressure.on.set()
            c0 = sum(c.value for c in counters)
            cpu0 = sum(daemon.cpu_times()[:2])
            t0 = time.monotonic()
            rss: list[int] = []
            while time.monotonic() - t0 < args.phase_s:
                rss.append(daemon.memory_info().rss)
                time.sleep(0.5)
            took = time.monotonic() - t0
            rate = (sum(c.value for c in counters) - c0) / took
            cpu = (sum(daemon.cpu_times()[:2]) - cpu0) / took
            stats = probe.stats()
            tune = stats.get("autotune")
            phases.append(
                {
                    "phase": name,
                    "samples_per_s": round(rate, 1),
                    "daemon_cpu": round(cpu, 2),
                    "rss_mean_mib": round(statistics.mean(rss) / 2**20, 1),
                    "rss_peak_mib": round(max(rss) / 2**20, 1),
                    "readahead_window_mib": round(stats["readahead"]["window_bytes"] / 2**20, 1),
                    "knobs": {k: v["value"] for k, v in tune["knobs"].items()} if tune else None,
                    "rounds": tune["rounds"] if tune else None,
                    "last_stall": tune["last_stall"] if tune else None,
                }
            )
            print(f"{mode:>5} | {name}: {phases[-1]}", flush=True)
        probe.close()
        return {
            "mode": mode,
            "phases": phases,
            "pressure_failed": pressure.failed,
        }
    finally:
        stop_all.set()
        for ev in stops + gos:
            ev.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if pressure is not None:
            pressure.close()
        stop_daemon(proc, timeout_s=30)
        shutil.rmtree(root, ignore_errors=True)


def order(modes: list[str], repeat: int) -> list[str]:
    """Runs in ABC CBA ... order, so a drift in the machine's load weighs on every mode alike."""
    return [m for r in range(repeat) for m in (modes if r % 2 == 0 else modes[::-1])]


def main(args: argparse.Namespace) -> None:
    os.nice(19)
    work = Path(tempfile.mkdtemp(prefix="ldat-store-", dir=args.dir))
    try:
        db = make_store(work, args.samples, args.sample_bytes)
        rows = [run_mode(mode, db, args) for mode in order(args.modes, args.repeat)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "command": "nice -n 19 python benchmarks/bench_autotune_daemon.py "
        + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "machine": machine(),
        "config": {
            k: getattr(args, k)
            for k in ("samples", "sample_bytes", "dram", "step_ms", "phase_s", "interval", "repeat")
        },
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / f"{args.name}.md").write_text(markdown(out))
    print(markdown(out))


def waited(rate: float, trainers: int, step_ms: float) -> float:
    """The trainers' share of time outside their step: 1 - rate / (what the steps allow)."""
    return max(0.0, 1.0 - rate / (trainers * 64 * 1000 / step_ms))


def _label(mode: str) -> str:
    return "fixed defaults" if mode == "fixed" else f"--autotune {mode}"


def markdown(out: dict[str, Any]) -> str:
    c, m = out["config"], out["machine"]
    names = [p for p, _, _ in PHASES]
    modes = list(dict.fromkeys(r["mode"] for r in out["rows"]))
    lines = [
        "# `serve --autotune` on a changing load, through a real daemon (seed 001)",
        "",
        f"`{out['command']}`",
        "",
        f"Store: {c['samples']:,} samples of {c['sample_bytes']:,} bytes "
        f"({c['samples'] * c['sample_bytes'] / 2**20:.0f} MiB), DRAM tier {c['dram']}; trainers "
        f"sleep {c['step_ms']} ms per batch of 64; {c['phase_s']} s per phase; controller "
        f"rounds of {c['interval']} s; each daemon run {c['repeat']} times, in ABC CBA order. "
        "Samples/s: all trainers together (higher is better); RSS: the daemon's, mean.",
        "",
        "Mean over the runs:",
        "",
        "| daemon | " + " | ".join(names) + " | all phases | daemon RSS, mean |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    for mode in modes:
        runs = [r for r in out["rows"] if r["mode"] == mode]
        rates = [statistics.mean(r["phases"][i]["samples_per_s"] for r in runs) for i in range(3)]
        rss = statistics.mean(p["rss_mean_mib"] for r in runs for p in r["phases"])
        cells = " | ".join(f"{x:,.0f}/s" for x in rates)
        lines.append(
            f"| {_label(mode)} | {cells} | {statistics.mean(rates):,.0f}/s | {rss:.0f} MiB |"
        )
    lines += [
        "",
        "Every run (samples/s; `waited`: the share of the trainers' time outside their step, "
        "1 - samples/s over what the steps alone allow, i.e. waiting for batches plus their "
        "own per-batch work; the daemon's RSS, mean (peak); the daemon's CPU, in cores):",
        "",
        "| run | daemon | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for i, r in enumerate(out["rows"]):
        cells = [
            f"{p['samples_per_s']:,.0f}/s, "
            f"waited {waited(p['samples_per_s'], n, c['step_ms']):.0%}, "
            f"{p['rss_mean_mib']:.0f} ({p['rss_peak_mib']:.0f}) MiB, {p['daemon_cpu']:.2f}"
            for p, (_, n, _) in zip(r["phases"], PHASES, strict=True)
        ]
        lines.append(f"| {i + 1} | {_label(r['mode'])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Knobs at each phase's end (read-ahead MiB / prefetch depth / workers), the round, and "
        "the stall the daemon measured in that round:",
        "",
    ]
    for i, r in enumerate(out["rows"]):
        if r["mode"] == "fixed":
            continue
        knobs = "; ".join(
            f"{p['phase']}: {p['knobs'].get('readahead_bytes', 0) / 2**20:g} / "
            f"{p['knobs']['prefetch_depth']} / {p['knobs']['workers']} "
            f"(round {p['rounds']}, stall {p['last_stall'] or 0:.1%})"
            for p in r["phases"]
        )
        lines.append(f"- run {i + 1}, `{_label(r['mode'])}`: {knobs}")
    failed = [r["mode"] for r in out["rows"] if r.get("pressure_failed")]
    if failed:
        lines += ["", f"The memory pressure could not be applied for: {', '.join(failed)}."]
    lines += [
        "",
        f"Machine: {m['cpu']}, {m['nproc']} cores (shared with other work: load average "
        f"{m['loadavg_1m']} at the end), {m['ram_gib']} GiB, Python {m['python']}, "
        f"kernel {m['kernel']}. The fixed defaults: read-ahead 256 MiB, prefetch depth 8, "
        "2 workers.",
        "",
    ]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--sample-bytes", type=int, default=12_288)
    p.add_argument("--dram", default="64MiB", help="the daemon's --dram-bytes")
    p.add_argument("--step-ms", type=float, default=5.0, help="each trainer's step per batch")
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--interval", type=float, default=1.0, help="--autotune-interval")
    p.add_argument("--repeat", type=int, default=2, help="runs of each daemon")
    p.add_argument("--pressure-s", type=float, default=0.5, help="page-out period, last phase")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--name", default="autotune_daemon", help="results/NAME.{json,md}")
    p.add_argument("--dir", default=None, help="where the store is built (default: /tmp)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())
