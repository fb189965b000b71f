from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import xxhash

from loaderd.storage import ingest as ingest_mod
from loaderd.storage.errors import SourceError
from loaderd.storage.ingest import BatchEncoder, IngestSummary, ingest
from loaderd.storage.readers import ColumnBatch
from loaderd.storage.records import RECORD_HEADER, STORED_VERSION, Field, RecordCodec, Schema, stamp
from loaderd.storage.store import SampleStore
from loaderd.storage.store_writer import StoreWriter

N = 23  # not a multiple of the batch sizes below, so the last batch is short


def read_store(path: Path) -> tuple[SampleStore, list[dict[str, Any]]]:
    store = SampleStore(path)
    codec = RecordCodec(store.schema)
    rows = [codec.decode(store.get(i), i, "test") for i in range(store.num_samples)]
    store.close()
    return store, rows


def fields(store: SampleStore) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {f.name: (f.dtype, f.shape) for f in store.schema.fields}


def assert_column(rows: list[dict[str, Any]], name: str, want: np.ndarray) -> None:
    got = np.stack([r[name] for r in rows])
    assert got.dtype == want.dtype, name
    assert got.shape == want.shape, name
    np.testing.assert_array_equal(got, want, err_msg=name)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


# --- round trips ----------------------------------------------------------------------------


def rich_table(n: int = N, start: int = 0) -> tuple[pa.Table, dict[str, np.ndarray]]:
    rng = np.random.default_rng(start)
    img = rng.integers(0, 255, (n, 3, 2, 2), dtype=np.uint8)
    tensor = rng.standard_normal((n, 2, 3)).astype(np.float32)
    vec = rng.integers(-9, 9, (n, 4), dtype=np.int16)
    want = {
        "label": np.arange(start, start + n, dtype=np.int64),
        "small": (np.arange(n) % 100).astype(np.int8),
        "u16": np.arange(n, dtype=np.uint16),
        "half": np.linspace(0, 1, n).astype(np.float16),
        "f32": np.linspace(0, 1, n).astype(np.float32),
        "f64": np.linspace(0, 1, n),
        "flag": (np.arange(n) % 2).astype(np.uint8),
        "img": img,
        "tensor": tensor,
        "vec": vec,
    }
    nested = pa.list_(pa.list_(pa.uint8(), 2), 2)  # fixed (3 of 2 of 2) -> shape (3, 2, 2)
    img_arr = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(
            pa.FixedSizeListArray.from_arrays(pa.array(img.reshape(-1)), 2), 2
        ),
        3,
    )
    assert img_arr.type == pa.list_(nested, 3)
    table = pa.table(
        {
            "label": pa.array(want["label"]),
            "small": pa.array(want["small"]),
            "u16": pa.array(want["u16"]),
            "half": pa.array(want["half"]),
            "f32": pa.array(want["f32"]),
            "f64": pa.array(want["f64"]),
            "flag": pa.array(want["flag"].astype(bool)),
            "img": img_arr,
            "tensor": pa.FixedShapeTensorArray.from_numpy_ndarray(tensor),
            "vec": pa.array(list(vec)),  # a plain list<int16>, every row of length 4
            "blob": pa.array([bytes([i]) * (i % 5) for i in range(n)], pa.binary()),
            "big": pa.array([b"x" * i for i in range(n)], pa.large_binary()),
            "name": pa.array([f"name-{i}-é" for i in range(n)], pa.string()),
            "lname": pa.array([str(i) for i in range(n)], pa.large_string()),
            "cat": pa.array([["a", "bb"][i % 2] for i in range(n)]).dictionary_encode(),
        }
    )
    return table, want


def check_rich(out: Path, n: int = N) -> None:
    store, rows = read_store(out)
    assert store.num_samples == n
    assert fields(store) == {
        "label": ("int64", ()),
        "small": ("int8", ()),
        "u16": ("uint16", ()),
        "half": ("float16", ()),
        "f32": ("float32", ()),
        "f64": ("float64", ()),
        "flag": ("uint8", ()),
        "img": ("uint8", (3, 2, 2)),
        "tensor": ("float32", (2, 3)),
        "vec": ("int16", (4,)),
        "blob": ("binary", ()),
        "big": ("binary", ()),
        "name": ("string", ()),
        "lname": ("string", ()),
        "cat": ("int64", ()),
    }
    _, want = rich_table(n)
    for name, values in want.items():
        assert_column(rows, name, values)
    assert [r["blob"] for r in rows] == [bytes([i]) * (i % 5) for i in range(n)]
    assert [r["big"] for r in rows] == [b"x" * i for i in range(n)]
    assert [r["name"] for r in rows] == [f"name-{i}-é" for i in range(n)]
    assert [r["lname"] for r in rows] == [str(i) for i in range(n)]
    # dictionary columns: codes into one dictionary for the store, first seen first
    assert [int(r["cat"]) for r in rows] == [i % 2 for i in range(n)]
    assert store.schema.fields[-1].attrs == {"dictionary": ["a", "bb"]}
    assert store.info["dictionaries"] == {"cat": ["a", "bb"]}


