"""storage/dram.py and storage/tiers.py: LRU order, byte bound, accounting, tier stack reads."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from loaderd.storage.admission import BACKGROUND_NICE
from loaderd.storage.arena import Arena
from loaderd.storage.dram import DramCache, own_copies
from loaderd.storage.pinning import still_locked
from loaderd.storage.policies import DRAM
from loaderd.storage.records import Field, RecordCodec, Schema
from loaderd.storage.store import VIEW_MIN_BYTES, SampleStore
from loaderd.storage.store_writer import StoreWriter
from loaderd.storage.syscalls import address_of
from loaderd.storage.tiers import TierStack
from tests.helpers import wait_until


def rec(tag: int, size: int = 10) -> bytes:
    return bytes([tag % 256]) * size


# ---------------------------------------------------------------- DramCache


def test_get_and_put() -> None:
    c = DramCache(100)
    assert c.get(1) is None
    assert c.put(1, rec(1)) is True
    assert c.get(1) == rec(1)
    assert 1 in c and 2 not in c and len(c) == 1
    s = c.stats()
    assert (s["hits"], s["misses"], s["used_bytes"], s["items"]) == (1, 1, 10, 1)
    assert s["hit_rate"] == 0.5 and s["name"] == "dram" and s["capacity_bytes"] == 100


def test_evicts_least_recently_used_first() -> None:
    c = DramCache(30)
    for i in range(3):
        c.put(i, rec(i))
    assert c.get(0) == rec(0)  # 0 is now the most recently used; 1 is the oldest
    c.put(3, rec(3))
    assert 1 not in c
    assert {0, 2, 3} == {i for i in range(4) if i in c}
    c.put(4, rec(4))  # next oldest: 2
    assert 2 not in c and 0 in c
    assert c.evictions == 2


def test_put_refreshes_recency_and_replaces_size() -> None:
    c = DramCache(30)
    c.put(0, rec(0))
    c.put(1, rec(1))
    c.put(0, rec(7, 15))  # replace: 0 becomes most recent and grows
    assert c.used_bytes == 25 and c.get(0) == rec(7, 15)
    c.put(2, rec(2))  # needs 5 more bytes: evicts 1, the least recent
    assert 1 not in c and 0 in c and 2 in c
    assert c.used_bytes == 25 and c.evictions == 1


def test_byte_bound_holds_and_evictions_count() -> None:
    rng = np.random.default_rng(0)
    c = DramCache(1000)
    admitted = 0
    for i in range(500):
        size = int(rng.integers(1, 200))
        assert c.put(i, rec(i, size))
        admitted += 1
        assert c.used_bytes <= 1000
        assert c.used_bytes == sum(len(c.peek(k) or b"") for k in c._items)
    assert c.evictions == admitted - len(c)
    assert c.stats()["evictions"] == c.evictions


def test_one_big_record_evicts_several() -> None:
    c = DramCache(100)
    for i in range(10):
        c.put(i, rec(i))
    assert c.put(99, rec(99, 95))
    assert len(c) == 1 and c.evictions == 10 and c.used_bytes == 95


def test_oversize_record_is_refused_and_evicts_nothing() -> None:
    c = DramCache(50)
    c.put(1, rec(1))
    assert c.put(2, rec(2, 51)) is False
    assert 2 not in c and 1 in c and c.evictions == 0 and c.used_bytes == 10
    assert c.put(3, rec(3, 50)) is True  # exactly the capacity fits
    assert c.used_bytes == 50 and len(c) == 1


def test_zero_capacity_holds_nothing() -> None:
    c = DramCache(0)
    assert c.put(1, rec(1, 1)) is False
    assert len(c) == 0 and c.get(1) is None
    assert c.stats()["hit_rate"] == 0.0 and c.misses == 1


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="`capacity_bytes` must be >= 0, got -1"):
        DramCache(-1)


@pytest.mark.parametrize("size", [100, 100_000])  # copied by bytes(), and by numpy
def test_a_view_that_is_not_locked_is_held_as_a_copy_of_its_own(size: int) -> None:
    source = bytearray(np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes())
    want = bytes(source)
    dram = DramCache(1 << 20)  # no pin: every view is copied
    assert dram.put(7, memoryview(source))
    source[:] = bytes(size)  # the memory the view pointed at is reused
    got = dram.get(7)
    assert got is not None and bytes(got) == want and len(got) == size
    assert dram.used_bytes == size and dram.pinned == 0


def test_a_batch_put_whole_leaves_what_one_put_after_another_leaves() -> None:
    rng = np.random.default_rng(4)
    whole, single = DramCache(20_000), DramCache(20_000)
    released: list[int] = []
    for step in range(300):
        sids = rng.choice(60, size=int(rng.integers(1, 9)), replace=False).tolist()
        if step % 7 == 0:  # a batch larger than the tier: taken one record at a time
            sids = rng.choice(60, size=30, replace=False).tolist()
        sizes = rng.integers(100, 1_500, len(sids)).tolist()
        for cache in (whole, single):
            held = {
                s: (bytes([s % 256]) * n, None if s % 3 else (lambda s=s: released.append(s)))
                for s, n in zip(sids, sizes, strict=True)
            }
            if cache is whole:
                cache.put_many(held)
            else:
                for s, h in held.items():
                    cache.put(s, h[0], h)
        if step % 5 == 0:
            whole.get(int(sids[0])), single.get(int(sids[0]))  # a hit reorders both alike
        assert list(whole._items) == list(single._items)
        assert [bytes(whole.peek(s) or b"") for s in whole._items] == [
            bytes(single.peek(s) or b"") for s in single._items
        ]
        w, o = whole.stats(), single.stats()
        assert (w["used_bytes"], w["evictions"], w["pinned"]) == (
            o["used_bytes"],
            o["evictions"],
            o["pinned"],
        )
        assert w["used_bytes"] <= 20_000
    assert whole.stats()["evictions"] > 100  # the bound was in play
    assert len(released) % 2 == 0  # every lock let go by one was let go by the other


def test_a_batch_put_names_the_records_too_large_for_the_tier() -> None:
    released: list[int] = []
    cache = DramCache(100)
    held = {s: (bytes(n), lambda s=s: released.append(s)) for s, n in [(1, 40), (2, 101), (3, 60)]}
    assert cache.put_many(held) == [2]  # let go, its lock with it
    assert released == [2] and 1 in cache and 3 in cache and cache.used_bytes == 100
    assert cache.put_many({4: (bytes(10), None)}) == []


@pytest.mark.parametrize("size", [100, 20_000])
def test_own_copies_do_not_share_the_memory_they_were_copied_from(size: int) -> None:
    source = bytearray(b"ab" * size)
    views = [memoryview(source)[i * size : (i + 1) * size] for i in range(2)]
    copies = own_copies(views)
    source[:] = bytes(len(source))  # the source's memory reused
    assert [bytes(c) for c in copies] == [b"ab" * (size // 2)] * 2


def test_records_of_their_own_are_put_together_evicting_the_oldest() -> None:
    cache = DramCache(100, recency=False)
    assert cache.put_all([1, 2], [bytes(30), bytes(30)]) == []
    assert cache.put_all([3, 4, 5], [bytes(20), bytes(20), bytes(101)]) == [5]  # one at a time
    assert cache.put_all([6, 7], [bytes(30), bytes(20)]) == []  # 1 and 2 go, oldest first
    assert sorted(cache._items) == [3, 4, 6, 7] and cache.used_bytes == 90
    assert cache.pinned == 0 and cache.evictions == 2


def test_hit_rate_with_no_lookups() -> None:
    assert DramCache(10).stats()["hit_rate"] == 0.0


# ---------------------------------------------------------------- TierStack

SCHEMA = Schema((Field("x", "int64", (3,)), Field("s", "binary")))
CODEC = RecordCodec(SCHEMA)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiers") / "store"
    with StoreWriter(path, SCHEMA) as w:
        w.append([CODEC.encode({"x": [i, i, i], "s": b"v" * (i % 7)}) for i in range(100)])
    return path


def big_store(tmp_path: Path, n: int, kib: int) -> tuple[Path, list[bytes]]:
    """A store of ``n`` records of ``kib`` KiB (large enough to be locked, not copied), and
    the bytes of each as stored."""
    path = tmp_path / "big"
    with StoreWriter(path, SCHEMA) as w:
        w.append([CODEC.encode({"x": [i, i, i], "s": bytes([i]) * (kib << 10)}) for i in range(n)])
    with SampleStore(path) as s:
        return path, s.get_many(range(n))


def test_a_batch_another_process_read_is_counted_as_if_read_here(
    store_path: Path, tmp_path: Path
) -> None:
    # Repeats, records DRAM holds and records it does not, and evictions: the books of a
    # batch a miss worker read are those of the same batch read here.
    rng = np.random.default_rng(6)
    every = np.arange(100)
    twin = shutil.copytree(store_path, tmp_path / "twin")  # LMDB opens a file once a process
    with SampleStore(twin) as a, SampleStore(store_path) as b:
        truth = a.get_many(every)
        index = b.value_index
        assert index is not None
        cap = sum(map(len, truth)) // 3
        with TierStack(a, cap) as here, TierStack(b, cap) as there:
            for _ in range(80):
                ids = rng.integers(0, 100, int(rng.integers(1, 20)))
                here.get_many(ids)
                there.read_elsewhere(ids, index.offsets[ids], index.lengths[ids].astype(np.int64))
                assert (here.policy.lookup_many(every) == there.policy.lookup_many(every)).all()
                assert here.policy.stats(DRAM) == there.policy.stats(DRAM)
            st = there.policy.stats(DRAM)
            assert st["hits"] > 0 and st["misses"] > 100 and st["items"] > 10  # a full tier
            assert set(there.dram._items) == set(here.dram._items)
            for sid in there.dram._items:
                assert bytes(there.dram.peek(sid) or b"") == truth[sid]


def test_small_records_another_process_read_are_held_as_copies_of_their_own(
    store_path: Path, tmp_path: Path
) -> None:
    """A batch of small misses DRAM takes whole is copied at once (``_copy_all``); one with a
    record large enough to lock goes record by record, the large one held as a locked view."""
    with SampleStore(store_path) as s, TierStack(s, 1 << 20) as stack:
        truth = s.get_many(range(100))
        index = s.value_index
        assert index is not None
        ids = np.array([7, 3, 99, 40])
        stack.read_elsewhere(ids, index.offsets[ids], index.lengths[ids].astype(np.int64))
        held = stack.dram._items
        assert list(held) == [7, 3, 99, 40] and all(type(held[i]) is bytes for i in ids)
        assert [held[i] for i in ids] == [truth[i] for i in ids]
        assert (stack.policy.lookup_many(ids) == DRAM).all()
        assert stack.dram.used_bytes == stack.policy.stats(DRAM)["used_bytes"]
        ids = np.array([3, 12, 40, 55])  # two held already, two new: only those are admitted
        stack.read_elsewhere(ids, index.offsets[ids], index.lengths[ids].astype(np.int64))
        assert list(held) == [7, 3, 99, 40, 12, 55] and [held[12], held[55]] == [
            truth[12],
            truth[55],
        ]
        assert stack.policy.stats(DRAM)["hits"] == 2
        assert stack.dram.used_bytes == stack.policy.stats(DRAM)["used_bytes"]
    path, big = big_store(tmp_path, 4, 20)
    with SampleStore(path) as s, TierStack(s, 1 << 20) as stack:
        index = s.value_index
        assert index is not None
        ids = np.arange(4)
        stack.read_elsewhere(ids, index.offsets[ids], index.lengths[ids].astype(np.int64))
        assert [bytes(stack.dram.peek(i) or b"") for i in ids] == big
        if stack.dram.pinned:  # where the kernel lets this process lock pages
            assert all(stack.dram.holds_view(i) for i in ids)


def test_a_record_the_batch_pushed_out_of_an_lru_is_admitted_again_from_the_store(
    store_path: Path,
) -> None:
    """Read elsewhere, a batch's misses come first: admitting them pushes out of a full LRU
    tier a record a later id of the batch was found in. That id's access admits it again,
    with the store's bytes (it failed the batch: the read had no bytes of it)."""
    with SampleStore(store_path) as s:
        truth = s.get_many(range(100))
        index = s.value_index
        assert index is not None
        size = len(truth[0])  # ids that are multiples of 7 have records of one size
        with TierStack(s, 4 * size, policy="lru", load_map=False) as stack:

            def read_elsewhere(ids: list[int]) -> None:
                at = np.array(ids)
                stack.read_elsewhere(at, index.offsets[at], index.lengths[at].astype(np.int64))

            read_elsewhere([0, 7, 14, 21])  # the tier is full, 0 least recently used
            read_elsewhere([28, 35, 0])  # 28 pushes 0 out, 35 pushes 7, then 0 comes back
            assert list(stack.dram._items) == [21, 28, 35, 0]
            assert [bytes(stack.dram.peek(i) or b"") for i in (21, 28, 35, 0)] == [
                truth[i] for i in (21, 28, 35, 0)
            ]
            assert stack.dram.used_bytes == stack.policy.stats(DRAM)["used_bytes"] == 4 * size


