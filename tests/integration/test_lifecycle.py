"""The daemon's lifecycle: SIGTERM, a second daemon on the same paths, stale files after kill -9."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loaderd.client import LoaderdDataset
from loaderd.launch import wait_ready
from tests.helpers import Daemon

pytestmark = pytest.mark.integration


def ipc_path(d: Daemon) -> Path:
    return Path(d.address[len("ipc://") :])


def test_sigterm_flushes_state_and_removes_the_socket(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="term", batch_size=32, timeout_s=2.0)
    it = iter(ds)
    for _ in range(5):
        next(it)
    it.close()  # leaves the pass early: the 5 batches it took are acknowledged
    assert ds.stats()["jobs"]["term"]["ranks"][0]["acked"] == 5  # (and the ACK has arrived)
    assert daemon.proc is not None
    t0 = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=5) == 0
    assert time.monotonic() - t0 < 5
    assert not ipc_path(daemon).exists(), "the socket file is removed"
    saved = json.loads((daemon.state_dir / "jobs" / "term" / "job.json").read_text())
    assert len(saved["ranks"][0]["acked"]) == 5, "acknowledgements are flushed on the way out"
    # What it had asked for ahead stays its own until it comes back or is declared gone.
    assert 0 < len(saved["ranks"][0]["inflight"]) <= ds.prefetch
    ds.close()


def serve(d: Daemon, socket: str, state_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "loaderd", "serve", "--db", str(d.db), "--socket", socket]
    return subprocess.run(
        [*cmd, "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=30
    )


def test_second_daemon_refuses_the_same_socket_or_state_dir(daemon: Daemon, tmp_path: Path) -> None:
    same_socket = serve(daemon, daemon.address, tmp_path / "other-state")
    assert same_socket.returncode != 0
    errors = [line for line in same_socket.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("loaderd: error: socket ")
    assert "already served by a live daemon (pid" in errors[0]

    other = f"ipc://{daemon.sock_dir}/other.sock"
    same_state = serve(daemon, other, daemon.state_dir)
    assert same_state.returncode != 0
    assert same_state.stderr.strip().splitlines()[-1].startswith("loaderd: error: state directory")
    assert not Path(other[len("ipc://") :]).exists()

    # The first daemon never noticed: its socket file is intact and it keeps serving.
    assert ipc_path(daemon).exists()
    ds = LoaderdDataset(daemon.address, job="first", batch_size=96, timeout_s=2.0)
    assert sum(len(b["id"]) for b in ds) == 480


def test_restart_after_kill_9_with_stale_files(daemon: Daemon) -> None:
    daemon.kill()
    sock = ipc_path(daemon)
    assert sock.exists(), "kill -9 leaves the socket file behind"
    assert sock.with_name(sock.name + ".lock").exists()
    assert (daemon.state_dir / "daemon.lock").exists()
    daemon.start()  # the very same command
    wait_ready(daemon.address, timeout_s=5)
    ds = LoaderdDataset(daemon.address, job="after", batch_size=96, timeout_s=2.0)
    assert sum(len(b["id"]) for b in ds) == 480