def test_parquet_file_round_trip(tmp_path: Path) -> None:
    table, _ = rich_table()
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=10)
    summary = ingest(tmp_path / "d.parquet", tmp_path / "db", progress=False, batch_rows=8)
    assert isinstance(summary, IngestSummary)
    assert (summary.samples, summary.kind, summary.out) == (N, "parquet", tmp_path / "db")
    assert summary.bytes > 0 and summary.seconds > 0
    assert summary.source == str(tmp_path / "d.parquet")
    check_rich(tmp_path / "db")
    info = SampleStore(tmp_path / "db").info
    assert info["source_kind"] == "parquet" and info["bytes"] == summary.bytes
    # Every record's checksum names its sample: written stamped by the encoder (batch_rows
    # 8, so ids carry on across batches), not sealed again by the writer.
    assert info["record_version"] == STORED_VERSION
    env = lmdb.open(str(tmp_path / "db"), readonly=True, lock=False, max_dbs=2)
    with env.begin(db=env.open_db(b"samples", create=False)) as txn:
        for key, rec in txn.cursor():
            digest, _, version = RECORD_HEADER.unpack_from(rec)
            assert version == STORED_VERSION
            assert digest == xxhash.xxh3_64_intdigest(
                rec[RECORD_HEADER.size :], int.from_bytes(key, "big")
            )
    env.close()


