"""Records sliced from the store's map once LMDB, or their checksum, showed where each lies."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import numpy as np
import pytest

from loaderd.storage.errors import CorruptRecordError
from loaderd.storage.store import META_DB, SampleStore
from tests.unit.test_readahead import N, make_store


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_store(tmp_path_factory.mktemp("slices") / "s.db")


@pytest.fixture(scope="module")
def older_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store whose info does not say its checksums name their samples, as one written
    before record version 2 (or resumed after such a writer)."""
    path = make_store(tmp_path_factory.mktemp("older") / "s.db")
    env = lmdb.open(str(path), max_dbs=2)
    with env.begin(write=True, db=env.open_db(META_DB)) as txn:
        info = json.loads(txn.get(b"info"))
        del info["record_version"]
        txn.put(b"info", json.dumps(info).encode())
    env.close()
    return path


def stored(path: Path) -> list[bytes]:
    """Every record as LMDB returns it, from a store without a value index."""
    with SampleStore(path) as store:
        return store.get_many(range(N))


def test_records_are_sliced_after_lmdb_confirmed_them(store_path: Path) -> None:
    want = stored(store_path)
    ids = np.random.default_rng(1).permutation(N)
    with SampleStore(store_path) as store:
        with store.views(ids[:50]) as views:  # no index yet: LMDB, nothing confirmed
            assert [bytes(v) for v in views] == [want[i] for i in ids[:50]]
        assert store.value_index is not None  # the read-ahead builds it
        with store.views(ids[:100]) as views:  # through LMDB, confirming each
            assert [bytes(v) for v in views] == [want[i] for i in ids[:100]]
        slices = store._slices
        assert slices is not None and slices.confirmed == 100 and slices.sliced == 0
        with store.views(ids[:100][::-1]) as views:  # every one confirmed: slices
            assert [bytes(v) for v in views] == [want[i] for i in ids[:100][::-1]]
        assert slices.sliced == 100
        with store.views(ids[90:110]) as views:  # some never read: LMDB for the batch
            assert [bytes(v) for v in views] == [want[i] for i in ids[90:110]]
        assert slices.sliced == 100 and slices.confirmed == 110
        for bad in (N, -1):
            with pytest.raises(KeyError, match=f"sample {bad} is not in store"):
                store.get_many([int(ids[0]), bad])


def test_an_index_that_disagrees_with_lmdb_turns_slicing_off(store_path: Path) -> None:
    want = stored(store_path)
    with SampleStore(store_path) as store:
        index = store.value_index
        assert index is not None
        index.offsets[4] = index.offsets[2]  # as a walk of the B-tree gone wrong would say
        index.lengths[4] = index.lengths[2]
        for _ in range(2):
            with store.views([2, 4]) as views:
                assert [bytes(v) for v in views] == [want[2], want[4]]  # never sample 2's
        slices = store._slices
        assert slices is not None and not slices.enabled and slices.sliced == 0


def test_offsets_another_process_saw_confirm_records_or_turn_slicing_off(
    store_path: Path,
) -> None:
    want = stored(store_path)
    ids = np.arange(10, 30)
    # ``reader`` plays a miss worker: its own map, at its own address.
    with SampleStore(store_path) as reader, reader.views(ids) as views:
        offsets = reader.file_offsets(views)
        lengths = np.array([v.nbytes for v in views])
    assert offsets is not None
    with SampleStore(store_path) as store:
        index = store.value_index
        assert index is not None
        np.testing.assert_array_equal(offsets, index.offsets[ids])
        store.confirm_offsets(ids, offsets, lengths)
        slices = store._slices
        assert slices is not None and slices.confirmed == 20
        with store.views(ids) as views:  # sliced, without a call into LMDB
            assert [bytes(v) for v in views] == [want[i] for i in ids]
        assert slices.sliced == 20
        offsets[3] += 8  # a reader that saw record 13 elsewhere: the index is in doubt
        store.confirm_offsets(ids, offsets, lengths)
        assert not slices.enabled and not store.sliceable
        with store.views(ids) as views:
            assert [bytes(v) for v in views] == [want[i] for i in ids]


def test_another_process_slices_records_at_the_offsets_lmdb_confirmed(older_path: Path) -> None:
    """What a miss worker does with the offsets the daemon sends (``views_at``)."""
    want = stored(older_path)
    ids = np.arange(40, 60)
    with SampleStore(older_path) as daemon:
        assert daemon.value_index is not None
        assert daemon.sliceable_spans(ids) is None  # LMDB has not returned them yet
        with daemon.views(ids[:-1]):
            pass
        assert daemon.sliceable_spans(ids) is None  # nor the last one
        with daemon.views(ids):
            pass
        spans = daemon.sliceable_spans(ids[::-1])
    assert spans is not None
    offsets, lengths = spans
    # The worker: a map of its own (LMDB opens a path once per process, so one after the other).
    with SampleStore(older_path) as worker:
        with worker.views_at(ids[::-1], offsets, lengths) as views:
            assert [bytes(v) for v in views] == [want[i] for i in ids[::-1]]
        assert worker.reads == len(ids)
        shifted = offsets.copy()
        shifted[2] += 8  # a wrong offset is caught by the checksum, naming the sample
        wrong = pytest.raises(CorruptRecordError, match=f"sample {ids[::-1][2]}: ")
        with wrong, worker.views_at(ids[::-1], shifted, lengths):
            pass
        past = offsets.copy()
        past[0] = worker.file_bytes  # outside the file: read through LMDB instead
        with worker.views_at(ids[::-1], past, lengths) as views:
            assert [bytes(v) for v in views] == [want[i] for i in ids[::-1]]


def test_a_worker_slices_records_whose_checksums_name_them_before_lmdb_returned_them(
    store_path: Path,
) -> None:
    want = stored(store_path)
    ids = np.arange(60, 80)[::-1]
    with SampleStore(store_path) as daemon:
        assert daemon.value_index is not None
        spans = daemon.sliceable_spans(ids)  # no read through LMDB yet
        assert spans is not None and daemon.reads == 0
    with SampleStore(store_path) as worker, worker.views_at(ids, *spans) as views:
        assert [bytes(v) for v in views] == [want[i] for i in ids]


def test_a_wrong_index_fails_a_workers_checksum_and_the_daemons_lmdb_read_turns_it_off(
    store_path: Path,
) -> None:
    want = stored(store_path)
    ids = np.array([2, 4])

    def daemon() -> SampleStore:
        store = SampleStore(store_path)
        index = store.value_index
        assert index is not None
        index.offsets[4] = index.offsets[2]  # as a walk of the B-tree gone wrong would say
        index.lengths[4] = index.lengths[2]
        return store

    with daemon() as store:
        spans = store.sliceable_spans(ids)
    assert spans is not None
    # The worker's slice for sample 4 is sample 2's record, whose checksum names sample 2.
    # (LMDB opens a path once per process: the daemon and the worker one after the other.)
    wrong = pytest.raises(CorruptRecordError, match="sample 4: ")
    with SampleStore(store_path) as worker, wrong, worker.views_at(ids, *spans):
        pass
    # The daemon then reads the batch itself, through LMDB, which says where 4 lies.
    with daemon() as store:
        with store.views(ids) as views:
            assert [bytes(v) for v in views] == [want[2], want[4]]
        assert not store.sliceable and store.sliceable_spans(ids) is None