@pytest.mark.parametrize("load_map", [True, False])
def test_a_locked_map_holds_records_with_pages_of_their_own_as_views(
    tmp_path: Path, load_map: bool
) -> None:
    """With the whole map locked, a record of ``VIEW_MIN_BYTES`` or more is held as a view of
    it, not copied (together once every page is mapped); a smaller one is copied."""
    path = tmp_path / "mixed"
    sizes = [VIEW_MIN_BYTES * 4 if i % 2 else VIEW_MIN_BYTES - 200 for i in range(16)]
    with StoreWriter(path, SCHEMA) as w:
        w.append([CODEC.encode({"x": [i, i, i], "s": bytes([i]) * n}) for i, n in enumerate(sizes)])
    with SampleStore(path) as s, TierStack(s, 1 << 22, load_map=load_map) as stack:
        truth = s.get_many(range(16))
        if not s.map_locked:
            pytest.skip("this process may not lock the store's map in RAM")
        if load_map:
            wait_until(lambda: s.map_resident, what="the whole store mapped")
        index = s.value_index
        assert index is not None
        # large ones, small ones, each admitted whole; then some of a mixed batch
        for ids in (np.array([1, 3, 5, 7]), np.array([0, 2, 4, 6]), np.array([9, 8, 15, 12])):
            stack.read_elsewhere(ids, index.offsets[ids], index.lengths[ids].astype(np.int64))
        dram = stack.dram
        held = list(dram._items)
        assert sorted(held) == [*range(10), 12, 15]
        assert [bytes(dram.peek(i) or b"") for i in held] == [truth[i] for i in held]
        assert [dram.holds_view(i) for i in held] == [i % 2 == 1 for i in held]
        assert stack.dram.pinned == 6
        assert stack.get_many(np.array([15, 2, 3])) == [truth[15], truth[2], truth[3]]


