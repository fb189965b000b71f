"""Jobs a user can see and reset, bound to the store they were built on (a real daemon)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loaderd.client.dataset import LoaderdDataset
from loaderd.client.errors import ErrorCode, RemoteError
from loaderd.storage.ingest import ingest
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, make_npz


def loaderd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loaderd", *args], capture_output=True, text=True, timeout=60
    )


def take(ds: LoaderdDataset, batches: int) -> list[int]:
    """The ids of the first ``batches`` batches of a pass (then the loop breaks)."""
    ids: list[int] = []
    for i, batch in enumerate(ds):
        ids += batch["id"].tolist()
        if i + 1 == batches:
            break
    return ids


def test_jobs_lists_and_reset_forgets(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="run-1", batch_size=64, timeout_s=10)
    assert take(ds, 3)
    out = loaderd("jobs", "--json", "--socket", daemon.address)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert (row["name"], row["epoch"], row["sampler"]) == ("run-1", 0, "uniform")
    assert row["acked"] == 3 and row["batches"] == -(-N_SAMPLES // 64)
    table = loaderd("jobs", "--socket", daemon.address).stdout
    assert "run-1" in table and f"3/{row['batches']} batches" in table

    # This process is a live consumer of the job: a reset must be asked for by force.
    out = loaderd("jobs", "reset", "run-1", "--socket", daemon.address)
    assert out.returncode == 1
    assert "live consumers" in out.stderr and "--force" in out.stderr
    out = loaderd("jobs", "reset", "run-1", "--force", "--socket", daemon.address)
    assert out.returncode == 0, out.stderr
    assert not (daemon.state_dir / "jobs" / "run-1").exists()
    ds.close()

    # The name is free again: another seed is no conflict, and the epoch starts afresh.
    fresh = LoaderdDataset(daemon.address, job="run-1", batch_size=64, seed=7, timeout_s=10)
    assert sorted(i for b in fresh for i in b["id"].tolist()) == list(range(N_SAMPLES))
    assert fresh.epoch == 0
    fresh.close()
    out = loaderd("jobs", "reset", "nope", "--socket", daemon.address)
    assert out.returncode == 1 and "no job 'nope'" in out.stderr


def test_a_job_is_bound_to_its_store(tmp_path: Path) -> None:
    db, state = tmp_path / "train.db", tmp_path / "state"
    make_npz(tmp_path / "a.npz", N_SAMPLES, seed=1)
    ingest(tmp_path / "a.npz", db, progress=False)
    with Daemon(db=db, state_dir=state) as d:
        ds = LoaderdDataset(d.address, job="bound", batch_size=64, timeout_s=10)
        take(ds, 2)
        ds.close()

    # The same path, the same size, other samples: the old job's state must not come back.
    make_npz(tmp_path / "b.npz", N_SAMPLES, seed=2)
    ingest(tmp_path / "b.npz", db, overwrite=True, progress=False)
    with Daemon(db=db, state_dir=state) as d:
        ds = LoaderdDataset(d.address, job="bound", batch_size=64, timeout_s=10, reconnect_s=0)
        with pytest.raises(RemoteError) as e:
            ds.connect()
        assert e.value.code == ErrorCode.JOB_CONFLICT
        assert "built on another store" in str(e.value)
        assert "loaderd jobs reset bound" in str(e.value)
        ds.close()
        # Offline access is refused while a daemon serves the state directory.
        out = loaderd("jobs", "--state-dir", str(state))
        assert out.returncode == 1 and "a daemon serves" in out.stderr

    out = loaderd("jobs", "--state-dir", str(state), "--json")
    assert out.returncode == 0, out.stderr
    assert [r["name"] for r in json.loads(out.stdout)] == ["bound"]
    out = loaderd("jobs", "reset", "bound", "--state-dir", str(state))
    assert out.returncode == 0, out.stderr
    with Daemon(db=db, state_dir=state) as d:
        ds = LoaderdDataset(d.address, job="bound", batch_size=64, timeout_s=10)
        ids = [i for b in ds for i in b["id"].tolist()]
        assert sorted(ids) == list(range(N_SAMPLES))
        ds.close()


def test_idle_jobs_are_removed_when_the_daemon_starts(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    with Daemon(db=dataset[0], state_dir=state) as d:
        for name in ("old", "recent"):
            ds = LoaderdDataset(d.address, job=name, batch_size=64, timeout_s=10)
            take(ds, 1)
            ds.close()
    job_json = state / "jobs" / "old" / "job.json"
    saved = json.loads(job_json.read_text())
    saved["last_active"] -= 3 * 86400
    job_json.write_text(json.dumps(saved))
    notes = state / "jobs" / "notes"  # not a job: never touched
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    with Daemon(db=dataset[0], state_dir=state, extra=["--job-retention-days", "2"]):
        pass
    assert not (state / "jobs" / "old").exists()
    assert (state / "jobs" / "recent" / "job.json").exists()
    assert (notes / "todo.txt").read_text() == "mine"
