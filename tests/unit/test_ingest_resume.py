"""Resumable ingest: an interrupted ingest continues where it stopped, into the same store."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loaderd.storage.errors import ResumeError, StoreFullError
from loaderd.storage.ingest import ingest
from loaderd.storage.store_writer import StoreWriter, partial_path, read_partial

N = 100


def dump(path: Path) -> dict[str, Any]:
    """Everything a (partial) store holds but the time it was made: records, meta, info."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=2)
    try:
        with env.begin() as txn:
            samples = [bytes(v) for _, v in txn.cursor(db=env.open_db(b"samples", txn=txn))]
            meta = {bytes(k): bytes(v) for k, v in txn.cursor(db=env.open_db(b"meta", txn=txn))}
    finally:
        env.close()
    info = json.loads(meta.pop(b"info", b"{}"))
    info.pop("created", None)
    return {"samples": samples, "meta": meta, "info": info}


def parquet_folder(root: Path, n: int = N) -> Path:
    """Three files of small row groups: every kind of column whose state spans batches."""
    root.mkdir(parents=True)
    ids = np.arange(n)
    table = pa.table(
        {
            "n": pa.array(ids),
            "tokens": pa.array([list(range(i % 4)) for i in ids], pa.list_(pa.int32())),
            "maybe": pa.array([None if i % 7 == 3 else float(i) for i in ids]),
            "cat": pa.array([f"c{i // 9}" for i in ids]).dictionary_encode(),  # new values late
            "pair": pa.array([{"a": int(i), "b": f"b{i}"} for i in ids]),
            "when": pa.array(ids * 1000, pa.timestamp("ms")),
        }
    )
    third = n // 3
    for k, lo in enumerate((0, third, 2 * third)):
        hi = n if k == 2 else lo + third
        pq.write_table(table.slice(lo, hi - lo), root / f"part-{k}.parquet", row_group_size=10)
    return root


def arrow_stream(root: Path, n: int = N) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "data.arrows"
    table = pa.table({"x": np.arange(n, dtype=np.float32), "s": [f"s{i}" for i in range(n)]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=13):
            w.write_batch(batch)
    return path


def npz(root: Path, n: int = N) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "d.npz"
    np.savez(path, image=np.arange(n * 12, dtype=np.uint8).reshape(n, 3, 4), y=np.arange(n))
    return path


def image_folder(root: Path, n: int = N) -> Path:
    for i in range(n):
        d = root / "imgs" / f"class{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:04d}.jpg").write_bytes(b"\xff\xd8" + bytes([i % 256]) * (i % 17))
    return root / "imgs"


