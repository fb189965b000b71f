"""A worker sends what its transform made through shared memory it reuses (client/output_pool.py).

One process plays worker and loop's process for the protocol; a real daemon and real forked
DataLoader workers for the rest: the values and their strides are the transform's, a slot
the loop holds is never written, and the loop forgets the pools of workers that ended.
"""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from loaderd.client import LoaderdDataset, output_pool, slot_handover
from loaderd.client.loop_acks import HandedOver, TaggedValue
from loaderd.client.slot_handover import slot_ref
from loaderd.shm_ring import LentRing
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, daemon_shm, make_npz, wait_until

pytestmark = pytest.mark.integration

Dataset = tuple[Path, dict[str, np.ndarray]]


def crossed(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """``tensors`` placed as a worker does and rebuilt as the loop's process does."""
    ref, entries = output_pool.place(tensors)
    if ref is None:
        return [e[1] for e in entries], None
    anchor = output_pool.receive(ref)
    assert anchor is not None
    return [output_pool.rebuild(e, anchor) if e[0] == "pool" else e[1] for e in entries], ref


def test_a_batch_s_new_storages_cross_once_each_keeping_strides_and_aliases() -> None:
    made = torch.arange(600_000, dtype=torch.float32).reshape(600, 1000)
    other = torch.ones(50_000, dtype=torch.int64)
    tensors = [made, made.t(), made[10:20, 5:], other, made.view(torch.int32)]
    back, ref = crossed(tensors)
    assert ref is not None and ref[5] is not None, "the pool travels until the loop has it"
    for got, want in zip(back, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.stride() == want.stride() and torch.equal(got, want)
        assert got.data_ptr() != want.data_ptr(), "the pool's bytes, not the worker's"
    back[0][11, 7] = -1.0  # one storage: its views still share their bytes
    assert back[2][1, 2].item() == -1.0 and back[1][7, 11].item() == -1.0
    assert back[3].untyped_storage().data_ptr() != back[0].untyped_storage().data_ptr()
    # The loop's process has the pool now: later batches name it only.
    again, ref = crossed([made.clone()])
    assert ref is not None and ref[5] is None and torch.equal(again[0], made)


def test_a_slot_the_loop_holds_is_never_written_and_comes_back_once_dropped() -> None:
    made = [torch.full((100_000,), float(i)) for i in range(output_pool.SLOTS + 2)]
    held = []
    for t in made:
        back, ref = crossed([t.clone()])
        held.append((back[0], ref))
    pooled = [ref is not None for _, ref in held]
    assert sum(pooled) <= output_pool.SLOTS and not pooled[-1], "no slot free: as torch sends"
    for (got, _), want in zip(held, made, strict=True):
        assert torch.equal(got, want), "a slot the loop held was written again"
    held.clear()
    gc.collect()
    assert crossed([made[0].clone()])[1] is not None, "dropped: the slots are free again"


def test_a_batch_larger_than_a_slot_gets_a_new_pool() -> None:
    small = crossed([torch.zeros(20_000)])[1]
    large, ref = crossed([torch.ones(2_000_000)])
    assert small is not None and ref is not None and ref[0] != small[0] and ref[5] is not None
    assert torch.equal(large[0], torch.ones(2_000_000))


def test_storages_in_shared_memory_or_too_large_travel_as_torch_sends_them() -> None:
    shared = torch.zeros(100_000)
    shared.share_memory_()  # type: ignore[no-untyped-call]
    ref, entries = output_pool.place([shared])
    assert ref is None and entries[0][1] is shared
    huge = torch.empty(output_pool.MAX_POOL_BYTES // output_pool.MIN_SLOTS, dtype=torch.uint8)
    ref, entries = output_pool.place([huge])
    assert ref is None and entries[0][1] is huge


def test_large_batches_get_fewer_slots_down_to_two(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output_pool, "MAX_POOL_BYTES", 4 << 20)
    back, ref = crossed([torch.ones(1 << 18)])  # 1 MiB: 3 slots of 1.25 MiB fit in 4 MiB
    assert ref is not None and torch.equal(back[0], torch.ones(1 << 18))
    assert crossed([torch.ones(1 << 19)])[1] is None, "2 MiB: not two slots: as torch sends"


def test_a_stale_batch_gives_its_pool_slot_back() -> None:
    """Its daemon slot was lent again before the loop unpickled it: nothing of it is kept."""
    with LentRing.create(2, 4096) as ring:
        slot = ring.acquire()
        assert slot is not None
        view = ring.view(slot)
        result = TaggedValue((torch.ones(100_000), torch.from_numpy(np.frombuffer(view, np.uint8))))
        value = HandedOver(result, slot_ref("j", 0, (ring.name, slot, ring.generation(slot)), view))
        value.packed = slot_handover.pooled(value.packed)
        pool = value.packed[4][0]
        assert pool is not None
        packed = pickle.dumps(value)
        ring.release(slot)
        assert ring.acquire() is not None  # lent again
        flags = pool_flags()
        assert flags[pool[2]] == 1
        assert pickle.loads(packed).loaderd_stale
        assert flags[pool[2]] == 0, "the pool slot went back"


def pool_flags() -> np.ndarray:
    """This process's pool's slot flags (1: in flight)."""
    assert output_pool._POOL is not None
    return output_pool._POOL.flags[1 : 1 + output_pool._POOL.slots]


def test_a_pool_dev_shm_cannot_hold_is_not_made_and_the_worker_lives() -> None:
    """Its file is taken whole at once, not faulted in later (SIGBUS past a full ``/dev/shm``).

    A child process whose files may not grow past 1 MiB stands for a full ``/dev/shm``.
    """
    script = textwrap.dedent(
        """
        import resource, signal, torch
        from loaderd.client import output_pool
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        for _ in range(2):
            t = torch.ones(1_000_000)
            ref, entries = output_pool.place([t])
            assert ref is None and entries[0][1] is t
        print("alive")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "alive"
    assert out.stderr.count("no room in /dev/shm") == 1, out.stderr


def resized(image: torch.Tensor) -> torch.Tensor:
    """Floats in [0, 1], four times as wide and high: a new tensor larger than 64 KB."""
    return torch.nn.functional.interpolate(image.float() / 255, scale_factor=4)


def resized_and_channels_last(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A transform making a new tensor, with a permuted view of it and views of the slot."""
    x = resized(batch["image"])
    return {"x": x, "nhwc": x.permute(0, 2, 3, 1), "label": batch["label"], "id": batch["id"]}


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_send_their_transform_s_tensors_through_their_pools(
    dataset: Dataset, tmp_path: Path, persistent: bool
) -> None:
    db, arrays = dataset
    with Daemon(db=db, state_dir=tmp_path / "state", extra=["--shm-slots", "16"]) as d:
        ds = LoaderdDataset(
            d.address, job="pool", batch_size=16, prefetch=2, transform=resized_and_channels_last
        )
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
        for epoch in range(3):
            seen: list[int] = []
            kept = []  # the second epoch keeps every batch: more than the pools have slots
            for out in loader:
                ids = out["id"].numpy()
                want = resized(torch.from_numpy(arrays["image"][ids]))
                assert torch.equal(out["x"], want) and torch.equal(
                    out["nhwc"], out["x"].permute(0, 2, 3, 1)
                )
                assert out["nhwc"].stride() == want.permute(0, 2, 3, 1).stride()
                assert out["nhwc"].data_ptr() == out["x"].data_ptr(), "one storage still"
                seen += ids.tolist()
                if epoch == 1:
                    kept.append((want, out["x"]))
            for want, x in kept:
                assert torch.equal(x, want), "a batch the loop kept was written again"
            assert sorted(seen) == list(range(N_SAMPLES))
            assert len(worker_pools()) == (2 if persistent else 0), "ended workers' are forgotten"
        del out, ids, kept, loader
        ds.close()
        wait_until(lambda: daemon_shm(d.address)["lent"] == 0, what="every slot back")


class Wrapped(torch.utils.data.IterableDataset[Any]):
    """loaderd's dataset inside a user's own, as a framework's combined loader holds it."""

    def __init__(self, inner: LoaderdDataset) -> None:
        self.inner = inner

    def __iter__(self) -> Any:
        yield from self.inner


@pytest.mark.filterwarnings("ignore:LoaderdDataset runs in a worker of a DataLoader iterator")
def test_a_wrapped_dataset_s_workers_pools_are_forgotten_when_they_end(
    dataset: Dataset, tmp_path: Path
) -> None:
    db, arrays = dataset
    with Daemon(db=db, state_dir=tmp_path / "state") as d:
        inner = LoaderdDataset(d.address, job="wrapped", batch_size=16, transform=resized_dict)
        loader = DataLoader(Wrapped(inner), batch_size=None, num_workers=2)
        for _ in range(2):
            seen: list[int] = []
            for out in loader:
                x, ids = out["x"], out["id"]
                assert torch.equal(x, resized(torch.from_numpy(arrays["image"][ids.numpy()])))
                assert in_a_pool(x)
                seen += ids.tolist()
            assert sorted(seen) == list(range(N_SAMPLES))
            assert not worker_pools(), "the ended workers' pools are forgotten"
        inner.close()


def resized_dict(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A dict stays loaderd's batch through a user's dataset (a tuple goes as torch sends it)."""
    return {"x": resized(batch["image"]), "id": batch["id"]}


def worker_pools() -> set[int]:
    """The pids of the DataLoader workers whose pools this process holds."""
    return {pid for pid, _ in output_pool._mapped().pools.values() if pid != os.getpid()}


def in_a_pool(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in a DataLoader worker's output pool, as mapped here."""
    pools = [m for _, m in output_pool._mapped().pools.values()]
    return any(0 <= t.data_ptr() - m.data_ptr() < m.numel() for m in pools)


def image_and_id(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["image"], batch["id"]


@pytest.mark.parametrize("transform", [None, image_and_id])
def test_batches_that_came_over_the_socket_cross_through_the_pool(
    tmp_path: Path, transform: Any
) -> None:
    """No ring (``--no-shm``, or a daemon on another host): the worker's tensors are its own."""
    from loaderd.storage.ingest import ingest

    arrays = make_npz(tmp_path / "big.npz", 256, shape=(3, 32, 32))  # 98 KB a batch of 32
    ingest(tmp_path / "big.npz", tmp_path / "big.db", progress=False)
    with Daemon(db=tmp_path / "big.db", state_dir=tmp_path / "state", extra=["--no-shm"]) as d:
        ds = LoaderdDataset(d.address, job="sock", batch_size=32, transform=transform)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        for _ in range(2):
            seen: list[int] = []
            for out in loader:
                image, ids = (out["image"], out["id"]) if transform is None else out
                np.testing.assert_array_equal(image.numpy(), arrays["image"][ids.numpy()])
                assert in_a_pool(image), "through the worker's pool, not a file of its own"
                seen += ids.tolist()
            assert sorted(seen) == list(range(256))
        del out, image, loader
        ds.close()
