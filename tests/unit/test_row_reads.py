"""storage/row_reads.py: records read with preadv straight into a batch's rows, verified there."""

from __future__ import annotations

import mmap
import os
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from loaderd.prefetch import BatchWriter, fresh
from loaderd.storage import row_reads
from loaderd.storage.errors import CorruptRecordError
from loaderd.storage.records import RECORD_HEADER, Field, RecordCodec, Schema, seal, stamp
from loaderd.storage.row_reads import read_rows
from loaderd.storage.store import SampleStore
from loaderd.storage.store_writer import StoreWriter

# 12 bytes of coords are padded to 16 before the label: the rows skip 4 bytes of each record.
SCHEMA = Schema(
    (Field("image", "uint8", (20_000,)), Field("coords", "float32", (3,)), Field("label", "int64"))
)
CODEC = RecordCodec(SCHEMA)
N = 12


@pytest.fixture(autouse=True, params=["compiled", "python"])
def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs twice: the loop in C (``read_rows.c``) and in Python, to the same end."""
    if request.param == "python":
        monkeypatch.setattr(row_reads, "_LIB", None)
    return str(request.param)


@pytest.fixture(params=["preadv", "map"])
def source(request: pytest.FixtureRequest) -> str:
    """Where ``read`` takes the records from: the file (``preadv``) or a map of it."""
    return str(request.param)


def test_the_install_builds_the_record_reader(loop: str) -> None:
    # setup.py builds it as an optional extension: a failed build would go unnoticed.
    assert row_reads.AVAILABLE


def sample(i: int) -> dict[str, np.ndarray | int]:
    rng = np.random.default_rng(i)
    return {
        "image": rng.integers(0, 256, 20_000, dtype=np.uint8),
        "coords": rng.random(3, dtype=np.float32),
        "label": i * 11,
    }


def records_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Records 0..N-1 one after another, with a few bytes between them; (offsets, lengths).

    Even ids are sealed as stored (seeded with the id), odd ones as an older writer did.
    """
    offsets, lengths, data = [], [], bytearray()
    for i in range(N):
        rec = CODEC.encode(sample(i))
        rec = stamp(rec, i) if i % 2 == 0 else seal(memoryview(rec)[RECORD_HEADER.size :])
        data += b"\xab" * 5
        offsets.append(len(data))
        lengths.append(len(rec))
        data += rec
    path.write_bytes(bytes(data))
    return np.array(offsets, np.int64), np.array(lengths, np.int64)


def read(
    path: Path, ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, source: str = "preadv"
) -> dict[str, np.ndarray]:
    """The batch's fixed fields, read with ``read_rows`` into fresh frames."""
    writer = BatchWriter(SCHEMA)
    frames = fresh(writer.frame_sizes(len(ids))).frames
    with ExitStack() as stack:
        fd = os.open(path, os.O_RDONLY)
        stack.callback(os.close, fd)
        mapped: row_reads.Maps | None = None
        if source == "map":
            view = memoryview(stack.enter_context(mmap.mmap(fd, 0, prot=mmap.PROT_READ)))
            stack.callback(view.release)
            mapped = [("data.mdb", view)], np.zeros(len(ids), np.int8)
        writer.fill_read(
            ids,
            np.ones(len(ids), np.float32),
            frames,
            lambda rows: read_rows(fd, ids, offsets, lengths, rows, "test file", mapped),
        )
    return dict(writer.wrap(frames).columns)  # type: ignore[arg-type]


def test_each_field_lands_in_its_row(tmp_path: Path, source: str) -> None:
    path = tmp_path / "records"
    offsets, lengths = records_file(path)
    ids = np.array([5, 0, 11, 2, 2], np.int64)  # any order, a repeat, both record versions
    cols = read(path, ids, offsets[ids], lengths[ids], source)
    for row, i in enumerate(ids.tolist()):
        want = sample(i)
        np.testing.assert_array_equal(cols["image"][row], want["image"])
        np.testing.assert_array_equal(cols["coords"][row], want["coords"])
        assert int(cols["label"][row]) == want["label"]


