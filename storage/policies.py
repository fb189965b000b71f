"""Placement policies of the tier stack: which sample lives in which tier, as bookkeeping only.

A policy never touches bytes. It keeps, per tier (0 = DRAM, 1 = the NVRAM arena), which ids
it holds and how many bytes they take, answers ``lookup`` and, for every demand access and
every re-ranking, returns the moves the tier stack must carry out::

    ("admit", id, tier)    put the record just read into ``tier``
    ("drop", id, tier)     remove it from ``tier``
    ("promote", id, 0)     move it from the arena to DRAM
    ("demote", id, 1)      move it from DRAM to the arena

Tiers are exclusive: an id is held by at most one tier, so the total capacity is the sum of
the tiers'. Because policies are pure bookkeeping, the cache benchmark replays id traces
through these very classes, and the daemon's tier stack applies the same decisions to bytes.

* ``importance`` (default, seed 002): ``place(ranking)`` at each epoch boundary decides the
  target tier of every sample (the top of the ranking in DRAM, the next in the arena). Within
  an epoch the placement is static: a miss of a targeted sample fills its slot, evicting a
  sample the ranking no longer wants; a miss of any other sample is served from below and
  changes nothing. Before the first ranking it behaves like ``static``.
* ``lru``: an exclusive two-level LRU; a miss enters DRAM, DRAM's victims are demoted to the
  arena, the arena's are dropped; an arena hit is promoted to DRAM.
* ``static``: fill once, never evict (the known remedy for LRU thrashing under random access).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import repeat
from typing import ClassVar, Final, cast

import numpy as np

Move = tuple[str, int, int]


class Admitted(list[Move]):
    """The moves of a batch admitted whole into one tier, in order, evicting nothing.

    A list of moves like any other; ``ids`` and ``tier`` tell the tier stack it may admit
    the records together (``TierStack._admit_all``) instead of move by move.
    """

    def __init__(self, sample_ids: list[int], tier: int) -> None:
        super().__init__(zip(repeat("admit"), sample_ids, repeat(tier)))
        self.ids = sample_ids
        self.tier = tier


DRAM: Final = 0
ARENA: Final = 1
_NOWHERE: Final = 0xFF  # the tier byte of an id no tier holds (-1 as int8)
POLICIES: Final = ("importance", "lru", "static")


class _Unset:
    pass


_UNSET: Final = _Unset()


class Policy:
    """Common bookkeeping: what each tier holds, its bytes and its counters.

    Args:
        capacities: bytes of each tier, fastest first (DRAM, then the arena); 0 disables one.
        num_samples: N, the dataset size (ids are ``0 .. N-1``).
        record_bytes: the typical record size, used to turn a byte capacity into a count of
            samples when a ranking is placed.
    """

    name: ClassVar[str] = ""
    # Whether the DRAM tier may briefly hold more than the policy counts, so that the tier's
    # own bound (by its LRU order) decides what leaves: the moves of one batch are applied
    # departures first, and LRU can admit and demote the same record within a batch.
    overfills_dram: ClassVar[bool] = False
    keeps_recency: ClassVar[bool] = False  # ``held`` in order of use, not of admission

    def __init__(self, capacities: Sequence[int], num_samples: int, record_bytes: int) -> None:
        if any(c < 0 for c in capacities):
            raise ValueError(f"`capacities` must be >= 0, got {list(capacities)}")
        if record_bytes <= 0:
            raise ValueError(f"`record_bytes` must be positive, got {record_bytes}")
        self.capacities = list(capacities)
        self.num_samples = num_samples
        self.record_bytes = record_bytes
        n = len(self.capacities)
        self.used = [0] * n
        # Each tier's ids and sizes, oldest first: by use for a policy that keeps recency (an
        # OrderedDict, moved on a hit), else by admission, which a plain dict keeps for ~90
        # bytes an id less.
        self.held: list[dict[int, int]] = [
            OrderedDict() if self.keeps_recency else {} for _ in range(n)
        ]
        self.hits = [0] * n
        self.misses = [0] * n
        self.evictions = [0] * n
        self.promotions = [0] * n
        self.demotions = [0] * n
        # Where each id is held: a byte an id for 0 .. N-1 (255: nowhere), read one id at a
        # time as a bytearray and a batch at once as an int8 array over the same memory (-1:
        # nowhere); a dict for any other id. A dict for every id cost ~35 bytes an id.
        self._tier_of = bytearray(b"\xff") * num_samples
        self._tier = np.frombuffer(self._tier_of, np.int8)
        self._other: dict[int, int] = {}

    # ---- queries ---------------------------------------------------------------------------

    def lookup(self, sample_id: int) -> int | None:
        """The tier that holds ``sample_id``, or None."""
        if 0 <= sample_id < len(self._tier_of):
            tier = self._tier_of[sample_id]
            return None if tier == _NOWHERE else tier
        return self._other.get(sample_id)

    def lookup_many(self, sample_ids: np.ndarray) -> np.ndarray:
        """The tier that holds each of ``sample_ids`` (-1: none), int8, in one step."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        if ids.size == 0 or (ids.min() >= 0 and ids.max() < len(self._tier)):
            return self._tier[ids]
        get = self.lookup
        return np.fromiter((-1 if (t := get(i)) is None else t for i in ids.tolist()), np.int8)

    def all_in(self, sample_ids: Sequence[int] | np.ndarray, tier: int) -> bool:
        """Whether ``tier`` holds every one of ``sample_ids`` (at least one)."""
        if len(sample_ids) == 0:
            return False
        ids = np.asarray(sample_ids, dtype=np.int64)
        return bool((self.lookup_many(ids) == tier).all())

    def __len__(self) -> int:
        return sum(map(len, self.held))

    def room(self, tier: int, size: int) -> bool:
        """Whether ``size`` more bytes fit in ``tier`` without evicting anything."""
        return self.used[tier] + size <= self.capacities[tier]

    # ---- events ----------------------------------------------------------------------------

    def access(self, sample_id: int, size: int, found: int | _Unset | None = _UNSET) -> list[Move]:
        """Count a demand access and return the moves it causes.

        Args:
            sample_id: the id read.
            size: its record's size in bytes.
            found: the tier the record was actually read from (None: the store), when the
                caller read it before asking (a concurrent move may have changed the
                placement since); by default, where the policy holds it now.

        Returns:
            Moves for the tier stack, in the order they must be applied.
        """
        tier = self.lookup(sample_id)
        src = tier if isinstance(found, _Unset) else found
        top = len(self.capacities) if src is None else src
        for t in range(top):
            self.misses[t] += 1
        if src is not None:
            self.hits[src] += 1
        if tier is None:
            return self._miss(sample_id, size)
        return self._hit(sample_id, tier)

    def hit_all(self, sample_ids: list[int], tier: int) -> list[Move]:
        """``access`` of each id, all read from ``tier``, which holds them: one count for all.

        Returns:
            The moves the hits cause (none unless the policy moves records on a hit).
        """
        n = len(sample_ids)
        for t in range(tier):
            self.misses[t] += n
        self.hits[tier] += n
        if type(self)._hit is Policy._hit:
            return []
        moves: list[Move] = []
        for sid in sample_ids:
            moves += self._hit(sid, tier)
        return moves

    def miss_all(self, sample_ids: list[int], sizes: list[int]) -> list[Move]:
        """``access`` of each id, read from the store: no tier holds any, none repeats.

        The same counts and moves, in the same order, as ``access`` one id at a time. Where
        every record goes where ``_miss`` would put it without evicting anything
        (``_fits_all``), they are admitted in one step: a few numpy and dict calls for a
        batch, not several Python calls a record.
        """
        for t in range(len(self.capacities)):
            self.misses[t] += len(sample_ids)
        return self._miss_each(sample_ids, sizes)

    def access_all(
        self, sample_ids: list[int], sizes: list[int], found: np.ndarray
    ) -> list[Move] | None:
        """``access`` of each id, read from ``found``, in one step where the hits move nothing.

        The same counts and moves, in the same order, as ``access`` one id at a time, for a
        policy whose ``_hit`` is a no-op (``static``, ``importance``): the hits only count,
        and the ids no tier holds now take ``_miss`` in order (``miss_all``'s steps).

        Args:
            sample_ids: the ids read, none twice.
            sizes: their records' sizes.
            found: the tier each was read from (-1: the store).

        Returns:
            The moves; None (nothing counted) where one id at a time is needed: a policy
            whose hits move records, or an id twice.
        """
        if type(self)._hit is not Policy._hit or len(set(sample_ids)) != len(sample_ids):
            return None
        n = len(self.capacities)
        src = np.asarray(found, np.int64)
        per = np.bincount(np.where(src < 0, n, src), minlength=n + 1).tolist()
        for t in range(n):
            self.hits[t] += per[t]
            self.misses[t] += sum(per[t + 1 :])  # read from below ``t``
        new = np.flatnonzero(self.lookup_many(np.asarray(sample_ids, np.int64)) < 0).tolist()
        return self._miss_each([sample_ids[i] for i in new], [sizes[i] for i in new])

    def _miss_each(self, sample_ids: list[int], sizes: list[int]) -> list[Move]:
        """``_miss`` of each id (no tier holds any, none repeats), in as few steps as it can.

        Records ``_may_admit`` rules out are skipped (their ``_miss`` would change nothing);
        where every record goes where ``_miss`` would put it without evicting anything
        (``_fits_all``), they are admitted together.
        """
        tiers = self._fits_all(sample_ids, sizes)
        if tiers and tiers.count(tiers[0]) == len(tiers):  # all to one tier, or none
            if tiers[0] < 0:
                return []
            self._add_many(sample_ids, sizes, tiers[0])
            return Admitted(sample_ids, tiers[0])
        if tiers is None:
            moves: list[Move] = []
            may = self._may_admit(sample_ids, sizes).tolist()
            for sid, size, m in zip(sample_ids, sizes, may, strict=True):
                if m:
                    moves += self._miss(sid, size)
            return moves
        for t in range(len(self.capacities)):
            chosen = [i for i, to in enumerate(tiers) if to == t]
            if chosen:
                self._add_many([sample_ids[i] for i in chosen], [sizes[i] for i in chosen], t)
        return [("admit", sid, t) for sid, t in zip(sample_ids, tiers, strict=True) if t >= 0]

    def place(self, ranking: np.ndarray | None) -> list[Move]:
        """Take a new ranking (ids, most important first); only ``importance`` uses it."""
        return []

    def targets(self) -> np.ndarray | None:
        """The tier the latest ranking puts each id in (-1: none); None: no ranking is kept."""
        return None

    def adopt(self, sample_id: int, size: int, tier: int) -> bool:
        """Register a record a tier already holds (a warm restart); False if it does not fit."""
        if self.lookup(sample_id) is not None or not self.room(tier, size):
            return False
        self._add(sample_id, size, tier)
        return True

    def forget(self, sample_id: int) -> None:
        """A tier lost the record (a bad checksum, or the arena's ring overwrote it)."""
        tier = self.lookup(sample_id)
        if tier is not None:
            self._remove(sample_id)
            self.evictions[tier] += 1

    # ---- for subclasses --------------------------------------------------------------------

    def _hit(self, sample_id: int, tier: int) -> list[Move]:
        return []

    def _miss(self, sample_id: int, size: int) -> list[Move]:
        for t in range(len(self.capacities)):
            if self.room(t, size):
                self._add(sample_id, size, t)
                return [("admit", sample_id, t)]
        return []

    def _fits_all(self, sample_ids: list[int], sizes: list[int]) -> list[int] | None:
        """The tier ``_miss`` puts each record in (-1: none), where that evicts nothing.

        None: it would evict, or that cannot be told without taking the records one at a
        time. Filling the first tier with room (this class, and LRU, whose overflow then has
        nothing to push out): every record goes to DRAM when they all fit in its room.
        """
        if not self.capacities or not self.room(0, sum(sizes)):
            return None
        return [0] * len(sample_ids)

    def _may_admit(self, sample_ids: list[int], sizes: list[int]) -> np.ndarray:
        """Which of these misses ``_miss`` might admit; the others would change nothing.

        For this class's ``_miss`` (the first tier with room, never evicting): a record
        larger than every tier's room now never fits later in the batch, as room only
        shrinks. A subclass with another ``_miss`` says its own.
        """
        room = max((c - u for c, u in zip(self.capacities, self.used, strict=True)), default=-1)
        return np.asarray(sizes, np.int64) <= room

    def _add(self, sample_id: int, size: int, tier: int) -> None:
        self.held[tier][sample_id] = size
        self.used[tier] += size
        self._set_tier(sample_id, tier)

    def _add_many(self, sample_ids: list[int], sizes: list[int], tier: int) -> None:
        """``_add`` of each, in order, in a few calls."""
        self.held[tier].update(zip(sample_ids, sizes, strict=True))
        self.used[tier] += sum(sizes)
        ids = np.asarray(sample_ids, np.int64)
        inside = (ids >= 0) & (ids < len(self._tier))
        self._tier[ids[inside]] = tier
        if not inside.all():
            self._other.update(dict.fromkeys(ids[~inside].tolist(), tier))

    def _remove(self, sample_id: int) -> int:
        tier = self.lookup(sample_id)
        if tier is None:
            raise KeyError(sample_id)
        self.used[tier] -= self.held[tier].pop(sample_id)
        self._set_tier(sample_id, _NOWHERE)
        return tier

    def _set_tier(self, sample_id: int, tier: int) -> None:
        """Record where ``sample_id`` is held (``_NOWHERE``: no tier)."""
        if 0 <= sample_id < len(self._tier_of):
            self._tier_of[sample_id] = tier
        elif tier == _NOWHERE:
            self._other.pop(sample_id, None)
        else:
            self._other[sample_id] = tier

    def _move(self, sample_id: int, to: int) -> Move:
        frm = self.lookup(sample_id)
        if frm is None:
            raise KeyError(sample_id)
        size = self.held[frm][sample_id]
        self._remove(sample_id)
        self._add(sample_id, size, to)
        kind = "promote" if to < frm else "demote"
        counter = self.promotions if to < frm else self.demotions
        counter[frm] += 1
        counter[to] += 1
        return (kind, sample_id, to)

    def stats(self, tier: int) -> dict[str, int]:
        """One tier's occupancy and counters."""
        return {
            "capacity_bytes": self.capacities[tier],
            "used_bytes": self.used[tier],
            "items": len(self.held[tier]),
            "hits": self.hits[tier],
            "misses": self.misses[tier],
            "evictions": self.evictions[tier],
            "promotions": self.promotions[tier],
            "demotions": self.demotions[tier],
        }


