"""Unit tests of the hardening pieces: crash points, cursor resume, liveness, key files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from loaderd import crashpoints
from loaderd.client.curve import ClientKeys, KeyFileError
from loaderd.client.pids import pid_alive
from loaderd.client.resume import PassProgress, check_state
from loaderd.consumers import Consumers
from loaderd.jobs import JobError, JobSpec
from loaderd.pass_state import PassState
from loaderd.planner import plan_pass


def test_crash_point_parsing() -> None:
    with pytest.raises(ValueError, match="unknown crash point 'nowhere'"):
        crashpoints.arm("nowhere:1")
    with pytest.raises(ValueError, match="must be >= 1"):
        crashpoints.arm("ack:0")
    with pytest.raises(ValueError, match="must be an int"):
        crashpoints.arm("ack:x")
    crashpoints.arm(None)
    crashpoints.hit("ack")  # unarmed: nothing happens


def test_crash_point_exits_at_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []

    def fake_exit(status: int) -> None:
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(crashpoints.os, "_exit", fake_exit)
    crashpoints.arm("ack:3")
    passed = 0
    with pytest.raises(SystemExit):
        for _ in range(5):
            crashpoints.hit("deliver")  # another point: never counted
            crashpoints.hit("ack")
            passed += 1
    assert passed == 2 and exits == [crashpoints.EXIT_STATUS]
    crashpoints.arm(None)


def make_pass(batches: int = 6) -> PassState:
    ids = np.arange(batches * 4)
    plan = plan_pass(
        ids,
        np.ones(len(ids), np.float32),
        seed=0,
        epoch=0,
        phase="train",
        world_size=1,
        batch_size=4,
    )[0]
    return PassState.start(0, "train", plan)


def test_acks_of_queued_batches_count_and_restore_keeps_inflight() -> None:
    p = make_pass()
    assert [p.assign(0), p.assign(1)] == [0, 1]
    assert p.ack([3, 3, 99]) == 1, "a queued batch may be acknowledged once; 99 is no batch"
    assert 3 not in p.queue and 3 in p.acked
    restored = PassState.start(0, "train", p.plan, set(p.acked), dict(p.inflight))
    assert restored.inflight == {0: 0, 1: 1}
    assert list(restored.queue) == [2, 4, 5]
    assert restored.requeue(1) == 1 and list(restored.queue) == [1, 2, 4, 5]


def test_world_size_is_bounded_before_allocation() -> None:
    with pytest.raises(JobError, match="world_size"):
        JobSpec("j", 1 << 40, 0, 8).check(65536)


def test_pass_progress_and_state_validation() -> None:
    p = PassProgress("train")
    assert p.resume_meta() == {}
    p.begin(3)
    p.delivered |= {2, 0}
    assert p.resume_meta() == {"resume": {"epoch": 3, "delivered": [0, 2]}}
    p.begin(4)
    assert p.seen == p.delivered == set()
    with pytest.raises(ValueError, match="not a LoaderdDataset state"):
        check_state({"version": 99})


def test_consumers_notice_a_dead_pid() -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead = next(p for p in range(pid_max - 1, 1, -1) if not Path(f"/proc/{p}").exists())
    assert pid_alive(os.getpid()) and not pid_alive(dead)
    c = Consumers(timeout_s=60)
    ns = os.readlink("/proc/self/ns/pid")
    c.hello(b"a", dead, ns, local=True)
    c.hello(b"b", os.getpid(), ns, local=True)
    c.hello(b"r", dead, ns, local=False)  # a remote pid means nothing here
    c.seen(("j", 0, 0), b"a")
    c.seen(("j", 0, 1), b"b")
    c.seen(("j", 0, 2), b"r")
    assert c.gone() == [("j", 0, 0)]
    assert len(c) == 2


def test_missing_key_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match=r"client\.key_secret"):
        ClientKeys.load(tmp_path)