@pytest.mark.parametrize("bad", [4, 3])  # sealed as stored (seeded with its id), as encoded
@pytest.mark.parametrize(
    ("where", "message"),
    [
        (100, "checksum mismatch"),  # an image byte: it lands in a row
        (RECORD_HEADER.size + 20_000 + 12 + 1, "checksum mismatch"),  # padding, in no row
        (RECORD_HEADER.size + 20_000 + 16 + 8 - 1, "checksum mismatch"),  # its last byte
        (8, "record header is damaged"),  # the body length
        (12, "record header is damaged"),  # the version
    ],
)
def test_a_damaged_record_fails_naming_its_sample(
    tmp_path: Path, where: int, message: str, bad: int, source: str
) -> None:
    path = tmp_path / "records"
    offsets, lengths = records_file(path)
    data = bytearray(path.read_bytes())
    data[int(offsets[bad]) + where] ^= 0x01
    path.write_bytes(bytes(data))
    ids = np.array([2, bad, 5, bad + 6], np.int64)
    with pytest.raises(CorruptRecordError, match=f"sample {bad}: {message} in test file"):
        read(path, ids, offsets[ids], lengths[ids], source)


def test_the_first_failing_record_in_row_order_is_named(tmp_path: Path, source: str) -> None:
    path = tmp_path / "records"
    offsets, lengths = records_file(path)
    data = bytearray(path.read_bytes())
    data[int(offsets[6]) + 100] ^= 0x01
    path.write_bytes(bytes(data))
    ids = np.array([1, 6, 8, N - 1], np.int64)
    offsets, lengths = offsets[ids], lengths[ids]
    lengths[2] -= 100  # too short for its rows: checked before any read
    offsets[3] += 100  # runs past the end of the file
    with pytest.raises(CorruptRecordError, match="sample 6: checksum mismatch"):
        read(path, ids, offsets, lengths, source)
    with pytest.raises(CorruptRecordError, match=r"sample 8: record of .* its fields need"):
        read(path, ids[[0, 2, 1]], offsets[[0, 2, 1]], lengths[[0, 2, 1]], source)
    with pytest.raises(CorruptRecordError, match=r"sample 11: record runs past the end"):
        read(path, ids[[0, 3, 1]], offsets[[0, 3, 1]], lengths[[0, 3, 1]], source)


def test_with_a_map_the_records_come_from_it_not_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "records"
    offsets, lengths = records_file(path)
    blank = tmp_path / "blank"
    blank.write_bytes(bytes(path.stat().st_size))
    ids = np.array([3, 0, 7], np.int64)
    out = memoryview(bytearray(len(ids) * 20_000))
    rows = [(out, RECORD_HEADER.size, 20_000)]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        fd = os.open(blank, os.O_RDONLY)
        try:
            with pytest.raises(CorruptRecordError, match="sample 3: record header is damaged"):
                read_rows(fd, ids, offsets[ids], lengths[ids], rows, "f")  # the file's zeros
            mapped = memoryview(m)
            read_rows(
                fd,
                ids,
                offsets[ids],
                lengths[ids],
                rows,
                "f",
                ([("m", mapped)], np.zeros(3, np.int8)),
            )
            mapped.release()
        finally:
            os.close(fd)
    images = np.frombuffer(out, np.uint8).reshape(len(ids), -1)
    for row, i in enumerate(ids.tolist()):
        np.testing.assert_array_equal(images[row], sample(i)["image"])


