from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loaderd.client import protocol as P
from loaderd.client.errors import ProtocolError
from loaderd.client.shm import (
    ALIGN,
    CRC,
    HEADER,
    MAGIC,
    VERSION,
    ShmError,
    ShmRing,
    SlotDescriptor,
    copy_batch,
    layout_bytes,
    slot_layout,
)
from loaderd.shm_ring import LentRing, cleanup_stale

PREFIX = "ldtest-"
DEAD_PID = (1 << 22) + 4242  # above the largest pid_max Linux allows: never a live process


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    # A private directory on the tmpfs, so cleanup_stale never sees anyone else's rings.
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="ldshm-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ring(shm_dir: Path) -> Iterator[LentRing]:
    with LentRing.create(4, 10_000, prefix=PREFIX, directory=shm_dir) as r:
        yield r


def pack(ring: LentRing, slot: int, frames: list[Any]) -> SlotDescriptor:
    """Copy ready frames into a lent slot (what the assembler does in place)."""
    bufs = [memoryview(f).cast("B") for f in frames]
    desc = ring.layout(slot, [b.nbytes for b in bufs])
    for b, (off, n) in zip(bufs, desc.frames, strict=True):
        ring.view(slot, off, n)[:] = b
    return desc


def _rewrite_header(path: Path, *, pid: int, start: int = 0, magic: bytes = MAGIC) -> None:
    with open(path, "r+b") as f:
        raw = f.read(HEADER.size)
        _, version, slots, slot_bytes, data_offset, _, _ = HEADER.unpack(raw)
        head = HEADER.pack(magic, version, slots, slot_bytes, data_offset, pid, start)
        f.seek(0)
        f.write(head + CRC.pack(zlib.crc32(head)))


# --- layout ------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=20))
def test_slot_layout_is_aligned_ordered_and_disjoint(sizes: list[int]) -> None:
    spans = slot_layout(sizes)
    assert [n for _, n in spans] == sizes
    end = 0
    for off, n in spans:
        assert off % ALIGN == 0 and off >= end
        end = off + n
    assert layout_bytes(sizes) == end


def test_slot_layout_rejects_negative_size() -> None:
    with pytest.raises(ValueError, match="frame 1"):
        slot_layout([3, -1])


# --- round trip --------------------------------------------------------------------------------


def test_round_trip_exact_bytes(ring: LentRing, shm_dir: Path) -> None:
    assert ring.path.parent == shm_dir and ring.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert ring.slot_bytes % os.sysconf("SC_PAGE_SIZE") == 0 and ring.slot_bytes >= 10_000
    rng = np.random.default_rng(0)
    frames = [rng.bytes(n) for n in (1, 63, 64, 65, 0, 3000)]
    slot = ring.acquire("c1")
    assert slot is not None
    desc = pack(ring, slot, frames)
    assert all(off % ALIGN == 0 for off, _ in desc.frames)

    wire = SlotDescriptor.from_json(json.loads(json.dumps(desc.to_json())))
    assert wire == desc
    with ShmRing.attach(ring.name, directory=shm_dir) as client:
        assert (client.slots, client.slot_bytes) == (ring.slots, ring.slot_bytes)
        views = client.frames(wire)
        assert [bytes(v) for v in views] == frames
        del views


