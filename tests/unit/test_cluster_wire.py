"""loaderd/cluster_wire.py: contributions and rounds round-trip, compactly and canonically."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaderd.cluster_wire import (
    Entries,
    JobStatus,
    Pending,
    RankStatus,
    WireError,
    coalesce,
    contribution_seqs,
    decode_contribution,
    decode_round,
    encode_contribution,
    encode_round,
    make_round,
    split_round,
    status_key,
)
from loaderd.importance import ImportanceConfig, ImportanceEngine

STATUS = {
    "b": JobStatus(
        {"name": "b", "world_size": 4, "options": {"sampler": "uniform"}},
        {2: RankStatus(3, "train", False), 3: RankStatus(3, "rescore", True, (3, "train"))},
    ),
    "a": JobStatus(
        {"name": "a", "world_size": 1}, {0: RankStatus(0, "rescore", False, (0, "rescore"))}
    ),
}


def entries(job: str, epoch: int, kind: str, ids: list[int] | np.ndarray) -> Entries:
    ids = np.asarray(ids, np.int64)
    return Entries(job, epoch, kind, ids, (ids % 13).astype(np.float32) + 0.5)


def same(a: Entries, b: Entries) -> bool:
    return (a.job, a.epoch, a.kind) == (b.job, b.epoch, b.kind) and (
        np.array_equal(a.ids, b.ids) and np.array_equal(a.losses, b.losses)
    )


def test_coalesce_orders_by_job_epoch_rescore_first_and_keeps_submission_order() -> None:
    pending = [
        Pending(1, entries("b", 4, "train", [9, 1])),
        Pending(2, entries("a", 4, "train", [5])),
        Pending(3, entries("b", 4, "rescore", [7])),
        Pending(4, entries("b", 3, "train", [2])),
        Pending(5, entries("b", 4, "train", [3, 8])),
    ]
    blocks = coalesce(pending)
    assert [(b.job, b.epoch, b.kind) for b in blocks] == [
        ("a", 4, "train"),
        ("b", 3, "train"),
        ("b", 4, "rescore"),
        ("b", 4, "train"),
    ]
    assert blocks[3].ids.tolist() == [9, 1, 3, 8]


def test_round_trip_with_status_raw_and_bitmap_blocks() -> None:
    dense = np.random.default_rng(0).permutation(10_000)[:5000]  # a rank's share of an epoch
    blocks = [
        entries("a", 0, "train", [17, 3, 900_000]),  # sparse: raw ids, submission order
        entries("b", 2, "rescore", dense),  # dense and unique: a bitmap, ids in order
        entries("b", 3, "train", [5, 5, 6]),  # a repeated id: raw, every entry kept
        entries("b", 4, "train", []),
    ]
    data = encode_contribution(10, 14, STATUS, blocks)
    got = decode_contribution(2, data)
    assert (got.node, got.seq_lo, got.seq_hi) == (2, 10, 14)
    assert got.status == STATUS
    assert same(got.blocks[0], blocks[0]) and same(got.blocks[2], blocks[2])
    order = np.argsort(dense)
    assert np.array_equal(got.blocks[1].ids, dense[order])
    assert np.array_equal(got.blocks[1].losses, blocks[1].losses[order])
    assert len(got.blocks[3].ids) == 0
    # the bitmap block costs a bit over 4 bytes a sample instead of 12
    assert len(data) < 5000 * 4.5 + 200 + 12 * 6


def test_applying_the_decoded_block_gives_the_same_engine_state() -> None:
    """Bitmap coding reorders a block's unique ids; the engine's state must not care."""
    rng = np.random.default_rng(1)
    n = 2000
    ids = rng.permutation(n)[:1500].astype(np.int64)
    losses = rng.random(1500).astype(np.float32)
    decoded = decode_contribution(
        0, encode_contribution(0, 1, {}, [Entries("j", 3, "train", ids, losses)])
    )
    config = ImportanceConfig(sampler="importance", warmup_epochs=2)
    a, b = ImportanceEngine(n, config), ImportanceEngine(n, config)
    a.record(ids, losses, 3, "train")
    b.record(decoded.blocks[0].ids, decoded.blocks[0].losses, 3, "train")
    for key, value in a.state_dict().items():
        assert np.array_equal(value, b.state_dict()[key], equal_nan=True), key


def test_round_record_round_trip_and_seqs() -> None:
    blobs = [
        encode_contribution(0, 3, STATUS, [entries("a", 1, "train", [1, 2, 3])]),
        encode_contribution(7, 7, {}, []),
        encode_contribution(2, 9, {}, [entries("a", 1, "train", [4])]),
    ]
    record = encode_round(12, blobs)
    number, back = split_round(record)
    assert number == 12 and [b.tobytes() for b in back] == [b.tobytes() for b in blobs]
    rnd = decode_round(record)
    assert rnd.number == 12 and [c.node for c in rnd.contributions] == [0, 1, 2]
    assert [b.ids.tolist() for b in rnd.entries()] == [[1, 2, 3], [4]]
    assert rnd.num_entries == 4
    assert [contribution_seqs(b) for b in blobs] == [(0, 3), (7, 7), (2, 9)]
    assert make_round(12, blobs).contributions[0].status == STATUS


def test_status_key_is_canonical() -> None:
    reordered = dict(reversed(list(STATUS.items())))
    assert status_key(reordered) == status_key(STATUS)
    changed = {**STATUS, "a": JobStatus(STATUS["a"].spec, {0: RankStatus(0, "rescore", True)})}
    assert status_key(changed) != status_key(STATUS)


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[:20],  # shorter than its header
        lambda d: np.concatenate([np.frombuffer(b"XXXX", np.uint8), d[4:]]),  # bad magic
        lambda d: d[:-16],  # a block runs past the end
    ],
)
def test_damaged_contribution_is_refused(damage: object) -> None:
    data = encode_contribution(0, 1, STATUS, [entries("a", 0, "train", [1, 2, 3, 4])])
    with pytest.raises(WireError, match="contribution of node 5"):
        decode_contribution(5, damage(data))  # type: ignore[operator]


def test_damaged_round_is_refused() -> None:
    record = encode_round(3, [encode_contribution(0, 0, {}, [])])
    with pytest.raises(WireError):
        split_round(record[:10])
    with pytest.raises(WireError):
        split_round(b"LDXX" + record[4:])


block_strategy = st.builds(
    lambda job, epoch, kind, ids: entries(job, epoch, kind, ids),
    st.sampled_from(["a", "b", "c"]),
    st.integers(0, 5),
    st.sampled_from(["train", "rescore"]),
    st.one_of(
        st.lists(st.integers(0, 10**12), max_size=30),
        st.lists(st.integers(0, 300), max_size=300, unique=True),
    ),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(block_strategy, max_size=6))
def test_any_blocks_round_trip(blocks: list[Entries]) -> None:
    pending = [Pending(i + 1, b) for i, b in enumerate(blocks)]
    coalesced = coalesce(pending)
    got = decode_contribution(0, encode_contribution(0, len(blocks), {}, coalesced)).blocks
    assert len(got) == len(coalesced)
    for sent, back in zip(coalesced, got, strict=True):
        assert (sent.job, sent.epoch, sent.kind) == (back.job, back.epoch, back.kind)
        if len(np.unique(sent.ids)) == len(sent.ids):  # maybe a bitmap: same pairs, id order
            order = np.argsort(sent.ids, kind="stable")
            if not np.array_equal(back.ids, sent.ids):
                assert np.array_equal(back.ids, sent.ids[order])
                assert np.array_equal(back.losses, sent.losses[order])
        else:
            assert same(sent, back)
