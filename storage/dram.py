"""The DRAM tier: verified records held in the daemon's memory, bounded in bytes.

A record is held either as bytes of its own, or, when it came from the store and the store
can lock its pages in RAM (``storage/pinning.py``), as a view of those pages: admitted without
a copy, unlocked when it leaves the tier. Where each view lies is kept in a table by sample id
too (``located``): a batch of them is gathered from those addresses in one compiled call,
without a Python object touched per record. A view whose pages stay locked as long as the
store is open (its map locked whole) is kept as that row alone, with no object of its own:
it is made again from its address when asked for.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, cast

import numpy as np

from loaderd.storage.pinning import still_locked
from loaderd.storage.syscalls import address_of

Record = bytes | memoryview
# Locks views' pages in RAM: for each, its unlock, or None (then it is copied).
Pin = Callable[[Sequence[memoryview]], "list[Callable[[], None] | None]"]
Held = tuple[Record, "Callable[[], None] | None"]  # what the tier keeps, and its unlock
ViewAt = Callable[[int, int], memoryview]  # (address, length): a view of the store's map

# What the tier keeps of a record held by its row of the address table alone (``_placed``).
# The same object for every record: such an entry costs the tier its key's place in the
# order and its 16-byte row, where a view and an unlock of its own took ~260 bytes more.
_PLACED = 0


# A copy at least this large is made by numpy, which lets go of the GIL for it.
_COPY_UNLOCKED = 16 << 10


def own_copy(view: memoryview) -> Record:
    """A copy of a view in memory of its own.

    A fresh allocation's pages are touched for the first time by the copy: about 1 GB/s on a
    VM with 4 KiB pages, 100 us for 100 KB. ``bytes()`` does that with the GIL held, which
    stalls every thread of the daemon (a daemon that may not lock pages admitted a warm store
    at a quarter of the speed of one that may); ``np.copyto`` lets go of it for the copy.
    """
    if view.nbytes < _COPY_UNLOCKED:
        return bytes(view)
    out = np.empty(view.nbytes, np.uint8)
    np.copyto(out, np.frombuffer(view, np.uint8))
    return out.data


def own_copies(views: Sequence[Record]) -> list[Record]:
    """``own_copy`` of each; when all are small, in one ``map``: no Python step per record."""
    if max(map(len, views), default=0) < _COPY_UNLOCKED:
        return list(map(bytes, views))
    return [own_copy(memoryview(v)) for v in views]


class DramCache:
    """A byte-bounded LRU map from sample id to record bytes. Thread-safe.

    Records are verified before they are put here and DRAM cannot tear, so hits are served
    without re-checking the checksum.

    Args:
        capacity_bytes: the most record bytes held at once; 0 disables the tier.
        pin: locks views' pages in RAM and returns each one's unlock, or None (then that
            record is copied); without it every view is copied. The views it locks are of
            the store's map, which stays mapped while the tier is in use (``clear`` comes
            first): their addresses stay readable after the tier lets a record go.
        recency: whether a hit marks the record most recently used (an LRU). False where an
            owner decides what the tier holds and keeps it within the capacity (the tier
            stack's policy): hits then skip that step, the costly part of serving a batch
            from a large tier, and the bound, a safety net there, evicts the oldest admitted.
        located_ids: sample ids below this have the address and length of a record held as
            a locked view kept in a table (16 bytes an id, made at the first such record),
            for ``located``; 0: none.
        view_at: a view of the store's map at an address. With it, a view among those ids
            whose unlock is ``still_locked`` is kept as its row of the table alone, and made
            again from it when asked for.
    """

    name = "dram"

    def __init__(
        self,
        capacity_bytes: int,
        pin: Pin | None = None,
        *,
        recency: bool = True,
        located_ids: int = 0,
        view_at: ViewAt | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"`capacity_bytes` must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = self.misses = self.evictions = 0
        self.pinned = 0  # records held as locked views of the store's pages
        self._pin = pin
        self.recency = recency
        # By use where a hit marks it (an LRU), else by admission, which a plain dict keeps
        # for ~90 bytes an entry less than an OrderedDict. A value may be ``_PLACED``.
        self._items: dict[int, Record | int] = OrderedDict() if recency else {}
        self._touch: Callable[[int], None] | None = (
            cast("OrderedDict[int, Record | int]", self._items).move_to_end if recency else None
        )
        self._unpin: dict[int, Callable[[], None]] = {}  # of views not ``_PLACED``
        self._located_ids = located_ids if pin is not None else 0
        self._view_at = view_at if self._located_ids else None
        self._placed_count = 0
        self._at: np.ndarray | None = None  # per id: a locked view's address (0: none), length
        self._lock = threading.Lock()

    def get(self, sample_id: int) -> Record | None:
        """The record, marked most recently used, or None on a miss."""
        with self._lock:
            rec = self._items.get(sample_id)
            if rec is None:
                self.misses += 1
                return None
            if self._touch is not None:
                self._touch(sample_id)
            self.hits += 1
            return self._record(sample_id, rec)

    def peek(self, sample_id: int) -> Record | None:
        """The record, neither marked nor counted; None if absent."""
        with self._lock:
            kept = self._items.get(sample_id)
            return None if kept is None else self._record(sample_id, kept)

    def holds_view(self, sample_id: int) -> bool:
        """Whether the record is held as the store's locked pages (a view), not a copy."""
        with self._lock:
            kept = self._items.get(sample_id)
            return kept is not None and (type(kept) is int or sample_id in self._unpin)

    def get_all(self, sample_ids: list[int], *, count: bool = True) -> list[Record] | None:
        """Every record, marked most recently used, under one lock; None if one is missing.

        Nothing is marked or counted when one is missing: the caller reads them another way.
        Without ``recency``, nothing is marked; without ``count``, no hit is counted (the
        caller counted them: ``located``).
        """
        fetch: Callable[[dict[int, Record | int]], tuple[Record | int, ...]] = (
            itemgetter(*sample_ids)
            if len(sample_ids) > 1  # of one key, ``itemgetter`` returns the value, no tuple
            else lambda items: tuple(items[s] for s in sample_ids)
        )
        with self._lock:
            items = self._items
            try:
                got: list[Record | int] = list(fetch(items))  # in C: no Python step per record
            except KeyError:
                return None
            if self._touch is not None:
                deque(map(self._touch, sample_ids), 0)  # in C too, in the batch's order
            self.hits += len(got) if count else 0
            if self._placed_count and got.count(_PLACED):
                return self._records(sample_ids, got)
            return cast("list[Record]", got)

    def located(self, sample_ids: np.ndarray) -> tuple[np.ndarray, int] | None:
        """Where every record lies, when each is held as a locked view; None otherwise.

        For a gather from those addresses with no Python step per record (``get_all``'s
        objects cost a hit of 3 KB records more than their copy). Marked and counted as
        ``get_all`` marks and counts. Returns:
            The addresses (uint64, in the batch's order) and the shortest record's length.
        """
        at = self._at
        if at is None or not len(sample_ids):
            return None
        ids = np.asarray(sample_ids, np.int64)
        if ids.min() < 0 or ids.max() >= len(at):
            return None
        with self._lock:
            rows = at[ids]
            if not rows[:, 0].all():
                return None
            if self._touch is not None:
                deque(map(self._touch, ids.tolist()), 0)
            self.hits += len(ids)
        return rows[:, 0].astype(np.uint64), int(rows[:, 1].min())

    @property
    def locates(self) -> bool:
        """Whether ``located`` may find anything: the tier holds, or held, a locked view."""
        return self._at is not None

    def _locate(
        self,
        sample_ids: Sequence[int],
        records: Sequence[Record],
        addresses: np.ndarray | None = None,
    ) -> None:
        """Table where these records, held as locked views, lie (the lock is held)."""
        if not self._located_ids:
            return
        if self._at is None:
            self._at = np.zeros((self._located_ids, 2), np.int64)
        n = len(records)
        if addresses is None:
            addresses = np.fromiter(map(address_of, records), np.int64, n)
        ids = np.asarray(sample_ids, np.int64)
        inside = (ids >= 0) & (ids < self._located_ids)
        self._at[ids[inside], 0] = addresses[inside]
        self._at[ids[inside], 1] = np.fromiter(map(len, records), np.int64, n)[inside]

    def hold(self, record: Record) -> Held:
        """What ``put`` keeps of a record: a view with its pages locked in RAM, else a copy.

        The tier never holds memory that someone else may reuse. This is the costly part of
        an admission (a system call or a copy), so callers that hold a lock of their own
        call it before taking that lock and pass the result to ``put``.
        """
        return self.hold_many([record])[0]

    def hold_many(self, records: Sequence[Record]) -> list[Held]:
        """``hold`` of each record, the views' pages locked together (one system call)."""
        views = [r for r in records if isinstance(r, memoryview)]
        unpins = iter(self._pin(views) if self._pin is not None and views else ())
        return [
            ((r, unpin) if (unpin := next(unpins, None)) is not None else (own_copy(r), None))
            if isinstance(r, memoryview)
            else (r, None)
            for r in records
        ]

    def put(self, sample_id: int, record: Record, held: Held | None = None) -> bool:
        """Admit a record, evicting the least recently used ones; False if it cannot fit.

        Args:
            sample_id: the record's id.
            record: its verified bytes (a view is locked or copied, see ``hold``).
            held: ``hold(record)`` done already; released here if the record cannot fit.
        """
        size = len(record)
        if size > self.capacity_bytes:
            if held is not None and held[1] is not None:
                held[1]()
            return False
        record, unpin = held if held is not None else self.hold(record)
        with self._lock:
            self._drop(sample_id)
            while self.used_bytes + size > self.capacity_bytes:
                self._drop(next(iter(self._items)))
                self.evictions += 1
            self.used_bytes += size
            if unpin is None:
                self._items[sample_id] = record
                return True
            self._hold_views([sample_id], [record], [unpin], None)
            return True

    def put_many(self, held: dict[int, Held]) -> list[int]:
        """``put`` of each record, in order, from what ``hold`` made of it (``put_all``)."""
        pairs = held.values()
        return self.put_all(list(held), [rec for rec, _ in pairs], [unpin for _, unpin in pairs])

    def put_all(
        self,
        sample_ids: list[int],
        records: list[Record],
        unpins: list[Callable[[], None] | None] | None = None,
        addresses: np.ndarray | None = None,
    ) -> list[int]:
        """``put`` of each record, in order, under one lock; ``unpins``: from ``hold``.

        ``addresses``: each record's (``address_of``), where the caller has them already.

        The same records evicted as one ``put`` after another: the least recently used
        until the batch fits. A batch larger than the tier, or with a record held already
        (a ``put`` replaces it in its turn), is put one record at a time. Records of their
        own (no ``unpins``) take no Python step each.

        Returns:
            The ids not admitted (too large for the tier; let go as ``put`` does).
        """
        size = sum(map(len, records))
        items = self._items
        with self._lock:
            whole = size <= self.capacity_bytes and items.keys().isdisjoint(sample_ids)
            if whole:
                while self.used_bytes + size > self.capacity_bytes:
                    self._drop(next(iter(items)))
                    self.evictions += 1
                self.used_bytes += size
                if unpins is None:  # records of their own: no step each
                    items.update(zip(sample_ids, records, strict=True))
                else:
                    self._hold_views(sample_ids, records, unpins, addresses)
        if whole:
            return []
        pins = unpins if unpins is not None else [None] * len(records)
        return [
            sid
            for sid, rec, unpin in zip(sample_ids, records, pins, strict=True)
            if not self.put(sid, rec, (rec, unpin))
        ]

    def _hold_views(
        self,
        sample_ids: list[int],
        records: list[Record],
        unpins: list[Callable[[], None] | None],
        addresses: np.ndarray | None,
    ) -> None:
        """Put records just held: distinct ids, in order, under the lock.

        Copies as they are; views with their unlocks and where they lie, or as that alone
        (``_placed``).
        """
        placed = self._placed(sample_ids, unpins)
        if placed.all():  # a batch of a map locked whole: no Python step per record
            self._items.update(dict.fromkeys(sample_ids, _PLACED))
            self._placed_count += len(sample_ids)
            self.pinned += len(sample_ids)
            self._locate(sample_ids, records, addresses)
            return
        flags = placed.tolist()
        self._items.update(
            zip(
                sample_ids,
                [_PLACED if p else r for p, r in zip(flags, records, strict=True)],
                strict=True,
            )
        )
        self._placed_count += sum(flags)
        self._unpin.update(
            (s, u)
            for s, u, p in zip(sample_ids, unpins, flags, strict=True)
            if u is not None and not p
        )
        if None in unpins:  # copies among them: locate the views alone
            kept = [k for k, unpin in enumerate(unpins) if unpin is not None]
            sample_ids = [sample_ids[k] for k in kept]
            records = [records[k] for k in kept]
            addresses = None if addresses is None else addresses[kept]
        self.pinned += len(sample_ids)
        self._locate(sample_ids, records, addresses)

    def _placed(self, sample_ids: list[int], unpins: list[Callable[[], None] | None]) -> np.ndarray:
        """Which records are kept as their row of the address table alone.

        Views whose pages stay locked as long as the store is open (``still_locked``), of
        ids in the table.
        """
        n = len(unpins)
        if self._view_at is None or not n:
            return np.zeros(n, bool)
        if unpins.count(still_locked) == n:  # in C: the usual batch
            locked = np.ones(n, bool)
        else:
            locked = np.fromiter((u is still_locked for u in unpins), bool, n)
        ids = np.asarray(sample_ids, np.int64)
        return locked & (ids >= 0) & (ids < self._located_ids)

    def _records(self, sample_ids: list[int], kept: list[Record | int]) -> list[Record]:
        """``_record`` of each (the lock is held); of a batch kept as rows, from one lookup."""
        if kept.count(_PLACED) < len(kept):
            return [self._record(s, k) for s, k in zip(sample_ids, kept, strict=True)]
        assert self._at is not None and self._view_at is not None
        view_at = self._view_at
        return [view_at(a, n) for a, n in self._at[sample_ids].tolist()]

    def _record(self, sample_id: int, kept: Record | int) -> Record:
        """The record the tier keeps as ``kept`` (the lock is held)."""
        if type(kept) is not int:
            return cast("Record", kept)
        assert self._at is not None and self._view_at is not None  # ``_placed`` made it so
        address, length = self._at[sample_id].tolist()
        return self._view_at(address, length)

    def discard(self, sample_id: int) -> Record | None:
        """Remove a record without counting an eviction; returns it, or None if absent."""
        with self._lock:
            kept = self._items.get(sample_id)
            rec = None if kept is None else self._record(sample_id, kept)  # before its row goes
            self._drop(sample_id)
            return rec

    def _drop(self, sample_id: int) -> None:
        kept = self._items.pop(sample_id, None)
        if kept is None:
            return
        if type(kept) is int:  # ``_PLACED``: its row says how long it is
            assert self._at is not None
            self.used_bytes -= int(self._at[sample_id, 1])
            self._at[sample_id, 0] = 0
            self._placed_count -= 1
            self.pinned -= 1
            return
        self.used_bytes -= len(cast("Record", kept))
        unpin = self._unpin.pop(sample_id, None)
        if unpin is not None:
            unpin()
            self.pinned -= 1
            if self._at is not None and 0 <= sample_id < len(self._at):
                self._at[sample_id, 0] = 0

    def clear(self) -> None:
        """Drop every record (before the store's map goes away)."""
        with self._lock:
            for sid in list(self._items):
                self._drop(sid)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy."""
        with self._lock:
            lookups = self.hits + self.misses
            return {
                "name": self.name,
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": self.used_bytes,
                "items": len(self._items),
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "pinned": self.pinned,
                "hit_rate": self.hits / lookups if lookups else 0.0,
            }
