"""The device path on a GPU: batches into device memory, and a step with and without overlap.

``LoaderdDataset(device="cuda", buffers=3)`` stages each batch in pinned memory and copies it
to the device on a side stream while the previous step computes (``client/device.py``, seed
003). On one store of 3x224x224 uint8 images held in a real daemon's DRAM (every epoch after
the first is all hits, through shared memory), in one run:

* the host-to-device bound: a batch's bytes copied from pinned memory, and from pageable;
* delivery alone: an epoch of ``device="cuda"`` with no step (samples/s and GB/s into device
  memory; copied from the page-locked ring slot, and staged through pinned buffers as when
  the ring cannot be page-locked), against the same epoch on the CPU path (``device=None``)
  and ``device=None`` followed by a blocking ``.to("cuda")`` of each batch;
* a compute-bound step (convolutions, bf16 autocast, SGD): per-step time with the batches
  already in device memory (the floor), through ``device="cuda"`` (copies overlapped), and
  through ``device=None`` with each batch copied to the device before its step (no overlap).

Needs CUDA (it says so and exits without). Writes ``device.json`` and ``device.md``.

    python benchmarks/bench_device.py [--samples 8000] [--batch 64] [--epochs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _timing import machine, make_store, write_results  # the script's folder is on sys.path
from torch import nn

from loaderd.client import LoaderdDataset
from loaderd.launch import start_daemon, stop_daemon, wait_ready

HERE = Path(__file__).resolve().parent
SHAPE = (3, 224, 224)


def model() -> nn.Module:
    """A plain convolutional stack (ResNet-18's widths, no shortcuts): compute-bound at 224."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    width = 64
    for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [nn.Conv2d(width, out, 3, stride, 1), nn.BatchNorm2d(out), nn.ReLU()]
        layers += [nn.Conv2d(out, out, 3, 1, 1), nn.BatchNorm2d(out), nn.ReLU()]
        width = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 1000)]
    return nn.Sequential(*layers).cuda().to(memory_format=torch.channels_last)


