"""Start, wait for and stop a ``loaderd serve`` subprocess (the demo, tests and benchmarks)."""

from __future__ import annotations

import os
import shutil
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
    under: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Start ``python -m loaderd serve`` in the background (output to ``log`` if given).

    ``under``: a command the daemon runs under, which execs it (``setpriv ...``).
    """
    cmd = [*under, sys.executable, "-m", "loaderd", "serve", "--db", str(db), "--socket", socket]
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


# An ordinary user's RLIMIT_MEMLOCK on most distributions.
MEMLOCK_DEFAULT = 8 << 20
_CAP_IPC_LOCK = 14


def as_ordinary_user(memlock_bytes: int = MEMLOCK_DEFAULT) -> list[str] | None:
    """``under`` for a daemon that may lock no more pages than an ordinary user may.

    The limit set to ``memlock_bytes`` (``prlimit``; an ordinary user's is usually 8 MiB),
    and for a process that may lock any amount (``CAP_IPC_LOCK``, root's) that capability
    dropped (``setpriv``): what a daemon run without privileges does, for tests and
    benchmarks run as root. None where those tools are missing or refuse (``setpriv`` needs
    ``CAP_SETPCAP``, which a container may not grant).
    """
    status = Path("/proc/self/status").read_text()
    caps = int(next(ln for ln in status.splitlines() if ln.startswith("CapEff:")).split()[1], 16)
    tools = {"prlimit": [f"--memlock={memlock_bytes}:{memlock_bytes}"]}
    if caps >> _CAP_IPC_LOCK & 1:
        tools["setpriv"] = ["--bounding-set=-ipc_lock"]
    if not all(map(shutil.which, tools)):
        return None
    under = [word for tool, args in tools.items() for word in (tool, *args)]
    tried = subprocess.run([*under, "true"], capture_output=True, check=False)
    return under if tried.returncode == 0 else None
