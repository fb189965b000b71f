"""The cached process id follows a fork, so per-process sockets and rings are not shared."""

from __future__ import annotations

import os

from loaderd.client.current_pid import current_pid


def test_current_pid_is_the_process_id() -> None:
    assert current_pid() == os.getpid()


def test_current_pid_changes_in_a_forked_child() -> None:
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # the child reports what it sees, then leaves without cleanup
        os.write(w, f"{current_pid()} {os.getpid()}".encode())
        os._exit(0)
    os.close(w)
    seen, real = os.read(r, 64).decode().split()
    os.close(r)
    os.waitpid(child, 0)
    assert int(seen) == int(real) == child
    assert current_pid() == os.getpid() != child