def test_each_record_comes_from_the_file_or_from_its_own_map(tmp_path: Path) -> None:
    # An NVRAM arena holds records in the store's format at offsets of its own: a batch
    # takes some from the store's file, some from the arena's map.
    path = tmp_path / "records"
    offsets, lengths = records_file(path)
    other = tmp_path / "other"
    other.write_bytes(b"\xcd" * 4096 + path.read_bytes())  # the same records, 4 KiB further
    ids = np.array([3, 0, 7, 10], np.int64)
    source = np.array([-1, 0, 0, -1], np.int8)
    at = offsets[ids] + np.where(source == 0, 4096, 0)
    out = memoryview(bytearray(len(ids) * 20_000))
    rows = [(out, RECORD_HEADER.size, 20_000)]
    with open(other, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        fd = os.open(path, os.O_RDONLY)
        view = memoryview(m)
        try:
            read_rows(fd, ids, at, lengths[ids], rows, "f", ([("the other", view)], source))
            images = np.frombuffer(out, np.uint8).reshape(len(ids), -1)
            for row, i in enumerate(ids.tolist()):
                np.testing.assert_array_equal(images[row], sample(i)["image"])
            # Offsets of the file, not of the map: sample 0 is not where it is taken from.
            with pytest.raises(CorruptRecordError, match="sample 0: record header is damaged"):
                read_rows(fd, ids, offsets[ids], lengths[ids], rows, "f", ([("o", view)], source))
            past = at.copy()
            past[2] = len(view) - 10
            with pytest.raises(CorruptRecordError, match=r"sample 7: .* past the end of the other"):
                read_rows(fd, ids, past, lengths[ids], rows, "f", ([("the other", view)], source))
        finally:
            view.release()
            os.close(fd)


def test_a_file_that_cannot_be_read_raises_oserror(tmp_path: Path) -> None:
    offsets, lengths = records_file(tmp_path / "records")
    ids = np.array([0, 1], np.int64)
    with pytest.raises(OSError, match="Is a directory"):
        read(tmp_path, ids, offsets[ids], lengths[ids])


def test_another_samples_record_fails_its_checksum(tmp_path: Path, source: str) -> None:
    # An offset that lands on sample 2's record, whole and valid: the checksum is seeded
    # with the id asked for, so it is not served as sample 4.
    path = tmp_path / "records"
    offsets, lengths = records_file(path)
    ids = np.array([4], np.int64)
    with pytest.raises(CorruptRecordError, match="sample 4: checksum mismatch"):
        read(path, ids, offsets[[2]], lengths[[2]], source)


def test_a_record_past_the_end_of_the_file_or_too_short_fails(tmp_path: Path, source: str) -> None:
    path = tmp_path / "records"
    offsets, lengths = records_file(path)
    ids = np.array([N - 1], np.int64)
    with pytest.raises(CorruptRecordError, match=r"runs past the end of data\.mdb"):
        read(path, ids, offsets[ids] + 100, lengths[ids], source)
    with pytest.raises(CorruptRecordError, match="its fields need"):
        read(path, ids, offsets[ids], lengths[ids] - 100, source)


def test_a_batch_with_variable_fields_is_not_read_into_rows() -> None:
    writer = BatchWriter(Schema((Field("image", "uint8", (4,)), Field("tag", "binary"))))
    with pytest.raises(ValueError, match="variable-length"):
        writer.fill_read(np.zeros(1, np.int64), np.ones(1, np.float32), [], lambda rows: None)


def test_the_store_reads_rows_as_lmdb_returns_them(tmp_path: Path, source: str) -> None:
    db = tmp_path / "store"
    with StoreWriter(db, SCHEMA) as w:
        w.append([CODEC.encode(sample(i)) for i in range(N)])
    ids = np.array([9, 1, 6, 6, 0], np.int64)
    writer = BatchWriter(SCHEMA)
    with SampleStore(db) as store:
        assert store.value_index is not None  # built by the daemon's read-ahead
        offsets, lengths = store.sliceable_spans(ids) or (None, None)
        assert offsets is not None and lengths is not None  # record version 2: trusted
        got = fresh(writer.frame_sizes(len(ids))).frames
        weights = np.linspace(0, 1, len(ids), dtype=np.float32)
        rows: list[tuple[memoryview, int, int]] = []
        writer.fill_read(ids, weights, got, rows.extend)
        store.read_rows(ids, offsets, lengths, rows, from_map=source == "map")
        assert store.reads == len(ids) and store.bytes_read == int(lengths.sum())
        want = fresh(writer.frame_sizes(len(ids))).frames
        with store.views(ids) as records:
            writer.fill(ids, weights, records, [], want)
        assert [bytes(f) for f in got] == [bytes(f) for f in want]
        with pytest.raises(CorruptRecordError, match=f"sample 9: checksum mismatch in store {db}"):
            store.read_rows(ids[:1], offsets[1:2], lengths[1:2], rows, from_map=source == "map")
        assert store.corrupt == 1


def test_a_worker_reads_into_rows_only_large_records_of_their_schemas_length(loop: str) -> None:
    from loaderd.miss_worker import reads_rows

    big = BatchWriter(Schema((Field("image", "uint8", (70_000,)), Field("label", "int64"))))
    size = big.layout.record_bytes
    assert size is not None
    assert reads_rows(big, np.full(64, size))
    # One of another length is damaged: sliced as before, where its checksum reports it,
    # never a buffer sized by the damage.
    assert not reads_rows(big, np.array([size, 1 << 30, size]))
    assert not reads_rows(big, np.array([], np.int64))
    small = BatchWriter(Schema((Field("image", "uint8", (8_000,)),)))
    assert not reads_rows(small, np.full(4, small.layout.record_bytes or 0))
    mid = BatchWriter(Schema((Field("image", "uint8", (20_000,)),)))  # the loop compiled only
    assert reads_rows(mid, np.full(4, mid.layout.record_bytes or 0)) == (loop == "compiled")
    var = BatchWriter(Schema((Field("image", "uint8", (70_000,)), Field("tag", "binary"))))
    assert not reads_rows(var, np.full(4, 70_100))


def test_bytes_past_the_last_row_are_hashed_not_kept(tmp_path: Path) -> None:
    # Rows of the image alone: coords, padding and label are read and checked, not kept.
    path = tmp_path / "records"
    offsets, lengths = records_file(path)
    ids = np.array([7, 2], np.int64)
    out = memoryview(bytearray(len(ids) * 20_000))
    fd = os.open(path, os.O_RDONLY)
    try:
        read_rows(fd, ids, offsets[ids], lengths[ids], [(out, RECORD_HEADER.size, 20_000)], "f")
        images = np.frombuffer(out, np.uint8).reshape(len(ids), -1)
        for row, i in enumerate(ids.tolist()):
            np.testing.assert_array_equal(images[row], sample(i)["image"])
        data = bytearray(path.read_bytes())
        data[int(offsets[2] + lengths[2]) - 1] ^= 0x01  # the label's last byte
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptRecordError, match="sample 2: checksum mismatch"):
            read_rows(fd, ids, offsets[ids], lengths[ids], [(out, RECORD_HEADER.size, 20_000)], "f")
    finally:
        os.close(fd)


def test_fields_beyond_one_calls_pieces_are_sliced_not_read(tmp_path: Path, loop: str) -> None:
    from loaderd.miss_worker import reads_rows

    wide = Schema(tuple(Field(f"f{i}", "float32", (50,)) for i in range(600)))  # 120 KB
    size = BatchWriter(wide).layout.record_bytes
    assert size is not None
    assert not reads_rows(BatchWriter(wide), np.full(4, size))
    narrow = Schema(tuple(Field(f"f{i}", "float32", (50,)) for i in range(400)))
    assert reads_rows(BatchWriter(narrow), np.full(4, BatchWriter(narrow).layout.record_bytes))
    # Asked anyway, the read fails whole, as preadv does: no record is half read.
    path = tmp_path / "records"
    offsets, lengths = records_file(path)
    out = memoryview(bytearray(600 * 8))
    rows = [(out[i * 8 : (i + 1) * 8], RECORD_HEADER.size + 20 * i, 8) for i in range(600)]
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="Invalid argument"):
            read_rows(fd, np.array([0]), offsets[:1], lengths[:1], rows, "f")
    finally:
        os.close(fd)
