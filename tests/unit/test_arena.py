from __future__ import annotations

import itertools
import logging
import os
import random
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaderd.storage import arena as arena_mod
from loaderd.storage import arena_format, row_reads
from loaderd.storage.arena import HEADER_PAGE, Arena, record_extent
from loaderd.storage.arena_snapshot import SLOT_HEAD
from loaderd.storage.durability import filesystem_type, probe_durability
from loaderd.storage.errors import StorageError, StoreFullError

FP = bytes(range(16))
SMALL = 256 << 10  # 256 KiB file: fast to open, quick to wrap
SNAP = 64 << 10  # two 32 KiB snapshot slots
_example = itertools.count()
HYP = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def payload(sample_id: int, seq: int = 0, size: int | None = None) -> bytes:
    """Deterministic bytes for (id, seq), so that any served record can be checked."""
    n = size if size is not None else 1 + (sample_id * 7919 + seq * 104729) % 3000
    rng = random.Random(sample_id * 1_000_003 + seq)
    return rng.randbytes(n)


@pytest.fixture
def arena_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on /dev/shm where there is one: msync on a disk costs ~1 ms a put, which
    these tests do not need (test_round_trip_on_disk and the crash test use a disk)."""
    if not os.path.isdir("/dev/shm"):
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="loaderd-test-arena-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def path(arena_dir: Path) -> Path:
    return arena_dir / "arena.bin"


@pytest.fixture
def shm_path(arena_dir: Path) -> Path:
    if not str(arena_dir).startswith("/dev/shm/"):
        pytest.skip("no /dev/shm")
    return arena_dir / "arena.bin"


def fill(path: Path, n: int, *, capacity: int = SMALL) -> dict[int, bytes]:
    expected = {i: payload(i) for i in range(n)}
    with Arena(path, capacity, FP) as a:
        a.put_many(expected.items())
        assert len(a) == n, "fill must not wrap"
    return expected


def check_served(a: Arena, expected: dict[int, bytes]) -> set[int]:
    """Every id the arena claims must come back with exactly the expected bytes."""
    served = set()
    for sid in a.ids().tolist():
        got = a.get(sid)
        if got is not None:
            assert got == expected[sid], f"sample {sid}: wrong bytes served"
            served.add(sid)
    return served


def record_ends(expected: dict[int, bytes]) -> dict[int, int]:
    """File offset just past each record's commit word, for records written in id order."""
    off, ends = HEADER_PAGE, {}
    for sid in sorted(expected):
        n = len(expected[sid])
        ends[sid] = off + 64 + (n + 7) // 8 * 8 + 8
        off += record_extent(n)
    return ends


# ---- round trip ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["shm", "disk"])
def test_round_trip_and_reopen(arena_dir: Path, tmp_path: Path, where: str) -> None:
    path = (arena_dir if where == "shm" else tmp_path) / "arena.bin"
    with Arena(path, SMALL, FP) as a:
        assert a.rebuilt and len(a) == 0 and a.get(3) is None
        a.put(3, b"three")
        a.put(7, memoryview(b"seven"))
        a.put(9, np.arange(10, dtype=np.float32))
        a.put(4, b"")
        assert a.get(3) == b"three" and a.get(7) == b"seven" and a.get(4) == b""
        assert a.get(9) == np.arange(10, dtype=np.float32).tobytes()
        assert 3 in a and 5 not in a and len(a) == 4
        assert sorted(a.ids().tolist()) == [3, 4, 7, 9]
        s = a.stats()
        assert s["items"] == 4 and s["hits"] == 4 and s["misses"] == 1
        assert s["capacity_bytes"] == SMALL - HEADER_PAGE
        assert s["used_bytes"] == sum(record_extent(n) for n in (5, 5, 40, 0))
    with Arena(path, SMALL, FP) as a:
        assert not a.rebuilt and a.recovered_items == 4
        assert a.get(3) == b"three" and a.get(9) == np.arange(10, dtype=np.float32).tobytes()


