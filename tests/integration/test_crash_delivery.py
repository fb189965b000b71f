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
import subprocess
import sys
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

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


def trainer(
    address: str,
    rank: int,
    trained: mp.Array,
    gate: mp.Value,
    out: mp.Queue,
    workers: int,
    epochs: int,
) -> None:
    """Train ``epochs`` epochs; put (rank, ids per epoch) on ``out``, or (rank, the traceback)."""
    try:
        out.put((rank, train(address, rank, trained, gate, workers, epochs)))
    except BaseException:
        out.put((rank, traceback.format_exc()))
        raise


def stacks(pids: list[int]) -> str:
    """Where each of these processes waits, to say why a DataLoader got nothing.

    Python stacks where py-spy is installed (the bench extra), else each thread's kernel
    wait channel (a futex: a lock; an epoll or poll: a socket).
    """
    spy = Path(sys.executable).with_name("py-spy")
    if spy.exists():
        run = [
            subprocess.run(
                [spy, "dump", "--pid", str(p)], capture_output=True, text=True, timeout=20
            )
            for p in pids
        ]
        return "".join(f"\n{r.stdout[:3000]}{r.stderr[:300]}" for r in run)
    waits = []
    for p in pids:
        tasks = sorted(Path(f"/proc/{p}/task").glob("*/wchan"))
        waits.append(f"\npid {p} threads wait in: {[t.read_text() for t in tasks]}")
    return "".join(waits)


def train(
    address: str, rank: int, trained: mp.Array, gate: mp.Value, workers: int, epochs: int
) -> list[list[int]]:
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
    # No batch for 25 s (a daemon restart takes ~1): fail, saying where the workers are.
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=context,
        timeout=25 if workers else 0,
    )
    got: list[list[int]] = []
    for _ in range(epochs):
        ids: list[int] = []
        it = iter(loader)
        try:
            for batch in it:
                ids += batch["id"].tolist()
                ds.feedback(batch["id"], batch["label"].float())
                with trained.get_lock():
                    trained[rank] += 1
                while sum(trained) >= gate.value:  # the test is restarting the daemon: wait
                    time.sleep(0.005)
                time.sleep(0.01)  # a training step
        except RuntimeError as e:
            if "timed out" not in str(e):
                raise
            pids = [w.pid for w in getattr(it, "_workers", [])]
            raise RuntimeError(f"{e}; where its workers are:{stacks(pids)}") from e
        got.append(ids)
    ds.close()
    return got


def run_trainers(
    d: Daemon,
    kill_at: list[int],
    on_kill,  # type: ignore[no-untyped-def]
    workers: int = 2,
    hold: bool = False,
    epochs: int = EPOCHS,
) -> dict[int, list[list[int]]]:
    """Two ranks of trainers; ``on_kill(i)`` once they have trained ``kill_at[i]`` batches.

    With ``hold`` their loops wait at each of those counts (or at once, if past it when
    ``on_kill(i - 1)`` returns) until ``on_kill(i, resume)`` calls ``resume()``: the daemon it
    starts first still has the rest of the run to serve (the loops cannot run on and finish
    the epochs with batches prefetched before it is up). ``resume()`` lets them run to the
    next count, and from there one batch a call: called as ``on_kill`` waits for what it
    started, it keeps the loops going a batch at a time, never far past the next count.
    """
    ctx = mp.get_context("fork")
    trained = ctx.Array("i", 2)  # batches each rank's loop received
    never = 1 << 30
    gate = ctx.Value("i", kill_at[0] if hold else never)
    out: mp.Queue = ctx.Queue()
    args = [(d.address, r, trained, gate, out, workers, epochs) for r in range(2)]
    procs = [ctx.Process(target=trainer, args=a) for a in args]
    for p in procs:
        p.start()
    results: dict[int, list[list[int]] | str] = {}

    def resume(until: int) -> None:
        gate.value = max(until, sum(trained) + 1)

    def crashed() -> bool:  # (not "exited": one rank may finish well before the other)
        return any(p.exitcode not in (None, 0) for p in procs)

    def failures() -> dict[int, str]:  # the tracebacks the trainers sent instead of ids
        return {r: v for r, v in results.items() if isinstance(v, str)}

    try:
        for i, target in enumerate(kill_at):
            wait_until(lambda t=target: sum(trained) >= t or crashed(), 60, f"{target} batches")
            if crashed():
                raise AssertionError(f"a trainer failed before {target} batches")
            if not hold:
                on_kill(i)
                continue
            after = kill_at[i + 1] if i + 1 < len(kill_at) else never
            on_kill(i, partial(resume, after))
            gate.value = after
        results.update(out.get(timeout=60) for _ in procs)
    except AssertionError as e:  # a trainer that failed is the likelier story: tell it
        while not out.empty() and len(results) < len(procs):
            results.update([out.get()])
        told = f"{e}; batches each rank trained: {list(trained)}"
        raise AssertionError(
            f"{told}; a trainer failed: {failures()}" if failures() else told
        ) from e
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
    assert not failures(), f"a trainer failed: {failures()}"
    assert [p.exitcode for p in procs] == [0, 0]
    return results  # type: ignore[return-value]


def check_exactly_once(results: dict[int, list[list[int]]]) -> None:
    for epoch in range(len(results[0])):
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
    # The first point to fire is the first pass opened (armed before the trainers start).
    points = ["open-pass", *(p for p in crashpoints.POINTS if p != "open-pass")]
    # The others are armed in the first epoch, the trainers' loops held meanwhile, so that a
    # pass start still lies ahead of each armed daemon: it talks to every rank and writes
    # job.json ("replace", armed last, fires only there). Waiting for a point lets the loops
    # go on a batch a poll, since most points need their requests or feedback, and a daemon slow
    # to reach its point has let them run far: "replace" (and, armed last instead,
    # "cursor-log") timed out with the two epochs done, 60 and 60 batches, before the daemon
    # armed last came up. The third epoch is that runway.
    epochs = 3
    last = N_SAMPLES // BATCH * 3 // 4  # of the first epoch's 60 batches of the two ranks
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

    def crash(i: int, resume: Callable[[], None]) -> None:
        if i:
            arm(points[i])
        assert daemon.proc is not None

        def fired() -> bool:  # the loops meanwhile go on to the next count, then a batch a call
            resume()
            return daemon.proc.poll() is not None

        wait_until(fired, 30, f"crash at {points[i]}")
        exits.append(daemon.proc.returncode)
        daemon.start()

    arm(points[0])
    check_exactly_once(run_trainers(daemon, kill_at, crash, hold=True, epochs=epochs))
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
