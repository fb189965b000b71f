"""A trainer process for the StatefulDataLoader test: train k batches, checkpoint, go on.

Usage: python -m tests.integration.stateful_trainer ADDRESS JOB WORKERS DIR MODE
MODE ``first``: take 5 batches, save the loader's state_dict (torch.save) to DIR/ckpt.pt,
record the ids received before it in DIR/before.txt, then take 3 more batches (trained past
the checkpoint, to be redone) and exit without finishing the epoch. MODE ``resume``: load the
checkpoint into a new loader and record the rest of the epoch in DIR/after.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from loaderd.client import LoaderdDataset


def main() -> None:
    address, job, workers, out, mode = sys.argv[1:6]
    ds = LoaderdDataset(address, job=job, batch_size=20, prefetch=3)
    n = int(workers)
    loader = StatefulDataLoader(
        ds, batch_size=None, num_workers=n, prefetch_factor=4 if n else None
    )
    d = Path(out)
    ids: list[int] = []
    if mode == "first":
        it = iter(loader)
        for _ in range(5):
            ids += next(it)["id"].tolist()
        torch.save(loader.state_dict(), d / "ckpt.pt")
        (d / "before.txt").write_text(" ".join(map(str, ids)))
        for _ in range(3):
            next(it)
    else:
        loader.load_state_dict(torch.load(d / "ckpt.pt", weights_only=False))
        ids = [i for b in loader for i in b["id"].tolist()]
        (d / "after.txt").write_text(" ".join(map(str, ids)))
    ds.close()


if __name__ == "__main__":
    main()
