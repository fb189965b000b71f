"""Which client connections closed: ZeroMQ's socket monitor, matched to routing identities.

A ROUTER socket hides its peers' connections: a client that closes its socket (or whose
process dies) just stops sending. State the daemon keeps per connection (a shared-memory
consumer's entry) would pile up with every short-lived client. The socket monitor reports
each closed connection by its file descriptor, and every received message carries the
descriptor it came in on (``SRCFD``), so the first message of an identity ties it to its fd.

A descriptor is reused by the next connection as soon as it is closed; the order of events
keeps the two apart. The monitor event of a closed connection is queued before its fd can be
reused, so before it ties a new identity to an fd the watch reads every event queued so far:
the previous connection on that fd is closed by then. One fd carries one connection, so an
identity still tied to the fd at that point is closed too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

_SRCFD = 2  # ZMQ_SRCFD: the message property naming the descriptor it was received on


class ConnectionWatch:
    """Ties routing identities to connections and reports the ones that closed.

    Args:
        sock: the daemon's ROUTER socket (bound or not).
        on_closed: called with the identity of each connection that closed.
    """

    def __init__(self, sock: zmq.Socket[Any], on_closed: Callable[[bytes], None]) -> None:
        self._sock = sock
        self._on_closed = on_closed
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._on_fd: dict[int, bytes] = {}
        self._fd_of: dict[bytes, int] = {}
        self.closed_total = 0

    def seen(self, identity: bytes, frame: zmq.Frame) -> None:
        """A message from ``identity`` arrived in ``frame``: tie the identity to its fd."""
        if identity in self._fd_of:
            return
        try:
            fd = int(frame.get(_SRCFD))
        except zmq.ZMQError:
            return
        if fd < 0:
            return  # inproc: no descriptor, and a peer in this process
        self.poll()  # what closed before this message was sent, on this fd too
        old = self._on_fd.get(fd)
        if old is not None:  # one fd, one connection: the old one is gone
            self._close(fd)
        self._on_fd[fd] = identity
        self._fd_of[identity] = fd

    def poll(self) -> None:
        """Report every connection the monitor saw close since the last call."""
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._close(int(event["value"]))

    def _close(self, fd: int) -> None:
        identity = self._on_fd.pop(fd, None)
        if identity is None:
            return
        del self._fd_of[identity]
        self.closed_total += 1
        self._on_closed(identity)

    def __len__(self) -> int:
        """How many identities are tied to an open connection."""
        return len(self._fd_of)

    def close(self) -> None:
        """Stop monitoring (before the socket closes; safe to call twice)."""
        if not self._monitor.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
