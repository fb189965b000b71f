"""Requests sent without waiting for their replies, kept until the daemon confirms each.

Feedback and the training loop's acknowledgements need no answer before the trainer goes on,
only the certainty that each was recorded: a round trip per request would stall the loop. So
they are sent and kept here, oldest first; the replies are collected later (when more than
``limit`` are unconfirmed, at the end of a pass, at ``close``), so a refused one still raises
its ``RemoteError``. Replies to a socket that was dropped never come: after a reconnect every
kept request is sent again on the new one (the daemon applies each idempotently, or at worst
counts one more loss sample).

Thread-safe: the training loop may collect replies while a prefetch thread of its own sends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loaderd.client.connection import Connection
from loaderd.client.errors import RemoteError
from loaderd.client.protocol import Buffer, MsgType


@dataclass(frozen=True, slots=True)
class Request:
    """One request as sent: what goes again after a reconnect."""

    type: MsgType
    meta: dict[str, Any]
    frames: Sequence[Buffer] = ()


class Unconfirmed:
    """Requests awaiting their OK, in the order they were sent.

    Args:
        limit: how many may be unconfirmed before ``over_limit`` says to wait for the oldest.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._sent: dict[int, Request] = {}  # request id -> request, oldest first
        # Held through a wait: two threads collecting the same oldest reply would wait for it
        # twice, and the second until its timeout.
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._sent)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled with its dataset into spawned DataLoader workers: a lock does not travel.
        with self._lock:
            return {"limit": self.limit, "sent": dict(self._sent)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["limit"])  # type: ignore[misc]
        self._sent.update(state["sent"])

    def send(
        self, conn: Connection, type_: MsgType, meta: dict[str, Any], frames: Sequence[Buffer] = ()
    ) -> None:
        """Send a request without waiting and keep it until its reply is collected."""
        request = Request(type_, meta, frames)
        with self._lock:
            self._sent[conn.send(type_, meta, frames)] = request

    def over_limit(self) -> bool:
        """Whether more than ``limit`` are unconfirmed (the caller waits for the oldest)."""
        return len(self._sent) > self.limit

    def confirm_oldest(
        self, conn: Connection, again: Callable[[RemoteError], bool] | None = None
    ) -> None:
        """Wait for the oldest reply.

        Raises:
            RemoteError: the daemon refused the request; it is dropped, unless ``again(e)``
                says to send it once more (then nothing is raised).
            DaemonUnavailableError: no reply; the request is kept (``resend`` after a
                reconnect).
        """
        with self._lock:
            if not self._sent:
                return  # another thread collected it
            rid, request = next(iter(self._sent.items()))
            try:
                conn.wait(rid)
            except RemoteError as e:
                del self._sent[rid]
                if again is None or not again(e):
                    raise
                self.send(conn, request.type, request.meta, request.frames)
                return
            del self._sent[rid]

    def confirm_all(self, conn: Connection) -> None:
        """Wait until every kept request is confirmed (errors as ``confirm_oldest``)."""
        while self._sent:
            self.confirm_oldest(conn)

    def resend(self, conn: Connection) -> None:
        """Send every kept request again, on a fresh socket whose replies are still to come."""
        with self._lock:
            pending = list(self._sent.values())
            self._sent.clear()
            for request in pending:
                self.send(conn, request.type, request.meta, request.frames)

    def drop(self, conn: Connection | None = None) -> None:
        """Forget every kept request; with ``conn``, their replies are still read and logged.

        Without it: the requests were a parent process's, or the socket they went on is gone.
        """
        with self._lock:
            if conn is not None:
                for rid in self._sent:
                    conn.ignore(rid)
            self._sent.clear()
