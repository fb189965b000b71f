"""Turns at one ZeroMQ socket for the threads of a process.

A ZeroMQ socket is not thread-safe, and a thread waiting for its reply polls the socket for
up to the whole reply timeout. So one thread at a time holds the socket. Another that needs
it (to send, or to read its own reply) writes a byte to a pipe that the holder polls beside
the socket; the holder lets it in at once and takes the socket back after it. A trainer
whose batches come through a thread of its own can send losses from its training loop.

Uncontended, a turn costs one lock's acquire and release.
"""

from __future__ import annotations

import os
import threading
import weakref
from contextlib import suppress

from loaderd.client.pids import current_pid


class Turns:
    """Whose turn it is at a socket; re-entrant for the thread that holds it.

    Attributes:
        wake_fd: readable when another thread waits for its turn: the holder polls it beside
            the socket and then calls ``let_in``.
        pid: the process these turns belong to (a forked child makes its own).
    """

    def __init__(self) -> None:
        self.pid = current_pid()
        self._lock = threading.Lock()  # held by the thread whose turn it is
        self._owner: int | None = None
        self._depth = 0
        self._cv = threading.Condition()  # guards _wanting and _taken
        self._wanting = 0  # threads blocked in take()
        self._taken = 0  # turns they took: the holder waits for one before it takes it back
        self.wake_fd, self._poke_fd = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._poke_fd, False)
        # Closed when these turns are collected. In a reference cycle that may come before a
        # neighbour's finalizer still sends through the connection: it then makes new turns.
        self._open = [True]
        weakref.finalize(self, _close_fds, self._open, self.wake_fd, self._poke_fd)

    @property
    def usable(self) -> bool:
        """Whether these are this process's turns and their pipe is open."""
        return self._open[0] and self.pid == current_pid()

    def take(self) -> None:
        """Wait for this thread's turn (at once if it holds it already)."""
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return
        if not self._lock.acquire(blocking=False):
            with self._cv:
                self._wanting += 1
            try:
                self._poke()
                self._lock.acquire()
            finally:
                with self._cv:
                    self._wanting -= 1
                    self._taken += 1
                    self._cv.notify_all()
        self._owner, self._depth = me, 1

    def give(self) -> None:
        """End one ``take`` of the holder's."""
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    def let_in(self) -> None:
        """The holder, between two polls: the threads waiting have their turns, then it goes on.

        Only from the outermost turn: an inner one may be mid-message.
        """
        with suppress(BlockingIOError):
            os.read(self.wake_fd, 4096)
        if self._depth != 1:
            return
        me = threading.get_ident()
        while True:
            with self._cv:
                if not self._wanting:
                    return
                taken = self._taken
            self._owner, self._depth = None, 0
            self._lock.release()
            with self._cv:  # until one of them has it (one by the fast path is not counted)
                if self._taken == taken:
                    self._cv.wait(timeout=0.01)
            self._lock.acquire()
            self._owner, self._depth = me, 1

    def _poke(self) -> None:
        with suppress(BlockingIOError):  # full: the holder has been woken already
            os.write(self._poke_fd, b"\0")


def _close_fds(open_: list[bool], *fds: int) -> None:
    open_[0] = False
    for fd in fds:
        with suppress(OSError):
            os.close(fd)