class Step:
    """One training step on a batch already on the device."""

    def __init__(self) -> None:
        self.net = model()
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9)

    def __call__(self, image: torch.Tensor, label: torch.Tensor) -> None:
        x = image.view(-1, *SHAPE).to(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(self.net(x.float().div_(255)), label)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def timed_epoch(batches: Iterable[dict[str, Any]], each: Callable[[dict[str, Any]], None]) -> float:
    """Seconds per batch of one pass, from its first batch to the device's last work."""
    it = iter(batches)
    each(next(it))
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    for batch in it:
        each(batch)
        n += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / max(n, 1)


def copy_bound(nbytes: int, pinned: bool, rounds: int = 50) -> float:
    """Bytes per second of one batch's bytes copied host to device (median of ``rounds``)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).fill_(7)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(rounds + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=pinned)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times[5:])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per row; the best counts")
    ap.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "loaderd-bench"))
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_device: no CUDA device here; nothing measured")
        sys.exit(0)
    torch.backends.cudnn.benchmark = True
    sample = SHAPE[0] * SHAPE[1] * SHAPE[2]
    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    db = make_store(root, args.samples, sample)
    batch_bytes = args.batch * (sample + 8)
    info = machine() | {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
    rows: list[dict[str, Any]] = []

    def row(name: str, per_batch: float, **extra: Any) -> None:
        r = {"config": name, "ms_per_batch": round(per_batch * 1e3, 3)}
        r |= {"samples_per_s": round(args.batch / per_batch)}
        r |= {"gb_per_s": round(batch_bytes / per_batch / 1e9, 2)} | extra
        rows.append(r)
        print(r, flush=True)

    for pinned in (True, False):
        bound = copy_bound(batch_bytes, pinned)
        rows.append(
            {"config": f"host to device, {'pinned' if pinned else 'pageable'} (one batch)"}
            | {
                "gb_per_s": round(bound / 1e9, 2),
                "ms_per_batch": round(batch_bytes / bound * 1e3, 3),
            }
        )
        print(rows[-1], flush=True)

    step = Step()
    resident = [
        (
            torch.randint(0, 256, (args.batch, sample), dtype=torch.uint8, device="cuda"),
            torch.randint(0, 1000, (args.batch,), device="cuda"),
        )
        for _ in range(8)
    ]
    on_device = [{"image": x, "label": y} for x, y in resident] * (args.samples // args.batch // 8)

    def train(b: dict[str, Any]) -> None:
        step(b["image"], b["label"])

    def to_device_then_train(b: dict[str, Any]) -> None:
        step(b["image"].to("cuda"), b["label"].to("cuda"))

    def touch(b: dict[str, Any]) -> None:
        pass

    def to_device(b: dict[str, Any]) -> None:
        b["image"].to("cuda")
        b["label"].to("cuda")

    floor = min(timed_epoch(on_device, train) for _ in range(args.epochs))
    row("step alone, batches already in device memory (the floor)", floor)

    with tempfile.TemporaryDirectory(prefix="ld-dev-") as tmp:
        addr = f"ipc://{tmp}/d.sock"
        size = (db / "data.mdb").stat().st_size
        extra = ["--dram-bytes", str(int(size * 1.5)), "--shm-slots", "32"]
        proc = start_daemon(
            db, addr, state_dir=Path(tmp) / "st", extra=extra, log=Path(tmp) / "log"
        )
        try:
            wait_ready(addr, timeout_s=120, proc=proc)
            cpu = LoaderdDataset(addr, job="cpu", batch_size=args.batch, prefetch=8)
            gpu = LoaderdDataset(addr, job="gpu", batch_size=args.batch, prefetch=8, device="cuda")
            # The same, its ring never page-locked: every batch staged through pinned buffers
            # (as before the ring was registered with CUDA).
            staged = LoaderdDataset(
                addr, job="staged", batch_size=args.batch, prefetch=8, device="cuda"
            )
            staged._shm.pin = lambda register: None  # type: ignore[method-assign]
            for _ in cpu:  # the first epoch fills DRAM: every later one is all hits
                pass
            cases: list[tuple[str, LoaderdDataset, Callable[[dict[str, Any]], None]]] = [
                ('delivery: device="cuda", buffers=3, no step', gpu, touch),
                ('delivery: device="cuda", staged (ring not page-locked), no step', staged, touch),
                ("delivery: device=None (CPU tensors in shared memory), no step", cpu, touch),
                ('delivery: device=None, then a blocking .to("cuda")', cpu, to_device),
                ('step: device="cuda", buffers=3 (copies overlapped)', gpu, train),
                ('step: device="cuda", staged (ring not page-locked)', staged, train),
                (
                    'step: device=None, a blocking .to("cuda") before each step',
                    cpu,
                    to_device_then_train,
                ),
            ]
            for name, ds, each in cases:
                best = min(timed_epoch(ds, each) for _ in range(args.epochs))
                row(
                    name, best, vs_floor=round(best / floor, 3) if name.startswith("step") else None
                )
            for ds in (cpu, gpu, staged):
                ds.close()
        finally:
            stop_daemon(proc)

    def markdown(command: str) -> str:
        lines = [
            "# The device path on a GPU",
            "",
            f"Machine: {info['gpu']} (CUDA {info['cuda']}), {info['nproc']} CPUs ({info['cpu']}), "
            f"{info['ram_gib']} GiB RAM, Python {info['python']}, torch {info['torch']}, "
            f"Linux {info['kernel']}.",
            "",
            f"Command: `{command}`",
            "",
            f"{args.samples} samples of 3x224x224 uint8 and an int64 label, batch {args.batch} "
            f"({batch_bytes / 1e6:.1f} MB); the store in the daemon's DRAM (hits, shared "
            "memory); each row the best of its epochs. The step: a convolutional stack with "
            "ResNet-18's widths, bf16 autocast, SGD.",
            "",
            "| configuration | ms a batch | samples/s | GB/s | x the floor |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in rows:
            vs = r.get("vs_floor")
            sps = r.get("samples_per_s")
            lines.append(
                f"| {r['config']} | {r['ms_per_batch']} | {f'{sps:,}' if sps else ''} | "
                f"{r['gb_per_s']} | {vs if vs else ''} |"
            )
        return "\n".join(lines) + "\n"

    write_results(args.out, "device", info, rows, markdown)


if __name__ == "__main__":
    main()