def test_slot_frames_decode_as_a_batch_without_copy(ring: LentRing, shm_dir: Path) -> None:
    schema = [P.FieldSpec("x", "float32", (3,)), P.FieldSpec("txt", "binary")]
    arrays = P.BatchArrays(
        ids=np.arange(4, dtype=np.int64),
        weights=np.ones(4, np.float32),
        columns={
            "x": np.arange(12, dtype=np.float32).reshape(4, 3),
            "txt": P.VarColumn(np.array([0, 1, 3, 3, 6], np.int64), memoryview(b"abbccc")),
        },
    )
    slot = ring.acquire()
    assert slot is not None
    desc = pack(ring, slot, P.batch_frames(arrays, schema))
    with ShmRing.attach(ring.name, directory=shm_dir) as client:
        msg = P.Message(P.MsgType.BATCH, 1, {"n": 4}, client.frames(desc))
        got = P.decode_batch(msg, schema)
        np.testing.assert_array_equal(got.columns["x"], arrays.columns["x"])
        assert bytes(got.columns["txt"].item(1)) == b"bb"  # type: ignore[union-attr]
        # The views are writable, so torch.frombuffer neither warns nor copies.
        t = torch.frombuffer(msg.frames[2], dtype=torch.float32).view(4, 3)
        ring.view(slot, desc.frames[2][0], 4)[:] = np.float32(99).tobytes()
        assert t[0, 0].item() == 99.0
        del t, got, msg


def test_copy_batch_survives_slot_reuse(ring: LentRing, shm_dir: Path) -> None:
    slot = ring.acquire()
    assert slot is not None
    desc = pack(ring, slot, [np.arange(8, dtype=np.int64)])
    with ShmRing.attach(ring.name, directory=shm_dir) as client:
        (frame,) = client.frames(desc)
        arr = np.frombuffer(frame, np.int64)
        batch = {"t": torch.frombuffer(frame, dtype=torch.int64), "a": arr, "m": frame, "k": 7}
        kept = copy_batch(batch)
        ring.view(slot)[:64] = bytes(64)  # the daemon reuses the slot
        assert batch["t"].sum().item() == 0  # the view changed under the trainer
        assert kept["t"].tolist() == list(range(8))
        assert kept["a"].tolist() == list(range(8))
        assert kept["m"] == np.arange(8, dtype=np.int64).tobytes()
        assert kept["k"] == 7
        del batch, arr, frame


# --- lending -----------------------------------------------------------------------------------


def test_slots_are_not_reused_before_release(ring: LentRing, shm_dir: Path) -> None:
    got = [ring.acquire("a") for _ in range(ring.slots)]
    assert sorted(got) == list(range(ring.slots))  # type: ignore[type-var]
    assert ring.acquire("a") is None and ring.free_count == 0
    first = got[1]
    assert first is not None
    old = ring.layout(first, [16])
    ring.release(first)
    assert ring.acquire("b") == first  # the one released, and only that one
    assert ring.acquire("b") is None
    with ShmRing.attach(ring.name, directory=shm_dir) as client:
        assert not client.is_current(old) and client.generation(first) == old.generation + 1
        with pytest.raises(ProtocolError, match="lent again"):
            client.frames(old)
        assert client.is_current(ring.layout(first, [16]))


def test_release_checks_lending(ring: LentRing) -> None:
    slot = ring.acquire("a")
    assert slot is not None
    with pytest.raises(ValueError, match="not lent to 'b'"):
        ring.release(slot, "b")
    ring.release(slot, "a")
    with pytest.raises(ValueError, match="not lent"):
        ring.release(slot)
    with pytest.raises(ValueError, match="not lent"):
        ring.view(slot)
    with pytest.raises(ValueError, match="not lent"):
        ring.layout(slot, [1])


def test_reclaim_frees_only_that_owners_slots(ring: LentRing) -> None:
    a = [ring.acquire(("job", 0, 1)) for _ in range(2)]
    b = ring.acquire(("job", 0, 2))
    assert ring.reclaim(("job", 0, 1)) == sorted(a)  # type: ignore[type-var]
    assert ring.lent() == {b: ("job", 0, 2)}
    assert ring.reclaim(("job", 0, 1)) == []
    assert ring.free_count == ring.slots - 1


def test_a_ring_retires_only_with_no_slot_lent_and_then_lends_none(ring: LentRing) -> None:
    slot = ring.acquire("prefetch")
    assert slot is not None
    assert not ring.retire() and not ring.retired, "a lent slot keeps the ring lending"
    ring.release(slot)
    assert ring.retire() and ring.retired
    assert ring.acquire("prefetch") is None and ring.free_count == ring.slots


