"""``loaderd demo``: generate a small image classification set, serve it, train on it.

Everything is real: the data is written to an ``.npz`` and ingested into an LMDB store, the
daemon runs as a subprocess on an ipc socket, and a small CNN trains through
``LoaderdDataset`` under a two-worker ``DataLoader``, sending per-sample losses back.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CLASSES = 10
SHAPE = (3, 32, 32)


def make_dataset(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noisy, shifted copies of one blocky random template per class: learnable, not trivial."""
    rng = np.random.default_rng(seed)
    coarse = np.random.default_rng(12345).integers(0, 256, (CLASSES, 3, 4, 4)).astype(np.float32)
    templates = np.kron(coarse, np.ones((8, 8), np.float32))  # 4x4 blocks of 8x8 pixels
    labels = rng.integers(0, CLASSES, n)
    shifts = rng.integers(-3, 4, (n, 2))
    images = np.empty((n, *SHAPE), np.uint8)
    for i in range(n):
        img = np.roll(templates[labels[i]], tuple(shifts[i]), axis=(1, 2))
        img = 0.45 * img + 0.55 * rng.integers(0, 256, SHAPE)
        images[i] = img.clip(0, 255).astype(np.uint8)
    return images, labels.astype(np.int64)


def run_demo(
    workdir: Path,
    *,
    epochs: int = 6,
    samples: int = 8192,
    sampler: str = "learnable",
    budget: float = 0.5,
) -> int:
    """Run the demo in ``workdir`` (recreated); returns the exit status.

    With a sampler other than ``uniform`` the job spends ``budget`` of the sample-steps of
    ``epochs`` full epochs: the measured setting of ``benchmarks/results/importance.md``.
    """
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    from loaderd.client import LoaderdDataset
    from loaderd.launch import start_daemon, stop_daemon, wait_ready
    from loaderd.stats import format_table
    from loaderd.storage.ingest import ingest

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the daemon and two loader workers share the two cores
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    images, labels = make_dataset(samples, seed=0)
    np.savez(workdir / "train.npz", image=images, label=labels)
    test_images, test_labels = make_dataset(1024, seed=1)
    summary = ingest(workdir / "train.npz", workdir / "train.db", progress=False)
    mb = summary.bytes / 1e6
    print(f"ingested {summary.samples:,} samples ({mb:.1f} MB) in {summary.seconds:.1f} s")

    sock_dir = Path(tempfile.mkdtemp(prefix="loaderd-demo-", dir="/tmp"))
    address = f"ipc://{sock_dir}/d.sock"
    proc = start_daemon(
        workdir / "train.db", address, state_dir=workdir / "state", log=workdir / "daemon.log"
    )
    try:
        wait_ready(address, proc=proc)
        print(f"daemon pid {proc.pid} serving {address} (log: {workdir / 'daemon.log'})")
        # Importance sampling is one argument away: the engine trains everything for the
        # warm-up epochs, then the samples still being learned, within the budget.
        options: dict[str, Any] = (
            {} if sampler == "uniform" else {"budget": budget, "epochs": epochs}
        )
        if options:
            print(f"sampler {sampler}: {budget:.0%} of the sample-steps of {epochs} full epochs")
        ds = LoaderdDataset(
            address,
            job="demo",
            batch_size=128,
            rank=0,
            world_size=1,
            seed=0,
            sampler=sampler,
            **options,
        )
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        model = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=2, padding=2),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, CLASSES),
        )
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        x_test = torch.from_numpy(test_images).float() / 255
        y_test = torch.from_numpy(test_labels)
        for epoch in range(epochs):
            start, seen, correct, loss_sum = time.perf_counter(), 0, 0, 0.0
            model.eval()
            rescored = 0
            with torch.no_grad():  # seed 002: a forward pass re-scores the volatile samples
                for batch in ds.rescore():
                    out = model(batch["image"].float() / 255)
                    ds.feedback(batch["id"], F.cross_entropy(out, batch["label"], reduction="none"))
                    rescored += len(batch["id"])
            model.train()
            for batch in loader:
                out = model(batch["image"].float() / 255)
                loss = F.cross_entropy(out, batch["label"], reduction="none")
                ds.feedback(batch["id"], loss.detach())
                opt.zero_grad()
                (loss * batch["weight"]).mean().backward()
                opt.step()
                seen += len(loss)
                correct += int((out.argmax(1) == batch["label"]).sum())
                loss_sum += float(loss.detach().sum())
            ds.flush()
            elapsed = time.perf_counter() - start
            model.eval()
            with torch.no_grad():
                test_acc = float((model(x_test).argmax(1) == y_test).float().mean())
            print(
                f"epoch {epoch}: loss {loss_sum / seen:.3f}  train acc {correct / seen:.1%}  "
                f"test acc {test_acc:.1%}  {seen / elapsed:,.0f} samples/s  "
                f"({seen:,} trained, {rescored:,} re-scored)"
            )
        print()
        print(format_table(ds.stats()))
        del loader  # stop the workers before the daemon
        ds.close()
    finally:
        stop_daemon(proc)
        shutil.rmtree(sock_dir, ignore_errors=True)
    return 0
