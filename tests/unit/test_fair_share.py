"""A fair share per connection in the server loop, and per stream in the assembly queue."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zmq

from loaderd.fair_share import Inbox, RoundRobin
from loaderd.prefetch import Assembler, Prefetcher
from loaderd.storage.store import SampleStore
from loaderd.storage.tiers import TierStack
from tests.helpers import make_npz, wait_until


def test_round_robin_takes_each_key_in_turn_and_keeps_each_keys_order() -> None:
    rr: RoundRobin[str, int] = RoundRobin()
    for i in range(4):
        rr.push("flood", i)
    rr.push("a", 10)
    rr.push("b", 20)
    rr.push("a", 11)
    got = []
    while (item := rr.pop()) is not None:
        got.append(item)
    first = [("flood", 0), ("a", 10), ("b", 20), ("flood", 1), ("a", 11)]
    assert got == [*first, ("flood", 2), ("flood", 3)]
    assert len(rr) == 0 and rr.keys() == []


def frames(request_id: int, payload: bytes = b"") -> list[zmq.Frame]:
    return [zmq.Frame(b"id"), zmq.Frame(b"x" * 16), zmq.Frame(payload)]


def test_the_inbox_bounds_each_backlog_and_hands_out_a_few_of_each_per_turn() -> None:
    inbox = Inbox(max_backlog=5, max_backlog_bytes=1 << 20, per_turn=2)
    for rid in range(8):
        reason = inbox.add(b"flood", frames(rid))
        assert (reason is None) == (rid < 5)
    assert reason is not None and "max_backlog_per_client" in reason and "\n" not in reason
    assert inbox.add(b"trainer", frames(100)) is None
    first = inbox.turn()
    # Two of the flooder's, one of the trainer's, taken in turn.
    assert len(first) == 3 and first[1][1].bytes == b"x" * 16
    s = inbox.stats()
    assert s["waiting"] == 3 and s["connections_waiting"] == 1
    assert s["peak_backlog"] == 5 and s["refused"] == 3
    assert inbox.add(b"flood", frames(9)) is None  # room again
    assert len(inbox.turn()) == 2 and len(inbox.turn()) == 2 and not inbox


def test_the_inbox_bounds_each_backlogs_bytes_but_takes_a_lone_large_request() -> None:
    inbox = Inbox(max_backlog=100, max_backlog_bytes=1000, per_turn=2)
    assert inbox.add(b"big", frames(1, b"y" * 5000)) is None  # alone: the socket bounds it
    assert inbox.add(b"big", frames(2)) is not None
    assert inbox.add(b"other", frames(3, b"y" * 900)) is None
    assert inbox.add(b"other", frames(4, b"y" * 200)) is not None


def test_assembly_takes_each_stream_in_turn(tmp_path: Path) -> None:
    """One worker, and the gate held while two streams queue: the worker then takes the
    flooding stream's and the other's batches in turn, not first come, first served."""
    from loaderd.storage.ingest import ingest

    make_npz(tmp_path / "d.npz", 64)
    ingest(tmp_path / "d.npz", tmp_path / "d.db", progress=False)
    with SampleStore(tmp_path / "d.db") as store:
        tiers = TierStack(store, 1 << 20, None)
        prefetcher = Prefetcher(Assembler(tiers, store.schema), workers=1)
        try:
            ids = np.arange(4, dtype=np.int64)
            weights = np.ones(4, np.float32)
            flood = [("flood", 0, 0, "train", i) for i in range(6)]
            trainer = [("trainer", 0, 0, "train", i) for i in range(2)]
            done: list[tuple[object, ...]] = []
            with prefetcher.gate:  # the one worker waits at the gate
                for key in [*flood, *trainer]:
                    prefetcher.submit(key, ids, weights)

            def finished() -> bool:
                done.extend(prefetcher.completed())
                return len(done) == len(flood) + len(trainer)

            wait_until(finished, timeout_s=30, what="every assembly")
            assert done == [flood[0], trainer[0], flood[1], trainer[1], *flood[2:]]
            assert all(prefetcher.get(k).result().ids.tolist() == [0, 1, 2, 3] for k in done)  # type: ignore[union-attr]
        finally:
            prefetcher.close()
            tiers.close()
