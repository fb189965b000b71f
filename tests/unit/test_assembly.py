"""Batch assembly of large fixed-field records: the store's bytes, a bad one fails cleanly."""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np
import pytest

from loaderd.prefetch import Assembler, BatchWriter
from loaderd.storage.errors import CorruptRecordError
from loaderd.storage.records import Field, RecordCodec, Schema
from loaderd.storage.store import SampleStore, sample_key
from loaderd.storage.store_writer import StoreWriter
from loaderd.storage.tiers import TierStack

IMAGE = 40_000  # above the size where records are joined: copied row by row
SCHEMA = Schema((Field("image", "uint8", (IMAGE,)), Field("label", "int64")))
N = 30


def make_store(path: Path) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, IMAGE, dtype=np.uint8) for _ in range(N)]
    codec = RecordCodec(SCHEMA)
    with StoreWriter(path, SCHEMA) as w:
        w.append(codec.encode({"image": images[i], "label": i}) for i in range(N))
    return images


def test_assembled_batches_hold_the_store_bytes(tmp_path: Path) -> None:
    images = make_store(tmp_path / "s.db")
    with TierStack(SampleStore(tmp_path / "s.db"), 8 * (IMAGE + 64)) as stack:
        assembler = Assembler(stack, SCHEMA)
        rng = np.random.default_rng(0)
        for _ in range(4):  # misses, then some DRAM hits among them, a repeated id too
            ids = rng.integers(0, N, 12)
            batch = assembler.assemble(ids, np.ones(len(ids), np.float32))
            image = np.asarray(batch.columns["image"])
            assert (image == np.stack([images[i] for i in ids])).all()
            assert np.asarray(batch.columns["label"]).tolist() == ids.tolist()
            assert np.asarray(batch.ids).tolist() == ids.tolist()


def test_a_corrupt_record_fails_the_batch_and_holds_no_memory(tmp_path: Path) -> None:
    make_store(tmp_path / "s.db")
    env = lmdb.open(str(tmp_path / "s.db"), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"samples")) as txn:
        rec = bytearray(txn.get(sample_key(7)))
        rec[-1] ^= 0xFF
        txn.put(sample_key(7), bytes(rec))
    env.close()

    class Lease:
        lent = released = 0

        def release(self) -> None:
            Lease.released += 1

    def allocate(sizes: list[int]) -> object:
        from loaderd.prefetch import Placed, fresh

        Lease.lent += 1
        return Placed(fresh(sizes).frames, Lease())

    with TierStack(SampleStore(tmp_path / "s.db"), 0) as stack:
        assembler = Assembler(stack, SCHEMA)
        ids = np.array([3, 7, 4])
        with pytest.raises(CorruptRecordError, match="sample 7"):
            assembler.assemble(ids, np.ones(3, np.float32), allocate)  # type: ignore[arg-type]
        assert Lease.released == Lease.lent  # nothing lent is left held
        ok = assembler.assemble(np.array([3, 4]), np.ones(2, np.float32))
        assert np.asarray(ok.columns["label"]).tolist() == [3, 4]


def test_every_finished_batch_is_announced_to_a_loop_that_waits_on_the_pipe(
    tmp_path: Path,
) -> None:
    """Completions wake the loop once per drain, not once per batch: a loop that looks only
    when the pipe is readable (as the server's does) still gets every key, exactly once."""
    import select

    from loaderd.prefetch import Prefetcher

    make_store(tmp_path / "s.db")
    with TierStack(SampleStore(tmp_path / "s.db"), 0) as stack:
        prefetcher = Prefetcher(Assembler(stack, SCHEMA), workers=3, inline_bytes=0)
        try:
            rng = np.random.default_rng(1)
            keys = [("job", rank, 0, "train", i) for i in range(40) for rank in range(3)]
            got: list[tuple[object, ...]] = []
            for n, key in enumerate(keys):
                prefetcher.submit(key, rng.integers(0, N, 4), np.ones(4, np.float32))
                if n % 7 == 0:  # the loop drains now and then while batches still finish
                    readable, _, _ = select.select([prefetcher.wake_fd], [], [], 0)
                    if readable:
                        got += prefetcher.completed()
            while len(got) < len(keys):
                readable, _, _ = select.select([prefetcher.wake_fd], [], [], 60)
                assert readable, f"no wake-up with {len(keys) - len(got)} batches unannounced"
                got += prefetcher.completed()
            assert sorted(got) == sorted(keys)
        finally:
            prefetcher.close()


def test_a_batchs_frame_bytes_follow_from_its_records_total_length() -> None:
    schema = Schema(
        (
            Field("image", "uint8", (5,)),  # padded to 8 bytes in a record
            Field("label", "int64"),
            Field("tag", "binary"),
            Field("text", "string"),
        )
    )
    codec = RecordCodec(schema)
    writer = BatchWriter(schema)
    rng = np.random.default_rng(1)
    for n in (1, 7, 64):
        records = [
            codec.encode(
                {
                    "image": rng.integers(0, 256, 5, dtype=np.uint8),
                    "label": i,
                    "tag": rng.bytes(int(rng.integers(0, 3000))),
                    "text": "x" * int(rng.integers(0, 40)),
                }
            )
            for i in range(n)
        ]
        sizes, _ = writer.measure(records)
        assert writer.frame_bytes(n, sum(map(len, records))) == sum(sizes)


def test_hits_of_views_of_a_locked_map_are_gathered_by_address(tmp_path: Path) -> None:
    """Records of fixed fields held as views of the locked map (a DRAM tier that holds the
    store): a hit batch is copied from their addresses, and holds the store's bytes."""
    small = Schema((Field("image", "uint8", (3000,)), Field("label", "int64")))
    rng = np.random.default_rng(9)
    images = [rng.integers(0, 256, 3000, dtype=np.uint8) for _ in range(N)]
    codec = RecordCodec(small)
    with StoreWriter(tmp_path / "s.db", small) as w:
        w.append(codec.encode({"image": images[i], "label": i}) for i in range(N))
    store = SampleStore(tmp_path / "s.db")
    with TierStack(store, 1 << 22) as stack:
        if not store.map_locked:
            pytest.skip("this process may not lock the store's map in RAM")
        assembler = Assembler(stack, small)
        every = np.arange(N)
        assembler.assemble(every, np.ones(N, np.float32))  # misses: admitted as views
        for _ in range(4):
            ids = rng.integers(0, N, 9)
            assert stack.located(ids) is not None  # the path this hit takes
            hits = stack.stats()["cache"]["hits"]
            batch = assembler.assemble_resident(ids, np.full(len(ids), 0.5, np.float32))
            assert batch is not None and stack.stats()["cache"]["hits"] == hits + len(ids)
            assert (np.asarray(batch.columns["image"]) == np.stack([images[i] for i in ids])).all()
            assert np.asarray(batch.columns["label"]).tolist() == ids.tolist()
            assert np.asarray(batch.weights).tolist() == [0.5] * len(ids)
