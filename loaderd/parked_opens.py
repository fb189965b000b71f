"""OPEN_PASS requests waiting for their pass to be decided: bounded, and retried by group.

A pass cannot always open at once (its rank waits at a re-score barrier, or for the
cluster's round). Its OPEN_PASS is parked and retried when something may have changed.
Deciding costs O(samples) per try, and a client may send as many OPEN_PASS as it likes, so:

- at most ``max_parked_opens_per_client`` per connection and ``max_parked_opens`` in all;
  past either the request is refused with an error naming the bound;
- requests that wait for the same thing (same job, rank and phase, same rewind target) form
  one group, and a retry tries the group's first request only. The others follow it when
  it opens, and are told why they wait (WAITING) meanwhile.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from loaderd.client.protocol import Message
from loaderd.limits import LimitError

# (job, rank, phase, rewind epoch or None): what decides whether an OPEN_PASS can open.
GroupKey = tuple[str, int, str, int | None]
Parked = tuple[bytes, Message]


@dataclass(slots=True)
class Group:
    """Parked requests waiting for the same pass, oldest first, and why they wait."""

    why: str
    requests: list[Parked] = field(default_factory=list)


class ParkedOpens:
    """The parked OPEN_PASS requests of the daemon.

    Args:
        per_client: the most one connection may have parked.
        total: the most parked in all.
    """

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client = per_client
        self.total = total
        self._groups: dict[GroupKey, Group] = {}
        self._per_peer: Counter[bytes] = Counter()
        self._count = 0
        self.refused = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return bool(self._groups)

    def park(self, key: GroupKey, identity: bytes, msg: Message, why: str) -> None:
        """Park one request.

        Raises:
            LimitError: its connection, or the daemon, has as many parked as allowed.
        """
        if self._per_peer[identity] >= self.per_client:
            self.refused += 1
            raise LimitError(
                f"this connection has {self._per_peer[identity]} OPEN_PASS requests waiting, "
                f"at most {self.per_client} (max_parked_opens_per_client): wait for their replies"
            )
        if self._count >= self.total:
            self.refused += 1
            raise LimitError(
                f"the daemon has {self._count} OPEN_PASS requests waiting, at most {self.total} "
                "(max_parked_opens): try again once passes open"
            )
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = Group(why)
        group.why = why
        self._add(group, [(identity, msg)])

    def put_back(self, key: GroupKey, group: Group) -> None:
        """Park a group taken by ``take`` again, behind its requests parked anew if any.

        Never refused: its requests were counted before.
        """
        mine = self._groups.setdefault(key, Group(group.why))
        self._add(mine, group.requests)

    def why(self, key: GroupKey) -> str:
        """Why the group ``key`` waits ('' if none waits)."""
        group = self._groups.get(key)
        return "" if group is None else group.why

    def take(self) -> list[tuple[GroupKey, Group]]:
        """Every group, oldest first; the store is left empty."""
        groups, self._groups = list(self._groups.items()), {}
        self._per_peer.clear()
        self._count = 0
        return groups

    def waiting(self) -> set[tuple[bytes, int]]:
        """(identity, request id) of every parked request."""
        return {(peer, msg.request_id) for g in self._groups.values() for peer, msg in g.requests}

    def _add(self, group: Group, requests: list[Parked]) -> None:
        group.requests.extend(requests)
        self._per_peer.update(peer for peer, _ in requests)
        self._count += len(requests)
