"""Damaged files at start: one job's state is quarantined, a truncated store refused by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from loaderd.client import LoaderdDataset
from loaderd.journal import FeedbackJournal
from tests.helpers import Daemon

pytestmark = pytest.mark.integration


def open_job(d: Daemon, job: str) -> LoaderdDataset:
    ds = LoaderdDataset(d.address, job=job, batch_size=64, timeout_s=10.0)
    batch = next(iter(ds))
    ds.feedback(batch["id"], batch["id"].float())
    ds.flush()
    return ds


def test_damaged_jobs_are_quarantined_and_the_rest_served(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    with Daemon(db=dataset[0], state_dir=state) as d:
        for job in ("empty-npz", "bad-json", "fine"):
            before = open_job(d, job).stats()["jobs"][job]  # "fine" is last
    jobs = state / "jobs"
    (jobs / "empty-npz" / "importance.npz").write_bytes(b"")  # as after a power loss
    (jobs / "bad-json" / "job.json").write_bytes(b'{"spec": {"na')
    with Daemon(db=dataset[0], state_dir=state) as d:
        stats = LoaderdDataset(d.address, job="fine", batch_size=64).stats()["jobs"]
        assert set(stats) == {"fine"}
        assert stats["fine"]["importance"] == before["importance"]
        log = d.log.read_text()
    kept = {p.name.split("-2")[0]: p for p in (state / "quarantine").iterdir()}
    assert set(kept) == {"empty-npz", "bad-json"}
    assert (kept["bad-json"] / "job.json").read_bytes() == b'{"spec": {"na'
    assert (kept["empty-npz"] / "feedback.log").exists(), "moved whole, nothing deleted"
    assert "cannot be loaded" in log and "quarantine" in log


def test_journal_damaged_in_the_middle_keeps_the_rest_aside(tmp_path: Path) -> None:
    path = tmp_path / "feedback.log"
    j = FeedbackJournal(path)
    for e in range(3):
        j.append(e, "train", np.arange(4), np.ones(4, np.float32))
    j.close()
    data = bytearray(path.read_bytes())
    entry = len(data) // 3
    data[entry + 30] ^= 0xFF  # the second entry's payload
    path.write_bytes(bytes(data))
    assert [x.epoch for x in FeedbackJournal.replay(path)] == [0]
    assert path.stat().st_size == entry
    aside = tmp_path / f"feedback.log.damaged-at-{entry}"
    assert aside.read_bytes() == bytes(data[entry:])


def test_truncated_store_is_refused_by_name(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    store = tmp_path / "cut.db"
    shutil.copytree(dataset[0], store)
    data = store / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    sock = Path(tempfile.mkdtemp(prefix="ld-", dir="/tmp"))
    try:
        out = subprocess.run(
            [
                *(sys.executable, "-m", "loaderd", "serve", "--db", str(store)),
                *("--state-dir", str(tmp_path / "s"), "--socket", f"ipc://{sock}/d.sock"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        shutil.rmtree(sock)
    assert out.returncode == 1, out.stderr  # not -SIGBUS
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("loaderd: error: ") and f"{data} is truncated" in last
