"""Each job keeps its own snapshot: another job's writes never evict it, across a kill -9."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from loaderd.client import LoaderdDataset
from tests.helpers import Daemon, wait_until

pytestmark = pytest.mark.integration


def save(d: Daemon, job: str, step: int) -> None:
    ds = LoaderdDataset(d.address, job=job, batch_size=8, shm=False)
    try:
        ds.save_snapshot({"job": job, "w": torch.full((1000,), step)}, step=step)
    finally:
        ds.close()


def written(d: Daemon) -> int:
    ds = LoaderdDataset(d.address, job="stats", batch_size=1, shm=False)
    try:
        return int(ds.stats()["snapshots"]["written"])
    finally:
        ds.close()


def check(d: Daemon, job: str, step: int) -> None:
    got = LoaderdDataset.load_snapshot(d.address, job)
    assert got is not None, f"job {job}'s snapshot is gone"
    assert got["job"] == job and torch.equal(got["w"], torch.full((1000,), step))


def test_two_snapshots_of_one_job_keep_the_others(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    extra = ["--nvram-dir", str(tmp_path / "nv"), "--nvram-bytes", "16MiB"]
    d = Daemon(db=dataset[0], state_dir=tmp_path / "s", extra=extra).start()
    try:
        writes = [("a", 1), ("b", 1), ("b", 2), ("b", 3), ("c", 7), ("b", 4)]
        for n, (job, step) in enumerate(writes, 1):
            save(d, job, step)
            wait_until(lambda n=n: written(d) == n, what=f"snapshot {job}@{step} written")
        for job, step in [("a", 1), ("b", 4), ("c", 7)]:
            check(d, job, step)
        d.kill()
        d.start()
        for job, step in [("a", 1), ("b", 4), ("c", 7)]:
            check(d, job, step)
        out = tmp_path / "b.pt"
        r = subprocess.run(
            [
                *(sys.executable, "-m", "loaderd", "snapshot", "get", "--job", "b"),
                *("--out", str(out), "--socket", d.address),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, r.stderr
        assert out.stat().st_mode & 0o077 == 0 and torch.load(out)["job"] == "b"
    finally:
        d.close()
