"""A fair share of the daemon for each client: of the server loop, and of the assembly workers.

One thread serves every connection. Read in arrival order, a connection that floods the
socket (cheap requests that are refused, or GET_BATCH after GET_BATCH) takes the loop turn
after turn, and a trainer's request waits behind all of it; the batches it asks for wait
behind the flooder's in the assemblers' queue as well. So:

* ``Inbox``: each loop turn reads what the socket has (at most ``READ_PER_TURN`` messages)
  into a queue per connection, then hands the loop at most ``PER_TURN`` requests of each
  connection, round robin, one of each in turn. A connection's queue (its backlog) holds at
  most ``max_backlog_per_client`` requests and ``max_request_bytes`` bytes; a request past
  that is refused at once with a one-line error naming the bound, and costs the loop O(1).
  A client that waits for its replies never comes near it (the client library keeps a few
  requests in flight per connection).
* ``RoundRobin``: the prefetcher's queue of batches to assemble, served one stream at a time
  in turn (a stream is a job's rank) instead of first come, first served.

Neither changes the order of one connection's (or one stream's) own requests.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import zmq

from loaderd.client.errors import ErrorCode
from loaderd.client.protocol import Message, error_message, peek_request_id

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# Requests of one connection the loop handles per turn: between turns it delivers finished
# batches and answers the other connections, so one connection's burst delays them by this
# many requests, not by the whole burst.
PER_TURN = 16
# Messages read from the socket per turn (every connection together); ZeroMQ's ROUTER reads
# its peers in turn, so a flooder cannot fill this with its own messages while others wait.
# What is not read waits in ZeroMQ's queue for that peer, bounded by its high-water mark,
# which then holds the flooder's sends back: reading few per turn answers a flood with that
# push-back rather than with refusals that each cost the loop (on 2 shared cores a trainer
# beside a GET_BATCH flooder kept ~45% of its rate reading 256 a turn, ~65% reading 32).
READ_PER_TURN = 32


class RoundRobin(Generic[K, T]):
    """Queues per key, popped one key at a time in turn (each key's own items in order).

    Not thread-safe: its owner locks.
    """

    def __init__(self) -> None:
        self._queues: OrderedDict[K, deque[T]] = OrderedDict()  # least recently served first
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def count(self, key: K) -> int:
        """Items waiting under ``key``."""
        q = self._queues.get(key)
        return len(q) if q is not None else 0

    def keys(self) -> list[K]:
        """Keys with items waiting, the least recently served first."""
        return list(self._queues)

    def push(self, key: K, item: T) -> None:
        """Queue ``item`` after the others of ``key``."""
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
        q.append(item)
        self._len += 1

    def pop(self) -> tuple[K, T] | None:
        """The next item of the key served least recently (None: nothing waits)."""
        if not self._queues:
            return None
        key = next(iter(self._queues))
        return key, self.pop_from(key)

    def pop_from(self, key: K) -> T:
        """The next item of ``key`` (which must have one); the key goes to the back."""
        q = self._queues[key]
        item = q.popleft()
        self._len -= 1
        if q:
            self._queues.move_to_end(key)
        else:
            del self._queues[key]
        return item

    def drain(self) -> list[T]:
        """Every item, removed."""
        items = [item for q in self._queues.values() for item in q]
        self._queues.clear()
        self._len = 0
        return items


Frames = list[zmq.Frame]


class Inbox:
    """Requests read from the ROUTER socket and not yet handled, per connection identity.

    Args:
        max_backlog: the most requests of one connection that wait.
        max_backlog_bytes: the most bytes they may hold together (a lone request may hold
            more: the socket's own limits bound it).
        per_turn: requests of one connection handed out per turn.
        read_per_turn: messages read from the socket per turn.
    """

    def __init__(
        self,
        max_backlog: int,
        max_backlog_bytes: int,
        per_turn: int = PER_TURN,
        read_per_turn: int = READ_PER_TURN,
    ) -> None:
        self.max_backlog = max_backlog
        self.max_backlog_bytes = max_backlog_bytes
        self.per_turn = per_turn
        self.read_per_turn = read_per_turn
        self._waiting: RoundRobin[bytes, tuple[Frames, int]] = RoundRobin()
        self._bytes: dict[bytes, int] = {}
        self.refused = 0
        self.peak_backlog = 0  # the most requests one connection ever had waiting

    def __bool__(self) -> bool:
        return len(self._waiting) > 0

    def receive(self, sock: zmq.Socket[Any], send: Callable[[bytes, Message], None]) -> None:
        """Read what ``sock`` has (up to ``read_per_turn``); refuse what overflows a backlog."""
        for _ in range(self.read_per_turn):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            reason = self.add(identity, frames)
            if reason is not None:
                send(
                    identity,
                    error_message(peek_request_id(frames[1:]), ErrorCode.BAD_ARGUMENT, reason),
                )

    def add(self, identity: bytes, frames: Frames) -> str | None:
        """Queue a request; returns why it is refused instead (its backlog is full), or None."""
        count = self._waiting.count(identity)
        size = sum(len(f) for f in frames)
        held = self._bytes.get(identity, 0)
        if count >= self.max_backlog or (count and held + size > self.max_backlog_bytes):
            self.refused += 1
            return (
                f"this connection has {count} requests ({held} bytes) waiting in the daemon, "
                f"at most {self.max_backlog} (max_backlog_per_client) and "
                f"{self.max_backlog_bytes} bytes: wait for replies before sending more"
            )
        self._waiting.push(identity, (frames, size))
        self._bytes[identity] = held + size
        self.peak_backlog = max(self.peak_backlog, count + 1)
        return None

    def turn(self) -> list[Frames]:
        """This turn's requests: up to ``per_turn`` of each connection, one of each in turn.

        At most ``read_per_turn`` in all; the connections not reached come first next turn.
        """
        out: list[Frames] = []
        for _ in range(self.per_turn):
            keys = self._waiting.keys()
            if not keys:
                break
            for identity in keys:
                if len(out) >= self.read_per_turn:
                    return out
                frames, size = self._waiting.pop_from(identity)
                left = self._bytes[identity] - size
                if self._waiting.count(identity):
                    self._bytes[identity] = left
                else:
                    del self._bytes[identity]
                out.append(frames)
        return out

    def stats(self) -> dict[str, Any]:
        """The ``fair_share`` section of STATS."""
        return {
            "per_turn": self.per_turn,
            "max_backlog_per_client": self.max_backlog,
            "max_backlog_bytes": self.max_backlog_bytes,
            "waiting": len(self._waiting),
            "connections_waiting": len(self._bytes),
            "peak_backlog": self.peak_backlog,
            "refused": self.refused,
        }
