"""kill -9 a process writing into an arena on a real file; reopen; only whole records come back.

SIGKILL tests the process-crash contract (stores already made to a shared mapping survive);
a power loss cannot be simulated here.
"""

from __future__ import annotations

import os
import random
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from time import monotonic

import pytest

from loaderd.storage.arena import Arena, record_extent
from tests.integration.arena_crash_writer import (
    CAPACITY,
    FP,
    N_IDS,
    SNAPSHOT_BYTES,
    record,
    snapshot,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def lines(proc: subprocess.Popen[bytes], timeout_s: float) -> Iterator[str]:
    """The writer's stdout, line by line, failing if it dies or stays silent too long."""
    assert proc.stdout is not None
    fd, buf = proc.stdout.fileno(), b""
    deadline = monotonic() + timeout_s
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - monotonic()))
        if not ready:
            raise TimeoutError(f"the arena writer was silent for {timeout_s} s")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        buf += chunk


def run_and_kill(mode: str, path: Path, first: int, target: int) -> tuple[int, int]:
    """Start a writer, SIGKILL it once it reports `target`; return (recovered, last reported)."""
    cmd = [sys.executable, "-m", "tests.integration.arena_crash_writer", mode, str(path)]
    proc = subprocess.Popen(
        [*cmd, str(first)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    recovered, last = -1, first - 1
    try:
        out = lines(proc, timeout_s=10)
        for line in out:
            if line.startswith("open"):
                recovered = int(line.split()[1])
            else:
                last = int(line)  # a batch's last k: this one may pass target by up to 15
                if last >= target:
                    break
        proc.kill()
        proc.wait(timeout=5)
        for line in out:  # what it reported between our read and the kill
            last = max(last, int(line)) if not line.startswith("open") else last
        assert proc.returncode == -9, proc.stderr.read().decode() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    return recovered, max(last, target)


def test_kill_during_record_writes(tmp_path: Path) -> None:
    path = tmp_path / "arena.bin"
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    served_before = -1
    for rnd in range(6):
        first = rnd * 1_000_000
        target = first + rng.randrange(0, 1_200)
        recovered, last = run_and_kill("log", path, first, target)
        why = f"seed {seed}, round {rnd}, killed after k={last}"
        if rnd:
            assert recovered == served_before, f"{why}: the writer recovered another set"
        with Arena(path, CAPACITY, FP, snapshot_bytes=SNAPSHOT_BYTES) as arena:
            assert not arena.rebuilt, why
            served: dict[int, int] = {}
            for sid in arena.ids().tolist():
                data = arena.get(sid)
                assert data is not None, f"{why}: recovered sample {sid} is not whole"
                k = int.from_bytes(data[:8], "little")
                assert record(k) == (sid, data), f"{why}: sample {sid} has wrong bytes"
                assert k <= last + 16, f"{why}: sample {sid} from k={k}, never written"
                served[sid] = k
            # Everything committed lately is back, in its newest version: walk back from the
            # last acknowledged put over half the ring, which no eviction can have reached.
            budget, seen = arena.capacity_bytes // 2, set()
            for k in range(last, first - 1, -1):
                sid, data = record(k)
                budget -= record_extent(len(data))
                if budget < 0:
                    break
                if sid not in seen:
                    seen.add(sid)
                    assert served.get(sid, -1) >= k, f"{why}: lost sample {sid} (k={k})"
            assert arena.corrupt_dropped == 0
            served_before = len(served)
        assert 0 < served_before <= N_IDS


def test_kill_during_snapshot_writes(tmp_path: Path) -> None:
    path = tmp_path / "arena.bin"
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    for rnd in range(6):
        first = rnd * 1000
        target = first + rng.randrange(0, 6)
        _, last = run_and_kill("snapshot", path, first, target)
        why = f"seed {seed}, round {rnd}, killed after step {last}"
        with Arena(path, CAPACITY, FP, snapshot_bytes=SNAPSHOT_BYTES) as arena:
            got = arena.read_snapshot("crash")
            assert got is not None, f"{why}: no whole snapshot"
            job, step, data = got
            assert job == "crash" and last <= step <= last + 1, f"{why}: got step {step}"
            assert data == snapshot(step), f"{why}: snapshot {step} has wrong bytes"
