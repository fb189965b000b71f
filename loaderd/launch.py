"""Start, wait for and stop a ``loaderd serve`` subprocess (the demo, tests and benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from loaderd.client.connection import Connection
from loaderd.client.errors import DaemonUnavailableError
from loaderd.client.protocol import MsgType


def start_daemon(
    db: Path,
    socket: str,
    *,
    state_dir: Path | None = None,
    extra: Sequence[str] = (),
    log: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``python -m loaderd serve`` in the background (output to ``log`` if given)."""
    cmd = [sys.executable, "-m", "loaderd", "serve", "--db", str(db), "--socket", socket]
    if state_dir is not None:
        cmd += ["--state-dir", str(state_dir)]
    cmd += list(extra)
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]


def wait_ready(
    address: str, timeout_s: float = 20.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """PING the daemon until it answers.

    Raises:
        DaemonUnavailableError: no answer within ``timeout_s``, or ``proc`` exited first.
    """
    deadline = time.monotonic() + timeout_s
    with Connection(address, timeout_s=0.2) as conn:
        while True:
            if proc is not None and proc.poll() is not None:
                raise DaemonUnavailableError(f"loaderd for {address} exited with {proc.returncode}")
            try:
                conn.request(MsgType.PING, {}, expect=MsgType.PONG)
                return
            except DaemonUnavailableError:
                if time.monotonic() > deadline:
                    raise


def stop_daemon(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode
