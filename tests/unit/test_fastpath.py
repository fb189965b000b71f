"""The client's fast path: device refusal without CUDA, pickling, socket fallback, descriptors."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from loaderd.client import LoaderdDataset
from loaderd.client.errors import ProtocolError
from loaderd.client.fastpath import ShmReceiver, check_device, to_shared_tensors
from loaderd.client.protocol import Message, MsgType
from loaderd.shm_ring import LentRing


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_device_is_refused_on_a_cpu_only_machine() -> None:
    with pytest.raises(RuntimeError, match=r"needs CUDA.*is_available\(\) is False"):
        LoaderdDataset("ipc:///tmp/none.sock", job="j", batch_size=4, device="cuda")


def test_bad_device_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="buffers"):
        check_device(None, 0)
    with pytest.raises(ValueError, match="CUDA device"):
        check_device("cpu", 3)
    assert check_device(None, 3) is None


def test_shm_is_asked_for_only_over_ipc() -> None:
    assert LoaderdDataset("ipc:///tmp/x.sock", job="j", batch_size=4)._shm.wanted
    assert not LoaderdDataset("ipc:///tmp/x.sock", job="j", batch_size=4, shm=False)._shm.wanted
    assert not LoaderdDataset("tcp://127.0.0.1:5555", job="j", batch_size=4)._shm.wanted


def test_receiver_pickles_without_its_mapping_and_falls_back() -> None:
    r = ShmReceiver(True)
    assert pickle.loads(pickle.dumps(r)).wanted
    # a WELCOME naming a ring that does not exist: use the socket
    assert not r.accept({"shm": {"ring": "loaderd-1-doesnotexist"}})
    assert not r.wanted
    msg = Message(MsgType.BATCH, 1, {"n": 0})
    assert not r.resolve(msg), "a BATCH without a descriptor keeps its frames"


def test_to_shared_tensors_copies_into_shared_memory() -> None:
    src = torch.arange(6)
    out = to_shared_tensors({"x": src, "names": ["a"]})
    assert out["x"].is_shared() and torch.equal(out["x"], src)
    assert out["x"].data_ptr() != src.data_ptr() and out["names"] == ["a"]


# --- descriptors of a ring already checked ------------------------------------------------------


def _batch(
    ring: LentRing, slot: int, payloads: list[bytes], shm: dict[str, Any] | None = None
) -> Message:
    desc = ring.layout(slot, [len(p) for p in payloads])
    for (off, n), p in zip(desc.frames, payloads, strict=True):
        ring.view(slot, off, n)[:] = p
    return Message(MsgType.BATCH, 1, {"n": 1, "shm": shm or desc.to_json()})


@pytest.fixture
def rings() -> Iterator[list[LentRing]]:
    made: list[LentRing] = []
    yield made
    for ring in made:
        ring.close()
        ring.unlink()


def test_receiver_checks_every_batch_of_a_known_layout(rings: list[LentRing]) -> None:
    """The layout is checked once per ring; each batch's slot and generation every time."""
    a = LentRing.create(2, 4096, prefix="ldtest-")
    rings.append(a)
    r = ShmReceiver(True)
    assert r.accept({"shm": {"ring": a.name}})
    freed: list[int] = []
    s0, s1 = a.acquire(), a.acquire()
    assert s0 is not None and s1 is not None
    first = _batch(a, s0, [b"x" * 16, b"y" * 8])
    assert r.resolve(first, lambda: freed.append(0))
    second = _batch(a, s1, [b"z" * 16, b"w" * 8])  # same layout: the known-ring path
    assert r.resolve(second, lambda: freed.append(1))
    assert [bytes(f) for f in first.frames] == [b"x" * 16, b"y" * 8]
    assert [bytes(f) for f in second.frames] == [b"z" * 16, b"w" * 8]
    view = np.frombuffer(second.frames[1], np.uint8)
    del first
    assert freed == [0], "the slot goes back once nothing views the batch"
    del second
    assert freed == [0], "an array made from a frame keeps the slot"
    del view
    assert freed == [0, 1]

    stale = a.layout(s0, [16, 8]).to_json()
    a.release(s0)
    assert a.acquire() == s0  # lent again
    with pytest.raises(ProtocolError, match="lent again"):
        r.resolve(Message(MsgType.BATCH, 1, {"n": 1, "shm": stale}))
    for bad in ({**stale, "gen": True}, {**stale, "slot": 99}, {**stale, "frames": [[0, 9e9]]}):
        with pytest.raises(ProtocolError):
            r.resolve(Message(MsgType.BATCH, 1, {"n": 1, "shm": bad}))

    # A restarted daemon's new ring, with the same layout: its own bytes, not the old ring's.
    b = LentRing.create(2, 4096, prefix="ldtest-")
    rings.append(b)
    t0 = b.acquire()
    assert t0 is not None
    fresh = _batch(b, t0, [b"n" * 16, b"m" * 8])
    assert r.resolve(fresh)
    assert [bytes(f) for f in fresh.frames] == [b"n" * 16, b"m" * 8]
    del fresh
    r.close()  # a closed mapping is never used again: the next batch maps the ring anew
    again = _batch(b, t0, [b"o" * 16, b"q" * 8])
    assert r.resolve(again)
    assert [bytes(f) for f in again.frames] == [b"o" * 16, b"q" * 8]
    del again
    r.close()


