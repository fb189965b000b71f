"""Hybrid CPU+GPU training (seed 000): time per epoch against the second device alone.

For each model, three ways of training the same batches (same seed, same optimizer):

- ``alone``: a plain loop on ``devices[1]`` (the GPU alone, the baseline the seed competes with);
- ``hybrid``: ``HybridTrainer(devices=...)``, merging every ``--merge-fraction`` of an epoch
  and sending each merged model to a real daemon as a snapshot;
- with two CPU replicas (``--devices cpu,cpu``, the form this machine can run) also
  ``alone-all-cores``: the plain loop with every core as intra-op threads, the ordinary way to
  use a second core. Both other configurations then run with one intra-op thread per replica.

Two models: ``wide`` (an MLP of 1024-wide layers, batch 256: the time is in matmul kernels,
which release the GIL and scale with the samples: the candidate where a CPU share can pay) and
``tiny`` (a 32-wide MLP, batch 64: the time is the per-step Python and launch overhead, which
every replica pays whatever its share: splitting cannot pay).

Reported per configuration: median seconds per epoch, samples/s, the last epoch's mean loss;
for ``hybrid`` also the final split R, each replica's busy microseconds per sample, the
overlap of the two threads (``HybridStats.overlap``: 1.0 when the shorter part ran wholly in
parallel with the longer), the share of time spent merging (snapshot copies included), and the
snapshots sent/dropped.

    nice -n 19 .venv/bin/python benchmarks/bench_hybrid.py                      # CUDA if any
    nice -n 19 .venv/bin/python benchmarks/bench_hybrid.py --devices cpu,cpu    # no GPU

Results go to ``benchmarks/results/hybrid_<devices>.json`` with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import machine, make_store

from loaderd.client.hybrid import HybridTrainer
from loaderd.client.snapshot_sender import SnapshotSender
from loaderd.launch import start_daemon, stop_daemon, wait_ready

RESULTS = Path(__file__).resolve().parent / "results"

MODELS: dict[str, dict[str, Any]] = {
    "wide": {"dim": 256, "width": 1024, "depth": 2, "batch": 256, "samples": 16384},
    "tiny": {"dim": 32, "width": 32, "depth": 1, "batch": 64, "samples": 8192},
}
CLASSES = 10


def build(spec: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width_in = spec["dim"]
    for _ in range(spec["depth"]):
        layers += [nn.Linear(width_in, spec["width"]), nn.ReLU()]
        width_in = spec["width"]
    return nn.Sequential(*layers, nn.Linear(width_in, CLASSES))


def data(spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(spec["samples"], spec["dim"], generator=g)
    teacher = torch.randn(spec["dim"], CLASSES, generator=g)
    return x, (x @ teacher).argmax(1)


def batches(x: torch.Tensor, y: torch.Tensor, batch: int, epoch: int) -> Iterator[Any]:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
    for i in range(0, len(x) - batch + 1, batch):
        idx = order[i : i + batch]
        yield x[idx], y[idx]


def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
    return F.cross_entropy(m(b[0]), b[1], reduction="none")


def make_opt(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_epochs(
    step: Callable[[Any], float],
    x: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
    batch: int,
    end_epoch: Callable[[], None],
) -> dict[str, Any]:
    """Warm-up epoch(s), then timed epochs until ``--epochs`` or ``--max-seconds``."""
    times: list[float] = []
    loss = float("nan")
    start = time.perf_counter()
    for epoch in range(args.warmup + args.epochs):
        t0 = time.perf_counter()
        losses = [step(b) for b in batches(x, y, batch, epoch)]
        end_epoch()
        if epoch >= args.warmup:
            times.append(time.perf_counter() - t0)
        loss = statistics.fmean(losses)
        if times and time.perf_counter() - start > args.max_seconds:
            break
    epoch_s = statistics.median(times)
    return {
        "epochs_timed": len(times),
        "epoch_s": round(epoch_s, 4),
        "samples_per_s": round(len(x) // batch * batch / epoch_s, 1),
        "last_epoch_loss": round(loss, 4),
    }


def run_alone(
    spec: dict[str, Any], device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    x, y = data(spec)
    model = build(spec).to(device)
    opt = make_opt(model)

    def step(b: Any) -> float:
        out = loss_fn(model, (b[0].to(device), b[1].to(device))).mean()
        opt.zero_grad(set_to_none=True)
        out.backward()
        opt.step()
        return float(out.detach())  # .item() waits for the device, as the hybrid step does

    return run_epochs(step, x, y, args, spec["batch"], lambda: sync(device))


def run_hybrid(
    spec: dict[str, Any], devices: tuple[str, str], args: argparse.Namespace, address: str | None
) -> dict[str, Any]:
    x, y = data(spec)
    per_epoch = len(x) // spec["batch"]
    merge_every = max(1, round(per_epoch * args.merge_fraction))
    sender = SnapshotSender(address, "bench-hybrid") if address else None
    trainer = HybridTrainer(
        build(spec),
        make_opt,
        loss_fn,
        devices=devices,
        merge_every=merge_every,
        measure_every=args.measure_every,
        snapshots=sender,
    )
    try:
        row = run_epochs(lambda b: trainer.step(b).loss, x, y, args, spec["batch"], trainer.merge)
    finally:
        trainer.close()
        if sender is not None:
            sender.close()
    st = trainer.stats
    row.update(
        merge_every=merge_every,
        ratio=round(trainer.ratio, 4),
        # busy time per sample over the whole run (the meter keeps only the last interval's)
        us_per_sample=[
            round(b / n * 1e6, 2) if n else None for b, n in zip(st.busy_s, st.samples, strict=True)
        ],
        overlap=None if st.overlap is None else round(st.overlap, 3),
        merge_share=round(st.merge_s / max(1e-9, sum(st.busy_s) / 2 + st.merge_s), 4),
        samples=st.samples,
    )
    if sender is not None:
        row.update(snapshots_sent=sender.sent, snapshots_dropped=sender.dropped)
    return row


@contextmanager
def snapshot_daemon(enabled: bool) -> Iterator[str | None]:
    """A real daemon with an arena to take the snapshots (its store is a placeholder)."""
    if not enabled:
        yield None
        return
    root = Path(tempfile.mkdtemp(prefix="ldh-", dir="/tmp"))
    db = make_store(root, 64, 16)
    address = f"ipc://{root}/d.sock"
    extra = ["--nvram-dir", str(root / "nv"), "--nvram-bytes", "96MiB", "--snapshot-bytes", "64MiB"]
    proc = start_daemon(db, address, state_dir=root / "state", extra=extra, log=root / "log")
    try:
        wait_ready(address, timeout_s=30, proc=proc)
        yield address
    finally:
        stop_daemon(proc)
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def main(args: argparse.Namespace) -> None:
    devices = tuple(args.devices.split(","))
    if len(devices) != 2:
        raise SystemExit(f"--devices needs two devices, got {args.devices!r}")
    cpu_pair = all(d == "cpu" for d in devices)
    cores = len(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    # Two CPU replicas get a core each; next to a GPU the CPU replica leaves one core to the
    # thread that launches the GPU's kernels.
    replica_threads = 1 if cpu_pair else max(1, cores - 1)
    with snapshot_daemon(not args.no_snapshots) as address:
        for name in args.models:
            spec = MODELS[name]
            configs = ["alone", "hybrid"] + (["alone-all-cores"] if cpu_pair else [])
            for config in configs:
                n_threads = cores if config == "alone-all-cores" else replica_threads
                with threads(n_threads):
                    row = {"model": name, "config": config, "threads": n_threads, **spec}
                    if config == "hybrid":
                        row.update(run_hybrid(spec, devices, args, address))
                    else:
                        row.update(run_alone(spec, torch.device(devices[1]), args))
                rows.append(row)
                print(json.dumps(row), flush=True)
            base = next(r for r in rows if r["model"] == name and r["config"] == "alone")
            for r in rows:
                if r["model"] == name:
                    r["speedup_vs_alone"] = round(base["epoch_s"] / r["epoch_s"], 3)
    out = Path(args.out or RESULTS / f"hybrid_{'_'.join(devices)}.json")
    result = {
        "command": " ".join(["nice -n 19 .venv/bin/python", *sys.argv]),
        "devices": devices,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "machine": machine(),
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    first, second = result["devices"]
    lines = [
        f"# Hybrid training (seed 000): {first} + {second} against {second} alone",
        "",
        f"`{result['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['nproc']} cores, {m['ram_gib']} GiB, torch {m['torch']}, "
        f"GPU {result['gpu'] or 'none'}; load average {m['loadavg_1m']} at the end (a load "
        "above the core count means the figures include waiting for a core).",
        "",
        *(
            [
                "Two CPU replicas stand in for the CPU and the GPU; the GPU form "
                "(`--devices cpu,cuda`) has not been measured here, for want of a GPU.",
                "",
            ]
            if "cuda" not in second
            else []
        ),
        "| model | config | threads | s/epoch | samples/s | speed-up | R | us/sample (1st, 2nd)"
        " | overlap | merge share | last loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        hybrid = r["config"] == "hybrid"
        per = ", ".join("-" if t is None else f"{t:g}" for t in r.get("us_per_sample", []))
        cells = [
            r["model"],
            r["config"],
            str(r["threads"]),
            f"{r['epoch_s']:.3f}",
            f"{r['samples_per_s']:.0f}",
            f"{r['speedup_vs_alone']:.2f}x",
            f"{r['ratio']:.3f}" if hybrid else "",
            per,
            "" if not hybrid or r["overlap"] is None else f"{r['overlap']:.2f}",
            f"{r['merge_share']:.1%}" if hybrid else "",
            f"{r['last_epoch_loss']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = "cpu,cuda" if torch.cuda.is_available() else "cpu,cpu"
    p.add_argument("--devices", default=default, help=f"first,second (default {default})")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed epochs first")
    p.add_argument("--max-seconds", type=float, default=60.0, help="per configuration")
    p.add_argument("--merge-fraction", type=float, default=1 / 15, help="of an epoch (k)")
    p.add_argument("--measure-every", type=int, default=5, help="iterations per timing (M)")
    p.add_argument("--no-snapshots", action="store_true", help="no daemon, no snapshots")
    p.add_argument("--out", help="results file (default results/hybrid_<devices>.json)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())