def webdataset(root: Path, n: int = N) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "shard-000.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            for ext, data in (("cls", str(i % 5).encode()), ("jpg", bytes([i % 256]) * 9)):
                info = tarfile.TarInfo(f"s{i:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


SOURCES: dict[str, Callable[[Path], Path]] = {
    "parquet": parquet_folder,
    "arrow-stream": arrow_stream,
    "npz": npz,
    "imagefolder": image_folder,
    "webdataset": webdataset,
}


class Interrupt:
    """Raise ``exc`` once the ``after``-th batch has been committed (a ^C, a full disk)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, after: int, exc: BaseException) -> None:
        self.calls: list[int] = []
        monkeypatch.setattr(StoreWriter, "COMMIT_SECONDS", 0.0)  # a transaction per batch
        append = StoreWriter.append

        def spy(w: StoreWriter, records: Iterable[bytes], extra: Any = None) -> None:
            batch = list(records)
            append(w, batch, extra)
            self.calls.append(len(batch))
            if len(self.calls) == after:
                raise exc

        monkeypatch.setattr(StoreWriter, "append", spy)


@pytest.mark.parametrize("kind", list(SOURCES))
def test_an_interrupted_ingest_continues_into_the_same_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    src = SOURCES[kind](tmp_path / "src")
    whole = ingest(src, tmp_path / "whole", progress=False, batch_rows=8)
    assert whole.samples == N and whole.restarts == 0

    with monkeypatch.context() as m:
        first = Interrupt(m, after=3, exc=KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            ingest(src, tmp_path / "db", progress=False, batch_rows=8)
    assert not (tmp_path / "db").exists()
    kept = read_partial(tmp_path / "db")
    assert kept is not None and kept["samples"] == sum(first.calls) > 0

    second = Interrupt(monkeypatch, after=-1, exc=AssertionError())
    resumed = ingest(src, tmp_path / "db", progress=False, batch_rows=8)
    assert resumed.resumed_at == sum(first.calls)
    assert sum(second.calls) == N - resumed.resumed_at  # nothing written twice
    assert resumed.samples == N
    assert dump(tmp_path / "db") == dump(tmp_path / "whole")
    assert not partial_path(tmp_path / "db").exists()


@pytest.mark.parametrize(
    ("exc", "kept"), [(StoreFullError("disk full"), True), (RuntimeError("a bug"), False)]
)
def test_a_full_disk_keeps_the_partial_store_other_errors_drop_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException, kept: bool
) -> None:
    src = parquet_folder(tmp_path / "src")
    with monkeypatch.context() as m:
        Interrupt(m, after=2, exc=exc)
        with pytest.raises(type(exc)):
            ingest(src, tmp_path / "db", progress=False, batch_rows=8)
    if not kept:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no partial, no store
        return
    assert read_partial(tmp_path / "db") is not None
    assert ingest(src, tmp_path / "db", progress=False, batch_rows=8).resumed_at > 0


def test_learned_columns_survive_the_interruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first pass finds a list ragged at row 30 and starts again; that pass is cut."""
    lists = [[1, 2]] * 30 + [[1, 2, 3]] * 20
    pq.write_table(pa.table({"v": lists, "i": list(range(50))}), tmp_path / "a.parquet")
    whole = ingest(tmp_path / "a.parquet", tmp_path / "whole", progress=False, batch_rows=8)
    assert whole.restarts == 1
    with monkeypatch.context() as m:
        Interrupt(m, after=3 + 2, exc=KeyboardInterrupt())  # 3 batches, restart, 2 batches
        with pytest.raises(KeyboardInterrupt):
            ingest(tmp_path / "a.parquet", tmp_path / "db", progress=False, batch_rows=8)
    resumed = ingest(tmp_path / "a.parquet", tmp_path / "db", progress=False, batch_rows=8)
    assert (resumed.resumed_at, resumed.restarts) == (16, 0)
    assert dump(tmp_path / "db") == dump(tmp_path / "whole")


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("append-row", r"the source changed: 3 files of [\d,]+ bytes then, 4 of"),
        ("touch", "a file was modified, renamed or replaced since"),
        ("columns", r"columns were \[\], now \[.n.\]"),
        ("other-source", "the source is now"),
    ],
)
def test_a_resume_against_another_source_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str, why: str
) -> None:
    src = parquet_folder(tmp_path / "src")
    with monkeypatch.context() as m:
        Interrupt(m, after=2, exc=KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            ingest(src, tmp_path / "db", progress=False, batch_rows=8)
    columns: tuple[str, ...] = ()
    if change == "append-row":
        extra = pq.read_table(src / "part-2.parquet").slice(0, 1)
        pq.write_table(extra, src / "part-3.parquet")
    elif change == "touch":
        os.utime(src / "part-1.parquet", ns=(1, 1))
    elif change == "columns":
        columns = ("n",)
    else:
        src = parquet_folder(tmp_path / "elsewhere")
    before = dump(partial_path(tmp_path / "db"))
    with pytest.raises(ResumeError, match=why) as err:
        ingest(src, tmp_path / "db", progress=False, batch_rows=8, columns=columns)
    assert "\n" not in str(err.value) and "--restart" in str(err.value)
    assert dump(partial_path(tmp_path / "db")) == before  # untouched
    # --restart drops loaderd's own partial store and starts over.
    fresh = ingest(
        src, tmp_path / "db", progress=False, batch_rows=8, columns=columns, resume=False
    )
    assert fresh.resumed_at == 0 and not partial_path(tmp_path / "db").exists()


def test_a_live_ingest_is_not_joined(tmp_path: Path) -> None:
    src = npz(tmp_path)
    from loaderd.storage.records import Field, Schema

    writer = StoreWriter(tmp_path / "db", Schema((Field("x", "int64"),)), resumable={"a": 1})
    try:
        with pytest.raises(ResumeError, match="another ingest is writing this store"):
            ingest(src, tmp_path / "db", progress=False)
        with pytest.raises(ResumeError, match="another ingest is writing"):
            ingest(src, tmp_path / "db", progress=False, resume=False)
    finally:
        writer.abort()
    assert ingest(src, tmp_path / "db", progress=False).samples == N


def test_a_foreign_folder_at_the_partial_name_is_never_deleted(tmp_path: Path) -> None:
    src = npz(tmp_path)
    mine = partial_path(tmp_path / "db")
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    for resume in (True, False):
        with pytest.raises(FileExistsError, match="not a partial loaderd store"):
            ingest(src, tmp_path / "db", progress=False, resume=resume)
    assert (mine / "notes.txt").read_text() == "the user's"


def test_fingerprint_does_not_depend_on_batching(tmp_path: Path) -> None:
    src = npz(tmp_path, n=3000)  # several fingerprint blocks
    ingest(src, tmp_path / "a", progress=False, batch_rows=7)
    ingest(src, tmp_path / "b", progress=False, batch_rows=4096)
    assert (
        dump(tmp_path / "a")["info"]["fingerprint"] == dump(tmp_path / "b")["info"]["fingerprint"]
    )


def test_a_resumable_writer_gathers_batches_and_keeps_them_on_ctrl_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = npz(tmp_path)
    monkeypatch.setattr(StoreWriter, "COMMIT_SECONDS", 3600.0)
    write = StoreWriter._write
    transactions: list[int] = []

    def spy(w: StoreWriter, batch: list[bytes], extra: dict[bytes, bytes]) -> None:
        transactions.append(len(batch))
        write(w, batch, extra)

    monkeypatch.setattr(StoreWriter, "_write", spy)
    assert ingest(src, tmp_path / "a", progress=False, batch_rows=8).samples == N
    assert transactions == [N]  # one commit at the end
    transactions.clear()
    append = StoreWriter.append
    calls: list[int] = []

    def interrupted(w: StoreWriter, records: Iterable[bytes], extra: Any = None) -> None:
        append(w, records, extra)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(StoreWriter, "append", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ingest(src, tmp_path / "b", progress=False, batch_rows=8)
    assert transactions == [24]  # the gathered batches were committed on the way out
    kept = read_partial(tmp_path / "b")
    assert kept is not None and kept["samples"] == 24


def test_a_store_resumed_after_an_older_writer_does_not_claim_its_records_name_their_ids(
    tmp_path: Path,
) -> None:
    from loaderd.storage.records import RECORD_HEADER, STORED_VERSION, Field, RecordCodec, Schema
    from loaderd.storage.store import SampleStore, sample_key

    schema = Schema((Field("x", "int64"),))
    codec = RecordCodec(schema)
    writer = StoreWriter(tmp_path / "db", schema, resumable={"a": 1})
    writer.append([codec.encode({"x": i}) for i in range(10)])
    writer.abort(keep=True)
    # As a writer of before stamping left them: checksums of the body alone (version 1).
    env = lmdb.open(str(partial_path(tmp_path / "db")), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"samples")) as txn:
        for i in range(10):
            txn.put(sample_key(i), codec.encode({"x": i}))
    env.close()
    writer = StoreWriter(tmp_path / "db", schema, resumable={"a": 1})
    assert writer.resumed_at == 10
    writer.append([codec.encode({"x": i}) for i in range(10, 20)])
    writer.commit()
    with SampleStore(tmp_path / "db") as store:
        assert "record_version" not in store.info  # some records do not name their ids
        versions = [RECORD_HEADER.unpack_from(r)[2] for r in store.get_many(range(20))]
    assert versions == [1] * 10 + [STORED_VERSION] * 10  # and every one verified as read
