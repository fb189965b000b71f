"""Jobs a user can see and forget: listing saved jobs, resetting one, and the retention rule.

A job's state (cursors, loss history, importance) outlives the trainer on purpose, so that a
restarted run continues its epoch. That also means a re-run of a script under the same job
name continues the old run, and that jobs pile up in the state directory. ``loaderd jobs``
shows them, ``loaderd jobs reset NAME`` forgets one (through the daemon when it runs, else
straight in the state directory), and jobs idle for longer than the retention period
(``loaderd serve --job-retention-days``, 30 by default) are removed when the daemon starts.

Only directories that hold a ``job.json`` under ``STATE_DIR/jobs/`` are ever removed: they
are loaderd's own; nothing else in a state directory is touched.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaderd.journal import read_json

logger = logging.getLogger(__name__)

DEFAULT_RETENTION_DAYS = 30.0


@dataclass(frozen=True, slots=True)
class SavedJob:
    """What ``job.json`` says about one job, for listing without a daemon."""

    name: str
    dir: Path
    epoch: int
    world_size: int
    batch_size: int
    sampler: str
    last_active: float
    store: str  # the fingerprint of the store it was built on ("" before stores were bound)
    acked: int  # batches acknowledged in the ranks' current passes
    batches: int  # batches of the ranks' current passes, where job.json knows them

    def row(self) -> dict[str, Any]:
        """The job as one JSON-ready row (``loaderd jobs --json``)."""
        return {
            "name": self.name,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "sampler": self.sampler,
            "last_active": self.last_active,
            "store": self.store,
            "acked": self.acked,
            "batches": self.batches,
        }


def jobs_dir(state_dir: Path) -> Path:
    """Where the jobs of a state directory live."""
    return state_dir / "jobs"


def read_saved(job_dir: Path) -> SavedJob | None:
    """The job saved in ``job_dir``, or None when it holds no readable job.json."""
    try:
        saved = read_json(job_dir / "job.json")
    except (OSError, ValueError) as e:
        logger.warning("unreadable job state in %s: %s", job_dir, e)
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("spec"), dict):
        return None
    spec = saved["spec"]
    ranks = [r for r in saved.get("ranks", []) if isinstance(r, dict)]
    options = spec.get("options") if isinstance(spec.get("options"), dict) else {}
    last = saved.get("last_active")
    return SavedJob(
        name=str(spec.get("name", job_dir.name)),
        dir=job_dir,
        epoch=max((int(r.get("epoch", 0)) for r in ranks), default=0),
        world_size=int(spec.get("world_size", 0)),
        batch_size=int(spec.get("batch_size", 0)),
        sampler=str(options.get("sampler", "default")),
        last_active=float(last) if isinstance(last, int | float) else _mtime(job_dir),
        store=str(saved.get("store", "")),
        acked=sum(len(r.get("acked", [])) for r in ranks),
        batches=sum(int(r.get("batches", 0)) for r in ranks),
    )


def list_saved(state_dir: Path) -> list[SavedJob]:
    """Every job saved under ``state_dir``, most recently active first."""
    root = jobs_dir(state_dir)
    found = [read_saved(d) for d in sorted(root.iterdir()) if d.is_dir()] if root.is_dir() else []
    return sorted((j for j in found if j is not None), key=lambda j: -j.last_active)


def remove_job_dir(state_dir: Path, name: str) -> Path:
    """Delete the saved state of job ``name``; returns the directory removed.

    Raises:
        ValueError: no job of that name is saved there (nothing else is ever removed).
    """
    path = jobs_dir(state_dir) / name
    if "/" in name or name.startswith(".") or not (path / "job.json").is_file():
        raise ValueError(f"no job {name!r} in {jobs_dir(state_dir)}")
    shutil.rmtree(path)
    return path


def sweep(state_dir: Path, max_age_s: float, now: float | None = None) -> list[str]:
    """Remove jobs idle for longer than ``max_age_s`` (0 or less keeps every job)."""
    if max_age_s <= 0:
        return []
    now = time.time() if now is None else now
    removed = []
    for job in list_saved(state_dir):
        if now - job.last_active > max_age_s:
            remove_job_dir(state_dir, job.dir.name)
            removed.append(job.dir.name)
            logger.info(
                "job %s removed: idle for %.0f days (retention %.0f days)",
                job.name,
                (now - job.last_active) / 86400,
                max_age_s / 86400,
            )
    return removed


def daemon_holds(state_dir: Path) -> bool:
    """Whether a live daemon serves ``state_dir`` (it holds the directory's lock file)."""
    try:
        fd = os.open(state_dir / "daemon.lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken just now
    return False


def _mtime(path: Path) -> float:
    try:
        return (path / "job.json").stat().st_mtime
    except OSError:
        return 0.0
