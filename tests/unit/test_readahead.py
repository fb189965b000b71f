"""The read path's parts on a real LMDB store: value index, read-ahead window, locked views."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from loaderd.planner import RankPlan, plan_pass
from loaderd.readahead import ReadAhead
from loaderd.storage import syscalls, value_index
from loaderd.storage.dram import DramCache
from loaderd.storage.errors import CorruptRecordError
from loaderd.storage.prefault import Prefault
from loaderd.storage.records import Field, RecordCodec, Schema
from loaderd.storage.store import ADVISE_GAP, PIN_MIN_BYTES, READ_UNIT, SampleStore
from loaderd.storage.store_writer import StoreWriter
from loaderd.storage.tiers import TierStack
from loaderd.storage.value_index import block_ranges, build_value_index
from tests.helpers import damage_value_length, evict, point_value_at, wait_until

N = 200
SIZES = (3_000, 40_000)  # a value under a page, and one of many pages


def make_store(path: Path, n: int = N, seed: int = 0) -> Path:
    """Samples of two sizes, alternating, with a variable-length tag."""
    schema = Schema((Field("blob", "binary"), Field("label", "int64")))
    codec = RecordCodec(schema)
    rng = np.random.default_rng(seed)
    with StoreWriter(path, schema) as w:
        w.append(codec.encode({"blob": rng.bytes(SIZES[i % 2] + i), "label": i}) for i in range(n))
    return path


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_store(tmp_path_factory.mktemp("ra") / "s.db")


def test_value_index_points_at_every_record(store_path: Path) -> None:
    with SampleStore(store_path) as store:
        index = store.value_index
        assert index is not None and len(index) == N
        fd = os.open(store_path / "data.mdb", os.O_RDONLY)
        try:
            for sid in range(N):
                rec = store.get(sid)
                assert index.lengths[sid] == len(rec)
                assert os.pread(fd, len(rec), int(index.offsets[sid])) == rec
        finally:
            os.close(fd)
        assert index.nbytes(np.arange(N)) == store.total_bytes


def test_value_index_keeps_the_pages_every_lookup_reads(store_path: Path) -> None:
    """The meta pages, the branch pages and the leaves of pointers of the samples tree."""
    with SampleStore(store_path) as store:
        index = store.value_index
        assert index is not None
        psize = index.page_bytes
        assert list(index.inner_pages[:2]) == [0, 1]
        kinds = {}
        with open(store_path / "data.mdb", "rb") as f:
            for pgno in [*index.inner_pages[2:].tolist(), *index.leaf_pages.tolist()]:
                page = os.pread(f.fileno(), psize, pgno * psize)
                assert int.from_bytes(page[:8], "little") == pgno
                kinds[pgno] = int.from_bytes(page[10:12], "little") & 0x03
        assert all(kinds[p] == 0x01 for p in index.inner_pages[2:].tolist())  # branches
        # Its values have pages of their own: the leaves hold pointers, and 200 need several.
        assert all(kinds[p] == 0x02 for p in index.leaf_pages.tolist())
        assert 1 < len(index.leaf_pages) < N // 20


def test_leaves_that_hold_records_are_not_tree_pages(tmp_path: Path) -> None:
    """A record's advice reads the leaf it lies in: the tree adds only the branch pages."""
    schema = Schema((Field("blob", "binary"), Field("label", "int64")))
    codec = RecordCodec(schema)
    with StoreWriter(tmp_path / "s.db", schema) as w:
        w.append(codec.encode({"blob": bytes(100), "label": i}) for i in range(3000))
    with SampleStore(tmp_path / "s.db") as store:
        index = store.value_index
        assert index is not None
        psize = index.page_bytes
        holding = set((index.offsets // psize).tolist())  # the leaves the records lie in
        assert len(holding) > 10
        assert not len(index.leaf_pages)
        assert not holding & set(index.inner_pages.tolist())
        assert 2 < len(index.inner_pages) < 2 + len(holding) // 10  # meta, root, a few branches


def test_the_walk_reads_a_level_a_part_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leaves of a store of small records hold the records: the walk reads them a part at
    a time, never the whole level (a store of 1 KB records was held whole in memory)."""
    schema = Schema((Field("blob", "binary"), Field("label", "int64")))
    codec = RecordCodec(schema)
    rng = np.random.default_rng(5)
    with StoreWriter(tmp_path / "s.db", schema) as w:
        w.append(codec.encode({"blob": rng.bytes(1000), "label": i}) for i in range(3000))
    asked: list[int] = []
    read_pages = value_index._Walker._read_pages

    def counted(walker: value_index._Walker, pgnos: list[int]) -> list[bytes]:
        asked.append(len(pgnos))
        return read_pages(walker, pgnos)

    monkeypatch.setattr(value_index._Walker, "_read_pages", counted)
    index = build_value_index(tmp_path / "s.db" / "data.mdb", b"samples", 3000)
    assert index is not None
    assert max(asked) == value_index._PAGES_AT_ONCE < sum(asked) // 3  # 1,000 leaves or so
    with SampleStore(tmp_path / "s.db") as store, open(tmp_path / "s.db" / "data.mdb", "rb") as f:
        for sid in rng.choice(3000, 50, replace=False).tolist():
            rec = store.get(sid)
            assert os.pread(f.fileno(), len(rec), int(index.offsets[sid])) == rec


def test_leaves_of_pointers_are_asked_for_only_within_their_share(tmp_path: Path) -> None:
    """A store of 10 M large records has ~250 MB of them: past the read-ahead's quarter of
    its window they are left to the readers; the meta and branch pages never are."""
    with SampleStore(make_store(tmp_path / "s.db", 1000)) as store:
        index = store.value_index
        assert index is not None and len(index.leaf_pages) > 2
        leaves = len(index.leaf_pages) * index.page_bytes
        assert store.advise_tree(leaves - 1) == len(index.inner_pages)
        assert store.advise_tree(leaves) == len(index.inner_pages) + len(index.leaf_pages)


def test_a_new_pass_asks_for_the_tree_pages_before_its_records(tmp_path: Path) -> None:
    """Its readers look each record up through those pages: a cold one would be read on its
    own, behind the window. Here every record is cached, so only the tree is asked for."""
    plan = plan_pass(
        np.arange(1000), np.ones(1000, np.float32), seed=0, epoch=0, phase="train",
        world_size=1, batch_size=8,
    )[0]  # fmt: skip
    path = make_store(tmp_path / "s.db", 1000)  # no lookup has mapped most of its leaves
    with SampleStore(path) as store:
        index = store.value_index
        assert index is not None
        ra = ReadAhead(store, lambda ids: np.ones(len(ids), bool), 1 << 30)
        try:
            evict(path)  # but the pages this process maps (the meta pages, the root)
            tree = np.union1d(index.inner_pages, index.leaf_pages)
            cold = tree[~file_cached(path)[tree]]
            if len(cold) < 3:
                pytest.skip("the page cache cannot be emptied here")
            ra.follow(("j", 0, 0, "train"), plan, 0)
            wait_until(lambda: file_cached(path)[cold].all(), what="the tree's pages")
            assert ra.stats()["tree_pages"] == len(tree)
            assert ra.stats()["advised_records"] == 0
            ra.follow(("j", 0, 0, "train"), plan, 2)  # the same pass moving asks nothing again
            ra.follow(("j", 0, 1, "train"), plan, 0)  # the next pass asks again
            wait_until(lambda: ra.stats()["tree_pages"] == 2 * len(tree), what="2")
        finally:
            ra.close()


def test_value_index_of_a_damaged_file_is_none(tmp_path: Path) -> None:
    bad = tmp_path / "data.mdb"
    bad.write_bytes(b"\0" * 8192)
    assert build_value_index(bad, b"samples", 10) is None
    src = make_store(tmp_path / "s.db", n=20)
    # A store claiming more samples than its tree holds has no index (ids would be missing).
    assert build_value_index(src / "data.mdb", b"samples", 21) is None
    assert build_value_index(src / "data.mdb", b"other", 20) is None


def test_a_record_running_past_the_file_is_refused_before_lmdb_reads_it(tmp_path: Path) -> None:
    db = make_store(tmp_path / "s.db", n=20)
    damage_value_length(db, 3)  # odd ids are 40 KB: overflow pages of their own
    index = build_value_index(db / "data.mdb", b"samples", 20)
    assert index is not None, "one damaged node leaves the rest of the index"
    assert index.damaged.tolist() == [3] and index.lengths[3] == 0
    assert index.first_damaged(np.array([5, 3, 1])) == 3
    assert index.first_damaged(np.array([5, 1])) is None
    # Reading it through LMDB is a SIGBUS: the store must refuse it first (in a child, so
    # that a regression fails this test rather than kills the run).
    script = f"""
import numpy as np
from loaderd.storage.errors import CorruptRecordError
from loaderd.storage.store import SampleStore
with SampleStore({str(db)!r}) as store:
    with store.views([2, 4, 5]) as views:
        assert len(views) == 3
    assert store.sliceable_spans(np.array([2, 4, 5])) is not None
    assert store.sliceable_spans(np.array([2, 3])) is None  # nor is it sent to a worker
    try:
        with store.views([2, 3]):
            pass
    except CorruptRecordError as e:
        print(e, store.corrupt)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sample 3" in done.stdout and "past the end of data.mdb" in done.stdout
    assert done.stdout.split()[-1] == "1"  # counted as corrupt


def test_another_samples_record_reached_through_a_damaged_leaf_is_refused(
    tmp_path: Path,
) -> None:
    schema = Schema((Field("blob", "binary"), Field("label", "int64")))
    codec, rng = RecordCodec(schema), np.random.default_rng(0)
    db = tmp_path / "s.db"
    with StoreWriter(db, schema) as w:  # records of one length, as images of one size
        w.append(codec.encode({"blob": rng.bytes(40_000), "label": i}) for i in range(20))
    with SampleStore(db) as store:
        wanted = store.get(5)
    point_value_at(db, 3, 5)  # LMDB now returns sample 5's record, whole and valid, for 3
    with SampleStore(db) as store:
        assert store.get(5) == wanted
        for _ in range(2):  # through LMDB, then (confirmed) as a slice of the map
            with pytest.raises(CorruptRecordError, match="sample 3: checksum mismatch"):
                store.get(3)
            assert store.value_index is not None
        assert store.corrupt == 2


def test_ranges_cover_every_record_once_in_file_order(store_path: Path) -> None:
    with SampleStore(store_path) as store:
        index = store.value_index
        assert index is not None
        page = os.sysconf("SC_PAGE_SIZE")
        rng = np.random.default_rng(1)
        for ids in (np.arange(N), rng.permutation(N)[:40], rng.integers(0, N, 60), np.arange(1)):
            starts, lengths = index.ranges(ids, ADVISE_GAP, page)
            ends = starts + lengths
            assert (starts % page == 0).all() and (lengths % page == 0).all()
            assert (np.diff(starts) > 0).all() and (starts[1:] > ends[:-1] + ADVISE_GAP).all()
            where = np.searchsorted(starts, index.offsets[ids], side="right") - 1
            assert (where >= 0).all()  # every record lies inside one range
            assert (index.offsets[ids] + index.lengths[ids] <= ends[where]).all()
            assert store.advise_bytes(ids) == int(lengths.sum())
        # Records stored in a row are one range; with no gap allowed, only touching pages join.
        assert len(index.ranges(np.arange(N), ADVISE_GAP, page)[0]) == 1
        assert len(index.ranges(np.arange(0, N, 8), 0, 1)[0]) == len(range(0, N, 8))


def test_a_run_of_records_is_advised_in_one_call_and_read_exact(
    store_path: Path, tmp_path: Path
) -> None:
    codec = RecordCodec(Schema((Field("blob", "binary"), Field("label", "int64"))))
    rng = np.random.default_rng(0)  # make_store's draws, in its order
    want = [rng.bytes(SIZES[i % 2] + i) for i in range(N)]
    evict(store_path)  # cold: pages the page cache holds are not advised (residency.py)
    with SampleStore(store_path) as store:
        run = np.arange(40, 104)  # 64 records stored one after the other
        plan = RankPlan(run, np.ones(len(run), np.float32), np.array([0, len(run)]))
        ra = ReadAhead(store, lambda ids: np.zeros(len(ids), bool), 1 << 30)
        try:
            ra.follow(("run", 0, 0, "train"), plan, 0)
            wait_until(lambda: ra.stats()["advised_records"] == len(run), what="the run")
            s = ra.stats()
            assert s["advise_calls"] == 1
            assert s["advised_bytes"] == store.value_index.nbytes(run)  # type: ignore[union-attr]
            assert s["window_bytes"] == store.advise_bytes(run) <= s["budget_bytes"]
        finally:
            ra.close()
        with TierStack(store, 0) as tiers:  # the serving path's read, advised in one call too
            where = f"store {store_path}"
            got = [
                codec.decode(r, int(i), where)
                for r, i in zip(tiers.get_many(run), run, strict=True)
            ]
        assert [g["blob"] for g in got] == [want[i] for i in run]
        assert [g["label"] for g in got] == run.tolist()


def test_blocks_are_the_aligned_blocks_each_record_touches(store_path: Path) -> None:
    with SampleStore(store_path) as store:
        index = store.value_index
        assert index is not None
        assert store.read_unit == 0  # records of 21 KB on average: each read on its own
        rng = np.random.default_rng(2)
        for unit in (4096, 8192, READ_UNIT):  # 40 KB records span several 4-8 KiB blocks
            ends = index.offsets + index.lengths.astype(np.int64) - 1
            within = np.flatnonzero(index.offsets // unit == ends // unit)  # in one block each
            assert len(within) > 5 or unit < READ_UNIT
            cases = (np.arange(N), rng.permutation(N)[:30], rng.integers(0, N, 50), within)
            for ids in cases:
                spans = zip(index.offsets[ids].tolist(), index.lengths[ids].tolist(), strict=True)
                want = {b for o, n in spans for b in range(o // unit, (o + n - 1) // unit + 1)}
                assert index.blocks(ids, unit).tolist() == sorted(want)
    starts, lengths = block_ranges(np.array([1, 2, 3, 7, 9, 10]), 8)  # adjacent ones joined
    assert (starts.tolist(), lengths.tolist()) == ([8, 56, 72], [24, 8, 16])


def make_small_store(path: Path, n: int) -> Path:
    """Records of 2-3 KB: a pass over them is read ahead in blocks."""
    schema = Schema((Field("blob", "binary"), Field("label", "int64")))
    codec = RecordCodec(schema)
    rng = np.random.default_rng(3)
    with StoreWriter(path, schema) as w:
        w.append(
            codec.encode({"blob": rng.bytes(2000 + 7 * i % 1000), "label": i}) for i in range(n)
        )
    return path


def file_cached(db: Path) -> np.ndarray:
    """Per page of a store's data.mdb: is it in the page cache (a map of it, never touched)."""
    with open(db / "data.mdb", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, np.uint8)
        try:
            return cached_pages(view.ctypes.data, len(m) // mmap.PAGESIZE * mmap.PAGESIZE)
        finally:
            del view


def test_small_records_are_read_ahead_in_blocks_each_once_a_pass(tmp_path: Path) -> None:
    n = 1500
    path = make_small_store(tmp_path / "s.db", n)
    evict(path)
    if file_cached(path).any():
        pytest.skip("the page cache cannot be emptied here")
    no_cache = lambda ids: np.zeros(len(ids), bool)  # noqa: E731
    plan = plan_pass(
        np.arange(n), np.ones(n, np.float32), seed=0, epoch=0, phase="train",
        world_size=1, batch_size=4,
    )[0]  # fmt: skip
    with SampleStore(path) as store:  # a whole pass, cold
        assert store.read_unit == READ_UNIT and store.value_index is not None
        index = store.value_index
        blocks = index.blocks(np.arange(n), READ_UNIT)
        ra = ReadAhead(store, no_cache, 1 << 30)
        try:
            ra.follow(("j", 0, 0, "train"), plan, 0)
            wait_until(lambda: ra.stats()["advised_records"] == n, what="the whole pass")
            s = ra.stats()
            assert s["read_unit_bytes"] == READ_UNIT
            # Every block once, runs of adjacent ones in one call: per record, ~15x as many.
            assert 0 < s["advise_calls"] <= len(blocks) < n / 10
            assert s["window_bytes"] == s["peak_window_bytes"] <= len(blocks) * READ_UNIT
        finally:
            ra.close()
        page = mmap.PAGESIZE
        first = index.offsets // page
        last = (index.offsets + index.lengths.astype(np.int64) - 1) // page
        wait_until(
            lambda: all(
                file_cached(path)[a : b + 1].all() for a, b in zip(first, last, strict=True)
            ),
            what="every record read by its block's advice",
        )
    evict(path)
    with SampleStore(path) as store:  # a window of two thirds of the file's blocks
        budget = len(blocks) * 2 // 3 * READ_UNIT  # a batch's 4 records lie in 4 or fewer
        ra = ReadAhead(store, no_cache, budget)
        try:
            ra.follow(("j", 0, 1, "train"), plan, 0)
            wait_until(lambda: not ra.busy and ra.stats()["window_bytes"] > 0, what="a window")
            s = ra.stats()
            assert 0 < s["window_bytes"] <= budget and s["window_bytes"] % READ_UNIT == 0
            assert s["advised_records"] < n  # the budget holds it back
        finally:
            ra.close()


def test_records_read_before_their_advice_do_not_say_the_store_is_cached(tmp_path: Path) -> None:
    """At a pass's start the workers read its first batches while the read-ahead begins, so
    the read-ahead finds those pages cached. Taken as a sign that the store is cached, they
    had the next batches of a cold store go unadvised, read one fault at a time."""
    path = make_store(tmp_path / "s.db", 400)
    batches = np.arange(400).reshape(-1, 8)
    with SampleStore(path) as store:
        assert store.value_index is not None and store.prefaulting  # the probe is on
        evict(path)
        if file_cached(path)[1 + int(store.value_index.offsets[-1]) // mmap.PAGESIZE]:
            pytest.skip("the page cache cannot be emptied here")
        for ids in batches[:4]:  # a reader first: advised as it reads
            store.advise_known(ids)
            with store.views(ids.tolist()) as views:
                assert all(len(v) for v in views)
        for ids in batches[:4]:  # then the read-ahead: cached pages
            store.advise(ids)
        for ids in batches[4:8]:  # cold batches the read-ahead comes to first: each asked for
            assert store.advise(ids)[1] > 0
        assert store.advice_skipped == 0


def test_readahead_window_holds_its_budget_and_follows_the_pass(store_path: Path) -> None:
    with SampleStore(store_path) as store:
        budget = 500_000  # two batches of 8 samples (~210 KB each)
        plan = plan_pass(
            np.arange(N), np.ones(N, np.float32), seed=0, epoch=0, phase="train",
            world_size=1, batch_size=8,
        )[0]  # fmt: skip
        ra = ReadAhead(store, lambda ids: np.zeros(len(ids), bool), budget)
        try:
            store.prefault(np.arange(1))  # locates the map (record 0's pages)
            address, length = map_of(store_path / "data.mdb")
            evict(store_path)  # what stays cached is what this process has mapped
            opened = mapped_pages(address, length)
            if (cached_pages(address, length) & ~opened).any():
                pytest.skip("the page cache cannot be emptied here")
            ra.follow(("j", 0, 0, "train"), plan, 0)
            wait_until(lambda: not ra.busy and ra.stats()["window_bytes"] > 0, what="a window")
            first = ra.stats()
            assert 0 < first["window_bytes"] <= budget and first["peak_window_bytes"] <= budget
            # The window is read and mapped ahead of its reader, and nothing beyond it.
            assert first["prefaulted_records"] == first["advised_records"] > 0
            mapped = mapped_pages(address, length) & ~opened
            assert not (mapped & ~cached_pages(address, length)).any()  # maps, never reads
            # The kernel may read a range's neighbouring page with it (whole folios).
            slack = first["advise_calls"] * mmap.PAGESIZE
            assert 0 < mapped.sum() * mmap.PAGESIZE <= first["window_bytes"] + slack
            # The pass does not move: nothing more is read, however long we look.
            assert ra.stats()["advised_bytes"] == first["advised_bytes"]
            ra.follow(("j", 0, 0, "train"), plan, 3)  # three batches handed out
            wait_until(lambda: ra.stats()["advised_bytes"] > first["advised_bytes"], what="more")
            wait_until(lambda: not ra.busy, what="idle")
            s = ra.stats()
            assert s["peak_window_bytes"] <= budget
            handed = sum(store.value_index.nbytes(plan.batch(i)[0]) for i in range(3))  # type: ignore[union-attr]
            assert s["advised_bytes"] <= handed + budget
            ra.drop(lambda key: key[0] == "j")
            assert ra.stats()["streams"] == 0 and ra.stats()["window_bytes"] == 0
        finally:
            ra.close()
            ra.close()


def test_cached_samples_are_not_read_ahead(store_path: Path) -> None:
    with SampleStore(store_path) as store:
        plan = plan_pass(
            np.arange(N), np.ones(N, np.float32), seed=0, epoch=0, phase="train",
            world_size=1, batch_size=8,
        )[0]  # fmt: skip
        ra = ReadAhead(store, lambda ids: np.ones(len(ids), bool), 1 << 30)
        try:
            ra.follow("k", plan, 0)  # type: ignore[arg-type]
            wait_until(lambda: not ra.busy and ra.stats()["streams"] == 1, what="a pass")
            # Passed over at once, taking no room: the window stays free for uncached passes.
            wait_until(
                lambda: ra.stats()["cached_batches"] == plan.num_batches, what="the whole pass"
            )
            assert ra.stats()["advised_records"] == 0 and ra.stats()["window_bytes"] == 0
        finally:
            ra.close()


def test_nothing_is_read_ahead_while_the_store_streams_in_whole(store_path: Path) -> None:
    loaded = threading.Event()
    asked: list[bool] = []

    def paused() -> bool:
        asked.append(not loaded.is_set())
        return asked[-1]

    with SampleStore(store_path) as store:
        plan = plan_pass(
            np.arange(N), np.ones(N, np.float32), seed=0, epoch=0, phase="train",
            world_size=1, batch_size=8,
        )[0]  # fmt: skip
        ra = ReadAhead(store, lambda ids: np.zeros(len(ids), bool), 1 << 30, paused=paused)
        try:
            ra.follow("k", plan, 0)  # type: ignore[arg-type]
            # It has looked whether it may go on (at once, then once a second): nothing advised.
            wait_until(lambda: asked.count(True) >= 2, what="the read-ahead asking")
            assert ra.stats()["advised_records"] == 0 and ra.stats()["window_bytes"] == 0
            loaded.set()  # the load is done: the pass is read ahead as before
            wait_until(lambda: ra.stats()["advised_records"] > 0, what="advice after the load")
        finally:
            ra.close()


def map_of(path: Path) -> tuple[int, int]:
    """Address and length of this process's one map of ``path`` (``/proc/self/maps``).

    A lock of part of it splits it into adjacent mappings: they are joined here.
    """
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == str(path.resolve()):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                found.append((lo, hi))
    assert found and all(a[1] == b[0] for a, b in pairwise(found)), found
    return found[0][0], found[-1][1] - found[0][0]


def mapped_pages(address: int, length: int) -> np.ndarray:
    """Per page of the range: is it mapped in this process (``/proc/self/pagemap``)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // mmap.PAGESIZE * 8)
        raw = f.read(length // mmap.PAGESIZE * 8)
    return (np.frombuffer(raw, np.uint64) >> np.uint64(63)).astype(bool)


def cached_pages(address: int, length: int) -> np.ndarray:
    """Per page of the range: is it in the page cache (``mincore``)."""
    vec = (ctypes.c_ubyte * (length // mmap.PAGESIZE))()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) == 0
    return (np.frombuffer(vec, np.uint8) & 1).astype(bool)


def pages_of(store: SampleStore, ids: np.ndarray, pages: int) -> np.ndarray:
    """Per page of data.mdb: does ``advise(ids)`` cover it."""
    assert store.value_index is not None
    out = np.zeros(pages, bool)
    starts, lengths = store.value_index.ranges(ids, ADVISE_GAP, mmap.PAGESIZE)
    for off, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        out[off // mmap.PAGESIZE : (off + n) // mmap.PAGESIZE] = True
    return out


@pytest.mark.parametrize("many", [True, False], ids=["one call", "a call each"])
def test_prefault_is_switched_off_where_the_kernel_refuses_a_range(
    monkeypatch: pytest.MonkeyPatch, many: bool
) -> None:
    monkeypatch.setattr(syscalls._self, "usable", many)
    region = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    region.close()  # unmapped: no map there to populate
    pages = Prefault(address, 4 * mmap.PAGESIZE)
    assert pages.populate(np.array([0, 2 * mmap.PAGESIZE]), np.array([mmap.PAGESIZE] * 2)) >= 1
    assert not pages.enabled
    assert pages.populate(np.array([0]), np.array([mmap.PAGESIZE])) == 0  # not asked again


@pytest.mark.parametrize("many", [True, False], ids=["one call", "a call each"])
def test_populate_read_maps_every_range_past_what_one_call_takes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, many: bool
) -> None:
    monkeypatch.setattr(syscalls._self, "usable", many)
    pages = 2 * syscalls._IOV_MAX + 100
    path = tmp_path / "f"
    path.write_bytes(os.urandom(pages * mmap.PAGESIZE))
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        view = memoryview(region)
        address = syscalls.address_of(view)
        length = pages * mmap.PAGESIZE
        assert not mapped_pages(address, length).any()  # a fresh map: the test can fail
        every_other = np.arange(0, pages, 2, dtype=np.int64)  # more ranges than one call takes
        calls, err = syscalls.populate_read(
            address + every_other * mmap.PAGESIZE, np.full(len(every_other), mmap.PAGESIZE)
        )
        assert err == 0
        if many and not syscalls._self.usable:
            pytest.skip("this kernel takes one range a call (process_madvise before 6.13)")
        assert calls == (-(-len(every_other) // syscalls._IOV_MAX) if many else len(every_other))
        assert mapped_pages(address, length)[every_other].all()
        view.release()
    finally:
        region.close()


def test_prefault_maps_exactly_the_pages_of_the_advised_records(tmp_path: Path) -> None:
    path = make_store(tmp_path / "s.db")
    with SampleStore(path) as store:
        order = np.random.default_rng(5).permutation(N)
        first, ids = order[:8], order[8:40]
        store.advise(first)
        assert store.prefault(first)[0] == len(first)  # locates the map: reads record 0
        address, length = map_of(path / "data.mdb")
        evict(path)  # what stays cached is what this process has mapped
        before = mapped_pages(address, length)
        if (cached_pages(address, length) & ~before).any():
            pytest.skip("the page cache cannot be emptied here")
        want = pages_of(store, ids, len(before))
        assert (want & ~before).sum() > 10  # pages to map: the test can fail
        store.advise(ids)
        assert (mapped_pages(address, length) == before).all()  # advice reads, maps nothing
        assert store.prefault(ids)[0] == len(ids)
        after = mapped_pages(address, length)
        assert store.prefault(ids) == (0, 0)  # mapped already: not asked for again
        assert after[want].all()  # every page of every record
        assert not (after & ~before & ~want).any()  # and nothing else
        with store.views(ids) as views:  # verified: the store's bytes
            fd = os.open(path / "data.mdb", os.O_RDONLY)
            try:
                index = store.value_index
                assert index is not None
                for sid, view in zip(ids.tolist(), views, strict=True):
                    assert bytes(view) == os.pread(fd, view.nbytes, int(index.offsets[sid]))
            finally:
                os.close(fd)


def _locked_kib(path: Path) -> int:
    """KiB of this process's mappings of ``path`` that the kernel holds locked in RAM."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split(" ", 1)[0]:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Locked:"):
            total += int(line.split()[1])
    return total


def test_dram_holds_large_store_records_as_locked_views(store_path: Path) -> None:
    with SampleStore(store_path) as store:
        big, small = 1, 0  # odd ids are the large ones
        with store.views([big, small]) as (vbig, vsmall):
            assert vbig.nbytes >= PIN_MIN_BYTES > vsmall.nbytes
            want = bytes(vbig), bytes(vsmall)
            dram = DramCache(1 << 20, pin=store.pin_many)
            assert dram.put(big, vbig) and dram.put(small, vsmall)
        if not dram.pinned:
            pytest.skip("mlock is not allowed here (RLIMIT_MEMLOCK)")
        assert isinstance(dram.get(big), memoryview) and isinstance(dram.get(small), bytes)
        assert (bytes(dram.get(big) or b""), dram.get(small)) == want  # after the read ended
        assert store.locked_bytes >= len(want[0])
        assert _locked_kib(store_path / "data.mdb") * 1024 >= len(want[0])  # by the kernel
        dram.discard(big)
        assert store.locked_bytes == 0 and dram.pinned == 0
        assert _locked_kib(store_path / "data.mdb") == 0
        dram.put(big, store.views([big]).__enter__()[0])
        dram.clear()
        assert store.locked_bytes == 0 and len(dram) == 0


def test_a_store_locked_whole_holds_every_record_without_a_lock_each(store_path: Path) -> None:
    with SampleStore(store_path) as store:
        if not store.lock_map():
            pytest.skip("this process may not lock the store's map (RLIMIT_MEMLOCK)")
        big, small = 1, 0
        with store.views([big, small]) as (vbig, vsmall):
            want = bytes(vbig), bytes(vsmall)
            dram = DramCache(1 << 20, pin=store.pin_many)
            assert dram.put(big, vbig) and dram.put(small, vsmall)
        # The large one is a view of the map, locked without a lock of its own; the small
        # one a copy, as before (copies packed together serve hits faster).
        assert isinstance(dram.get(big), memoryview) and isinstance(dram.get(small), bytes)
        assert (bytes(dram.get(big) or b""), dram.get(small)) == want
        assert dram.pinned == 1 and store.locked_bytes == 0 and store.map_locked
        locked = _locked_kib(store_path / "data.mdb") * 1024
        assert locked >= len(want[0])  # the pages the read mapped, by the kernel's count
        assert locked < store.file_bytes  # and only those: nothing was read for the lock
        outside = memoryview(bytearray(want[0]))  # not the store's: copied
        assert DramCache(1 << 20, pin=store.pin_many).hold(outside)[1] is None


@pytest.mark.parametrize("together", [True, False], ids=["one call", "a call each"])
def test_records_held_from_a_map_locked_whole_have_their_pages_mapped_here(
    store_path: Path, together: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A miss worker read the records through a map of its own, so this process may never
    # have mapped their pages; the lock holds only pages mapped here (``MLOCK_ONFAULT``).
    # A batch's are mapped with one ``process_madvise``, or one ``madvise`` each where the
    # kernel refuses that (before Linux 6.13).
    if not together:
        monkeypatch.setattr(syscalls._self, "usable", False)
    with SampleStore(store_path) as store:
        if not store.lock_map():
            pytest.skip("this process may not lock the store's map (RLIMIT_MEMLOCK)")
        index = store.value_index
        assert index is not None
        address, length = map_of(store_path / "data.mdb")
        sids = [3, 7, 11, 0]  # odd ids are the large ones, with pages of their own
        views, pages = [], []
        for sid in sids:
            start, n = address + int(index.offsets[sid]), int(index.lengths[sid])
            first = start // mmap.PAGESIZE - address // mmap.PAGESIZE
            pages.append(slice(first, -(-(start + n) // mmap.PAGESIZE) - address // mmap.PAGESIZE))
            views.append(memoryview((ctypes.c_char * n).from_address(start)).cast("B"))
        mapped = mapped_pages(address, length)
        assert not any(mapped[p].any() for p in pages[:3]), "nothing read them here yet"
        unlocks = store.pin_many(views)  # the views touched nothing
        assert [u is not None for u in unlocks] == [True, True, True, False]  # 0: copied
        mapped = mapped_pages(address, length)
        assert all(mapped[p].all() for p in pages[:3])


def test_passes_read_by_other_processes_are_advised_but_not_mapped_here(
    store_path: Path,
) -> None:
    with SampleStore(store_path) as store:
        plan = plan_pass(
            np.arange(N), np.ones(N, np.float32), seed=0, epoch=0, phase="train",
            world_size=1, batch_size=8,
        )[0]  # fmt: skip
        elsewhere = ("j", 0, 0, "train")
        ra = ReadAhead(
            store,
            lambda ids: np.zeros(len(ids), bool),
            1 << 20,
            reads_here=lambda k: k != elsewhere,
        )
        try:
            ra.follow(elsewhere, plan, 0)
            wait_until(lambda: not ra.busy and ra.stats()["advised_records"] > 0, what="advice")
            assert ra.stats()["prefaulted_records"] == 0
            ra.drop(lambda k: k == elsewhere)  # its window makes room
            ra.follow(("j", 1, 0, "train"), plan, 0)  # a pass this process reads itself
            wait_until(lambda: ra.stats()["prefaulted_records"] > 0, what="a mapped batch")
        finally:
            ra.close()
