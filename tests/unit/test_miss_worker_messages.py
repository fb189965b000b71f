"""What the daemon and a miss worker send each other, packed by hand: back as it went."""

from __future__ import annotations

import numpy as np
import pytest

from loaderd.miss_messages import decode_reply, decode_task, encode_reply, encode_task


@pytest.mark.parametrize("from_map", [True, False])
@pytest.mark.parametrize("with_arena", [True, False])
@pytest.mark.parametrize("with_spans", [True, False])
@pytest.mark.parametrize("n", [0, 1, 64])
def test_a_task_arrives_as_it_was_sent(
    with_spans: bool, with_arena: bool, n: int, from_map: bool
) -> None:
    rng = np.random.default_rng(n)
    ids = rng.integers(0, 2**40, n)
    weights = rng.random(n).astype(np.float32)
    spans = (rng.integers(0, 2**35, n), rng.integers(16, 2**20, n)) if with_spans else None
    arena = None
    if with_arena:
        arena = (
            "2049:1234:/mnt/pmem/a b:c.arena",
            rng.integers(-1, 2**30, n),
            rng.integers(0, 9, n),
        )
    live = ["loaderd-ring-a", "loaderd-ring-b"]
    raw = encode_task("loaderd-ring-b", 7, ids, weights, live, spans, arena, from_map)
    ring, slot, got_ids, got_weights, got_live, got_spans, got_arena, got_map = decode_task(raw)
    assert (ring, slot, got_live, got_map) == ("loaderd-ring-b", 7, live, from_map)
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_weights, weights)
    if spans is None:
        assert got_spans is None
    else:
        assert got_spans is not None
        np.testing.assert_array_equal(got_spans[0], spans[0])
        np.testing.assert_array_equal(got_spans[1], spans[1])
    if arena is None:
        assert got_arena is None
    else:
        assert got_arena is not None and got_arena[0] == arena[0]
        np.testing.assert_array_equal(got_arena[1], arena[1])
        np.testing.assert_array_equal(got_arena[2], arena[2])
    assert decode_task(encode_task("r", 0, ids, weights, [], spans))[4] == []


def test_replies_arrive_as_they_were_sent() -> None:
    offsets, lengths = np.array([4096, -1, 81920]), np.array([3016, 3016, 100016])
    kind, sizes, got_offsets, got_lengths = decode_reply(
        encode_reply(("ok", [24, 12, 9048], offsets, lengths))
    )
    assert (kind, sizes) == ("ok", [24, 12, 9048])
    np.testing.assert_array_equal(got_offsets, offsets)
    np.testing.assert_array_equal(got_lengths, lengths)
    for failed in [("full", "the batch needs 9 bytes"), ("error", "KeyError: 'sample 3'")]:
        assert decode_reply(encode_reply(failed)) == failed
