"""Shared-memory rings across processes, and what is left after either side is SIGKILLed."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from loaderd.client.pids import pid_alive
from loaderd.client.shm import ShmRing
from loaderd.shm_ring import LentRing, cleanup_stale
from tests.unit.test_shm import pack

pytestmark = pytest.mark.integration

PREFIX = "ldcrash-"

DAEMON = textwrap.dedent(
    """
    import sys
    from loaderd.shm_ring import LentRing
    ring = LentRing.create(4, 1 << 20, prefix=sys.argv[1], directory=sys.argv[2])
    slot = ring.acquire("someone")
    ring.view(slot)[:5] = b"hello"
    print(ring.name, flush=True)
    sys.stdin.readline()  # hold the ring until killed
    """
)

CLIENT = textwrap.dedent(
    """
    import json, sys, zlib
    from loaderd.client.shm import ShmRing, SlotDescriptor
    rings = {}
    held = []  # views kept, as a trainer keeps its batch tensors
    for line in sys.stdin:
        desc = SlotDescriptor.from_json(json.loads(line))
        if desc.ring not in rings:
            rings[desc.ring] = ShmRing.attach(desc.ring, directory=sys.argv[1])
        frames = rings[desc.ring].frames(desc)
        held.append(frames)
        print(json.dumps([zlib.crc32(f) for f in frames]), flush=True)
    """
)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    d = Path(
        tempfile.mkdtemp(prefix="ldshm-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


def test_killed_daemon_leaves_nothing_that_blocks_a_restart(shm_dir: Path) -> None:
    proc = _spawn(DAEMON, PREFIX, str(shm_dir))
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name.startswith(f"{PREFIX}{proc.pid}-")
        with ShmRing.attach(name, directory=shm_dir) as seen:
            assert (seen.slots, seen.slot_bytes) == (4, 1 << 20)
        assert cleanup_stale(PREFIX, directory=shm_dir) == []  # its owner still runs
    finally:
        _kill(proc)
    assert proc.returncode == -signal.SIGKILL
    assert (shm_dir / name).exists()  # a SIGKILL runs no cleanup: the segment stays behind

    with LentRing.create(2, 4096, prefix=PREFIX, directory=shm_dir) as live:
        assert cleanup_stale(PREFIX, directory=shm_dir) == [name]
        assert sorted(p.name for p in shm_dir.iterdir()) == [live.name]
        with ShmRing.attach(live.name, directory=shm_dir):
            pass


def test_killed_client_slots_are_reclaimed(shm_dir: Path) -> None:
    rng = np.random.default_rng(1)
    with LentRing.create(3, 1 << 16, prefix=PREFIX, directory=shm_dir) as ring:
        proc = _spawn(CLIENT, str(shm_dir))
        try:
            assert proc.stdin is not None and proc.stdout is not None
            owner = ("pid", proc.pid)
            for _ in range(2):
                slot = ring.acquire(owner)
                assert slot is not None
                frames = [rng.bytes(n) for n in (100, 7, 40_000)]
                desc = pack(ring, slot, frames)
                proc.stdin.write(json.dumps(desc.to_json()) + "\n")
                proc.stdin.flush()
                # The other process reads exactly these bytes through its own mapping.
                assert json.loads(proc.stdout.readline()) == [zlib.crc32(f) for f in frames]
            other = ring.acquire("other")
            assert ring.free_count == 0 and ring.acquire(owner) is None
        finally:
            _kill(proc)

        assert not pid_alive(proc.pid)  # how the daemon learns the consumer is gone
        assert len(ring.reclaim(owner)) == 2
        assert ring.lent() == {other: "other"} and ring.free_count == 2
        slot = ring.acquire("next")
        assert slot is not None
        desc = pack(ring, slot, [b"fresh"])
        with ShmRing.attach(ring.name, directory=shm_dir) as client:
            assert [bytes(f) for f in client.frames(desc)] == [b"fresh"]


FORKER = textwrap.dedent(
    """
    import os, sys
    from loaderd.shm_ring import LentRing
    ring = LentRing.create(1, 4096, prefix=sys.argv[1], directory=sys.argv[2])
    pid = os.fork()
    if pid == 0:
        ring.close()
        os._exit(0)
    os.waitpid(pid, 0)
    print(ring.path.exists(), flush=True)
    ring.close()
    print(ring.path.exists(), flush=True)
    """
)


def test_forked_child_does_not_unlink_its_parents_ring(shm_dir: Path) -> None:
    # Forked in a fresh interpreter: forking pytest itself (threads from torch) is unsafe.
    out = subprocess.run(
        [sys.executable, "-c", FORKER, PREFIX, str(shm_dir)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.split() == ["True", "False"]