def test_parquet_folder_keeps_file_order(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    table, _ = rich_table()
    # Sorted path order is sample order: part-0 (rows 0..9), part-1, then sub/part-2.
    pq.write_table(table.slice(0, 10), src / "part-0.parquet")
    pq.write_table(table.slice(10, 5), src / "part-1.parquet")
    pq.write_table(table.slice(15), src / "sub" / "part-2.parquet")
    (src / "_SUCCESS").write_bytes(b"")
    (src / ".part-0.parquet.crc").write_bytes(b"junk")
    summary = ingest(src, tmp_path / "db", progress=False, batch_rows=4)
    assert (summary.samples, summary.kind) == (N, "parquet-folder")
    check_rich(tmp_path / "db")


def test_object_store_uri_goes_through_pyarrow_filesystems(tmp_path: Path) -> None:
    table, _ = rich_table()
    pq.write_table(table, tmp_path / "d.parquet")
    ingest(f"local://{tmp_path}/d.parquet", tmp_path / "db", progress=False)
    check_rich(tmp_path / "db")
    with pytest.raises(SourceError, match=r"nope\.parquet: no such file or directory"):
        ingest(f"local://{tmp_path}/nope.parquet", tmp_path / "db2", progress=False)


def test_feather_ipc_file_and_stream(tmp_path: Path) -> None:
    table, _ = rich_table()
    feather.write_feather(table, tmp_path / "d.feather", compression="lz4", chunksize=7)
    assert ingest(tmp_path / "d.feather", tmp_path / "a", progress=False).kind == "arrow"
    check_rich(tmp_path / "a")

    with (
        pa.OSFile(str(tmp_path / "d.arrows"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        for batch in table.to_batches(max_chunksize=9):
            writer.write_batch(batch)
    summary = ingest(tmp_path / "d.arrows", tmp_path / "b", progress=False, batch_rows=4)
    assert summary.kind == "arrow-stream"
    check_rich(tmp_path / "b")

    # The extension lies; the magic number decides.
    (tmp_path / "d.feather").rename(tmp_path / "really-arrow.parquet")
    assert ingest(tmp_path / "really-arrow.parquet", tmp_path / "c", progress=False).kind == (
        "arrow"
    )
    check_rich(tmp_path / "c")


def test_arrow_shapes(tmp_path: Path) -> None:
    x = np.arange(2 * 60, dtype=np.float32)
    # Physical shape (3, 4, 5) read through permutation [1, 0, 2]: logical shape (4, 3, 5).
    ptype = pa.fixed_shape_tensor(pa.float32(), [3, 4, 5], permutation=[1, 0, 2])
    perm = pa.ExtensionArray.from_storage(ptype, pa.FixedSizeListArray.from_arrays(x, 60))
    flat = pa.FixedSizeListArray.from_arrays(pa.array(x), 60)
    table = pa.table(
        {
            "perm": perm,
            "nested": pa.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]]]),
            "flat": flat,
        }
    )
    # A flat fixed-size list keeps the shape loaderd's own Schema.to_arrow writes beside it.
    meta = Schema((Field("flat", "float32", (6, 10)),)).to_arrow().field("flat").metadata
    table = table.set_column(2, pa.field("flat", flat.type, metadata=meta), flat)
    feather.write_feather(table, tmp_path / "d.feather")
    ingest(tmp_path / "d.feather", tmp_path / "db", progress=False)
    store, rows = read_store(tmp_path / "db")
    assert fields(store) == {
        "perm": ("float32", (4, 3, 5)),
        "nested": ("int64", (2, 2)),
        "flat": ("float32", (6, 10)),
    }
    assert_column(rows, "perm", np.ascontiguousarray(perm.to_numpy_ndarray()))
    assert_column(rows, "nested", np.arange(1, 9, dtype=np.int64).reshape(2, 2, 2))
    assert_column(rows, "flat", x.reshape(2, 6, 10))


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_round_trip(tmp_path: Path, compressed: bool) -> None:
    rng = np.random.default_rng(1)
    arrays = {
        "image": rng.integers(0, 255, (N, 3, 4, 4), dtype=np.uint8),
        "label": np.arange(N, dtype=np.int64),
        "score": rng.standard_normal(N).astype(np.float32),
        "mask": rng.integers(0, 2, (N, 2)).astype(bool),
        "big_endian": np.arange(N, dtype=">i4"),
        "text": np.array([f"t{i}" for i in range(N)]),
        "raw": np.array([b"r%d" % i for i in range(N)]),
    }
    save = np.savez_compressed if compressed else np.savez
    save(tmp_path / "d.npz", **arrays)
    summary = ingest(tmp_path / "d.npz", tmp_path / "db", progress=False, batch_rows=5)
    assert (summary.samples, summary.kind) == (N, "npz")
    store, rows = read_store(tmp_path / "db")
    assert fields(store) == {
        "image": ("uint8", (3, 4, 4)),
        "label": ("int64", ()),
        "score": ("float32", ()),
        "mask": ("uint8", (2,)),
        "big_endian": ("int32", ()),
        "text": ("string", ()),
        "raw": ("binary", ()),
    }
    for name in ("image", "label", "score"):
        assert_column(rows, name, arrays[name])
    assert_column(rows, "mask", arrays["mask"].astype(np.uint8))
    assert_column(rows, "big_endian", np.arange(N, dtype=np.int32))
    assert [r["text"] for r in rows] == [f"t{i}" for i in range(N)]
    assert [r["raw"] for r in rows] == [b"r%d" % i for i in range(N)]


def make_image_folder(root: Path) -> dict[str, tuple[bytes, int]]:
    files = {
        "dog/b.png": (b"\x89PNG dog b", 1),
        "cat/a.jpg": (b"\xff\xd8 cat a", 0),
        "dog/sub/c.JPEG": (b"\xff\xd8 dog c", 1),
        "cat/z.webp": (b"RIFF cat z", 0),
    }
    for rel, (data, _) in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "dog" / "notes.txt").write_text("not an image")
    (root / "cat" / ".hidden.jpg").write_bytes(b"skip me")
    return files


def test_image_folder_round_trip(tmp_path: Path) -> None:
    files = make_image_folder(tmp_path / "imgs")
    summary = ingest(tmp_path / "imgs", tmp_path / "db", progress=False, batch_rows=3)
    assert (summary.samples, summary.kind) == (4, "imagefolder")
    store, rows = read_store(tmp_path / "db")
    assert fields(store) == {"image": ("binary", ()), "label": ("int64", ())}
    assert store.info["classes"] == ["cat", "dog"]
    order = ["cat/a.jpg", "cat/z.webp", "dog/b.png", "dog/sub/c.JPEG"]
    assert [r["image"] for r in rows] == [files[k][0] for k in order]
    assert_column(rows, "label", np.array([files[k][1] for k in order], np.int64))