def test_receiver_maps_its_own_ring_after_fork(rings: list[LentRing]) -> None:
    a = LentRing.create(2, 4096, prefix="ldtest-")
    rings.append(a)
    r = ShmReceiver(True)
    slot = a.acquire()
    assert slot is not None
    assert r.resolve(_batch(a, slot, [b"p" * 16]))
    parent_ring = r._rings[a.name]
    rd, wr = os.pipe()
    child = os.fork()
    if child == 0:  # the child reports what it resolved, then leaves without cleanup
        try:
            msg = _batch(a, slot, [b"c" * 16])
            ok = r.resolve(msg) and bytes(msg.frames[0]) == b"c" * 16
            os.write(wr, b"1" if ok and r._rings[a.name] is not parent_ring else b"0")
        finally:
            os._exit(0)
    os.close(wr)
    got = os.read(rd, 1)
    os.close(rd)
    os.waitpid(child, 0)
    assert got == b"1", "the child attached the ring itself"
    r.close()


def test_rings_are_pinned_once_whether_mapped_before_or_after_and_unpinned_at_close(
    rings: list[LentRing],
) -> None:
    """``pin`` registers each ring this process maps, once, over the whole mapping (where a
    batch's tensors lie), and closing the receiver undoes it before unmapping."""
    a = LentRing.create(2, 4096, prefix="ldtest-")
    b = LentRing.create(2, 8192, prefix="ldtest-")
    rings += [a, b]
    pinned: dict[int, int] = {}
    unpinned: list[int] = []

    def register(address: int, nbytes: int) -> Any:
        pinned[address] = nbytes
        return lambda: unpinned.append(address)

    r = ShmReceiver(True)
    assert r.accept({"shm": {"ring": a.name}})  # mapped before the pin
    r.pin(register)
    r.pin(register)  # a second pass: nothing registered twice
    assert r.accept({"shm": {"ring": b.name}})  # mapped after it
    assert sorted(pinned.values()) == sorted([os.stat(a.path).st_size, os.stat(b.path).st_size])
    slot = b.acquire()
    assert slot is not None
    batch = _batch(b, slot, [b"p" * 64])
    assert r.resolve(batch)
    address = torch.frombuffer(batch.frames[0], dtype=torch.uint8).data_ptr()
    assert any(a0 <= address < a0 + n for a0, n in pinned.items())  # the batch lies in it
    del batch
    r.close()
    assert sorted(unpinned) == sorted(pinned)
