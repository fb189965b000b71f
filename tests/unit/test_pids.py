"""The cached process id follows a fork; a process that exited reads as dead, zombie or reused."""

from __future__ import annotations

import os
import time

from loaderd.client.pids import PerProcess, current_pid, pid_alive, start_time


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


def test_a_process_that_exited_is_dead_even_unreaped_or_its_pid_reused() -> None:
    assert pid_alive(os.getpid()) and not pid_alive(0)
    assert not pid_alive((1 << 22) + 4242)  # above the largest pid_max Linux allows
    started = start_time(os.getpid())
    assert started is not None and pid_alive(os.getpid(), started)
    assert not pid_alive(os.getpid(), started + 1), "another process under a reused pid"
    child = os.fork()
    if child == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pid_alive(child), "a zombie has exited"
    os.waitpid(child, 0)  # reaped only now


def test_a_forked_child_makes_its_own_per_process_value() -> None:
    held = PerProcess(list[int])
    assert held.peek() is None
    held.get().append(1)  # the parent holds something
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(w, f"{held.peek()} {held.get()}".encode())
        os._exit(0)
    os.close(w)
    seen = os.read(r, 64).decode()
    os.close(r)
    os.waitpid(child, 0)
    assert seen == "None []" and held.get() == [1]