def test_view_and_layout_bounds(ring: LentRing) -> None:
    slot = ring.acquire()
    assert slot is not None
    assert ring.view(slot).nbytes == ring.slot_bytes
    with pytest.raises(ValueError, match="outside slot"):
        ring.view(slot, ring.slot_bytes - 1, 2)
    with pytest.raises(ValueError, match="out of range"):
        ring.view(ring.slots)
    with pytest.raises(ValueError, match="batch needs"):
        ring.layout(slot, [ring.slot_bytes, 1])


def test_attached_side_cannot_lend(ring: LentRing, shm_dir: Path) -> None:
    with ShmRing.attach(ring.name, directory=shm_dir) as client:
        assert not hasattr(client, "acquire")  # lending lives in the daemon package


def test_close_twice_and_with_views_alive(shm_dir: Path) -> None:
    r = LentRing.create(1, 100, prefix=PREFIX, directory=shm_dir)
    slot = r.acquire()
    assert slot is not None
    v = r.view(slot)
    r.close()
    r.close()
    assert not r.path.exists()
    v[0] = 1  # still mapped: unmapped only when the last view goes
    del v
    with pytest.raises(ShmError, match="closed"):
        r.generation(0)


def test_create_arguments(shm_dir: Path) -> None:
    with pytest.raises(ValueError, match="slots"):
        LentRing.create(0, 10, directory=shm_dir)
    with pytest.raises(ValueError, match="slot_bytes"):
        LentRing.create(1, 0, directory=shm_dir)
    with pytest.raises(ValueError, match="prefix"):
        LentRing.create(1, 10, prefix="../x", directory=shm_dir)
    with pytest.raises(ShmError, match="cannot create"):
        LentRing.create(1, 10, directory=shm_dir / "missing")


# --- attach errors -----------------------------------------------------------------------------


def test_attach_missing_ring_names_the_path(shm_dir: Path) -> None:
    with pytest.raises(ShmError, match=f"no shared-memory ring at {shm_dir}/loaderd-1-x"):
        ShmRing.attach("loaderd-1-x", directory=shm_dir)


def test_attach_refuses_bad_names(shm_dir: Path) -> None:
    for name in ("../etc/passwd", "", ".hidden", "a/b"):
        with pytest.raises(ShmError, match="bad shared-memory ring name"):
            ShmRing.attach(name, directory=shm_dir)


def test_attach_refuses_bad_headers(ring: LentRing, shm_dir: Path) -> None:
    bad = shm_dir / "not-a-ring"
    bad.write_bytes(b"hello")
    with pytest.raises(ShmError, match=f"{bad} is not a loaderd ring"):
        ShmRing.attach(bad.name, directory=shm_dir)
    bad.write_bytes(b"X" * 4096)
    with pytest.raises(ShmError, match="magic"):
        ShmRing.attach(bad.name, directory=shm_dir)

    with open(ring.path, "r+b") as f:  # flip a bit of slot_bytes: the checksum must catch it
        f.seek(16)
        byte = f.read(1)
        f.seek(16)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ShmError, match=f"ring {ring.path} has a corrupt header"):
        ShmRing.attach(ring.name, directory=shm_dir)


def test_attach_refuses_wrong_version_and_size(shm_dir: Path) -> None:
    with LentRing.create(2, 100, prefix=PREFIX, directory=shm_dir) as r:
        os.truncate(r.path, os.path.getsize(r.path) - 4096)
        with pytest.raises(ShmError, match="its header says"):
            ShmRing.attach(r.name, directory=shm_dir)
        with open(r.path, "r+b") as f:
            raw = f.read(HEADER.size)
            fields = list(HEADER.unpack(raw))
            fields[1] = VERSION + 1
            head = HEADER.pack(*fields)
            f.seek(0)
            f.write(head + CRC.pack(zlib.crc32(head)))
        with pytest.raises(ShmError, match=f"layout version {VERSION + 1}"):
            ShmRing.attach(r.name, directory=shm_dir)