def test_webdataset_shards(tmp_path: Path) -> None:
    def shard(path: Path, keys: range) -> None:
        with tarfile.open(path, "w") as tar:
            for k in keys:
                for ext, data in (("jpg", b"img%d" % k), ("cls", b"%d\n" % (k % 3))):
                    info = tarfile.TarInfo(f"s/{k:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))

    (tmp_path / "shards").mkdir()
    shard(tmp_path / "shards" / "a-000.tar", range(5))
    shard(tmp_path / "shards" / "a-001.tar", range(5, 9))
    summary = ingest(tmp_path / "shards", tmp_path / "db", progress=False, batch_rows=4)
    assert (summary.samples, summary.kind) == (9, "webdataset")
    store, rows = read_store(tmp_path / "db")
    # webdataset's names: __key__, and each extension as it is (cls an integer)
    assert fields(store) == {"__key__": ("string", ()), "cls": ("int64", ()), "jpg": ("binary", ())}
    assert [r["__key__"] for r in rows] == [f"s/{k:04d}" for k in range(9)]
    assert [r["jpg"] for r in rows] == [b"img%d" % k for k in range(9)]
    assert_column(rows, "cls", np.arange(9, dtype=np.int64) % 3)


def test_batch_encoder_matches_record_codec() -> None:
    schema = Schema(
        (
            Field("a", "int8"),  # 1 byte, then 7 bytes of padding before the next field
            Field("b", "float64", (3,)),
            Field("s", "string"),
            Field("c", "uint16", (1, 3)),
            Field("blob", "binary"),
        )
    )
    n = 6
    rng = np.random.default_rng(2)
    cols = {
        "a": rng.integers(-100, 100, n, dtype=np.int8),
        "b": rng.standard_normal((n, 3)),
        "c": rng.integers(0, 60000, (n, 1, 3), dtype=np.uint16),
    }
    strs = [f"é{i}" * i for i in range(n)]
    blobs = [bytes(range(i)) for i in range(n)]
    batch = ColumnBatch(n, fixed=cols, variable={"s": [s.encode() for s in strs], "blob": blobs})
    codec = RecordCodec(schema)
    want = [
        codec.encode(
            {
                "a": cols["a"][i],
                "b": cols["b"][i],
                "c": cols["c"][i],
                "s": strs[i],
                "blob": blobs[i],
            }
        )
        for i in range(n)
    ]
    assert BatchEncoder(schema).encode(batch) == want
    fixed_only = Schema(schema.fields[:2])
    got = BatchEncoder(fixed_only).encode(ColumnBatch(n, fixed=cols))
    assert got == [
        RecordCodec(fixed_only).encode({"a": cols["a"][i], "b": cols["b"][i]}) for i in range(n)
    ]
    # As stored from id 100 on: what the store writer would make of the encoded records.
    assert BatchEncoder(schema).encode(batch, first_id=100) == [
        stamp(r, 100 + i) for i, r in enumerate(want)
    ]
    assert BatchEncoder(fixed_only).encode(ColumnBatch(n, fixed=cols), first_id=100) == [
        stamp(r, 100 + i) for i, r in enumerate(got)
    ]


def test_progress_bar_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "d.npz", x=np.zeros((N, 2), np.float32))
    ingest(tmp_path / "d.npz", tmp_path / "db", batch_rows=10)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{N}/{N}" in captured.err and "ingest npz" in captured.err
    ingest(tmp_path / "d.npz", tmp_path / "db2", progress=False)
    assert capsys.readouterr().err == ""


def test_overwrite(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.zeros(N, np.float32))
    ingest(tmp_path / "d.npz", tmp_path / "db", progress=False)
    with pytest.raises(FileExistsError, match="already exists"):
        ingest(tmp_path / "d.npz", tmp_path / "db", progress=False)
    np.savez(tmp_path / "d.npz", x=np.ones(5, np.float32))
    assert ingest(tmp_path / "d.npz", tmp_path / "db", overwrite=True, progress=False).samples == 5
    assert SampleStore(tmp_path / "db").num_samples == 5
    assert leftovers(tmp_path) == ["d.npz", "db"]


