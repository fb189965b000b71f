"""This process's id, without a system call per read: refreshed in the child after a fork.

Per-process state (a socket, a mapped ring, a HELLO) is checked against the pid on every
request; ``os.getpid`` is a system call each time, this is a global read.
"""

from __future__ import annotations

import os

_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def current_pid() -> int:
    """The id of the calling process (the same as ``os.getpid()``)."""
    return _pid