def test_later_put_wins_also_after_reopen(path: Path) -> None:
    with Arena(path, SMALL, FP) as a:
        a.put(1, b"old")
        a.put(1, b"new!")
        assert a.get(1) == b"new!" and len(a) == 1
    with Arena(path, SMALL, FP) as a:
        assert a.get(1) == b"new!" and len(a) == 1


def test_discard_survives_reopen(path: Path) -> None:
    with Arena(path, SMALL, FP) as a:
        a.put_many([(1, b"a"), (2, b"b")])
        a.discard(1)
        a.discard(99)  # absent: a no-op
        assert 1 not in a and a.get(2) == b"b"
    with Arena(path, SMALL, FP) as a:
        assert 1 not in a and a.get(2) == b"b"


def test_close_twice_use_after_close_and_second_opener(path: Path) -> None:
    a = Arena(path, SMALL, FP)
    with pytest.raises(StorageError, match="in use"):
        Arena(path, SMALL, FP)
    a.close()
    a.close()
    with pytest.raises(StorageError, match="closed"):
        a.get(1)
    with pytest.raises(StorageError, match="closed"):
        a.put(1, b"x")
    Arena(path, SMALL, FP).close()  # the lock went with the first close


def test_threads_share_an_arena(path: Path) -> None:
    def make(sid: int, i: int) -> bytes:
        return i.to_bytes(8, "little") + payload(sid, i, size=100 + i * 7)

    def check(sid: int, got: bytes | None) -> None:
        # another thread may have replaced or evicted it, but never with wrong bytes
        assert got is None or got == make(sid, int.from_bytes(got[:8], "little"))

    errors: list[BaseException] = []
    with Arena(path, SMALL, FP, snapshot_bytes=SNAP) as a:

        def work(t: int) -> None:
            try:
                for i in range(150):
                    sid = (t * 1000 + i) % 97
                    a.put(sid, make(sid, i))
                    check(sid, a.get(sid))
                    if i % 50 == 0:
                        a.write_snapshot(f"t{t}", i, make(t, i))
                        assert a.read_snapshot() is not None
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=10)
        assert not errors and not any(th.is_alive() for th in threads)
        for sid in a.ids().tolist():
            got = a.get(sid)
            assert got is not None
            check(sid, got)


def test_bad_arguments(path: Path) -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        Arena(path, SMALL, b"short")
    with pytest.raises(ValueError, match="capacity_bytes"):
        Arena(path, 4096, FP)
    with pytest.raises(ValueError, match="snapshot_bytes"):
        Arena(path, SMALL, FP, snapshot_bytes=4096)
    with Arena(path, SMALL, FP) as a, pytest.raises(ValueError, match="sample_id"):
        a.put(-1, b"x")


# ---- full arena ----------------------------------------------------------------------------


def test_oversize_payload_is_a_clear_store_full_error(path: Path) -> None:
    with Arena(path, SMALL, FP) as a:
        with pytest.raises(StoreFullError, match=r"sample 5 of \d+ bytes does not fit"):
            a.put(5, bytes(SMALL))
        assert len(a) == 0


def test_full_arena_without_eviction(path: Path) -> None:
    with Arena(path, SMALL, FP) as a:
        items = [(i, payload(i, size=10_000)) for i in range(100)]
        with pytest.raises(StoreFullError, match="is full"):
            a.put_many(items, evict=False)
        n = len(a)
        assert 0 < n < 100 and a.evictions == 0
        # what fitted before the error was committed, and is served whole
        assert all(a.get(i) == payload(i, size=10_000) for i in range(n))
    with Arena(path, SMALL, FP) as a:
        assert len(a) == n


# ---- the ring ------------------------------------------------------------------------------


