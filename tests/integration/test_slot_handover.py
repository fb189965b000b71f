"""DataLoader workers hand their shared-memory slots to the loop's process with the batches.

A real daemon, real DataLoader workers (forked), real rings: the bytes are the store's, no
batch is copied into torch's shared memory, a batch the loop keeps is never overwritten, and
every slot comes back, after a ``break``, with persistent workers, and when the training
process is killed.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import textwrap
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.errors import RemoteError
from loaderd.client.loop_acks import HandedOver, TaggedBatch, TaggedValue
from loaderd.client.protocol import MsgType
from loaderd.client.slot_handover import held, slot_ref
from loaderd.shm_ring import LentRing
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, client_process, daemon_shm, wait_until

pytestmark = pytest.mark.integration

Dataset = tuple[Path, dict[str, np.ndarray]]


def check(batch: dict[str, torch.Tensor], arrays: dict[str, np.ndarray]) -> list[int]:
    ids = batch["id"].numpy()
    np.testing.assert_array_equal(batch["image"].numpy(), arrays["image"][ids])
    np.testing.assert_array_equal(batch["label"].numpy(), arrays["label"][ids])
    return list(ids.tolist())


def test_workers_hand_the_loop_their_slots_not_copies(dataset: Dataset, tmp_path: Path) -> None:
    db, arrays = dataset
    with Daemon(db=db, state_dir=tmp_path / "state", extra=["--shm-slots", "16"]) as d:
        ds = LoaderdDataset(d.address, job="handover", batch_size=24, prefetch=2)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        batches = 0
        for _ in range(2):  # a pass of misses, then one of hits
            ids: list[int] = []
            for batch in loader:
                ids += check(batch, arrays)
                # A copy would have gone through torch's shared memory, file by file.
                assert not batch["image"].is_shared()
                batches += 1
            assert sorted(ids) == list(range(N_SAMPLES))
        s = daemon_shm(d.address)
        assert (s["delivered"], s["socket_fallbacks"]) == (batches, 0)
        assert s["returned"] >= batches - 2, "the loop gave back what it dropped"
        del batch, loader
        ds.close()
        wait_until(lambda: daemon_shm(d.address)["lent"] == 0, what="every slot back")


def image_and_label(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A transform as torchvision users write them: views of the batch, in a tuple."""
    return batch["image"], batch["label"], batch["id"]