@pytest.mark.parametrize("twice", [True, False])
def test_where_memory_holds_the_store_once_not_twice_small_records_are_views_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, twice: bool
) -> None:
    """A map held whole (locked, or owned where the process may not lock) keeps records of
    variable fields under a page as copies only where the memory available holds those
    copies beside the whole store; else every record is a view of the map, held once."""
    path = tmp_path / "small"
    with StoreWriter(path, SCHEMA) as w:
        w.append([CODEC.encode({"x": [i, i, i], "s": bytes([i]) * 1000}) for i in range(64)])
    with SampleStore(path) as s:
        copies = s.bytes_copied_when_held()
        assert copies == s.total_bytes  # every record under a page
        once = s.file_bytes + (copies if twice else copies // 2)
    monkeypatch.setattr("loaderd.storage.tiers.memory_available", lambda: int(once / 0.9) + 1)
    with SampleStore(path) as s, TierStack(s, 1 << 22) as stack:
        truth = s.get_many(range(64))
        assert s.map_locked or s.map_owned
        wait_until(lambda: s.map_resident, what="the whole store mapped")
        index = s.value_index
        assert index is not None
        ids = np.arange(64)
        stack.read_elsewhere(ids, index.offsets, index.lengths.astype(np.int64))
        dram = stack.dram
        assert sorted(dram._items) == list(range(64))
        assert [bytes(dram.peek(i) or b"") for i in range(64)] == truth
        assert [dram.holds_view(i) for i in range(64)] == [not twice] * 64
        assert s.bytes_copied_when_held() == (copies if twice else 0)
        assert stack.get_many(np.array([5, 63, 0])) == [truth[5], truth[63], truth[0]]


def _locking(views: object) -> list[object]:
    """A ``pin`` that holds every view (the store's map stays mapped in these tests)."""
    return [lambda: None for _ in views]  # type: ignore[attr-defined]


def test_views_locked_while_the_store_is_open_are_kept_as_where_they_lie() -> None:
    """A view whose unlock is ``still_locked`` is kept as its row of the address table, with
    no object of its own, and given back as the same bytes by every path; let go, its row
    is cleared. One of an id past the table is kept as the view it is."""
    buf = (np.arange(1 << 16) % 251).astype(np.uint8)
    whole = memoryview(buf)
    base = address_of(whole)
    views = [whole[i * 4096 : i * 4096 + 3000 - i] for i in range(5)]
    views.append(whole[5 * 4096 : 5 * 4096 + 3500])
    truth = [bytes(v) for v in views]
    c = DramCache(
        sum(map(len, views[:5])),
        pin=lambda vs: [still_locked] * len(vs),
        recency=True,
        located_ids=5,
        view_at=lambda a, n: whole[a - base : a - base + n],
    )
    assert c.put_all([0, 1, 2], views[:3], [still_locked] * 3) == []
    assert c.put(3, views[3], c.hold(views[3])) and c.put(9, views[4], c.hold(views[4]))
    assert not any(isinstance(c._items[i], memoryview) for i in range(4))
    assert isinstance(c._items[9], memoryview)  # past the table: the view itself
    assert all(c.holds_view(i) for i in (0, 1, 2, 3, 9)) and c.pinned == 5
    assert [bytes(c.peek(i) or b"") for i in range(4)] == truth[:4]
    assert [bytes(r) for r in c.get_all([3, 9, 0]) or []] == [truth[3], truth[4], truth[0]]
    assert bytes(c.get(2) or b"") == truth[2]
    assert c.used_bytes == sum(map(len, truth[:5]))
    assert bytes(c.discard(1) or b"") == truth[1]  # given back before its row is cleared
    assert c.located(np.array([1])) is None and c.pinned == 4 and 1 not in c
    assert c.used_bytes == sum(map(len, truth[:5])) - len(truth[1])
    # room for a larger sixth view takes out the least recently used: 3 (then 9, 0, 2)
    assert c.put(4, views[5], c.hold(views[5])) and 3 not in c and c.evictions == 1
    assert c.located(np.array([3])) is None and bytes(c.get(4) or b"") == truth[5]
    assert c.used_bytes == sum(len(truth[i]) for i in (0, 2, 4, 5))
    c.clear()
    assert c.used_bytes == 0 and c.pinned == 0 and c.located(np.array([2])) is None


def test_located_tells_where_views_lie_and_nothing_else() -> None:
    """Addresses for a batch of views only, counted as hits; a copy, an id let go or an id
    past the table give None and count nothing. An LRU tier's order is kept as by hits."""
    buf = np.arange(1 << 16, dtype=np.uint8) % 251
    views = [memoryview(buf)[i * 4096 : i * 4096 + 3000 - i] for i in range(4)]
    c = DramCache(1 << 20, pin=_locking, recency=False, located_ids=6)
    assert c.located(np.array([0])) is None  # nothing held yet
    assert c.put_all([0, 1, 2], views[:3], [held for _, held in c.hold_many(views[:3])]) == []
    assert c.put(3, views[3], c.hold(views[3])) and c.put(4, rec(4, 5000))
    assert c.pinned == 4
    got = c.located(np.array([3, 0, 1]))
    assert got is not None
    at, shortest = got
    assert at.dtype == np.uint64 and shortest == 2997
    assert at.tolist() == [address_of(views[i]) for i in (3, 0, 1)]
    assert c.hits == 3
    for ids in ([0, 4], [0, 6], [0, -1], []):  # a copy; past the table; none
        assert c.located(np.array(ids, np.int64)) is None
    c.discard(1)
    assert c.located(np.array([1])) is None and c.located(np.array([0, 2])) is not None
    c.clear()
    assert c.located(np.array([0])) is None and c.hits == 5
    lru = DramCache(3 * 3000, pin=_locking, located_ids=6)
    for i in range(3):
        lru.put(i, views[i])
    assert lru.located(np.array([0])) is not None  # 0 is now the most recently used
    lru.put(3, views[3])  # evicts the least recently used: 1
    assert 1 not in lru and 0 in lru and lru.located(np.array([1])) is None


FIXED = Schema((Field("image", "uint8", (2990,)), Field("label", "int64")))


def test_a_locked_map_holds_small_records_of_fixed_fields_as_views(tmp_path: Path) -> None:
    """Records under a page, of fixed fields: held as views of the locked map, not copied,
    and ``located`` gives the addresses of the store's bytes."""
    path = tmp_path / "fixed"
    codec = RecordCodec(FIXED)
    rng = np.random.default_rng(3)
    with StoreWriter(path, FIXED) as w:
        w.append(
            codec.encode({"image": rng.integers(0, 256, 2990, dtype=np.uint8), "label": i})
            for i in range(40)
        )
    with SampleStore(path) as s, TierStack(s, 1 << 22) as stack:
        truth = s.get_many(range(40))
        if not s.map_locked:
            pytest.skip("this process may not lock the store's map in RAM")
        wait_until(lambda: s.map_resident, what="the whole store mapped")
        ids = np.array([7, 3, 31, 12])
        assert stack.get_many(ids) == [truth[i] for i in ids]
        assert all(stack.dram.holds_view(i) for i in ids)
        got = stack.located(np.array([31, 7]))
        assert got is not None
        at, shortest = got
        assert shortest == len(truth[7])
        assert [ctypes.string_at(int(a), shortest) for a in at] == [truth[31], truth[7]]
        assert stack.located(np.array([31, 8])) is None  # 8 is not held


def test_tier_stack_serves_the_store_bytes_and_counts(store_path: Path) -> None:
    with SampleStore(store_path) as store:
        truth = store.get_many(range(100))
    store = SampleStore(store_path)
    stack = TierStack(store, DramCache(1 << 20))
    try:
        ids = np.array([5, 9, 5, 42])
        assert stack.get_many(ids) == [truth[i] for i in ids]
        s = stack.stats()
        # a repeated id within one call is read once, and its repeat is a hit
        assert s["cache"]["misses"] == 3 and s["cache"]["hits"] == 1
        assert s["backing"]["reads"] == 3
        assert "name" not in s["cache"] and s["tiers"][0]["name"] == "dram"

        assert stack.get_many([42, 9, 77]) == [truth[42], truth[9], truth[77]]
        s = stack.stats()
        assert (s["cache"]["hits"], s["cache"]["misses"]) == (3, 4)
        assert s["backing"]["reads"] == 4  # only 77 went to the store
        assert s["backing"]["bytes_read"] == sum(len(truth[i]) for i in (5, 9, 42, 77))
        assert s["cache"]["items"] == 4
    finally:
        stack.close()
        stack.close()  # twice is harmless


def test_tier_stack_with_a_full_cache_still_serves_everything(store_path: Path) -> None:
    with SampleStore(store_path) as store:
        truth = store.get_many(range(100))
    smallest = min(len(r) for r in truth)
    stack = TierStack(SampleStore(store_path), DramCache(smallest * 2))
    try:
        order = np.random.default_rng(1).integers(0, 100, 300)
        for lo in range(0, 300, 7):
            ids = order[lo : lo + 7]
            assert stack.get_many(ids) == [truth[i] for i in ids]
        s = stack.stats()
        assert s["cache"]["used_bytes"] <= smallest * 2
        assert s["cache"]["hits"] + s["cache"]["misses"] == 300
        assert s["backing"]["reads"] <= s["cache"]["misses"]  # repeats in a call: one read
    finally:
        stack.close()


def test_tier_stack_with_zero_capacity_reads_through(store_path: Path) -> None:
    stack = TierStack(SampleStore(store_path), DramCache(0))
    try:
        stack.get_many([1, 1, 2])
        stack.get_many([1])
        assert stack.stats()["backing"]["reads"] == 3  # the repeat within a call is read once
        assert stack.stats()["cache"]["hits"] == 0
        assert stack.stats()["cache"]["misses"] == 4
    finally:
        stack.close()


@pytest.mark.parametrize("indexed", [False, True])
def test_tier_stack_missing_id_is_a_key_error_and_admits_nothing(
    store_path: Path, indexed: bool
) -> None:
    store = SampleStore(store_path)
    if indexed:  # as after a read-ahead: the read's ranges are asked for first
        assert store.value_index is not None
    stack = TierStack(store, DramCache(1 << 20))
    try:
        with pytest.raises(KeyError):
            stack.get_many([1, 100])
        with pytest.raises(KeyError):
            stack.get_many([-1, 2])
        assert len(stack.dram) == 0
    finally:
        stack.close()


def test_locked_store_pages_follow_the_tier_under_concurrent_reads(tmp_path: Path) -> None:
    # Records large enough to be held as locked views of the store's pages (not copies);
    # admission locks them outside the stack's lock, so two threads race on it here.
    from concurrent.futures import ThreadPoolExecutor

    path, truth = big_store(tmp_path, 40, 40)
    store = SampleStore(path)
    stack = TierStack(store, len(truth[0]) * 5)  # room for five: evictions unlock pages
    try:
        rng = np.random.default_rng(3)
        batches = [rng.integers(0, 40, 6) for _ in range(60)]
        with ThreadPoolExecutor(2) as ex:
            got = list(ex.map(stack.get_many, batches))
        assert got == [[truth[i] for i in b] for b in batches]
        dram = stack.dram
        assert len(dram) <= 5
        page = mmap.PAGESIZE
        pages = -(-(len(truth[0]) + 16) // page) * page
        assert store.locked_bytes == dram.pinned * pages  # nothing locked and forgotten
        if store.locked_bytes:  # locking allowed here: the records are the store's own pages
            assert dram.pinned == len(dram)
        dram.clear()
        assert store.locked_bytes == 0 and dram.pinned == 0
    finally:
        stack.close()


def test_admission_queue_admits_after_the_read_and_locks_nothing_it_forgets(
    tmp_path: Path,
) -> None:
    # Records large enough to be held as locked views: the queue's worker locks them after
    # the read returned; a second read is then served from DRAM without touching the store.
    path, truth = big_store(tmp_path, 40, 40)
    store = SampleStore(path)
    # Room for every record, not for the whole file: records are locked one by one.
    stack = TierStack(store, store.file_bytes - 1, admit_queue_bytes=8 << 20)
    assert not store.map_locked
    try:
        ids = np.arange(40)
        assert stack.get_many(ids) == truth  # served from the views it was read from
        assert stack.settle()
        s = stack.stats()
        assert s["tiers"][0]["admitted_late"] == 40 and s["tiers"][0]["admit_queue_bytes"] == 0
        reads = s["backing"]["reads"]
        assert stack.get_many(ids[::-1]) == truth[::-1]
        s = stack.stats()
        assert s["backing"]["reads"] == reads and s["tiers"][0]["hits"] == 40
        page = mmap.PAGESIZE
        pages = -(-(len(truth[0]) + 16) // page) * page
        assert store.locked_bytes == stack.dram.pinned * pages
    finally:
        stack.close()
    assert store.locked_bytes == 0


def test_records_read_again_before_their_admission_are_locked_once(tmp_path: Path) -> None:
    path, truth = big_store(tmp_path, 40, 40)
    store = SampleStore(path)
    stack = TierStack(store, store.file_bytes - 1, admit_queue_bytes=64 << 20)
    try:
        for ids in (np.arange(20), np.arange(10, 40), np.arange(40)[::-1]):
            assert stack.get_many(ids) == [truth[i] for i in ids]
        assert stack.settle()
        page = mmap.PAGESIZE
        pages = -(-(len(truth[0]) + 16) // page) * page
        assert len(stack.dram) == 40 and store.locked_bytes == stack.dram.pinned * pages
    finally:
        stack.close()
    assert store.locked_bytes == 0


def test_a_dram_tier_that_holds_the_whole_store_locks_its_map_once(tmp_path: Path) -> None:
    path, truth = big_store(tmp_path, 40, 40)
    store = SampleStore(path)
    stack = TierStack(store, store.file_bytes, admit_queue_bytes=8 << 20)
    try:
        if not store.map_locked:
            pytest.skip("this process may not lock the store's map (RLIMIT_MEMLOCK)")
        ids = np.arange(40)
        assert stack.get_many(ids) == truth
        assert stack.settle()
        reads = stack.stats()["backing"]["reads"]
        assert stack.get_many(ids[::-1]) == truth[::-1]
        dram = stack.stats()["tiers"][0]
        assert stack.stats()["backing"]["reads"] == reads and dram["hits"] == 40
        # Held as views of the locked map: no lock of their own.
        assert dram["pinned"] == 40 and dram["map_locked"] and dram["locked_bytes"] == 0
    finally:
        stack.close()


def test_a_full_admission_queue_drops_and_the_policy_forgets(tmp_path: Path) -> None:
    # Records large enough to be locked go through the queue (smaller ones are copied inline).
    path, truth = big_store(tmp_path, 100, 20)
    # A bound below one record: one admission at a time, the rest of a read's are dropped.
    # (Not a map loaded whole: its records are admitted by the read, never queued.)
    stack = TierStack(SampleStore(path), DramCache(8 << 20), admit_queue_bytes=1, load_map=False)
    try:
        ids = np.arange(100)
        assert stack.get_many(ids) == truth
        assert stack.settle()
        s = stack.stats()
        dram = s["tiers"][0]
        assert dram["admit_dropped"] >= 1
        assert dram["admit_dropped"] + dram["admitted_late"] == 100
        assert dram["items"] == len(stack.dram) == dram["admitted_late"]  # policy == tier
        for _ in range(200):  # every read admits a few more; none is served wrong meanwhile
            assert stack.get_many(ids) == truth
            stack.settle()
            if len(stack.dram) == 100:
                break
        assert len(stack.dram) == 100
    finally:
        stack.close()


def test_closing_with_admissions_queued_unlocks_everything(tmp_path: Path) -> None:
    path, _ = big_store(tmp_path, 60, 40)
    store = SampleStore(path)
    stack = TierStack(store, 64 << 20, admit_queue_bytes=64 << 20)
    for lo in range(0, 60, 6):
        stack.get_many(range(lo, lo + 6))
    stack.close()  # the worker stops before the store's map goes away
    assert store.locked_bytes == 0


def test_resident_serves_a_batch_only_when_dram_holds_all_of_it(store_path: Path) -> None:
    with SampleStore(store_path) as store:
        truth = store.get_many(range(100))
    stack = TierStack(SampleStore(store_path), DramCache(1 << 20))
    try:
        stack.get_many([1, 2, 3])
        before = stack.stats()
        assert stack.resident(np.array([1, 2, 4])) is None  # 4 is in the store only
        assert stack.stats()["cache"] == before["cache"]  # nothing counted or touched
        got = stack.resident(np.array([3, 1, 3]))
        assert got is not None and [bytes(r) for r in got] == [truth[3], truth[1], truth[3]]
        s = stack.stats()
        assert s["cache"]["hits"] == before["cache"]["hits"] + 3
        assert s["cache"]["misses"] == before["cache"]["misses"]
        assert s["backing"]["reads"] == before["backing"]["reads"]  # no store read
    finally:
        stack.close()


@pytest.mark.parametrize("policy", ["importance", "lru", "static"])
def test_batch_answers_follow_the_policy_across_tiers(
    store_path: Path, tmp_path: Path, policy: str
) -> None:
    # ``cached`` and ``resident`` answer for a whole batch at once: after admissions,
    # evictions, promotions and demotions between DRAM and the arena, and forgets, they say
    # what the per-id bookkeeping says, and ``resident`` serves exactly DRAM's records.
    with SampleStore(store_path) as store:
        truth = store.get_many(range(100))
        one = len(truth[50])
    rng = np.random.default_rng(3)
    arena = Arena(tmp_path / "arena", 256 << 10, bytes(range(16)))
    stack = TierStack(SampleStore(store_path), one * 8, arena, policy=policy)
    ids = np.arange(100)
    try:
        for step in range(40):
            if step % 10 == 5:
                stack.place(rng.permutation(100)[:40])
            elif step % 10 == 9:
                with stack._lock:  # as when the arena loses records (its ring, a bad checksum)
                    for sid in rng.permutation(100)[:3].tolist():
                        if stack.policy.lookup(sid) == 1:
                            stack.policy.forget(sid)
            else:
                stack.get_many(rng.permutation(100)[:12])
            stack.flush()
            where = [stack.policy.lookup(i) for i in range(100)]
            assert stack.cached(ids).tolist() == [t is not None for t in where]
            in_dram = [i for i in range(100) if where[i] == 0]
            assert stack.dram.stats()["items"] >= len(in_dram)
            for batch in (
                in_dram,
                in_dram[::-1][:5],
                [*in_dram[:3], *(i for i in range(100) if where[i] != 0)][:6],
            ):
                got = stack.resident(np.array(batch, np.int64))
                if batch and all(where[i] == 0 for i in batch):
                    assert got is not None and [bytes(r) for r in got] == [truth[i] for i in batch]
                else:
                    assert got is None
        # Where the policy keeps DRAM within its capacity, the tier's own bound never has to
        # evict, so the LRU order the tier then does not keep (``recency``) decides nothing.
        assert stack.dram.recency == stack.policy.overfills_dram == (policy == "lru")
        assert stack.dram.evictions == 0 or stack.dram.recency
        moved = stack.policy.stats(0)
        if policy != "static":
            assert moved["evictions"] + moved["demotions"] + moved["promotions"] > 0
    finally:
        stack.close()


def test_get_all_takes_every_record_or_none_and_marks_them_in_order() -> None:
    c = DramCache(50)
    for i in range(5):
        c.put(i, rec(i))
    assert c.get_all([]) == [] and c.hits == 0
    assert c.get_all([2, 9]) is None and c.get_all([9]) is None and c.hits == 0
    assert c.get_all([0]) == [rec(0)] and c.hits == 1
    assert c.get_all([3, 1, 3]) == [rec(3), rec(1), rec(3)] and c.hits == 4
    assert list(c._items) == [2, 4, 0, 1, 3]  # as one get per id: 3's last use is the latest
    c.put(5, rec(5))
    assert 2 not in c and c.evictions == 1


def test_without_recency_hits_leave_the_order_and_the_oldest_admitted_goes_first() -> None:
    c = DramCache(30, recency=False)
    for i in range(3):
        c.put(i, rec(i))
    assert c.get(0) == rec(0) and c.get_all([1, 0]) == [rec(1), rec(0)] and c.hits == 3
    c.put(3, rec(3))
    assert 0 not in c and list(c._items) == [1, 2, 3]


def test_admissions_that_copy_yield_the_cpu_and_those_that_lock_do_not(tmp_path: Path) -> None:
    # A copy into fresh memory is background work that took a core from serving (admission.py).
    path, truth = big_store(tmp_path, 40, 40)
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for lock_pages in (False, True):
        store = SampleStore(path)
        stack = TierStack(
            store, store.file_bytes - 1, admit_queue_bytes=8 << 20, lock_pages=lock_pages
        )
        try:
            assert stack.get_many(np.arange(40)) == truth
            assert stack.settle() and len(stack.dram) == 40
            copied = stack.dram.pinned < 40  # locking refused (RLIMIT_MEMLOCK) copies too
            assert copied or lock_pages
            niced = min(19, here + BACKGROUND_NICE) if copied else here
            assert stack._admissions is not None and stack._admissions.niceness == niced
            assert stack.get_many(np.arange(40)) == truth  # served from DRAM all the same
            assert stack.stats()["tiers"][0]["hits"] == 40
        finally:
            stack.close()