# --- errors ---------------------------------------------------------------------------------


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"nope\.parquet: no such file or directory"):
        ingest(tmp_path / "nope.parquet", tmp_path / "db", progress=False)
    assert leftovers(tmp_path) == []


def test_unreadable_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d.parquet").write_bytes(b"PAR1")

    def denied(path: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(path))

    # Tests may run as root, where chmod cannot make a file unreadable.
    monkeypatch.setattr(ingest_mod, "_read_head", denied)
    with pytest.raises(SourceError, match=r"d\.parquet: cannot read \(Permission denied\)"):
        ingest(tmp_path / "d.parquet", tmp_path / "db", progress=False)


def test_unsupported_format(tmp_path: Path) -> None:
    (tmp_path / "notes.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SourceError, match=r"notes\.csv: unsupported format \(expected Parquet"):
        ingest(tmp_path / "notes.csv", tmp_path / "db", progress=False)
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(SourceError, match=r"empty\.parquet: the file is empty"):
        ingest(tmp_path / "empty.parquet", tmp_path / "db", progress=False)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "readme.md").write_text("hi")
    with pytest.raises(SourceError, match=r"dir: unsupported format"):
        ingest(tmp_path / "dir", tmp_path / "db", progress=False)
    (tmp_path / "void").mkdir()
    with pytest.raises(SourceError, match=r"void: the directory is empty"):
        ingest(tmp_path / "void", tmp_path / "db", progress=False)
    assert not (tmp_path / "db").exists()


def test_empty_dataset(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), tmp_path / "e.parquet")
    with pytest.raises(SourceError, match=r"e\.parquet: the dataset is empty \(0 samples\)"):
        ingest(tmp_path / "e.parquet", tmp_path / "db", progress=False)
    np.savez(tmp_path / "e.npz", x=np.zeros((0, 3)))
    with pytest.raises(SourceError, match=r"e\.npz: the dataset is empty \(0 samples\)"):
        ingest(tmp_path / "e.npz", tmp_path / "db", progress=False)
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    (tmp_path / "imgs" / "cat" / "a.txt").write_text("x")
    with pytest.raises(SourceError, match=r"imgs: no images in its class directories \['cat'\]"):
        ingest(tmp_path / "imgs", tmp_path / "db", progress=False)
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize(
    ("column", "pattern"),
    [
        (pa.array([[("k", 1)]] * 3, pa.map_(pa.string(), pa.int64())), "column 'bad' has type map"),
        (pa.array([1, 2, 3], pa.decimal128(5, 2)), r"column 'bad' has type decimal128\(5, 2\)"),
        (pa.array([["a", "b"]] * 3), r"column 'bad' has type list<item: string>"),
    ],
)
def test_unsupported_column_type(tmp_path: Path, column: pa.Array, pattern: str) -> None:
    # Feather keeps every Arrow type as it is (Parquet would turn a dictionary back to values).
    feather.write_feather(pa.table({"ok": [1, 2, 3], "bad": column}), tmp_path / "d.feather")
    with pytest.raises(SourceError, match=rf"d\.feather: {pattern}.*loaderd cannot store"):
        ingest(tmp_path / "d.feather", tmp_path / "db", progress=False)
    assert leftovers(tmp_path) == ["d.feather"]


def test_a_null_inside_a_value_names_column_and_says_what_to_do(tmp_path: Path) -> None:
    vecs = pa.array([[1.0, 2.0], [3.0, None], [5.0, 6.0]], pa.list_(pa.float32(), 2))
    pq.write_table(pa.table({"v": vecs}), tmp_path / "b.parquet")
    with pytest.raises(SourceError, match=r"b\.parquet: column 'v' holds a null inside a value"):
        ingest(tmp_path / "b.parquet", tmp_path / "db", progress=False)
    assert not (tmp_path / "db").exists()


def test_a_list_that_turns_ragged_later_restarts_as_a_list_field(tmp_path: Path) -> None:
    rows = [[1, 2, 3]] * 6 + [[1, 2]] + [[1]]
    pq.write_table(pa.table({"v": rows}), tmp_path / "d.parquet")
    summary = ingest(tmp_path / "d.parquet", tmp_path / "db", progress=False, batch_rows=4)
    assert summary.restarts == 1
    store, got = read_store(tmp_path / "db")
    assert store.schema.fields[0].kind == "list"
    assert [r["v"].tolist() for r in got] == rows
    assert leftovers(tmp_path) == ["d.parquet", "db"]


