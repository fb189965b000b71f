"""Kill -9 the daemon again and again under two ranks of trainers: exactly once.

The trainers (with DataLoader workers, or without: then acknowledgements ride unconfirmed on
the next request when the daemon dies) never restart. Each daemon restart reloads job.json;
the consumers notice the daemon went away (a request times out, or the pass is unknown),
reconnect, resume the pass with the batch indices they already delivered, and drop wire
duplicates by batch index.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from collections.abc import Callable

import numpy as np
import pytest
from torch.utils.data import DataLoader

from loaderd import crashpoints
from loaderd.client import DaemonUnavailableError, LoaderdDataset
from loaderd.launch import start_daemon
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, wait_until

pytestmark = pytest.mark.integration

EPOCHS = 2
BATCH = 8  # 480 / 2 ranks / 8 = 30 batches per rank and epoch


def trainer(address: str, rank: int, counter: mp.Value, out: mp.Queue, workers: int) -> None:
    import time

    ds = LoaderdDataset(
        address,
        job="crashy",
        batch_size=BATCH,
        rank=rank,
        world_size=2,
        seed=11,
        timeout_s=1.0,
        reconnect_s=30.0,
    )
    # The workers forked below wait for a daemon restarting as they start, once the dataset
    # has reached it; the daemon may be down right now (a crash point fires on the first pass).
    deadline = time.monotonic() + 30
    while True:
        try:
            ds.connect()
            break
        except DaemonUnavailableError:
            if time.monotonic() > deadline:
                raise
    context = "fork" if workers else None
    loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=context)
    got: list[list[int]] = []
    for _ in range(EPOCHS):
        ids: list[int] = []
        for batch in loader:
            ids += batch["id"].tolist()
            ds.feedback(batch["id"], batch["label"].float())
            with counter.get_lock():
                counter.value += 1
            time.sleep(0.01)  # a training step
        got.append(ids)
    ds.close()
    out.put((rank, got))


def run_trainers(
    d: Daemon, kill_at: list[int], on_kill, workers: int = 2
) -> dict[int, list[list[int]]]:  # type: ignore[no-untyped-def]
    ctx = mp.get_context("fork")
    counter = ctx.Value("i", 0)
    out: mp.Queue = ctx.Queue()
    args = [(d.address, r, counter, out, workers) for r in range(2)]
    procs = [ctx.Process(target=trainer, args=a) for a in args]
    for p in procs:
        p.start()
    try:
        for i, target in enumerate(kill_at):
            wait_until(lambda t=target: counter.value >= t, 60, f"{target} batches")
            on_kill(i)
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return results


def check_exactly_once(results: dict[int, list[list[int]]]) -> None:
    for epoch in range(EPOCHS):
        ids0, ids1 = results[0][epoch], results[1][epoch]
        assert len(ids0) == len(set(ids0)), f"rank 0 saw a sample twice in epoch {epoch}"
        assert len(ids1) == len(set(ids1)), f"rank 1 saw a sample twice in epoch {epoch}"
        assert not set(ids0) & set(ids1)
        assert sorted(ids0 + ids1) == list(range(N_SAMPLES)), f"epoch {epoch} lost samples"


def final_cursor(d: Daemon) -> dict[str, object]:
    from loaderd.client.connection import Connection
    from loaderd.client.protocol import MsgType

    with Connection(d.address, timeout_s=5) as conn:
        return conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta["jobs"]["crashy"]


def restarter(daemon: Daemon) -> Callable[[int], None]:
    """Kill -9 the daemon and start it again (the n-th time: same thing)."""

    def kill(_: int) -> None:
        daemon.kill()
        daemon.start()

    return kill


def test_kill_9_at_20_random_points(daemon: Daemon) -> None:
    rng = random.Random(1234)
    total = EPOCHS * N_SAMPLES // BATCH
    kill_at = sorted(rng.sample(range(1, total - 2), 20))

    check_exactly_once(run_trainers(daemon, kill_at, restarter(daemon)))
    job = final_cursor(daemon)
    assert all(r["inflight"] == 0 and r["acked"] == r["batches"] for r in job["ranks"])


def test_kill_9_without_workers(daemon: Daemon) -> None:
    """The loop's own process acknowledges each batch without waiting: none lost, none twice."""
    rng = random.Random(4321)
    total = EPOCHS * N_SAMPLES // BATCH
    kill_at = sorted(rng.sample(range(1, total - 2), 10))

    check_exactly_once(run_trainers(daemon, kill_at, restarter(daemon), workers=0))
    job = final_cursor(daemon)
    assert all(r["inflight"] == 0 and r["acked"] == r["batches"] for r in job["ranks"])


def test_crash_points(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon dies on its own at each named point, in the middle of the epochs."""
    total = EPOCHS * N_SAMPLES // BATCH
    # The first point to fire is the first pass opened (armed before the trainers start).
    points = ["open-pass", *(p for p in crashpoints.POINTS if p != "open-pass")]
    # The others are armed through the first three quarters of the run: a point armed with
    # a few batches left may never be reached (the trainers can take the last batches,
    # prefetched, and have them acknowledged before the armed daemon is up, which then has
    # nothing to write).
    last = total * 3 // 4
    kill_at = [0, *(2 + k * (last - 2) // (len(points) - 1) for k in range(len(points) - 1))]
    exits: list[int | None] = []

    def arm(point: str) -> None:
        daemon.stop()
        # job.json is replaced on the tick and at pass starts only: its first replace will do.
        count = 1 if point in ("open-pass", "replace") else 3
        monkeypatch.setenv("LOADERD_CRASH_AT", f"{point}:{count}")
        # Not daemon.start(): it may well die before it answered the readiness PING.
        daemon.proc = start_daemon(
            daemon.db, daemon.address, state_dir=daemon.state_dir, log=daemon.log
        )
        monkeypatch.delenv("LOADERD_CRASH_AT")

    def crash(i: int) -> None:
        if i:
            arm(points[i])
        assert daemon.proc is not None
        wait_until(lambda: daemon.proc.poll() is not None, 30, f"crash at {points[i]}")
        exits.append(daemon.proc.returncode)
        daemon.start()

    arm(points[0])
    check_exactly_once(run_trainers(daemon, kill_at, crash))
    assert exits == [crashpoints.EXIT_STATUS] * len(points)
    log = daemon.log.read_text()
    for p in points:
        assert f"crash point {p!r} reached" in log


def test_state_survives_on_disk(daemon: Daemon) -> None:
    """The cursor a restarted daemon starts from: acked and in-flight batches per rank."""
    import json

    from loaderd.jobs import load_cursors

    ds = LoaderdDataset(daemon.address, job="cur", batch_size=48, timeout_s=1.0)
    it = iter(ds)
    first = next(it)["id"].numpy().copy()  # shm views live until the next batch
    daemon.kill()
    job_dir = daemon.state_dir / "jobs" / "cur"
    saved = json.loads((job_dir / "job.json").read_text())
    (rank,) = load_cursors(job_dir, saved, 1)
    assert rank is not None
    assert rank["inflight"], "batches handed out are on disk (job.json + cursor log) before sent"
    daemon.start()
    rest = np.concatenate([b["id"].numpy().copy() for b in it])
    assert sorted(np.concatenate([first, rest]).tolist()) == list(range(N_SAMPLES))
    # (No reconnect may be needed: the DEALER's pipe reconnects to the new daemon by itself.)