class StaticPolicy(Policy):
    """Fill the tiers in order of first access, then never evict."""

    name = "static"


class LruPolicy(Policy):
    """Exclusive two-level LRU: misses enter DRAM, victims fall to the arena, then out."""

    name = "lru"
    overfills_dram = True
    keeps_recency = True

    def hit_all(self, sample_ids: list[int], tier: int) -> list[Move]:
        """As ``Policy.hit_all``; DRAM hits only refresh recency, done in one C-level pass."""
        if tier != DRAM:
            return super().hit_all(sample_ids, tier)
        self.hits[DRAM] += len(sample_ids)
        deque(map(self._by_use(DRAM).move_to_end, sample_ids), 0)  # ``_hit`` of each, in order
        return []

    def _hit(self, sample_id: int, tier: int) -> list[Move]:
        if tier == DRAM or self.capacities[DRAM] < self.held[tier][sample_id]:
            self._by_use(tier).move_to_end(sample_id)
            return []
        moves = [self._move(sample_id, DRAM)]
        return moves + self._overflow(DRAM, keep=sample_id)

    def _by_use(self, tier: int) -> OrderedDict[int, int]:
        return cast("OrderedDict[int, int]", self.held[tier])  # ``keeps_recency``

    def _may_admit(self, sample_ids: list[int], sizes: list[int]) -> np.ndarray:
        return np.ones(len(sample_ids), bool)  # a miss evicts to make room

    def _miss(self, sample_id: int, size: int) -> list[Move]:
        for t, cap in enumerate(self.capacities):
            if size <= cap:
                self._add(sample_id, size, t)
                return [("admit", sample_id, t), *self._overflow(t, keep=sample_id)]
        return []

    def _overflow(self, tier: int, keep: int) -> list[Move]:
        """Push the least recently used records of ``tier`` down until it fits."""
        moves: list[Move] = []
        below = tier + 1 if tier + 1 < len(self.capacities) else None
        while self.used[tier] > self.capacities[tier]:
            victim, size = next(iter(self.held[tier].items()))
            if victim == keep:  # the newcomer alone is too big: nothing else to push out
                break
            if below is not None and size <= self.capacities[below]:
                moves.append(self._move(victim, below))
                moves += self._overflow(below, keep=victim)
            else:
                self._remove(victim)
                self.evictions[tier] += 1
                moves.append(("drop", victim, tier))
        return moves


