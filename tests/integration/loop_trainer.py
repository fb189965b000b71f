"""A trainer process for the kill tests: records every batch its loop receives, one line each.

Usage: python -m tests.integration.loop_trainer ADDRESS JOB WORKERS OUT STOP_AFTER
After STOP_AFTER batches (0: never) it sleeps until it is killed, with its DataLoader workers
still holding prefetched batches.
"""

from __future__ import annotations

import sys
import time

from torch.utils.data import DataLoader

from loaderd.client import LoaderdDataset


def main() -> None:
    address, job, workers, out, stop_after = sys.argv[1:6]
    ds = LoaderdDataset(address, job=job, batch_size=20, prefetch=3)
    n = int(workers)
    loader = DataLoader(ds, batch_size=None, num_workers=n, prefetch_factor=4 if n else None)
    with open(out, "a") as f:
        for i, batch in enumerate(loader, 1):
            f.write(" ".join(map(str, batch["id"].tolist())) + "\n")
            f.flush()
            if i == int(stop_after):
                time.sleep(3600)
    ds.close()


if __name__ == "__main__":
    main()
