"""Process ids: this process's without a system call, and whether another still runs.

Per-process state (a socket, a mapped ring, a HELLO) is checked against the pid on every
request; ``os.getpid`` is a system call each time, ``current_pid`` a global read, refreshed
in the child after a fork. Whether a process runs is asked of slot holders, ring owners and
DataLoader workers (``pid_alive``): one answer for all, a zombie counting as dead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def current_pid() -> int:
    """The id of the calling process (the same as ``os.getpid()``)."""
    return _pid


class PerProcess(Generic[T]):
    """One ``make()`` per process: a forked child gets its own, never its parent's (thread-safe).

    For what a process holds of shared memory (slots it maps, pools of its workers): a child
    forked while its parent held some must not give them back too.
    """

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._pid = -1
        self._value: T | None = None

    def get(self) -> T:
        """This process's, made on first use."""
        with self._lock:
            if self._value is None or self._pid != current_pid():
                self._value, self._pid = self._make(), current_pid()
            return self._value

    def peek(self) -> T | None:
        """This process's if it made one, without making it."""
        value = self._value
        return value if value is not None and self._pid == current_pid() else None


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: count fields after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, started: int | None = None) -> bool:
    """Whether the process ``pid`` runs, and is the one that started at ``started``.

    A zombie has exited and will never touch anything again: it counts as dead.

    Args:
        pid: process id (of this pid namespace).
        started: the start time recorded with the pid (``start_time``); when given and
            readable, a reused pid reads as dead.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    if started:
        now = start_time(pid)
        if now is not None and now != started:
            return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")
