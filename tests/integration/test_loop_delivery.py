"""Exactly once at the training loop: a batch is delivered when the loop has received it.

Batches a DataLoader worker prefetched but the loop never took (a ``break``, a killed trainer)
come again; batches the loop took never do.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from loaderd.client import LoaderdDataset, RemoteError
from loaderd.client.pids import pid_alive
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, wait_until

pytestmark = pytest.mark.integration

BATCH = 20  # N_SAMPLES / BATCH = 24 batches per epoch


def loader(ds: LoaderdDataset, workers: int) -> DataLoader[dict[str, torch.Tensor]]:
    return DataLoader(
        ds, batch_size=None, num_workers=workers, prefetch_factor=4 if workers else None
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_break_then_a_new_loader_gets_the_rest_of_the_epoch(daemon: Daemon, workers: int) -> None:
    ds = LoaderdDataset(daemon.address, job=f"brk{workers}", batch_size=BATCH, prefetch=3)
    got: list[int] = []
    for i, batch in enumerate(loader(ds, workers)):
        got += batch["id"].tolist()
        if i == 4:
            break  # workers hold prefetched batches in the DataLoader's queues right now
    for batch in loader(ds, workers):
        got += batch["id"].tolist()
    assert len(got) == len(set(got)), "no sample twice"
    assert sorted(got) == list(range(N_SAMPLES)), "every sample of the epoch reached the loop"
    assert ds.stats()["jobs"][f"brk{workers}"]["epoch"] == 0
    # the next epoch is whole again
    nxt = [i for b in loader(ds, workers) for i in b["id"].tolist()]
    assert sorted(nxt) == list(range(N_SAMPLES))
    assert ds.stats()["jobs"][f"brk{workers}"]["epoch"] == 1
    ds.close()


def test_state_dict_with_workers_holds_what_the_loop_received(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="sdw", batch_size=BATCH)
    got: list[int] = []
    for i, batch in enumerate(loader(ds, 2)):
        got += batch["id"].tolist()
        if i == 6:
            break
    state = ds.state_dict()
    assert state["progress"]["train"]["epoch"] == 0
    assert len(state["progress"]["train"]["delivered"]) == 7
    ds.close()
    # a new process would do the same: a fresh dataset restored from the state
    ds2 = LoaderdDataset(daemon.address, job="sdw", batch_size=BATCH)
    ds2.load_state_dict(state)
    rest = [i for b in loader(ds2, 2) for i in b["id"].tolist()]
    assert sorted(got + rest) == list(range(N_SAMPLES))
    ds2.close()


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def read_ids(path: Path) -> list[int]:
    return [int(i) for line in path.read_text().splitlines() for i in line.split()]


@pytest.mark.parametrize("workers", [0, 2])
def test_trainer_killed_mid_epoch_and_restarted(
    daemon: Daemon, tmp_path: Path, workers: int
) -> None:
    out = tmp_path / "ids.txt"
    job = f"kill{workers}"
    argv = [sys.executable, "-m", "tests.integration.loop_trainer", daemon.address, job]
    first = subprocess.Popen([*argv, str(workers), str(out), "6"])
    try:
        wait_until(lambda: out.exists() and len(out.read_text().splitlines()) == 6, 60, "6 batches")
        helpers = children(first.pid)
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
    # The workers notice their parent is gone and exit; then a restarted trainer goes on.
    wait_until(lambda: not any(pid_alive(p) for p in helpers), 30, "the workers to exit")
    before = read_ids(out)
    assert len(before) == 6 * BATCH
    second = subprocess.run([*argv, str(workers), str(out), "0"], timeout=120)
    assert second.returncode == 0
    got = read_ids(out)
    assert len(got) == len(set(got)), "no sample reached the loop twice"
    assert sorted(got) == list(range(N_SAMPLES)), "every sample reached the loop"


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_at_the_checkpoint_in_a_new_process(
    daemon: Daemon, tmp_path: Path, workers: int
) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    argv = [sys.executable, "-m", "tests.integration.stateful_trainer", daemon.address]
    for mode in ("first", "resume"):
        run = subprocess.run(
            [*argv, f"sdl{workers}", str(workers), str(tmp_path), mode], timeout=120
        )
        assert run.returncode == 0, mode
    before = [int(i) for i in (tmp_path / "before.txt").read_text().split()]
    after = [int(i) for i in (tmp_path / "after.txt").read_text().split()]
    assert len(before) == 5 * BATCH
    assert not set(before) & set(after), "nothing received before the checkpoint comes again"
    assert len(after) == len(set(after))
    assert sorted(before + after) == list(range(N_SAMPLES)), "the rest of the epoch, all of it"


class RefusedAck(LoaderdDataset):
    """Acknowledges the loop's third batch with an index the daemon refuses (a bad client)."""

    received = 0

    def _loop_received(self, batch: Any) -> bool:
        self.received += 1
        if self.received == 3:
            batch.loaderd_tag = dataclasses.replace(batch.loaderd_tag, index=-1)
        return super()._loop_received(batch)


def test_a_refused_acknowledgement_raises_by_the_end_of_the_pass(daemon: Daemon) -> None:
    """The main process does not wait for each OK, yet a refusal is never dropped."""
    ds = RefusedAck(daemon.address, job="refused", batch_size=BATCH, prefetch=2)
    with pytest.raises(RemoteError, match="acks"):
        for _ in loader(ds, 2):
            pass
    assert ds.stats()["jobs"]["refused"], "the daemon stays up"
    ds.close()
