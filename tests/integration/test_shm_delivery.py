"""Shared-memory delivery over a real daemon: exact bytes, same batches as the socket path,
slot reuse only after release, and cleanup after a crash of either side."""

from __future__ import annotations

import os
import signal
import textwrap
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.protocol import MsgType
from loaderd.client.shm import SHM_DIR, SlotDescriptor
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, client_process, daemon_shm, wait_until

pytestmark = pytest.mark.integration


def shm_stats(ds: LoaderdDataset) -> dict[str, int]:
    return ds.stats()["shm"]


def test_shm_returns_exactly_the_stored_bytes(
    daemon: Daemon, dataset: tuple[Path, dict[str, np.ndarray]]
) -> None:
    arrays = dataset[1]
    ds = LoaderdDataset(daemon.address, job="shm-exact", batch_size=64)
    ids: list[int] = []
    for batch in ds:
        i = batch["id"].numpy()
        np.testing.assert_array_equal(batch["image"].numpy(), arrays["image"][i])
        np.testing.assert_array_equal(batch["label"].numpy(), arrays["label"][i])
        ids += i.tolist()
    assert sorted(ids) == list(range(N_SAMPLES))
    s = shm_stats(ds)
    assert s["ring"] and s["delivered"] == -(-N_SAMPLES // 64)
    assert s["socket_fallbacks"] == 0
    # The final ACK gives back every slot the trainer dropped; it still holds the last batch.
    assert s["lent_to_consumers"] == 1
    assert (SHM_DIR / s["ring"]).exists()
    ds.close()


def test_socket_and_shm_give_identical_batches(daemon: Daemon) -> None:
    def run(job: str, shm: bool) -> list[tuple[list[int], bytes]]:
        ds = LoaderdDataset(daemon.address, job=job, batch_size=48, seed=11, shm=shm)
        out = [(b["id"].tolist(), b["image"].numpy().tobytes()) for b in ds]
        ds.close()
        return out

    via_socket = run("same-a", shm=False)
    via_shm = run("same-b", shm=True)
    assert via_socket == via_shm
    with Connection(daemon.address) as conn:
        s = conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta["shm"]
    assert s["delivered"] == len(via_shm), "the shm job went through the ring, the other not"


def test_slots_are_reused_only_after_release(dataset: tuple[Path, dict[str, np.ndarray]]) -> None:
    from tempfile import mkdtemp

    root = Path(mkdtemp(prefix="ldshm-"))
    d = Daemon(
        db=dataset[0], state_dir=root / "state", extra=["--shm-slots", "4", "--prefetch", "0"]
    )
    d.start()
    try:
        with Connection(d.address) as conn:
            hello = {"job": "reuse", "rank": 0, "world_size": 1, "seed": 0, "batch_size": 16}
            hello |= {"options": {}, "pid": os.getpid(), "shm": True}
            welcome = conn.request(MsgType.HELLO, hello, expect=MsgType.WELCOME).meta
            assert welcome["shm"]["ring"]
            base = {"job": "reuse", "rank": 0, "worker": 0, "phase": "train"}
            epoch = conn.request(MsgType.OPEN_PASS, base, expect=MsgType.PASS).meta["epoch"]
            req = {**base, "epoch": epoch}

            def get(acks: list[int]) -> tuple[int, SlotDescriptor | None]:
                m = conn.request(MsgType.GET_BATCH, {**req, "acks": acks}, expect=MsgType.BATCH)
                if "shm" in m.meta:
                    assert m.frames == []
                    return m.meta["index"], SlotDescriptor.from_json(m.meta["shm"])
                assert m.frames, "a batch without a slot comes over the socket"
                return m.meta["index"], None

            held = [get([]) for _ in range(4)]
            slots = [desc.slot for _, desc in held if desc is not None]
            assert sorted(slots) == [0, 1, 2, 3], "four unacknowledged batches, four slots"
            index5, desc5 = get([])
            assert desc5 is None, "no slot is free until one is released: socket fallback"
            first_index, first = held[0]
            assert first is not None
            _, desc6 = get([first_index, index5])
            assert desc6 is not None and desc6.slot == first.slot
            assert desc6.generation == first.generation + 1
            stats = conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta["shm"]
            assert stats["lent"] == 4 and stats["lent_to_consumers"] == 4
    finally:
        d.close()


def test_read_ahead_leaves_a_small_ring_room_for_the_batches_asked_for(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """Eight slots, eight batches assembled ahead, a window of two: nothing over the socket.

    The read-ahead alone would fill the ring, and a batch asked for would then find no slot
    and go out over the socket from fresh memory (costly for large batches).
    """
    arrays = dataset[1]
    extra = ["--shm-slots", "8", "--prefetch", "8"]
    with Daemon(db=dataset[0], state_dir=tmp_path / "state", extra=extra) as d:
        ds = LoaderdDataset(d.address, job="small-ring", batch_size=16, prefetch=2)
        for _ in range(2):  # a pass of misses, then one of hits
            ids: list[int] = []
            for batch in ds:
                i = batch["id"].numpy()
                np.testing.assert_array_equal(batch["image"].numpy(), arrays["image"][i])
                ids += i.tolist()
            assert sorted(ids) == list(range(N_SAMPLES))
        s = shm_stats(ds)
        assert s["slots"] == 8
        assert (s["socket_fallbacks"], s["ring_full"]) == (0, 0)
        assert s["delivered"] == 2 * -(-N_SAMPLES // 16)
        ds.close()


def test_feedback_keeps_no_slot_lent(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """Losses sent back with the batch's own ``id`` tensor: every batch still over the ring.

    A FEEDBACK is kept until the daemon confirms it, up to 64 of them; kept as a view of the
    ``id`` tensor, it held the batch's slot lent, and half the batches of a ring of 32 found
    it full and came over the socket.
    """
    arrays = dataset[1]
    with Daemon(db=dataset[0], state_dir=tmp_path / "state", extra=["--shm-slots", "8"]) as d:
        ds = LoaderdDataset(d.address, job="feedback", batch_size=8, prefetch=2)
        for _ in range(2):
            ids: list[int] = []
            for batch in ds:
                i = batch["id"].numpy()
                np.testing.assert_array_equal(batch["image"].numpy(), arrays["image"][i])
                ids += i.tolist()
                ds.feedback(batch["id"], torch.full((len(i),), 0.5))
                del batch
            assert sorted(ids) == list(range(N_SAMPLES))
        s = shm_stats(ds)
        assert (s["socket_fallbacks"], s["ring_full"]) == (0, 0)
        assert s["delivered"] == 2 * -(-N_SAMPLES // 8)
        ds.close()


CLIENT = textwrap.dedent(
    """
    import sys
    from loaderd.client import LoaderdDataset
    ds = LoaderdDataset(sys.argv[1], job="victim", batch_size=16, prefetch=4)
    it = iter(ds)
    next(it)
    print("got", flush=True)
    sys.stdin.readline()  # hold the batch (and the window behind it) until killed
    """
)


def test_killed_clients_slots_are_reclaimed(daemon: Daemon) -> None:
    with client_process(CLIENT, daemon.address, ready="got") as proc:
        stats = partial(daemon_shm, daemon.address)
        wait_until(lambda: stats()["lent_to_consumers"] >= 2, what="the client's window")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until(lambda: stats()["lent_to_consumers"] == 0, what="slots reclaimed")
        assert stats()["reclaimed"] >= 2


def test_killed_daemon_leaves_nothing_that_stops_a_restart(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    with Daemon(db=dataset[0], state_dir=tmp_path / "state") as d:
        ds = LoaderdDataset(d.address, job="crash", batch_size=32)
        next(iter(ds))
        ring = shm_stats(ds)["ring"]
        dead_pid = d.proc.pid if d.proc is not None else -1
        ds.close()
        assert (SHM_DIR / ring).exists()
        d.kill()
        assert (SHM_DIR / ring).exists(), "SIGKILL leaves the ring behind"
        d.start()  # the same command again
        assert not (SHM_DIR / ring).exists(), "the restarted daemon removed the stale ring"
        assert not list(SHM_DIR.glob(f"loaderd-{dead_pid}-*"))
        ds2 = LoaderdDataset(d.address, job="crash2", batch_size=32)
        assert len(list(ds2)) == -(-N_SAMPLES // 32)
        s = shm_stats(ds2)
        assert s["ring"] != ring and s["delivered"] > 0
        ds2.close()
