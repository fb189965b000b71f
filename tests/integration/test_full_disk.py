"""A full state-directory disk (a real, small tmpfs): refused writes, no lost acknowledgements."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from loaderd.client import LoaderdDataset, RemoteError
from loaderd.client.errors import ErrorCode
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon

pytestmark = pytest.mark.integration


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 4 MiB tmpfs: a disk that really fills up (needs root; skipped otherwise)."""
    d = Path(tempfile.mkdtemp(prefix="ld-disk-", dir="/tmp"))
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(d)],
            capture_output=True,
        ).returncode
    ):
        d.rmdir()
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        d.rmdir()


def fill(disk: Path) -> Path:
    """Take every free byte of ``disk``; return the filler file."""
    filler = disk / "filler"
    chunk = b"\0" * (64 << 10)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        try:
            while True:
                f.write(b"\0")
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def feedback(ds: LoaderdDataset, ids: np.ndarray) -> None:
    ds.feedback(ids, ids.astype(np.float32) / N_SAMPLES)
    ds.flush()


def feedback_samples(ds: LoaderdDataset, job: str) -> int:
    return int(ds.stats()["jobs"][job]["importance"]["feedback_samples"])


def test_full_disk_refuses_feedback_and_loses_nothing_acknowledged(
    dataset: tuple[Path, dict[str, np.ndarray]], small_disk: Path
) -> None:
    d = Daemon(db=dataset[0], state_dir=small_disk / "state").start()
    try:
        ds = LoaderdDataset(d.address, job="full", batch_size=64, timeout_s=10.0)
        for batch in ds:
            ds.feedback(batch["id"], batch["id"].float() / N_SAMPLES)
        ds.flush()
        acked = N_SAMPLES
        filler = fill(small_disk)
        big = np.tile(np.arange(N_SAMPLES), 4)  # more than the page a journal may have left
        for _ in range(3):
            with pytest.raises(RemoteError, match="No space left on device") as e:
                feedback(ds, big)
            assert e.value.code == ErrorCode.STORAGE
        assert feedback_samples(ds, "full") == acked, "a refused feedback is not counted"
        # The daemon is up on the full disk, across ticks, and across a restart on it.
        d.kill()
        d.start()
        assert feedback_samples(ds, "full") == acked
        filler.unlink()
        feedback(ds, np.arange(100, 164))  # space is back: accepted without a restart
        acked += 64
        assert feedback_samples(ds, "full") == acked
        d.kill()
        d.start()
        assert feedback_samples(ds, "full") == acked, "every acknowledged feedback replayed"
    finally:
        d.close()
        shutil.rmtree(small_disk / "state", ignore_errors=True)


def test_a_full_state_disk_is_shown_in_stats(
    dataset: tuple[Path, dict[str, np.ndarray]], small_disk: Path
) -> None:
    import sys

    from tests.helpers import wait_until

    d = Daemon(db=dataset[0], state_dir=small_disk / "state").start()
    try:
        ds = LoaderdDataset(d.address, job="shown", batch_size=64, timeout_s=10.0)
        sum(1 for _ in ds)
        assert ds.stats()["state_disk"]["ok"] is True
        filler = fill(small_disk)
        with pytest.raises(RemoteError, match="No space left on device"):
            feedback(ds, np.tile(np.arange(N_SAMPLES), 4))
        disk = ds.stats()["state_disk"]
        assert disk["ok"] is False and "No space left on device" in disk["error"]
        assert disk["since"] is not None and disk["failures"] >= 1
        table = subprocess.run(
            [sys.executable, "-m", "loaderd", "stats", "--socket", d.address],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "state disk" in table and "WRITES FAIL" in table
        # Still failing across ticks, with nothing left to write: a full disk is not "ok".
        t = ds.stats()["uptime_s"]
        wait_until(lambda: ds.stats()["uptime_s"] > t + 2.0, what="a few ticks")
        assert ds.stats()["state_disk"]["ok"] is False
        filler.unlink()
        feedback(ds, np.arange(64))  # space is back
        wait_until(lambda: ds.stats()["state_disk"]["ok"], what="the state disk ok again")
    finally:
        d.close()
        shutil.rmtree(small_disk / "state", ignore_errors=True)
