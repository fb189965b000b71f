"""storage/store.py: StoreWriter / SampleStore round trip, growth, errors and on-disk corruption."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import numpy as np
import pytest

from loaderd.storage.errors import CorruptRecordError, NotAStoreError
from loaderd.storage.records import Field, RecordCodec, Schema, stamp
from loaderd.storage.store import FORMAT_VERSION, SampleStore, sample_key
from loaderd.storage.store_writer import StoreWriter

SCHEMA = Schema((Field("x", "float32", (4,)), Field("label", "int64"), Field("name", "string")))
CODEC = RecordCodec(SCHEMA)


def record(i: int) -> bytes:
    return CODEC.encode({"x": np.full(4, i, np.float32), "label": i * 3, "name": f"sample-{i:06d}"})


def write_store(path: Path, n: int, batch: int = 16) -> list[bytes]:
    """Write records 0..n-1; returns them as stored (each stamped with its id)."""
    recs = [record(i) for i in range(n)]
    with StoreWriter(path, SCHEMA) as w:
        for lo in range(0, n, batch):
            w.append(recs[lo : lo + batch])
    return [stamp(r, i) for i, r in enumerate(recs)]


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


# ---------------------------------------------------------------- round trip


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "store"
    recs = write_store(path, 50)
    assert siblings(path) == ["store"]  # no temporary directory left behind
    with SampleStore(path) as store:
        assert store.schema == SCHEMA
        assert store.num_samples == 50
        assert store.total_bytes == sum(len(r) for r in recs)
        assert store.info["format_version"] == FORMAT_VERSION
        assert len(store.fingerprint) == 16
        for i in (0, 17, 49):
            rec = store.get(i)
            assert rec == recs[i]
            out = CODEC.decode(rec, i, "t")
            assert out["label"] == i * 3 and out["name"] == f"sample-{i:06d}"
        assert store.get_many(np.array([49, 0, 3, 3])) == [recs[49], recs[0], recs[3], recs[3]]
        assert store.reads == 3 + 4
        assert store.bytes_read == sum(len(recs[i]) for i in (0, 17, 49, 49, 0, 3, 3))


def test_file_extents_name_views_of_the_map_and_nothing_else(tmp_path: Path) -> None:
    """Where each view of LMDB's map lies in data.mdb (the arena's writer reads it there)."""
    path = tmp_path / "store"
    recs = write_store(path, 20)
    with SampleStore(path) as store, store.views([3, 11, 3]) as views:
        got = store.file_extents([*views, recs[5], memoryview(bytearray(recs[5]))])
        assert got is not None
        fd, offsets = got
        assert offsets.tolist()[3:] == [-1, -1]  # copies: not in the map
        for off, rec in zip(offsets[:3].tolist(), [recs[3], recs[11], recs[3]], strict=True):
            assert os.pread(fd, len(rec), off) == rec
        assert store.file_extents([recs[5]]) is None and store.file_extents([]) is None


def test_fingerprint_depends_on_content(tmp_path: Path) -> None:
    write_store(tmp_path / "a", 10)
    write_store(tmp_path / "b", 10)
    with StoreWriter(tmp_path / "c", SCHEMA) as w:
        w.append([record(i) for i in range(9)] + [record(99)])
    fp = {}
    for name in "abc":
        with SampleStore(tmp_path / name) as s:
            fp[name] = s.fingerprint
    assert fp["a"] == fp["b"] != fp["c"]


def test_extra_info_is_stored(tmp_path: Path) -> None:
    w = StoreWriter(tmp_path / "s", SCHEMA)
    w.append([record(0)])
    assert w.commit({"source": "unit"}) == tmp_path / "s"
    assert w.commit() == tmp_path / "s"  # twice is harmless
    with SampleStore(tmp_path / "s") as s:
        assert s.info["source"] == "unit" and s.num_samples == 1


def test_empty_store(tmp_path: Path) -> None:
    with StoreWriter(tmp_path / "s", SCHEMA):
        pass
    with SampleStore(tmp_path / "s") as s:
        assert s.num_samples == 0 and s.total_bytes == 0
        with pytest.raises(KeyError):
            s.get(0)


def test_map_grows_with_many_records(tmp_path: Path) -> None:
    path = tmp_path / "s"
    w = StoreWriter(path, SCHEMA)
    # start from a tiny map so a modest number of records forces several growths
    w._map_size = 64 << 10
    w._env.set_mapsize(w._map_size)
    recs = [record(i) for i in range(3000)]
    for lo in range(0, len(recs), 500):
        w.append(recs[lo : lo + 500])
    # one batch much larger than the whole map
    big = [CODEC.encode({"x": np.zeros(4), "label": i, "name": "z" * 2000}) for i in range(200)]
    w.append(big)
    assert w._map_size > 64 << 10
    w.commit()
    recs += big
    with SampleStore(path) as s:
        assert s.num_samples == len(recs) == 3200
        ids = np.random.default_rng(0).permutation(len(recs))[:300]
        assert s.get_many(ids) == [stamp(recs[i], i) for i in ids]


def test_keys_are_big_endian_so_scans_follow_id_order(tmp_path: Path) -> None:
    write_store(tmp_path / "s", 300)
    env = lmdb.open(str(tmp_path / "s"), readonly=True, lock=False, max_dbs=2)
    try:
        db = env.open_db(b"samples", create=False)
        with env.begin(db=db) as txn:
            keys = [k for k, _ in txn.cursor()]
    finally:
        env.close()
    assert keys == [sample_key(i) for i in range(300)]


# ---------------------------------------------------------------- errors


def test_missing_id_is_a_key_error(tmp_path: Path) -> None:
    write_store(tmp_path / "s", 5)
    with SampleStore(tmp_path / "s") as s:
        with pytest.raises(KeyError, match="sample 5 is not in store"):
            s.get(5)
        with pytest.raises(KeyError, match="sample 1000 "):
            s.get_many([0, 1000])


def test_missing_path_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(NotAStoreError, match=r"no data\.mdb"):
        SampleStore(tmp_path / "nope")


def test_plain_directory_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "file.txt").write_text("hi")
    with pytest.raises(NotAStoreError, match="not a loaderd store"):
        SampleStore(tmp_path / "d")


def test_a_file_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100)
    with pytest.raises(NotAStoreError):
        SampleStore(tmp_path / "f")


def test_garbage_data_mdb_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "data.mdb").write_bytes(os.urandom(16384))
    with pytest.raises(NotAStoreError, match="not a loaderd store"):
        SampleStore(tmp_path / "d")


def test_lmdb_without_loaderd_databases_is_not_a_store(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "d"), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    with pytest.raises(NotAStoreError, match="not a loaderd store"):
        SampleStore(tmp_path / "d")


def test_other_format_version_is_refused(tmp_path: Path) -> None:
    write_store(tmp_path / "s", 2)
    env = lmdb.open(str(tmp_path / "s"), max_dbs=2)
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:
        txn.put(b"info", b'{"format_version": 99, "samples": 2}')
    env.close()
    with pytest.raises(
        NotAStoreError, match=f"store format 99, this loaderd reads {FORMAT_VERSION}"
    ):
        SampleStore(tmp_path / "s")


def test_existing_target_without_overwrite(tmp_path: Path) -> None:
    write_store(tmp_path / "s", 3)
    with pytest.raises(FileExistsError, match="already exists"):
        StoreWriter(tmp_path / "s", SCHEMA)
    assert siblings(tmp_path / "s") == ["s"]


def test_overwrite_replaces_the_store(tmp_path: Path) -> None:
    write_store(tmp_path / "s", 3)
    with StoreWriter(tmp_path / "s", SCHEMA, overwrite=True) as w:
        w.append([record(7)])
    with SampleStore(tmp_path / "s") as s:
        assert s.num_samples == 1 and s.get(0) == stamp(record(7), 0)
    assert siblings(tmp_path / "s") == ["s"]


def test_exception_inside_writer_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with pytest.raises(RuntimeError, match="boom"), StoreWriter(path, SCHEMA) as w:
        w.append([record(i) for i in range(10)])
        assert w.tmp.exists() and not path.exists()
        raise RuntimeError("boom")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_exception_during_overwrite_keeps_the_old_store(tmp_path: Path) -> None:
    path = tmp_path / "s"
    old = write_store(path, 4)
    with pytest.raises(RuntimeError), StoreWriter(path, SCHEMA, overwrite=True) as w:
        w.append([record(9)])
        raise RuntimeError("boom")
    assert siblings(path) == ["s"]
    with SampleStore(path) as s:
        assert s.num_samples == 4 and s.get(3) == old[3]


# ---------------------------------------------------------------- corruption on disk


def test_flipped_byte_in_data_mdb_is_caught_with_the_id(tmp_path: Path) -> None:
    path = tmp_path / "s"
    recs = write_store(path, 40)
    victim = 23
    needle = b"sample-000023"
    data = bytearray((path / "data.mdb").read_bytes())
    # LMDB may leave stale copies of a page (copy-on-write, splits) in free pages: flip the byte
    # in every copy, so the live one is flipped whichever it is; nothing else changes.
    hits = [i for i in range(len(data)) if data.startswith(needle, i)]
    assert hits
    for pos in hits:
        data[pos + 3] ^= 0x01
    (path / "data.mdb").write_bytes(bytes(data))

    with SampleStore(path) as s:
        with pytest.raises(CorruptRecordError, match=f"sample {victim}: checksum mismatch") as info:
            s.get(victim)
        assert info.value.sample_id == victim
        assert str(path) in info.value.where
        with pytest.raises(CorruptRecordError):
            s.get_many([0, victim, 1])
        # neighbours are intact
        assert s.get(victim - 1) == recs[victim - 1]
        assert s.get(victim + 1) == recs[victim + 1]


@pytest.mark.parametrize("kind", ["file", "folder", "store-with-extras", "link"])
def test_overwrite_never_deletes_what_is_not_a_store(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "s"
    if kind == "file":
        path.write_text("my notes")
    elif kind == "folder":
        path.mkdir()
        (path / "thesis.tex").write_text("years of work")
    elif kind == "store-with-extras":
        write_store(path, 2)
        (path / "README").write_text("the user's")
    else:
        (tmp_path / "elsewhere").mkdir()
        path.symlink_to(tmp_path / "elsewhere")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(FileExistsError, match="is not a loaderd store"):
        StoreWriter(path, SCHEMA, overwrite=True)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "nothing touched"