def test_wrap_around_keeps_the_newest(path: Path) -> None:
    expected: dict[int, bytes] = {}
    evicted: list[int] = []
    with Arena(path, SMALL, FP) as a:
        for i in range(150):  # ~1.3 MiB through a 252 KiB log: five laps
            expected[i] = payload(i, size=500 + (i * 131) % 17_000)
            evicted += a.put(i, expected[i])
            assert a.used_bytes <= a.capacity_bytes
        for j in range(150, 400, 50):  # and in batches, which commit early to not self-overlap
            batch = {i: payload(i, size=500 + (i * 131) % 17_000) for i in range(j, j + 50)}
            expected.update(batch)
            evicted += a.put_many(batch.items())
        kept = set(a.ids().tolist())
        assert a.evictions == len(evicted) == 400 - len(kept)
        assert kept.isdisjoint(evicted)
        # the newest records, contiguous up to the last one
        newest = sorted(kept)
        assert newest == list(range(400 - len(kept), 400)) and 399 in kept
        assert check_served(a, expected) == kept
    with Arena(path, SMALL, FP) as a:
        assert set(a.ids().tolist()) == kept and a.recovery_dropped == 0
        assert check_served(a, expected) == kept
        a.put(1000, b"after reopen")  # the ring carries on from the recovered head
        assert a.get(1000) == b"after reopen" and a.get(399) == expected[399]


def test_payloads_read_from_a_file_through_laps_and_a_reopen(path: Path, tmp_path: Path) -> None:
    """``read_from``: the kernel reads each payload from the file into the log, hashed there."""
    if not row_reads.AVAILABLE:
        pytest.skip("the compiled record reader is not built")
    expected = {i: payload(i, size=500 + (i * 131) % 17_000) for i in range(300)}
    src = tmp_path / "src.bin"
    src.write_bytes(b"".join(expected.values()))
    at = np.cumsum([0] + [len(v) for v in expected.values()])[:-1]
    fd = os.open(src, os.O_RDONLY)
    try:
        with Arena(path, SMALL, FP) as a:
            for j in range(0, 300, 60):  # five batches over a 252 KiB log: laps, early commits
                ids = list(range(j, j + 60))
                offsets = at[ids].copy()
                offsets[::3] = -1  # these copied from their payloads as before
                # The payload gives the length; what the log holds comes from the file.
                items = [
                    (i, expected[i] if k % 3 == 0 else bytes(len(expected[i])))
                    for k, i in enumerate(ids)
                ]
                a.put_many(items, read_from=(fd, offsets))
            kept = set(a.ids().tolist())
            assert 299 in kept and check_served(a, expected) == kept
        with Arena(path, SMALL, FP) as a:
            assert set(a.ids().tolist()) == kept and a.recovery_dropped == 0
            assert check_served(a, expected) == kept
            # A read that fails (past the end of the file) copies the batch from its payloads.
            a.put_many([(1000, b"copied"), (1001, b"too")], read_from=(fd, np.array([0, 1 << 40])))
            assert a.get(1000) == b"copied" and a.get(1001) == b"too"
    finally:
        os.close(fd)


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "put", "put", "discard", "reopen"]),
            st.integers(0, 40),
            st.integers(0, 30_000),
        ),
        max_size=60,
    )
)
@HYP
def test_model_with_random_ops(arena_dir: Path, ops: list[tuple[str, int, int]]) -> None:
    path = arena_dir / f"model-{next(_example)}.bin"  # hypothesis seeds `random`
    model: dict[int, bytes] = {}  # what may be served: the latest put of each id
    a = Arena(path, SMALL, FP)
    try:
        for seq, (op, sid, size) in enumerate(ops):
            if op == "put":
                model[sid] = payload(sid, seq, size)
                a.put(sid, model[sid])
                assert a.get(sid) == model[sid]
            elif op == "discard":
                a.discard(sid)
                model.pop(sid, None)
            else:
                before = set(a.ids().tolist())
                a.close()
                a = Arena(path, SMALL, FP)
                assert set(a.ids().tolist()) == before
            assert set(a.ids().tolist()) <= set(model)
            assert check_served(a, model) == set(a.ids().tolist())
    finally:
        a.close()


