"""loaderd/cluster_log.py: the round log and the outbox survive restarts and torn tails."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loaderd.cluster_log import Outbox, RoundLog
from loaderd.cluster_wire import Entries, Pending


def record(n: int) -> bytes:
    return f"round {n} ".encode() * (n % 5 + 1)


def test_round_log_survives_a_restart(tmp_path: Path) -> None:
    log = RoundLog(tmp_path)
    assert (log.first, log.last) == (1, 0)
    for n in range(1, 6):
        log.append(n, record(n))
    assert log.read(3) == record(3)
    log.close()
    with RoundLog(tmp_path) as again:
        assert (again.first, again.last) == (1, 5) and 4 in again and 6 not in again
        assert [again.read(n) for n in range(1, 6)] == [record(n) for n in range(1, 6)]
        again.append(6, record(6))  # goes on in a new segment
        assert again.read(6) == record(6)
        with pytest.raises(ValueError, match="round 8 does not follow round 6"):
            again.append(8, record(8))


def test_round_log_cuts_a_torn_tail(tmp_path: Path) -> None:
    log = RoundLog(tmp_path)
    for n in range(1, 4):
        log.append(n, record(n))
    log.close()
    (segment,) = tmp_path.glob("rounds-*.log")
    size = segment.stat().st_size
    with open(segment, "r+b") as f:
        f.truncate(size - 5)  # the daemon died inside round 3's append
    with RoundLog(tmp_path) as again:
        assert again.last == 2 and segment.stat().st_size < size - 5
        again.append(3, b"redone")
    with RoundLog(tmp_path) as third:
        assert third.read(3) == b"redone"


def test_round_log_detects_a_corrupt_record(tmp_path: Path) -> None:
    log = RoundLog(tmp_path)
    for n in range(1, 4):
        log.append(n, record(n))
    log.close()
    (segment,) = tmp_path.glob("rounds-*.log")
    data = bytearray(segment.read_bytes())
    data[-12] ^= 0xFF  # inside round 3's payload
    segment.write_bytes(bytes(data))
    with RoundLog(tmp_path) as again:
        assert again.last == 2


def test_compaction_drops_whole_segments_only(tmp_path: Path) -> None:
    log = RoundLog(tmp_path)
    for n in range(1, 5):
        log.append(n, record(n))
    assert log.compact(2) == 0  # rounds 3-4 share the segment: it stays, and is closed
    for n in range(5, 8):
        log.append(n, record(n))
    assert log.compact(5) == 4 and log.first == 5
    assert log.compact(7) == 3 and (log.first, log.last) == (8, 7)
    log.append(8, record(8))
    log.close()
    with RoundLog(tmp_path) as again:
        assert (again.first, again.last) == (8, 8)
        with pytest.raises(KeyError):
            again.read(4)


def pending(seq: int, n: int = 3) -> Pending:
    ids = np.arange(seq, seq + n, dtype=np.int64)
    return Pending(seq, Entries(f"job{seq % 2}", seq // 4, "train", ids, ids.astype(np.float32)))


def same(a: list[Pending], b: list[Pending]) -> bool:
    return [(p.seq, p.entries.job, p.entries.epoch, p.entries.ids.tolist()) for p in a] == [
        (p.seq, p.entries.job, p.entries.epoch, p.entries.ids.tolist()) for p in b
    ]


def test_outbox_keeps_synced_entries_and_its_floor(tmp_path: Path) -> None:
    path = tmp_path / "outbox.log"
    box = Outbox(path)
    assert (box.floor, box.pending) == (0, [])
    entries = [pending(s) for s in range(1, 6)]
    for p in entries:
        box.append(p)
    box.sync()
    box.close()
    box.close()
    with Outbox(path) as again:
        assert again.floor == 0 and same(again.pending, entries)
        again.reset(3, entries[3:])  # rounds carried 1..3
        again.append(pending(6))
    with Outbox(path) as third:
        assert third.floor == 3 and same(third.pending, [*entries[3:], pending(6)])
        third.reset(6, [], sync=True)
    with Outbox(path) as fourth:
        assert fourth.floor == 6 and fourth.pending == []


def test_outbox_cuts_a_torn_entry(tmp_path: Path) -> None:
    path = tmp_path / "outbox.log"
    box = Outbox(path)
    box.append(pending(1))
    box.append(pending(2, n=100))
    box.close()
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 40)
    with Outbox(path) as again:
        assert same(again.pending, [pending(1)])
