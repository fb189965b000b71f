"""Shared test helpers: a real daemon in a subprocess, and waiting on conditions."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loaderd.client.connection import Connection
from loaderd.client.protocol import MsgType
from loaderd.launch import start_daemon, stop_daemon, wait_ready
from loaderd.storage.memory import memory_cgroup


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (other tests run beside ours)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def evict(db: Path) -> None:
    """Drop a store's ``data.mdb`` from the page cache (``posix_fadvise(DONTNEED)``)."""
    fd = os.open(db / "data.mdb", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mapped_kib(path: Path, *fields: str, pid: int | str = "self") -> tuple[int, ...]:
    """KiB of ``path`` that process ``pid`` maps, per ``/proc/<pid>/smaps`` field of its
    mappings (``"Rss"``, ``"Locked"``, ``"Anonymous"``: its own pages), summed."""
    totals = dict.fromkeys(fields, 0)
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split(" ", 1)[0]:  # a mapping's first line
            inside = line.endswith(str(path.resolve()))
        elif inside and (name := line.split(":", 1)[0]) in totals:
            totals[name] += int(line.split()[1])
    return tuple(totals[f] for f in fields)


def wait_until(pred: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``pred`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def _overflow_node(data: bytes | bytearray, sample_id: int, db: Path) -> int:
    """Where the leaf node of a value kept in overflow pages starts in a data.mdb's bytes."""
    key = sample_id.to_bytes(8, "big")
    at = data.find(key)
    while at >= 0:
        _, _, flags, ksize = struct.unpack_from("<4H", data, at - 8)
        if ksize == 8 and flags & 0x01:  # F_BIGDATA: the node of a value in overflow pages
            return at - 8
        at = data.find(key, at + 1)
    raise AssertionError(f"no overflow node for sample {sample_id} in {db}")


def damage_value_length(db: Path, sample_id: int) -> None:
    """Make the leaf node of a value kept in overflow pages say it runs 16 MiB past the file.

    The kind of damage LMDB does not check: its ``get`` returns the value as the node says.
    """
    data = bytearray((db / "data.mdb").read_bytes())
    node = _overflow_node(data, sample_id, db)
    struct.pack_into("<H", data, node + 2, 0x0100)  # the length's high half: +16 MiB
    (db / "data.mdb").write_bytes(data)


def point_value_at(db: Path, sample_id: int, other: int) -> None:
    """Make a leaf node's overflow page number that of another sample's value (a bit flip
    that lands on another record): LMDB then returns that record, whole, for this id."""
    data = bytearray((db / "data.mdb").read_bytes())
    mine, theirs = _overflow_node(data, sample_id, db), _overflow_node(data, other, db)
    data[mine + 16 : mine + 24] = data[theirs + 16 : theirs + 24]
    (db / "data.mdb").write_bytes(data)


def make_npz(
    path: Path, n: int, shape: tuple[int, ...] = (3, 8, 8), seed: int = 0
) -> dict[str, np.ndarray]:
    """A small dataset whose image bytes encode the sample index (easy to check)."""
    rng = np.random.default_rng(seed)
    arrays = {
        "image": rng.integers(0, 256, (n, *shape), dtype=np.uint8),
        "label": (np.arange(n) % 10).astype(np.int64),
    }
    np.savez(path, **arrays)
    return arrays


@dataclass
class Daemon:
    """A ``loaderd serve`` subprocess on a temporary ipc socket."""

    db: Path
    state_dir: Path
    extra: list[str] = field(default_factory=list)
    sock_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ld-", dir="/tmp")))
    under: list[str] = field(default_factory=list)  # a command the daemon runs under
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        # ipc paths must stay under ~100 characters, so the socket lives in /tmp
        return f"ipc://{self.sock_dir}/d.sock"

    @property
    def log(self) -> Path:
        return self.state_dir.parent / f"{self.state_dir.name}.log"

    def start(self) -> Daemon:
        self.state_dir.parent.mkdir(parents=True, exist_ok=True)
        self.proc = start_daemon(
            self.db,
            self.address,
            state_dir=self.state_dir,
            extra=self.extra,
            log=self.log,
            under=self.under,
        )
        try:
            wait_ready(self.address, timeout_s=20, proc=self.proc)
        except Exception:
            print(self.log.read_text())
            raise
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        assert self.proc is not None
        return stop_daemon(self.proc, timeout_s=10)

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_daemon(self.proc, timeout_s=5)
        if self.log.exists():
            print(self.log.read_text()[-4000:])  # shown when the test fails
        shutil.rmtree(self.sock_dir, ignore_errors=True)


@contextmanager
def memory_limited(limit_bytes: int) -> Iterator[list[str] | None]:
    """A memory cgroup of ``limit_bytes`` below this process's own: ``under`` for a daemon.

    A container's limit, for real: the kernel kills a process of the group once the group
    goes past it. The command joins the group, then execs the daemon. None where no group
    can be made here (not root, or no memory controller to write to). The group is removed
    once empty, after the block.
    """
    own = memory_cgroup()
    if own is None:
        yield None
        return
    folder = own[1] / f"loaderd-test-{os.getpid()}"
    under = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(folder / "cgroup.procs")]
    try:
        folder.mkdir()
    except OSError:
        yield None
        return
    try:
        limit = "memory.limit_in_bytes" if own[0] == 1 else "memory.max"
        (folder / limit).write_text(str(limit_bytes))
        joined = subprocess.run([*under, "true"], capture_output=True, check=False)
    except OSError:
        joined = None
    if joined is None or joined.returncode != 0:  # no limit to set, or no joining it here
        folder.rmdir()
        yield None
        return
    try:
        yield under
    finally:
        wait_until(
            lambda: not (folder / "cgroup.procs").read_text().strip(), what="the group empty"
        )
        folder.rmdir()


def daemon_shm(address: str) -> dict[str, Any]:
    """The ``shm`` section of a daemon's statistics."""
    with Connection(address, timeout_s=10.0) as conn:
        meta = conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta
    return dict(meta["shm"])


@contextmanager
def client_process(script: str, *args: str, ready: str) -> Iterator[subprocess.Popen[bytes]]:
    """``python -c script *args``, once it has printed the line ``ready``; killed on exit."""
    with subprocess.Popen(
        [sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().decode().strip() == ready
        try:
            yield proc
        finally:
            proc.kill()