class ImportancePolicy(Policy):
    """Seed 002's static cache: placed by importance at epoch boundaries, fixed in between."""

    name = "importance"

    def __init__(self, capacities: Sequence[int], num_samples: int, record_bytes: int) -> None:
        super().__init__(capacities, num_samples, record_bytes)
        self._target: np.ndarray | None = None  # tier per id, -1: not cached; None: no ranking
        # Held records the current ranking no longer wants in their tier, oldest first.
        self._spare: list[dict[int, None]] = [{} for _ in self.capacities]

    def target(self, sample_id: int) -> int | None:
        """The tier the latest ranking puts ``sample_id`` in (-1: none; None: no ranking yet)."""
        return None if self._target is None else int(self._target[sample_id])

    def targets(self) -> np.ndarray | None:
        """The tier the latest ranking puts each id in (-1: none), None before any ranking.

        Read-only: a new ranking replaces the array, never changes it, so another thread may
        read the one it got while the stack re-places.
        """
        return self._target

    def place(self, ranking: np.ndarray | None) -> list[Move]:
        """Re-place for a new epoch: DRAM gets the top of ``ranking``, the arena the next.

        Records already cached move between tiers when their target changed (cheap: no read
        from the store). Records the ranking drops stay until a targeted sample needs their
        room, so a ranking that changes little costs little.

        Args:
            ranking: sample ids, most important first (need not cover every id); None keeps
                the current placement.

        Returns:
            The promotions and demotions to carry out now.
        """
        if ranking is None:
            return []
        ranking = np.asarray(ranking, dtype=np.int64)
        target = np.full(self.num_samples, -1, np.int8)
        lo = 0
        for t, cap in enumerate(self.capacities):
            n = cap // self.record_bytes
            target[ranking[lo : lo + n]] = t
            lo += n
        target.flags.writeable = False  # readers on other threads hold it (``targets``)
        self._target = target
        # In numpy, not a Python step per held record: 200 ms at a million held on the loop.
        wants: list[tuple[np.ndarray, np.ndarray]] = []  # per tier: held ids, their targets
        for t, held in enumerate(self.held):  # in the order of admission, oldest first
            ids = np.fromiter(held, np.int64, len(held))
            inside = (ids >= 0) & (ids < len(target))  # an id outside the ranking: not in it
            to = np.full(len(ids), -1, np.int8)
            to[inside] = target[ids[inside]]
            self._spare[t] = dict.fromkeys(ids[to < 0].tolist())
            wants.append((ids, to))
        if len(self.capacities) < 2:
            return []
        moves: list[Move] = []
        # Swap: take the demoted out of DRAM, promote into the room they leave, then put the
        # demoted into the room the promoted leave in the arena (evicting unranked ones).
        sizes = self.held[DRAM]
        down = [(i, sizes[i]) for i in wants[DRAM][0][wants[DRAM][1] == ARENA].tolist()]
        up: list[int] = wants[ARENA][0][wants[ARENA][1] == DRAM].tolist()
        for i, _ in down:
            self._remove(i)
        for i in up:
            if self._make_room(DRAM, self.held[ARENA][i], moves):
                moves.append(self._move(i, DRAM))
        for i, size in down:
            if self._make_room(ARENA, size, moves):
                self._add(i, size, ARENA)
                self.demotions[DRAM] += 1
                self.demotions[ARENA] += 1
                moves.append(("demote", i, ARENA))
            else:
                self.evictions[DRAM] += 1
                moves.append(("drop", i, DRAM))
        return moves

    def _miss(self, sample_id: int, size: int) -> list[Move]:
        if self._target is None:
            return super()._miss(sample_id, size)  # no ranking yet: fill, never evict
        t = int(self._target[sample_id])
        if t < 0:
            return []  # not wanted this epoch: served from below, placement unchanged
        moves: list[Move] = []
        if not self._make_room(t, size, moves):
            return moves
        self._add(sample_id, size, t)
        moves.append(("admit", sample_id, t))
        return moves

    def _may_admit(self, sample_ids: list[int], sizes: list[int]) -> np.ndarray:
        """With a ranking, the records it wants in a tier (a miss of any other changes nothing)."""
        if self._target is None:
            return super()._may_admit(sample_ids, sizes)
        ids = np.asarray(sample_ids, np.int64)
        inside = (ids >= 0) & (ids < len(self._target))
        may = np.ones(len(ids), bool)  # an id outside the ranking: ``_miss`` says
        may[inside] = self._target[ids[inside]] >= 0
        return may

    def _fits_all(self, sample_ids: list[int], sizes: list[int]) -> list[int] | None:
        """Each record's target tier (-1: not wanted), where every target tier has the room."""
        if self._target is None:
            return super()._fits_all(sample_ids, sizes)
        ids = np.asarray(sample_ids, np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self._target)):
            return None
        tiers = self._target[ids]
        wanted = tiers >= 0
        need = np.bincount(
            tiers[wanted], np.asarray(sizes, np.int64)[wanted], minlength=len(self.capacities)
        )
        if not all(self.room(t, int(b)) for t, b in enumerate(need.tolist()) if b):
            return None
        out: list[int] = tiers.tolist()
        return out

    def _make_room(self, tier: int, size: int, moves: list[Move]) -> bool:
        """Evict records the ranking does not want in ``tier`` until ``size`` bytes fit."""
        if size > self.capacities[tier]:
            return False
        spare = self._spare[tier]
        while not self.room(tier, size):
            if not spare:
                return False
            victim = next(iter(spare))
            del spare[victim]
            self._remove(victim)
            self.evictions[tier] += 1
            moves.append(("drop", victim, tier))
        return True

    def _remove(self, sample_id: int) -> int:
        tier = super()._remove(sample_id)
        self._spare[tier].pop(sample_id, None)
        return tier


def make_policy(
    name: str, capacities: Sequence[int], num_samples: int, record_bytes: int
) -> Policy:
    """Build a policy by name.

    Raises:
        ValueError: an unknown name.
    """
    classes: dict[str, type[Policy]] = {
        "importance": ImportancePolicy,
        "lru": LruPolicy,
        "static": StaticPolicy,
    }
    if name not in classes:
        raise ValueError(f"`cache_policy` must be one of {', '.join(POLICIES)}, got {name!r}")
    return classes[name](capacities, num_samples, record_bytes)
