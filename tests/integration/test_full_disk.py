"""A full state-directory disk (a real, small tmpfs): refused writes, no lost acknowledgements."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import threading
import time
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


def next_epoch_on_a_full_disk(ds: LoaderdDataset, disk: Path, room_after_s: float) -> np.ndarray:
    """The ids of ``ds``'s next epoch, begun on a full disk given room after ``room_after_s``.

    Checks the trainer waited for the room, told why, and never took the daemon for dead.
    """
    filler = fill(disk)
    threading.Timer(room_after_s, filler.unlink).start()
    t = time.monotonic()
    ids = np.concatenate([b["id"].numpy() for b in ds])
    assert time.monotonic() - t > room_after_s - 1.0, "batches went out before their state"
    return ids


def assert_told_why(log: str) -> None:
    assert "waiting for the daemon's state disk" in log and "No space left on device" in log
    assert "went away" not in log  # the daemon was never taken for dead


@pytest.fixture
def on_small_disk(
    dataset: tuple[Path, dict[str, np.ndarray]], small_disk: Path
) -> Iterator[Daemon]:
    """A daemon whose state directory is on the small disk."""
    d = Daemon(db=dataset[0], state_dir=small_disk / "state").start()
    try:
        yield d
    finally:
        d.close()
        shutil.rmtree(small_disk / "state", ignore_errors=True)


def test_a_trainer_on_a_full_disk_waits_told_why_and_goes_on_when_space_is_back(
    on_small_disk: Daemon, small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A batch goes out only once its assignment is written: on a full disk the trainer waits
    # (past its timeout and reconnect time, told why) instead of giving up on a daemon it
    # takes for dead, and the epoch goes on, each sample once, when space is back.
    address = on_small_disk.address
    ds = LoaderdDataset(address, job="wait", batch_size=64, timeout_s=2.0, reconnect_s=4.0)
    assert sum(len(b["id"]) for b in ds) == N_SAMPLES
    ids = next_epoch_on_a_full_disk(ds, small_disk, room_after_s=8.0)
    assert np.array_equal(np.sort(ids), np.arange(N_SAMPLES)), "epoch 1, whole, once each"
    assert ds.epoch == 1
    assert_told_why(caplog.text)


def test_a_selecting_epoch_on_a_full_disk_starts_once_its_selection_is_written(
    on_small_disk: Daemon, small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Served from a selection a restart could not find, the epoch could give a sample twice
    # or never: its start waits (parked, told why, tried again each tick) until it is written.
    options = {"warmup_epochs": 1, "keep_fraction": 0.5, "rescore": False}
    ds = LoaderdDataset(
        on_small_disk.address, "sel", 64, sampler="importance", timeout_s=2.0, **options
    )
    for b in ds:
        ds.feedback(b["id"], b["id"].float() / N_SAMPLES)
    ds.flush()
    ids = next_epoch_on_a_full_disk(ds, small_disk, room_after_s=5.0)
    assert ds.epoch == 1 and len(ids) == len(set(ids.tolist())) == N_SAMPLES // 2
    assert list((small_disk / "state").rglob("selection-1.npz"))
    assert_told_why(caplog.text)