# ---- recovery ------------------------------------------------------------------------------


def test_recovery_after_zeroing_the_tail_at_many_offsets(path: Path) -> None:
    expected = fill(path, 12)
    ends = record_ends(expected)
    image = path.read_bytes()
    cuts = {HEADER_PAGE}
    for sid, end in ends.items():  # around every boundary of every record
        start = end - 72 - (len(expected[sid]) + 7) // 8 * 8
        for at in (start, start + 1, start + 63, start + 64, start + 70, end - 9, end - 1, end):
            cuts.add(at)
        cuts.add(start + random.randrange(end - start))
    for cut in sorted(cuts):
        path.write_bytes(image[:cut] + bytes(len(image) - cut))
        with Arena(path, SMALL, FP) as a:
            # whole: the zeroing changed none of its bytes (a commit word may end in 0x00)
            whole = {sid for sid, end in ends.items() if not any(image[cut:end])}
            assert check_served(a, expected) == whole, f"cut at {cut}"


def test_truncated_file_is_rebuilt(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fill(path, 10)
    image = path.read_bytes()
    for cut in (0, 100, HEADER_PAGE, HEADER_PAGE + 1000, len(image) - 1):
        path.write_bytes(image[:cut])
        with caplog.at_level(logging.WARNING), Arena(path, SMALL, FP) as a:
            assert a.rebuilt and len(a) == 0
            a.put(1, b"usable")
            assert a.get(1) == b"usable"
    assert "size" in caplog.text


@given(flips=st.lists(st.integers(0, 8 * (SMALL - HEADER_PAGE) - 1), min_size=1, max_size=8))
@HYP
def test_recovery_after_random_bit_flips(path: Path, flips: list[int]) -> None:
    if not path.exists():
        fill(path, 60)
    expected = {i: payload(i) for i in range(60)}
    image = bytearray(path.read_bytes())
    pristine = bytes(image)
    for bit in flips:
        image[HEADER_PAGE + bit // 8] ^= 1 << (bit % 8)
    try:
        path.write_bytes(image)
        with Arena(path, SMALL, FP) as a:
            served = check_served(a, expected)
            assert a.corrupt_dropped == 0  # recovery verified everything it kept
            # a flip costs at most the record it lands in
            assert len(served) >= 60 - len(flips)
    finally:
        path.write_bytes(pristine)


@given(
    start=st.integers(0, SMALL - HEADER_PAGE - 1),
    length=st.integers(1, 40_000),
    flip=st.booleans(),
)
@HYP
def test_recovery_after_wrap_and_damage(path: Path, start: int, length: int, flip: bool) -> None:
    """Damage anywhere in a ring that has wrapped costs only the records it touches."""
    expected = {i: payload(i, size=300 + (i * 131) % 9_000) for i in range(120)}
    if not path.exists():
        with Arena(path, SMALL, FP) as a:
            for i, data in expected.items():
                a.put(i, data)
            assert a.evictions > 0
    with Arena(path, SMALL, FP) as a:
        extents = {sid: (off, ext) for off, ext, sid, _ in a._ring}
    pristine = path.read_bytes()
    lo = HEADER_PAGE + start
    hi = min(lo + length, HEADER_PAGE + SMALL - HEADER_PAGE)
    image = bytearray(pristine)
    if flip:
        image[lo] ^= 0x10
        hi = lo + 1
    else:
        image[lo:hi] = bytes(hi - lo)
    try:
        path.write_bytes(image)
        with Arena(path, SMALL, FP) as a:
            served = check_served(a, expected)
            untouched = {sid for sid, (off, ext) in extents.items() if off + ext <= lo or off >= hi}
            assert untouched <= served
    finally:
        path.write_bytes(pristine)


def test_corruption_while_open_is_dropped_at_read(path: Path) -> None:
    expected = fill(path, 5)
    ends = record_ends(expected)
    with Arena(path, SMALL, FP) as a:
        with open(path, "r+b") as f:  # the same page cache as the mapping
            f.seek(ends[2] - 20)
            byte = f.read(1)
            f.seek(ends[2] - 20)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert a.get(2) is None and 2 not in a
        assert a.stats()["corrupt_dropped"] == 1
        assert a.get(3) == expected[3]
    with Arena(path, SMALL, FP) as a:
        assert 2 not in a and check_served(a, expected) == {0, 1, 3, 4}


def test_foreign_fingerprint_is_rebuilt(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fill(path, 5)
    with caplog.at_level(logging.WARNING), Arena(path, SMALL, b"\xff" * 16) as a:
        assert a.rebuilt and len(a) == 0
    assert "another store" in caplog.text
    with Arena(path, SMALL, b"\xff" * 16) as a:
        assert not a.rebuilt


def test_other_version_is_rebuilt(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fill(path, 5)
    with open(path, "r+b") as f:
        raw = bytearray(f.read(arena_format._HEADER.size))
        struct.pack_into("<I", raw, 8, arena_format.FORMAT_VERSION + 1)
        f.seek(0)
        f.write(raw + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(raw))))
    with caplog.at_level(logging.WARNING), Arena(path, SMALL, FP) as a:
        assert a.rebuilt and len(a) == 0
    assert f"format version {arena_format.FORMAT_VERSION + 1}" in caplog.text


@pytest.mark.parametrize("garbage", [b"\x00" * 4096, b"LDARENA\x00" + b"\x01" * 100, None])
def test_garbage_header_is_rebuilt(
    path: Path, caplog: pytest.LogCaptureFixture, garbage: bytes | None
) -> None:
    fill(path, 5)
    with open(path, "r+b") as f:
        f.write(garbage if garbage is not None else random.Random(1).randbytes(4096))
    with caplog.at_level(logging.WARNING), Arena(path, SMALL, FP) as a:
        assert a.rebuilt and len(a) == 0
    assert "rebuilding arena" in caplog.text


def test_other_layout_is_rebuilt(path: Path) -> None:
    fill(path, 5)
    with Arena(path, SMALL, FP, snapshot_bytes=32 << 10) as a:
        assert a.rebuilt and len(a) == 0
    with Arena(path, SMALL * 2, FP, snapshot_bytes=32 << 10) as a:
        assert a.rebuilt


# ---- durability ----------------------------------------------------------------------------


def test_dev_shm_is_volatile(shm_path: Path) -> None:
    assert filesystem_type(Path("/dev/shm")) in {"tmpfs", "ramfs"}
    assert probe_durability(shm_path) == "volatile"  # before the file exists
    with Arena(shm_path, SMALL, FP) as a:
        assert a.durability == "volatile" and a.stats()["durability"] == "volatile"
        a.put(1, b"x")
    with Arena(shm_path, SMALL, FP) as a:
        assert a.get(1) == b"x"


def test_tmp_is_not_pmem(tmp_path: Path) -> None:
    probe = probe_durability(tmp_path / "arena.bin")
    assert probe != "pmem-sync"
    if filesystem_type(tmp_path) not in {"tmpfs", "ramfs"}:
        assert probe == "file-msync"
    with Arena(tmp_path / "arena.bin", SMALL, FP) as a:
        assert a.durability == probe


@pytest.mark.nvram
@pytest.mark.skipif(not os.environ.get("LOADERD_TEST_DAX"), reason="LOADERD_TEST_DAX not set")
def test_dax_file_is_pmem_sync() -> None:
    d = Path(tempfile.mkdtemp(prefix="loaderd-test-arena-", dir=os.environ["LOADERD_TEST_DAX"]))
    try:
        with Arena(d / "arena.bin", SMALL, FP) as a:
            assert a.durability == "pmem-sync"
            a.put(1, b"on pmem")
        with Arena(d / "arena.bin", SMALL, FP) as a:
            assert a.get(1) == b"on pmem"
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- snapshots -----------------------------------------------------------------------------


def slot_commit_offset(a: Arena, slot: int, length: int) -> int:
    base = a.capacity_bytes + HEADER_PAGE + slot * SNAP // 2
    return base + SLOT_HEAD + (length + 7) // 8 * 8


def test_snapshot_round_trip_and_alternation(path: Path) -> None:
    with Arena(path, SMALL, FP, snapshot_bytes=SNAP) as a:
        assert a.read_snapshot() is None and a.stats()["snapshot"] is None
        for step in range(5):
            a.write_snapshot("job-a", step, payload(step, size=1000 + step))
            assert a.read_snapshot("job-a") == ("job-a", step, payload(step, size=1000 + step))
        assert a.read_snapshot("job-b") is None
        snap = a.stats()["snapshot"]
        assert isinstance(snap, dict) and snap["step"] == 4 and snap["bytes"] == 1004
        a.put(1, b"the log is independent")
    with Arena(path, SMALL, FP, snapshot_bytes=SNAP) as a:
        assert a.read_snapshot() == ("job-a", 4, payload(4, size=1004))
        assert a.get(1) == b"the log is independent"


@pytest.mark.parametrize("damage", ["commit", "payload", "header"])
def test_torn_snapshot_leaves_the_previous_one(path: Path, damage: str) -> None:
    old, new = payload(1, size=5000), payload(2, size=7000)
    with Arena(path, SMALL, FP, snapshot_bytes=SNAP) as a:
        a.write_snapshot("j", 1, old)  # slot 0
        a.write_snapshot("j", 2, new)  # slot 1
        commit_at = slot_commit_offset(a, 1, len(new))
        base = a.capacity_bytes + HEADER_PAGE + SNAP // 2
    with open(path, "r+b") as f:
        where = {"commit": commit_at, "payload": base + SLOT_HEAD + 3000, "header": base + 20}
        f.seek(where[damage])
        f.write(b"\x00\x01\x02\x03")
    with Arena(path, SMALL, FP, snapshot_bytes=SNAP) as a:
        assert a.read_snapshot("j") == ("j", 1, old)
        # the next write goes to the torn slot, so step 1 stays until step 3 is whole
        a.write_snapshot("j", 3, b"three")
        assert a.read_snapshot("j") == ("j", 3, b"three")
    with Arena(path, SMALL, FP, snapshot_bytes=SNAP) as a:
        assert a.read_snapshot("j") == ("j", 3, b"three")


def test_snapshot_of_one_job_keeps_its_previous_across_other_jobs(path: Path) -> None:
    with Arena(path, SMALL, FP, snapshot_bytes=SNAP) as a:
        a.write_snapshot("a", 1, b"a1")
        a.write_snapshot("b", 1, b"b1")
        a.write_snapshot("a", 2, b"a2")  # must not overwrite a1's slot
        assert a.read_snapshot("a") == ("a", 2, b"a2")
        assert a.read_snapshot() == ("a", 2, b"a2")
        assert a.read_snapshot("b") is None  # the region holds two snapshots in all


def test_snapshot_too_large_is_a_clear_error(path: Path) -> None:
    with Arena(path, SMALL, FP, snapshot_bytes=SNAP) as a:
        with pytest.raises(StoreFullError, match=r"snapshot of 40000 bytes for job 'j'"):
            a.write_snapshot("j", 1, bytes(40_000))
        with pytest.raises(ValueError, match="job"):
            a.write_snapshot("x" * 1000, 1, b"")
    with Arena(path, SMALL, FP) as a, pytest.raises(StoreFullError, match="at most 0 bytes"):
        a.write_snapshot("j", 1, b"x")


class Crash(Exception):
    pass


def test_crash_before_the_commit_leaves_the_previous_state(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first flush (of the payload) comes before any commit word is stored."""
    with Arena(path, SMALL, FP, snapshot_bytes=SNAP) as a:
        a.put(1, b"one")
        a.write_snapshot("j", 1, b"snap one")
    a = Arena(path, SMALL, FP, snapshot_bytes=SNAP)

    def crash(*args: object) -> None:
        raise Crash

    monkeypatch.setattr(arena_mod.dur, "flush_range", crash)
    with pytest.raises(Crash):
        a.put_many([(2, b"two"), (3, b"three")])
    with pytest.raises(Crash):
        a.write_snapshot("j", 2, b"snap two")
    monkeypatch.undo()
    a._release()  # die without closing
    with Arena(path, SMALL, FP, snapshot_bytes=SNAP) as a:
        assert sorted(a.ids().tolist()) == [1] and a.get(1) == b"one"
        assert a.read_snapshot("j") == ("j", 1, b"snap one")


def _full_ring(a: Arena, size: int) -> int:
    """Fill the log with records of ``size`` bytes, ids 0.., without wrapping; their count."""
    n = a.capacity_bytes // record_extent(size)
    a.put_many((i, payload(i, size=size)) for i in range(n))
    return n


def test_a_lent_record_is_not_overwritten_until_it_is_given_back(path: Path) -> None:
    with Arena(path, SMALL, FP) as a:
        n = _full_ring(a, 1000)
        offsets = a.lend([0, n + 5])  # the next to be overwritten, and one not here
        again = a.lend([0])  # another batch's reader of the same record
        assert offsets[1] == -1 and again[0] == offsets[0] and a.stats()["lent"] == 2
        fd = os.open(path, os.O_RDONLY)
        errors: list[BaseException] = []

        def write() -> None:
            try:
                a.put_many((n + i, payload(n + i, size=1000)) for i in range(3))
            except BaseException as e:
                errors.append(e)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            writer.join(0.5)
            assert writer.is_alive(), "the ring overwrote a record lent to a reader"
            assert os.pread(fd, 1000, int(offsets[0])) == payload(0, size=1000)
            assert a.get(5) == payload(5, size=1000)  # readers do not wait on the writer
            a.give_back(offsets)
            writer.join(0.3)
            assert writer.is_alive(), "the ring overwrote a record one reader still reads"
            a.give_back(again)
            writer.join(10)
            assert not writer.is_alive() and not errors
        finally:
            os.close(fd)
        assert 0 not in a and a.get(n + 2) == payload(n + 2, size=1000)
        assert a.stats()["lent"] == 0


def test_closing_stops_a_writer_that_waits_on_a_loan(path: Path) -> None:
    a = Arena(path, SMALL, FP)
    n = _full_ring(a, 1000)
    a.lend([0])
    errors: list[BaseException] = []

    def write() -> None:
        try:
            a.put(n, payload(n, size=1000))
        except BaseException as e:
            errors.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    writer.join(0.3)
    assert writer.is_alive()
    a.close()  # returns: the writer gives up on the loan, nothing half-written is committed
    writer.join(10)
    assert not writer.is_alive() and isinstance(errors[0], StorageError)
    with Arena(path, SMALL, FP) as again:
        assert n not in again and again.get(0) == payload(0, size=1000)


def test_msync_writes_back_a_map_and_names_itself_when_refused(tmp_path: Path) -> None:
    import errno
    import mmap

    from loaderd.storage.syscalls import msync

    f = tmp_path / "m.bin"
    f.write_bytes(bytes(2 * mmap.PAGESIZE))
    with open(f, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
        mm[10:15] = b"hello"
        msync(mm, 0, 2 * mmap.PAGESIZE)  # lets go of the GIL while the disk writes
        assert f.read_bytes()[10:15] == b"hello"
        with pytest.raises(OSError, match="msync") as e:
            msync(mm, 1, 10)  # not on a page
        assert e.value.errno == errno.EINVAL
        mm.close()  # nothing of the map is still exported