def test_reserved_field_names(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1, 2], "x": [1, 2]}), tmp_path / "d.parquet")
    with pytest.raises(SourceError, match="field 'id' is reserved by loaderd"):
        ingest(tmp_path / "d.parquet", tmp_path / "db", progress=False)
    np.savez(tmp_path / "d.npz", weight=np.ones(3), x=np.ones(3))
    with pytest.raises(SourceError, match="field 'weight' is reserved by loaderd"):
        ingest(tmp_path / "d.npz", tmp_path / "db", progress=False)


def test_npz_first_dimensions_differ(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", image=np.zeros((10, 3)), label=np.zeros(9, np.int64))
    match = r"d\.npz: arrays have different first dimensions \(image 10, label 9\)"
    with pytest.raises(SourceError, match=match):
        ingest(tmp_path / "d.npz", tmp_path / "db", progress=False)
    np.savez(tmp_path / "s.npz", x=np.float32(3))
    with pytest.raises(SourceError, match=r"s\.npz: array 'x' is a scalar"):
        ingest(tmp_path / "s.npz", tmp_path / "db", progress=False)
    np.savez(tmp_path / "c.npz", x=np.zeros(3, np.complex64))
    with pytest.raises(SourceError, match=r"c\.npz: array 'x' has dtype complex64"):
        ingest(tmp_path / "c.npz", tmp_path / "db", progress=False)


def test_image_folder_without_classes(tmp_path: Path) -> None:
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(SourceError, match=r"imgs: an ImageFolder without classes"):
        ingest(tmp_path / "imgs", tmp_path / "db", progress=False)


def test_failure_half_way_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    appended: list[int] = []
    append = StoreWriter.append

    def spy(
        self: StoreWriter, records: Iterable[bytes], extra: dict[bytes, bytes] | None = None
    ) -> None:
        batch = list(records)
        appended.append(len(batch))
        append(self, batch, extra)

    monkeypatch.setattr(StoreWriter, "append", spy)  # proves the failure came mid-stream
    src = tmp_path / "src"
    src.mkdir()
    table, _ = rich_table()
    pq.write_table(table, src / "a.parquet")
    good = (src / "a.parquet").read_bytes()
    (src / "b.parquet").write_bytes(good[:4] + b"\0" * 64 + good[-4:])  # corrupt after a good one
    with pytest.raises(SourceError, match=r"src: cannot read"):
        ingest(src, tmp_path / "db", progress=False, batch_rows=5)
    # Arrow's read-ahead may meet the bad file before the good one is written, or after.
    assert leftovers(tmp_path) == ["src"]  # neither the store nor its temporary sibling

    # The same when our own checks stop the stream: a null inside a list in the second file.
    appended.clear()
    (src / "b.parquet").unlink()
    pq.write_table(pa.table({"v": [[1, 2]] * 4}), src / "a.parquet")
    pq.write_table(pa.table({"v": [[1, 2]] * 2 + [[1, None]]}), src / "b.parquet")
    with pytest.raises(SourceError, match="column 'v' holds a null inside a value"):
        ingest(src, tmp_path / "db", progress=False, batch_rows=2)
    assert sum(appended) == 6
    assert leftovers(tmp_path) == ["src"]

    # A damaged .npz member fails its CRC only when its last bytes are read.
    appended.clear()
    x = np.arange(40_000, dtype=np.int64)  # big enough that the header read stops short of it
    np.savez(tmp_path / "d.npz", x=x)
    raw = bytearray((tmp_path / "d.npz").read_bytes())
    raw[raw.index(x[:4].tobytes()) + 8 * 30_000] ^= 0xFF
    (tmp_path / "d.npz").write_bytes(bytes(raw))
    with pytest.raises(SourceError, match=r"d\.npz: array 'x': Bad CRC-32"):
        ingest(tmp_path / "d.npz", tmp_path / "db", progress=False, batch_rows=8_000)
    assert appended == [8_000] * 4
    assert leftovers(tmp_path) == ["d.npz", "src"]


def test_store_info_records_source(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.zeros(4, np.int64))
    ingest(tmp_path / "d.npz", tmp_path / "db", progress=False)
    info = SampleStore(tmp_path / "db").info
    assert (info["source"], info["source_kind"], info["samples"]) == (
        str(tmp_path / "d.npz"),
        "npz",
        4,
    )
    json.dumps(info)  # the info stays plain JSON
