"""Liveness of consumers, so a dead one's batches go back to its rank.

A consumer is one DataLoader worker of one rank of one job; a dead one must not hold its
rank's pass open forever.

A consumer is gone when the process that said HELLO on its socket no longer exists (a local
client: the daemon can look at its pid, so a ``kill -9`` is noticed within a tick), or when it
has sent nothing for ``timeout_s`` (any client, also across hosts). Silence alone is a slow
signal on purpose: a trainer may spend minutes on one step while holding its prefetched
batches, and taking them away from a live consumer would deliver them twice. A stopped
(SIGSTOP) consumer is alive: it keeps its few batches and slows nobody else down, since the
server loop never waits on one peer.

The daemon also hears which connections closed (``connection_closed``, told by
``loaderd.connections``), so what it keeps per connection can go with it. A closed connection
is not a dead process: a trainer that reconnects does so under a new identity and may still
hold its batches (and read its shared-memory slots), so those wait for the rules above.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from loaderd.client.pids import pid_alive

logger = logging.getLogger(__name__)

ConsumerKey = tuple[str, int, int]  # job, rank, worker
_MAX_PEERS = 1 << 16  # identities remembered for their pid (oldest forgotten first)
_MAX_CLOSED = 1 << 12  # closed connections remembered until the next tick has looked


def pid_namespace() -> str:
    """This process's pid namespace (pids are comparable only inside one)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(slots=True)
class _Seen:
    at: float
    identity: bytes


class Consumers:
    """Who consumes which rank's batches, when each was last heard from, and its pid.

    Args:
        timeout_s: silence after which a consumer counts as gone.
    """

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"`timeout_s` must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._ns = pid_namespace()
        self._pids: OrderedDict[bytes, int] = OrderedDict()
        self._closed: OrderedDict[bytes, None] = OrderedDict()  # connections seen to close
        self._seen: dict[ConsumerKey, _Seen] = {}
        self.gone_total = 0

    def hello(self, identity: bytes, pid: object, pidns: object, local: bool) -> None:
        """Remember the pid of the process behind ``identity`` when the daemon can check it."""
        self._closed.pop(identity, None)  # a client may reconnect under its own routing id
        if not (local and isinstance(pid, int) and pid > 0 and pidns == self._ns and self._ns):
            return
        self._pids[identity] = pid
        self._pids.move_to_end(identity)
        while len(self._pids) > _MAX_PEERS:
            self._pids.popitem(last=False)

    def pid(self, identity: bytes) -> int | None:
        """The pid of the process behind ``identity``; None when the daemon cannot check it."""
        return self._pids.get(identity)

    def alive(self, identity: bytes) -> bool | None:
        """Whether the process behind ``identity`` runs; None when its pid cannot be checked.

        The one liveness judge of the daemon (shared-memory slots ask it too): a pid counts
        only when the client is local and in this pid namespace.
        """
        pid = self._pids.get(identity)
        return None if pid is None else pid_alive(pid)

    def connection_closed(self, identity: bytes) -> None:
        """The connection ``identity`` closed (its process exited or closed its socket)."""
        self._closed[identity] = None
        self._closed.move_to_end(identity)
        while len(self._closed) > _MAX_CLOSED:
            self._closed.popitem(last=False)

    def is_closed(self, identity: bytes) -> bool:
        """Whether the connection ``identity`` was seen to close (and not yet forgotten)."""
        return identity in self._closed

    def forget(self, identity: bytes) -> None:
        """Nothing is kept for ``identity`` any more: drop its pid and closed mark."""
        self._pids.pop(identity, None)
        self._closed.pop(identity, None)

    def seen(self, key: ConsumerKey, identity: bytes) -> None:
        """The consumer sent a request just now."""
        self._seen[key] = _Seen(time.monotonic(), identity)

    def restored(self, key: ConsumerKey) -> None:
        """A consumer known from saved state: it has ``timeout_s`` from now to come back."""
        self._seen.setdefault(key, _Seen(time.monotonic(), b""))

    def active_since(self, t: float) -> set[bytes]:
        """Identities of the consumers that sent a request at ``time.monotonic()`` >= t."""
        return {s.identity for s in self._seen.values() if s.at >= t and s.identity}

    def of_job(self, job: str) -> list[ConsumerKey]:
        """The consumers of a job heard from and not (yet) found gone."""
        return [k for k in self._seen if k[0] == job]

    def forget_job(self, job: str) -> None:
        """Drop every consumer of a job."""
        for key in [k for k in self._seen if k[0] == job]:
            del self._seen[key]

    def gone(self) -> list[ConsumerKey]:
        """Consumers dead or silent for too long (each reported once, then forgotten)."""
        now = time.monotonic()
        out: list[ConsumerKey] = []
        for key, s in list(self._seen.items()):
            pid = self._pids.get(s.identity)
            dead = pid is not None and not pid_alive(pid)
            if dead or now - s.at > self.timeout_s:
                del self._seen[key]
                out.append(key)
                logger.info(
                    "consumer %s rank %d worker %d is gone (%s)",
                    *key,
                    f"pid {pid} exited" if dead else f"silent for {now - s.at:.0f} s",
                )
        self.gone_total += len(out)
        return out

    def __len__(self) -> int:
        return len(self._seen)
