"""The server's one outbox: replies held until what they promise is durable.

A reply is a promise. A BATCH says "this batch is yours", so it may go out only after the
assignment is in the cursor log: otherwise a daemon crash could hand the same batch to
another consumer while the first one trains on it. An OK to ACK says "recorded", so it
waits for the same cursor commit. An OK to FEEDBACK says "journalled", so it waits for the
journals' fsync. Every loop turn commits once for everything that arrived in it (group
commit), then releases what waited for that commit, in arrival order.

Everything else (errors, stats, PASS, WAITING) promises nothing durable and goes at once.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from loaderd.client.protocol import BatchKey, Message


class After(Enum):
    """What must be durable before a held reply goes out."""

    CURSORS = "cursors"  # the loop turn's cursor changes are written (no fsync: see server)
    JOURNAL = "journal"  # the feedback journals are fsynced


class Outbox:
    """Replies and batches waiting for the loop turn's commits.

    Args:
        send: sends one reply now (identity, message).
        deliver: sends an assembled batch to whoever waits for it.
    """

    def __init__(
        self, send: Callable[[bytes, Message], None], deliver: Callable[[BatchKey], None]
    ) -> None:
        self._send = send
        self._deliver = deliver
        self._batches: list[BatchKey] = []
        self._held: dict[After, list[tuple[bytes, Message]]] = {a: [] for a in After}

    def hold(self, identity: bytes, msg: Message, after: After) -> None:
        """Send ``msg`` once ``after`` is durable (at the end of this loop turn)."""
        self._held[after].append((identity, msg))

    def hold_batch(self, key: BatchKey) -> None:
        """Deliver a batch that is ready now, once its assignment is written."""
        self._batches.append(key)

    def waiting_for(self, after: After) -> bool:
        """Whether anything waits for ``after`` (so the commit is worth doing)."""
        return bool(self._held[after]) or (after is After.CURSORS and bool(self._batches))

    def release(self, after: After, instead: Callable[[Message], Message] | None = None) -> None:
        """``after`` is durable now: send what waited for it, batches first.

        Args:
            after: what became durable.
            instead: ``after`` failed (a full disk): each held reply is replaced by what this
                returns for it (an error), so nobody is told "recorded" for what is not.
        """
        if after is After.CURSORS:
            batches, self._batches = self._batches, []
            for key in batches:
                self._deliver(key)
        held, self._held[after] = self._held[after], []
        for identity, msg in held:
            self._send(identity, msg if instead is None else instead(msg))

    def held(self, after: After) -> list[tuple[bytes, int]]:
        """(identity, request id) of each reply waiting for ``after``."""
        return [(identity, msg.request_id) for identity, msg in self._held[after]]

    def __len__(self) -> int:
        return len(self._batches) + sum(len(v) for v in self._held.values())