# --- descriptors from the wire -----------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        None,
        [],
        {"ring": "../x", "slot": 0, "gen": 1, "frames": []},
        {"ring": "r", "slot": -1, "gen": 1, "frames": []},
        {"ring": "r", "slot": True, "gen": 1, "frames": []},
        {"ring": "r", "slot": 0, "frames": []},
        {"ring": "r", "slot": 0, "gen": 1, "frames": [[0]]},
        {"ring": "r", "slot": 0, "gen": 1, "frames": [[0, "1"]]},
        {"ring": "r", "slot": 0, "gen": 1, "frames": {"0": 1}},
    ],
)
def test_descriptor_from_json_rejects(obj: object) -> None:
    with pytest.raises(ProtocolError, match="slot descriptor"):
        SlotDescriptor.from_json(obj)


def test_frames_reject_descriptors_outside_the_ring(ring: LentRing, shm_dir: Path) -> None:
    slot = ring.acquire()
    assert slot is not None
    good = ring.layout(slot, [10, 20])
    with ShmRing.attach(ring.name, directory=shm_dir) as client:
        for desc, match in [
            (SlotDescriptor("other", slot, good.generation, good.frames), "names ring"),
            (SlotDescriptor(ring.name, ring.slots, 1, good.frames), "names slot"),
            (SlotDescriptor(ring.name, slot, good.generation, ((8, 10),)), "slot layout"),
            (
                SlotDescriptor(ring.name, slot, good.generation, ((0, ring.slot_bytes + 1),)),
                "reaches byte",
            ),
        ]:
            with pytest.raises(ProtocolError, match=match):
                client.frames(desc)
        assert [v.nbytes for v in client.frames(good)] == [10, 20]


# --- stale rings -------------------------------------------------------------------------------


def test_cleanup_stale_removes_dead_owners_and_keeps_live(shm_dir: Path) -> None:
    live = LentRing.create(1, 100, prefix=PREFIX, directory=shm_dir)
    dead = LentRing.create(1, 100, prefix=PREFIX, directory=shm_dir)
    reused = LentRing.create(1, 100, prefix=PREFIX, directory=shm_dir)
    dead.unlink()
    shutil.copy(live.path, shm_dir / f"{PREFIX}{DEAD_PID}-dead")
    _rewrite_header(shm_dir / f"{PREFIX}{DEAD_PID}-dead", pid=DEAD_PID)
    # Our pid, but another start time: the pid was reused, the owner is gone.
    _rewrite_header(reused.path, pid=os.getpid(), start=1)
    # Caught half-made (no valid header): judged by the pid in the name.
    (shm_dir / f"{PREFIX}{DEAD_PID}-half").write_bytes(b"")
    (shm_dir / f"{PREFIX}{os.getpid()}-half").write_bytes(b"")
    (shm_dir / f"{PREFIX}garbage").write_bytes(b"")
    (shm_dir / "other-1-x").write_bytes(b"")

    removed = cleanup_stale(PREFIX, directory=shm_dir)

    assert sorted(removed) == sorted(
        [f"{PREFIX}{DEAD_PID}-dead", f"{PREFIX}{DEAD_PID}-half", reused.name]
    )
    left = sorted(p.name for p in shm_dir.iterdir())
    assert left == sorted(
        [live.name, f"{PREFIX}{os.getpid()}-half", f"{PREFIX}garbage", "other-1-x"]
    )
    with ShmRing.attach(live.name, directory=shm_dir):
        pass
    for r in (live, dead, reused):
        r.close()
    assert cleanup_stale(PREFIX, directory=shm_dir / "missing") == []