def scaled(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A transform that makes a new tensor of the image and keeps the rest as it is."""
    return {"x": batch["image"].float() / 255, "label": batch["label"], "id": batch["id"]}


@pytest.mark.parametrize("transform", [image_and_label, scaled])
def test_a_transform_s_result_crosses_with_the_slot_it_views(
    dataset: Dataset, tmp_path: Path, transform: Any
) -> None:
    """What the result still views of the slot crosses as a place in it; the rest as torch sends it.

    Before, a transform's batch was copied into torch's shared memory first: 100 KB samples
    through two workers ran at a sixth of the rate without a transform.
    """
    db, arrays = dataset
    with Daemon(db=db, state_dir=tmp_path / "state", extra=["--shm-slots", "16"]) as d:
        ds = LoaderdDataset(d.address, job="tf", batch_size=24, prefetch=2, transform=transform)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        batches = 0
        for _ in range(2):
            seen: list[int] = []
            for out in loader:
                if isinstance(out, tuple):
                    image, label, ids = out
                    assert not image.is_shared(), "the slot's bytes, not a copy"
                else:
                    image, label, ids = out["x"], out["label"], out["id"]
                    image = (image * 255).round().to(torch.uint8)
                np.testing.assert_array_equal(image.numpy(), arrays["image"][ids.numpy()])
                np.testing.assert_array_equal(label.numpy(), arrays["label"][ids.numpy()])
                assert not label.is_shared()
                seen += ids.tolist()
                batches += 1
            assert sorted(seen) == list(range(N_SAMPLES))
        s = daemon_shm(d.address)
        assert (s["delivered"], s["socket_fallbacks"]) == (batches, 0)
        del out, image, label, ids, loader
        ds.close()
        wait_until(lambda: daemon_shm(d.address)["lent"] == 0, what="every slot back")


class Keeper:
    """A transform that keeps the last images it was given, views of their slots."""

    def __init__(self, images: np.ndarray) -> None:
        self.images = images
        self.kept: deque[tuple[np.ndarray, torch.Tensor]] = deque(maxlen=3)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.kept.append((batch["id"].numpy().copy(), batch["image"]))
        intact = all(np.array_equal(im.numpy(), self.images[ids]) for ids, im in self.kept)
        return {**batch, "intact": torch.tensor(intact)}


def test_a_transform_that_keeps_views_of_its_batches_keeps_their_slots(
    dataset: Dataset, tmp_path: Path
) -> None:
    """The slot stays the worker's while it views it: what it kept in a pass is not overwritten.

    Its worker's next pass takes its slots back, as a trainer's without workers.
    """
    db, arrays = dataset
    with Daemon(db=db, state_dir=tmp_path / "state", extra=["--shm-slots", "8"]) as d:
        keeper = Keeper(arrays["image"])
        ds = LoaderdDataset(d.address, job="keeper", batch_size=16, prefetch=2, transform=keeper)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        batches = 0
        for _ in range(3):
            ids: list[int] = []
            for batch in loader:
                assert batch["intact"].item(), "a batch the transform kept was overwritten"
                ids += check(batch, arrays)
                assert not held("keeper", 0), "a copy, not the slot: not handed over"
                batches += 1
            assert sorted(ids) == list(range(N_SAMPLES))
        s = daemon_shm(d.address)
        assert s["socket_fallbacks"] < batches
        del batch, loader
        ds.close()
        wait_until(lambda: daemon_shm(d.address)["lent"] == 0, what="every slot back")


def test_workers_windows_leave_the_ring_room_for_what_the_loop_holds(
    dataset: Dataset, tmp_path: Path
) -> None:
    """Two workers asking 8 batches ahead each, a ring of 16 slots: nothing over the socket.

    The slots of batches handed over stay lent until the loop drops them; two full windows
    took the whole ring, and a quarter of the batches of 1 MB samples came over the socket.
    """
    db, arrays = dataset
    with Daemon(db=db, state_dir=tmp_path / "state", extra=["--shm-slots", "16"]) as d:
        ds = LoaderdDataset(d.address, job="windows", batch_size=8, prefetch=8)
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        for _ in range(2):
            ids = [i for batch in loader for i in check(batch, arrays)]
            assert sorted(ids) == list(range(N_SAMPLES))
        s = daemon_shm(d.address)
        assert (s["delivered"], s["socket_fallbacks"]) == (2 * N_SAMPLES // 8, 0)
        del loader
        ds.close()


def test_batches_the_loop_keeps_are_never_overwritten(dataset: Dataset, tmp_path: Path) -> None:
    """Every batch of two epochs kept, three times the ring's slots: each stays the store's.

    Once every slot is held, later batches come over the socket; none is assembled into a
    slot the loop still reads.
    """
    db, arrays = dataset
    with Daemon(db=db, state_dir=tmp_path / "state", extra=["--shm-slots", "8"]) as d:
        ds = LoaderdDataset(d.address, job="keep", batch_size=16, prefetch=2)
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        kept = [batch for _ in range(2) for batch in loader]
        assert len(kept) == 2 * N_SAMPLES // 16
        for batch in kept:
            check(batch, arrays)
        s = daemon_shm(d.address)
        assert s["delivered"] >= 8 and s["socket_fallbacks"] > 0
        del kept, batch, loader
        ds.close()
        wait_until(lambda: daemon_shm(d.address)["lent"] == 0, what="every slot back")


@pytest.mark.parametrize("persistent", [False, True])
def test_a_loop_that_breaks_leaves_no_slot_behind(
    dataset: Dataset, tmp_path: Path, persistent: bool
) -> None:
    """Four epochs stopped after three batches: what the workers fetched ahead comes back."""
    db, arrays = dataset
    with Daemon(db=db, state_dir=tmp_path / "state", extra=["--shm-slots", "32"]) as d:
        ds = LoaderdDataset(d.address, job="break", batch_size=16, prefetch=4)
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
        for _ in range(4):
            for i, batch in enumerate(loader):
                check(batch, arrays)
                if i == 2:
                    break
        assert daemon_shm(d.address)["delivered"] > 0
        del batch, loader
        ds.close()
        wait_until(lambda: daemon_shm(d.address)["lent"] == 0, what="every slot back")


@pytest.mark.parametrize("kind", ["fresh", "persistent", "stateful", "stateful-mid"])
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's own
def test_batches_the_loop_cannot_map_after_the_workers_ended_are_fetched_by_the_loop(
    dataset: Dataset, tmp_path: Path, kind: str
) -> None:
    """A worker ends its pass while its batches still wait in the DataLoader's queue.

    The daemon that lent their ring dies, and its successor removes the ring before the loop's
    process has mapped it: no worker is left to fetch them again, so that process does. A
    ``StatefulDataLoader``'s checkpoint taken then resumes at the next epoch, whole; one taken
    after the first of those batches resumes with the other two.
    """
    loader_type: Any = DataLoader
    if kind.startswith("stateful"):
        loader_type = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    db, arrays = dataset
    d = Daemon(db=db, state_dir=tmp_path / "state", extra=["--shm-slots", "16"]).start()

    def dataset_and_loader() -> tuple[LoaderdDataset, Any]:
        ds = LoaderdDataset(
            d.address, job="gone", batch_size=N_SAMPLES // 3, prefetch=1, reconnect_s=30
        )
        loader = loader_type(
            ds,
            batch_size=None,
            num_workers=1,
            prefetch_factor=4,
            persistent_workers=kind == "persistent",
        )
        return ds, loader

    try:
        ds, loader = dataset_and_loader()
        it = iter(loader)
        # Three batches and the worker's end of its pass, all waiting for the loop.
        wait_until(lambda: it._data_queue.qsize() == 4, what="the worker's whole pass queued")
        d.kill()
        d.start()  # removes the dead daemon's rings
        if kind == "stateful-mid":
            ids = check(next(it), arrays)  # the first batch the loop fetches itself
        else:
            ids = [i for batch in it for i in check(batch, arrays)]
            assert sorted(ids) == list(range(N_SAMPLES))
        assert ds.delivery.lost == 3
        if kind.startswith("stateful"):
            state = loader.state_dict()
            del it, loader
            ds.close()
            ds, loader = dataset_and_loader()
            loader.load_state_dict(state)
        if kind == "stateful-mid":  # the rest of the epoch, none of it twice
            ids += [i for batch in loader for i in check(batch, arrays)]
            assert sorted(ids) == list(range(N_SAMPLES))
        for _ in range(2):  # the next epochs as usual
            ids = [i for batch in loader for i in check(batch, arrays)]
            assert sorted(ids) == list(range(N_SAMPLES))
        assert ds.delivery.lost == (0 if kind.startswith("stateful") else 3)
        del loader
        ds.close()
        # Left mid-way, the first loop's own fetch had asked for its next batch: as after a
        # break without workers, that slot stays lent until the process exits.
        left = 1 if kind == "stateful-mid" else 0
        wait_until(lambda: daemon_shm(d.address)["lent"] == left, what="every slot back")
    finally:
        d.close()


TRAINER = textwrap.dedent(
    """
    import sys
    from torch.utils.data import DataLoader
    from loaderd.client import LoaderdDataset
    ds = LoaderdDataset(sys.argv[1], job="killed", batch_size=16, prefetch=4)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    kept = []
    for batch in loader:
        kept.append(batch)
        if len(kept) == 6:
            print("holding", flush=True)
            sys.stdin.readline()  # hold them until killed
    """
)


@pytest.mark.parametrize("persistent", [False, True])
def test_after_a_daemon_restart_between_epochs_handed_slots_still_come_back(
    dataset: Dataset, tmp_path: Path, persistent: bool
) -> None:
    """The loop's process says HELLO to the daemon that restarted, once a batch of it arrives.

    Nothing of that process was in flight at the restart, so ZeroMQ took its next requests to
    the new daemon without a HELLO: its pid unknown there, the slots it gave back were ignored,
    the ring filled up, and every later batch came over the socket.
    """
    db, arrays = dataset
    d = Daemon(db=db, state_dir=tmp_path / "state", extra=["--shm-slots", "16"]).start()
    try:
        ds = LoaderdDataset(d.address, job="restart", batch_size=16, prefetch=2, reconnect_s=30)
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
        assert sorted(i for b in loader for i in check(b, arrays)) == list(range(N_SAMPLES))
        d.kill()
        d.start()
        for _ in range(3):
            assert sorted(i for b in loader for i in check(b, arrays)) == list(range(N_SAMPLES))
        s = daemon_shm(d.address)
        per_epoch = N_SAMPLES // 16
        assert s["socket_fallbacks"] < per_epoch and s["returned"] >= 2 * per_epoch
        del loader
        ds.close()
    finally:
        d.close()


def test_a_killed_training_process_gives_its_slots_back(daemon: Daemon) -> None:
    with client_process(TRAINER, daemon.address, ready="holding") as proc:
        assert daemon_shm(daemon.address)["lent"] >= 6
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until(lambda: daemon_shm(daemon.address)["lent"] == 0, what="slots reclaimed")


def test_a_malformed_return_is_refused_and_the_daemon_stays_up(daemon: Daemon) -> None:
    with Connection(daemon.address) as conn:
        hello = {"job": "bad", "rank": 0, "world_size": 1, "seed": 0, "batch_size": 16}
        hello |= {"options": {}, "pid": os.getpid(), "shm": True}
        conn.request(MsgType.HELLO, hello, expect=MsgType.WELCOME)
        ack = {"job": "bad", "rank": 0, "worker": 0, "epoch": 0, "phase": "train", "acks": []}
        ack["loop"] = True  # from the loop's process, naming no pass the daemon knows
        with pytest.raises(RemoteError, match="'returned' must be a list"):
            conn.request(MsgType.ACK, {**ack, "returned": [["r", -1, 0]]}, expect=MsgType.OK)
        conn.request(MsgType.ACK, {**ack, "returned": [["r", 1, 0]]}, expect=MsgType.OK)
    assert daemon_shm(daemon.address)["returned"] == 0, "a slot never handed over is not taken"


def test_a_worker_gives_back_a_slot_it_kept_by_its_id_not_its_batch(daemon: Daemon) -> None:
    """Its own slot, named by ring, slot and generation: one lent again since is never taken.

    By batch index, a worker whose transform kept a batch that the daemon, restarted, then sent
    it again gave back the new batch's slot under the loop (seen: a kept batch rewritten).
    """
    loop = subprocess.Popen(["sleep", "60"])  # the loop's process, alive
    try:
        with Connection(daemon.address) as conn:
            hello = {"job": "kept", "rank": 0, "world_size": 1, "seed": 0, "batch_size": 16}
            hello |= {"options": {}, "pid": os.getpid(), "pidns": os.readlink("/proc/self/ns/pid")}
            hello |= {"shm": True, "handover": loop.pid}
            conn.request(MsgType.HELLO, hello, expect=MsgType.WELCOME)
            head = {"job": "kept", "rank": 0, "worker": 0, "phase": "train"}
            conn.request(MsgType.OPEN_PASS, head, expect=MsgType.PASS)
            get = {**head, "epoch": 0, "acks": [], "release": []}
            d = conn.request(MsgType.GET_BATCH, get, expect=MsgType.BATCH).meta["shm"]
            ack = {**head, "epoch": 0, "acks": []}
            conn.request(MsgType.ACK, {**ack, "returned": [[d["ring"], d["slot"], d["gen"] + 1]]})
            assert daemon_shm(daemon.address)["returned"] == 0, "another lending of the slot"
            conn.request(MsgType.ACK, {**ack, "returned": [[d["ring"], d["slot"], d["gen"]]]})
            assert daemon_shm(daemon.address)["returned"] == 1
    finally:
        loop.kill()
        loop.wait()


def test_a_packed_batch_views_the_same_bytes_until_its_slot_is_lent_again() -> None:
    """Pickled as a worker's queue does, unpickled as the loop's process does (one process)."""
    with LentRing.create(2, 4096) as ring:
        slot = ring.acquire()
        assert slot is not None
        view = ring.view(slot)
        block = np.frombuffer(view, np.float32)[:64].reshape(8, 8)
        block[:] = np.arange(64, dtype=np.float32).reshape(8, 8)
        batch = TaggedBatch(
            whole=torch.from_numpy(block),
            column=torch.from_numpy(block)[:, 3],  # strided, inside the slot
            outside=torch.arange(5),  # small and elsewhere: by value
            names=["a", "b"],
        )
        batch.loaderd_slot = slot_ref("j", 0, (ring.name, slot, ring.generation(slot)), view)
        back = pickle.loads(pickle.dumps(batch))
        assert back["whole"].data_ptr() != batch["whole"].data_ptr(), "a mapping of its own"
        torch.testing.assert_close(back["whole"], batch["whole"])
        torch.testing.assert_close(back["column"], batch["column"])
        torch.testing.assert_close(back["outside"], torch.arange(5))
        assert back["names"] == ["a", "b"] and not back.loaderd_stale
        block[0, 0] = -1.0  # the same bytes, not a copy
        assert back["whole"][0, 0].item() == -1.0
        packed = pickle.dumps(batch)
        ring.release(slot)
        assert ring.acquire() is not None  # lent again: a new generation
        stale = pickle.loads(packed)
        assert stale.loaderd_stale and not stale


class Marked(torch.Tensor):
    """A tensor subclass, as torchvision's ``tv_tensors.Image``."""


def test_a_packed_value_keeps_its_shape_and_what_torch_would_keep() -> None:
    """A transform's result: nested dicts, lists and tuples; subclasses and grads as pickled."""
    with LentRing.create(2, 4096) as ring:
        slot = ring.acquire()
        assert slot is not None
        view = ring.view(slot)
        block = torch.from_numpy(np.frombuffer(view, np.int64)[:16])
        block[:] = torch.arange(16)
        grad = torch.ones(3, requires_grad=True)
        result = TaggedValue(
            (
                block[:8],
                {"deep": [block[8:], block[3]], "big": torch.zeros(70_000, dtype=torch.uint8)},
                OrderedDict(small=torch.arange(2)),
                block.as_subclass(Marked),
                grad,
                torch.tensor(7),
                "text",
            )
        )
        value = HandedOver(result, slot_ref("j", 0, (ring.name, slot, ring.generation(slot)), view))
        back = pickle.loads(pickle.dumps(value))
        first, nested, ordered, marked, grad_back, scalar, text = back.value
        block[0] = -1  # the same bytes where the result viewed the slot
        assert first[0].item() == -1 and nested["deep"][0].tolist() == list(range(8, 16))
        assert nested["deep"][1].shape == () and nested["deep"][1].item() == 3
        assert nested["big"].shape == (70_000,) and not nested["big"].any()
        assert type(marked) is Marked and marked[1].item() == 1
        assert type(ordered) is OrderedDict and ordered["small"].tolist() == [0, 1]
        assert grad_back.requires_grad and grad_back.tolist() == [1.0, 1.0, 1.0]
        assert scalar.item() == 7 and text == "text" and not back.loaderd_stale
        packed = pickle.dumps(value)
        ring.release(slot)
        assert ring.acquire() is not None  # lent again
        assert pickle.loads(packed).loaderd_stale
