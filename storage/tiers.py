"""The tier stack, DRAM then the NVRAM arena then LMDB: the only code that knows tier order.

A read looks each id up in the placement policy (``policies.py``), takes DRAM hits from memory,
reads arena hits (verified against their checksums: a bad record is dropped, counted and read
from the store instead, so the trainer never sees wrong bytes) and reads the rest from the
store, which verifies them too. Then the policy hears of every access and answers with moves
(admit, drop, promote, demote): DRAM moves happen at once, arena writes go to a background
writer that batches them into ``put_many``, so the serving path never waits on a flush. Until
it is written, a record queued for the arena is served from the write queue. With an
admission queue (``admission.py``), a record read from the store enters DRAM after the read,
on a thread of its own: the batch is served from the bytes it was assembled from, and the
record's pages are locked (or copied) off the serving path. Until then, or when the queue
was full and dropped it, the record is read from the store.

The arena is a ring log that overwrites its oldest records. Before a batch is appended, the
writer re-appends the live records the policy still wants that the batch would overwrite
(compaction by relocation); the policy is told of any record the ring takes anyway.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import numpy as np

from loaderd.storage.admission import AdmissionQueue
from loaderd.storage.arena import Arena, record_extent
from loaderd.storage.dram import DramCache, Held, own_copies
from loaderd.storage.errors import CorruptRecordError, StorageError
from loaderd.storage.map_loader import MEMORY_SHARE, MapLoader
from loaderd.storage.memory import memory_available
from loaderd.storage.policies import ARENA, DRAM, Admitted, Move, Policy, make_policy
from loaderd.storage.store import PIN_MIN_BYTES, SampleStore
from loaderd.storage.syscalls import address_of

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Share of the arena's log the policy may fill: the rest is slack for the ring's dead records,
# so that relocating live records ahead of the head stays cheap (write amplification <= 4).
ARENA_FILL: Final = 0.75
_WRITE_QUEUE_BYTES: Final = 64 << 20  # arena admissions beyond this are skipped, not queued
_WRITE_BATCH_BYTES: Final = 8 << 20
_ADMIT_CHUNK: Final = 64  # late DRAM admissions put per turn at the lock

Ranking = Callable[[], "np.ndarray | None"]
Record = bytes | memoryview  # a record's bytes, or a view of them (valid during a read)


@dataclass(slots=True)
class ArenaLoan:
    """A batch's arena records, lent to a reader in another process (``Arena.lend``).

    ``offsets[i]`` is where sample i's payload lies in the arena file (-1: not in the arena,
    read it from the store) and ``lengths[i]`` its record's length. The ring does not
    overwrite these records until ``release``.
    """

    path: str
    file_id: tuple[int, int]
    offsets: np.ndarray
    lengths: np.ndarray
    _arena: Arena
    _lent: np.ndarray | None = field(default=None)

    def release(self) -> None:
        """The reader is done (or gone): the records may be overwritten. Idempotent."""
        lent, self._lent = self._lent, None
        if lent is not None:
            self._arena.give_back(lent)


def _room_for(store: SampleStore) -> bool:
    """Whether data.mdb fits in the memory available, to be brought into RAM at start."""
    if store.file_bytes <= memory_available() * MEMORY_SHARE:
        return True
    logger.info(
        "store %s: %d MiB is more than the memory available: it is brought into RAM as "
        "records are read, not at start",
        store.path,
        store.file_bytes >> 20,
    )
    return False


def _held_once(store: SampleStore) -> None:
    """Hold every record as a view of the held map where copies would not fit beside it."""
    copies = store.bytes_copied_when_held()
    if not copies or store.file_bytes + copies <= memory_available() * MEMORY_SHARE:
        return
    store.views_only()
    logger.info(
        "store %s: its records under a page are held as views of its map, not copied: the "
        "memory available holds the store once, not with %d MiB of copies beside it",
        store.path,
        copies >> 20,
    )


def _hold_whole(store: SampleStore, load: bool) -> MapLoader | None:
    """Hold the store's map in RAM for a DRAM tier that can hold all of it; its loader.

    Locked (``lock_map``), and brought in at start where ``load`` and it fits the memory
    available. Where the process may not lock, owned (``own_map``): only the loader, which
    copies it, can make it so. None: no loader (the map may be locked still).
    """
    locked = store.lock_map()
    room = load and _room_for(store)
    if not locked and not (room and store.own_map()):
        return None
    _held_once(store)
    if not room:
        return None  # a locked map's pages are locked as records are read
    span = store.held_range
    assert span is not None
    lo, hi = span
    return MapLoader(
        lo,
        hi - lo,
        label=f"store {store.path}",
        on_done=store.map_loaded,
        copy_from=store.path / "data.mdb" if store.map_owned else None,
    )


class TierStack:
    """DRAM and an optional NVRAM arena in front of the LMDB store.

    Thread-safe. A context manager; ``close`` flushes queued arena writes.

    Args:
        store: the backing store (the source of truth).
        dram: the DRAM tier, or its capacity in bytes.
        arena: the NVRAM arena, or None for DRAM only. Its surviving records are served at
            once (a warm restart).
        policy: ``importance`` (default), ``lru`` or ``static`` (see ``policies.py``).
        admit_queue_bytes: record bytes waiting for DRAM admission at most, admitted by a
            background thread (full: an admission is dropped, never waited for); 0 (default)
            admits during the read.
        lock_pages: whether DRAM may hold a record as the store's pages, locked in RAM
            (``SampleStore.pin``) or, where it can hold the whole store and the process may
            not lock, copied whole into memory of its own (``own_map``); False: as a copy.
        load_map: where DRAM can hold the whole store, bring the whole file in at once, in
            file order (``map_loader.py``); False: as records are read (and a process that
            may not lock copies them).
    """

    def __init__(
        self,
        store: SampleStore,
        dram: DramCache | int,
        arena: Arena | None = None,
        *,
        policy: str = "importance",
        admit_queue_bytes: int = 0,
        lock_pages: bool = True,
        load_map: bool = True,
    ) -> None:
        self.store = store
        self.arena = arena
        self.record_bytes = max(1, store.total_bytes // max(store.num_samples, 1))
        caps = [dram.capacity_bytes if isinstance(dram, DramCache) else dram]
        if arena is not None:
            # The policy counts payload bytes; the log also holds each record's header.
            per = self.record_bytes / record_extent(self.record_bytes)
            caps.append(int(arena.capacity_bytes * ARENA_FILL * per))
        self.policy: Policy = make_policy(
            policy, caps, max(store.num_samples, 1), self.record_bytes
        )
        # Where the policy keeps DRAM within its capacity, the tier's own LRU order would
        # decide nothing: its hits skip keeping one (``recency``).
        self.dram = (
            dram
            if isinstance(dram, DramCache)
            else DramCache(
                dram,
                pin=store.pin_many if lock_pages else None,
                view_at=store.view_at,
                recency=self.policy.overfills_dram,
                located_ids=store.num_samples,
            )
        )
        # DRAM can hold it all: the map held whole, no lock per record, and the whole file
        # brought in, in file order, from the start (``_hold_whole``; below).
        fits = lock_pages and self.dram.capacity_bytes >= store.file_bytes and store.num_samples
        self._lock = threading.Lock()
        self._ops: deque[tuple[str, Any, Any]] = deque()  # arena work for the writer
        # Queued for the arena, served from here: bytes of their own, or views of the store's
        # read-only map (valid while the store is open; the writer is stopped before it closes).
        self._pending: dict[int, Record] = {}
        self._pending_bytes = 0
        self.skipped_writes = 0
        self.relocated = 0
        self.write_errors = 0
        self.placements = 0
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._idle = True
        self._writer: threading.Thread | None = None
        self._placer: ThreadPoolExecutor | None = None  # placements, where no writer runs
        self._closed = False
        self.admitted_late = 0  # records the admission queue put into DRAM
        self._admissions = (
            AdmissionQueue(admit_queue_bytes, self._admit_late) if admit_queue_bytes > 0 else None
        )
        if arena is not None:
            adopted = sum(self.policy.adopt(i, n, ARENA) for i, n in sorted(arena.sizes().items()))
            if adopted < len(arena):
                logger.info("arena holds %d records, the policy kept %d", len(arena), adopted)
            self._writer = threading.Thread(
                target=self._run_writer, name="loaderd-arena-writer", daemon=True
            )
            self._writer.start()
        self._loader = _hold_whole(store, load_map) if fits else None

    # ---- reads -----------------------------------------------------------------------------

    def get_many(self, ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """Verified records for ids, in order, as bytes (copies; see ``read`` for none)."""
        with self.read(ids) as records:
            return [bytes(r) for r in records]

    @contextmanager
    def read(self, ids: Sequence[int] | np.ndarray) -> Iterator[list[Record]]:
        """Verified records for ids, in order, from the fastest tier that holds each.

        Records read from the store are views into LMDB's map, valid inside the ``with``
        block only: the caller copies them once, into its batch. Each record's checksum is
        verified once, where it crosses from a tier that can be corrupted (the store, the
        arena); DRAM hits are served as they are. A record the policy admits into DRAM has
        its pages locked or is copied there, during the read or, with an admission queue,
        after it.

        Raises:
            KeyError: an id is not in the store.
            CorruptRecordError: the store's own copy is bad (a tier's bad copy is skipped).
        """
        keys = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]
        got: dict[int, Record] = {}
        found: dict[int, int | None] = {}
        in_arena: list[int] = []
        unique = list(dict.fromkeys(keys))
        with self._lock:
            lookup, dram = self.policy.lookup, self.dram.get
            for sid in unique:
                tier = lookup(sid)
                if tier == DRAM:
                    rec = dram(sid)
                elif tier == ARENA:
                    rec = self._pending.get(sid)
                    if rec is None:
                        in_arena.append(sid)
                        continue
                else:
                    continue
                if rec is not None:
                    got[sid], found[sid] = rec, tier
        if in_arena:
            assert self.arena is not None
            for sid in in_arena:
                arec = self.arena.get(sid)  # verified; a bad record is dropped and counted
                if arec is not None:
                    got[sid], found[sid] = arec, ARENA
        missing = [sid for sid in unique if sid not in got]
        self.store.advise_known(missing)  # cold pages are read together, not one by one
        with self.store.views(missing, verified=False) as views:
            got.update(zip(missing, views, strict=True))
            self._account(keys, missing, got, found, verify=True)
            yield [got[sid] for sid in keys]

    def readable_elsewhere(self, ids: np.ndarray) -> tuple[np.ndarray, ArenaLoan | None] | None:
        """What another process needs to read this batch itself; None: it may not.

        It may (``read_elsewhere``) when the store can slice the records it reads for DRAM
        and map their pages (a lock of pages never mapped here would hold nothing). Its arena
        records are lent to it (``Arena.lend``: not overwritten while it reads them); those
        still queued for the arena it reads from the store, which holds the same bytes.
        Returns the ids no tier holds (the ones to read ahead) and the loan, which the
        caller releases once the reader is done.
        """
        if not (self.store.sliceable and self.store.prefaulting):
            return None
        with self._lock:
            where = self.policy.lookup_many(ids)
        in_arena = where == ARENA
        if self.arena is None or not bool(in_arena.any()):
            return ids[where < 0], None
        # Those still queued for the arena (or lost from it) the reader reads from the store.
        lent = self.arena.lend(ids[in_arena].tolist())
        offsets = np.full(len(ids), -1, np.int64)
        offsets[in_arena] = lent
        lengths = self.store.record_bytes(ids)  # an arena payload is the store's record
        if lengths is None:  # (no value index: then not ``sliceable`` either)
            self.arena.give_back(lent)
            return None
        arena = self.arena
        loan = ArenaLoan(str(arena.path), arena.file_id, offsets, lengths, arena, lent)
        return ids[where < 0], loan

    def read_elsewhere(self, ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """Account for a batch that another process read from the store and verified.

        The records are counted where the policy finds them now (a DRAM record was read
        from the store's pages all the same), and those it admits into DRAM are this
        process's slices of the same pages, at the file offsets the reader saw
        (``SampleStore.confirm_offsets``): no second read, no second checksum.

        Args:
            ids: the batch's sample ids, in order.
            offsets: where the reader found each record in data.mdb (file offsets).
            lengths: each record's length.
        """
        keys = ids.tolist()
        ids = np.asarray(ids, np.int64)
        with self._lock:
            where = self.policy.lookup_many(ids)
        held = where >= 0
        found: dict[int, int | None] = {}
        at: slice | np.ndarray = slice(None)  # the usual batch: no tier holds any, none twice
        if held.any() or len(set(keys)) < len(keys):
            found = dict(zip(ids[held].tolist(), where[held].tolist(), strict=True))
            _, first = np.unique(ids, return_index=True)  # an id's first place in the batch
            at = np.sort(first[~held[first]])
        miss = ids[at]
        missing = miss.tolist()
        self.store.confirm_offsets(miss, offsets[at], lengths[at])
        sizes = dict(zip(keys, lengths.tolist(), strict=True)) if found else None
        # The worker mapped the pages, not this process: a record DRAM admits has its pages
        # mapped here by the admission (``SampleStore.pin``), the others never are.
        with self.store.views(missing, verified=False) as views:
            got: dict[int, Record] = dict(zip(missing, views, strict=True))
            self._account(keys, missing, got, found, sizes=sizes)

    def _account(
        self,
        keys: list[int],
        missing: list[int],
        got: dict[int, Record],
        found: dict[int, int | None],
        *,
        verify: bool = False,
        sizes: dict[int, int] | None = None,
    ) -> None:
        """Tell the policy of a read's accesses and carry out its moves.

        ``got`` holds the records read from the store (``missing``: views valid during the
        call) and those found in a tier (by id; ``sizes`` gives the length of any not in
        ``got``), ``found`` where each was found. ``verify``: check the store's records.
        """
        with self._lock:
            for sid in missing if self.arena is not None else ():
                if self.policy.lookup(sid) == ARENA and not self._in_arena(sid):
                    self.policy.forget(sid)  # the arena lost it (bad checksum, ring)
            moves: list[Move] = []
            if not found and len(got) == len(keys) and self._none_held(keys):
                # Every record came from the store, once: the policy takes them together.
                moves = self.policy.miss_all(keys, list(map(len, map(got.__getitem__, keys))))
            else:
                lengths = [
                    len(rec) if (rec := got.get(sid)) is not None else sizes[sid] if sizes else 0
                    for sid in keys
                ]
                tiers = np.array([-1 if (t := found.get(s)) is None else t for s in keys], np.int8)
                batch = self.policy.access_all(keys, lengths, tiers)
                if batch is not None:
                    moves = batch
                else:
                    access = self.policy.access
                    for sid, size in zip(keys, lengths, strict=True):
                        moves += access(sid, size, found.get(sid))
                        found[sid] = self.policy.lookup(sid)  # a repeat counts where it is now
        if verify:
            self._verify(missing, got)
        # A record read from a tier that the batch's own misses pushed out (an LRU's, before
        # a later id of the batch came to it) is admitted again. Where ``got`` lacks it (read
        # elsewhere), it is taken from the store, as that read was.
        again = [s for k, s, _ in moves if k == "admit" and s not in got] if found else []
        with ExitStack() as stack:
            if again:
                views = stack.enter_context(self.store.views(again, verified=False))
                got = {**got, **dict(zip(again, views, strict=True))}
            self._carry_out(moves, got)

    def _carry_out(self, moves: list[Move], got: dict[int, Record]) -> None:
        """Admit, drop and move records as the policy's ``moves`` say (``got``: the records)."""
        if moves and not self._admit_all(got, moves):
            # Locking pages (or copying) for DRAM is the slow part of an admission: done
            # before taking the lock, so that assembly threads overlap it; with a queue,
            # records large enough to be locked are left to it (a small one's copy costs
            # less than queueing it), unless holding one costs no system call (every page
            # of a locked map mapped already, or an owned map): less than waking the queue.
            admits = dict.fromkeys(s for k, s, t in moves if k == "admit" and t == DRAM)
            if self._admissions is not None and not self.store.holds_free:
                admits = dict.fromkeys(s for s in admits if len(got[s]) < PIN_MIN_BYTES)
            held = dict(zip(admits, self.dram.hold_many([got[s] for s in admits]), strict=True))
            try:
                with self._lock:
                    self._apply(moves, got, held)
            finally:
                for _, unpin in held.values():  # not taken by the tier
                    if unpin is not None:
                        unpin()

    def _admit_all(self, got: dict[int, Record], moves: list[Move]) -> bool:
        """Admit the records the policy took into DRAM together; False: the moves are not such.

        What ``hold_many`` and ``put_many`` do, without a Python step per record (at 3 KB
        those steps cost the server loop about 2 us a record), where it takes no system
        call: records under ``store.copy_below`` are copied; once every page of a locked map
        is mapped, or in an owned map, larger ones are held as views of it
        (``store.holds_free``). Otherwise larger ones are locked or
        queued record by record (``_apply``). The admitted records were read from the store:
        ``got`` holds each.
        """
        if not (isinstance(moves, Admitted) and moves.tier == DRAM):
            return False
        records = list(map(got.__getitem__, moves.ids))
        sizes = list(map(len, records))
        unpins: list[Callable[[], None] | None] | None = None
        at = None
        if max(sizes) < self.store.copy_below:
            records = own_copies(records)
        elif self.store.holds_free and min(sizes) >= self.store.copy_below:
            at = np.fromiter(map(address_of, records), np.int64, len(records))
            unpins = self.store.pin_many(records, at)  # views: no system call
            if None in unpins:
                return False  # not of the locked map
        else:
            return False
        with self._lock:
            for sid in self.dram.put_all(moves.ids, records, unpins, at):
                self.policy.forget(sid)  # larger than the tier (a policy's room says no first)
        return True

    def _none_held(self, keys: list[int]) -> bool:
        """Whether no tier holds any of these ids now (the lock is held)."""
        return bool((self.policy.lookup_many(np.asarray(keys, np.int64)) < 0).all())

    def resident(self, ids: np.ndarray) -> list[Record] | None:
        """Records for ids, in order, when DRAM holds every one; else None, nothing counted.

        The hit path without ``read``'s per-record steps for other tiers: one pass under the
        lock, no store transaction. The records are the tier's own (verified when admitted,
        immutable while held); a concurrent eviction leaves the caller a valid record.
        """
        return self._dram_hits(ids, self.dram.get_all)

    def located(self, ids: np.ndarray) -> tuple[np.ndarray, int] | None:
        """``resident``, as addresses: where each record lies and the shortest's length.

        None (nothing counted) unless DRAM holds every record as a view of the store's
        locked map (``DramCache.located``). The addresses stay readable while the store is
        open, whatever the tier lets go meanwhile: the map's pages hold the same bytes.
        """
        if not self.dram.locates:  # no view held: no lock taken, nothing counted
            return None
        return self._dram_hits(ids, lambda _: self.dram.located(ids))

    def _dram_hits(self, ids: np.ndarray, take: Callable[[list[int]], _T | None]) -> _T | None:
        """What ``take`` gives of a batch DRAM holds whole, counted as hits; else None."""
        keys = ids.tolist()
        with self._lock:
            if not self.policy.all_in(ids, DRAM):
                return None
            got = take(keys)
            if got is None:
                return None
            moves = self.policy.hit_all(keys, DRAM)
            if moves:  # no policy moves a DRAM hit today; one that does is still obeyed
                records = self.dram.get_all(keys, count=False) or []
                self._apply(moves, dict(zip(keys, records, strict=True)))
        return got

    def _verify(self, missing: list[int], got: dict[int, Record]) -> None:
        """Check the checksums of records read from the store (once per tier crossing)."""
        try:
            self.store.verify([got[sid] for sid in missing], missing)
        except CorruptRecordError as e:
            with self._lock:  # it was admitted in the bookkeeping: take that back
                self.policy.forget(e.sample_id)
            raise

    def cached(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` a tier holds now (a read-ahead skips them): bool per id."""
        with self._lock:
            return self.policy.lookup_many(ids) >= 0

    def in_dram(self, ids: np.ndarray) -> bool:
        """Whether DRAM holds every one of ``ids`` now (at least one)."""
        with self._lock:
            return self.policy.all_in(ids, DRAM)

    def _in_arena(self, sid: int) -> bool:
        return sid in self._pending or (self.arena is not None and sid in self.arena)

    # ---- placement -------------------------------------------------------------------------

    def place(self, ranking: np.ndarray | None) -> None:
        """Re-place by a ranking (ids, most important first) now; see the policy.

        Promotions read the arena; demotions queue arena writes.
        """
        if ranking is None:
            return  # keep the current placement
        with self._lock:
            moves = self.policy.place(ranking)
            self.placements += 1
            self._apply(moves, {})
        if moves:
            logger.info("placement: %d records moved between tiers", len(moves))

    def place_async(self, ranking: Ranking) -> None:
        """Compute a ranking and place it in the background, one placement after another.

        On the arena's writer thread, in order with its writes; without an arena, on a thread
        of its own. Done inline, a selecting epoch's start held the server loop for the
        ranking's sort and the policy's pass over what it holds: ~0.3 s at a million samples.
        """
        if self._writer is None:
            if self._placer is None:
                self._placer = ThreadPoolExecutor(1, thread_name_prefix="loaderd-place")
            self._placer.submit(self._place_logged, ranking)
            return
        with self._wake:
            self._ops.append(("place", ranking, None))
            self._wake.notify()

    def _place_logged(self, ranking: Ranking) -> None:
        try:
            self.place(ranking())
        except Exception:  # the placement stays as it was; serving goes on
            logger.exception("placement failed; the tiers keep their current placement")

    def _apply(
        self, moves: list[Move], have: dict[int, Record], held: dict[int, Held] | None = None
    ) -> None:
        """Carry out a policy's moves (the lock is held).

        What leaves DRAM goes first, so that DRAM never holds more than its capacity on the
        way (its own LRU bound would otherwise push out a record that is being demoted).
        """
        if held and len(held) == len(moves):  # a batch of misses DRAM takes whole
            self.dram.put_many(held)
            held.clear()
            return
        if any(kind != "admit" for kind, _, _ in moves):  # a batch of misses has none to order
            moves = sorted(moves, key=lambda m: m[0] != "demote" and m != ("drop", m[1], DRAM))
        late: list[tuple[int, memoryview]] = []  # for the admission queue, offered together
        for kind, sid, tier in moves:
            if kind == "admit":
                rec = have[sid]
                if tier == DRAM:
                    self._put_dram(sid, rec, held.pop(sid, None) if held else None, late)
                elif not self._queue_put(sid, rec):  # a view of the store stays valid: no copy
                    self.policy.forget(sid)
            elif kind == "drop":
                if tier == DRAM:
                    self.dram.discard(sid)
                else:
                    self._queue_discard(sid)
            elif kind == "promote":
                got = have.get(sid) or self._pending.get(sid)
                if got is None and self.arena is not None:
                    got = self.arena.get(sid)
                if got is None:
                    self.policy.forget(sid)
                    continue
                self._put_dram(sid, got, None, late)
                self._queue_discard(sid)
            else:  # demote
                demoted = self.dram.discard(sid) or have.get(sid)
                if demoted is None or not self._queue_put(sid, demoted):
                    self.policy.forget(sid)
        if late and self._admissions is not None:
            for sid in self._admissions.offer_many(late):
                self.policy.forget(sid)  # dropped: the next read goes to the store again

    def _put_dram(
        self, sid: int, rec: Record, held: Held | None, late: list[tuple[int, memoryview]]
    ) -> None:
        """Admit into DRAM now, or (a view of the store, with a queue) into ``late``."""
        if self._admissions is None or held is not None or not isinstance(rec, memoryview):
            self.dram.put(sid, rec, held)
        else:
            late.append((sid, rec))

    def _admit_late(self, batch: list[tuple[int, memoryview]]) -> None:
        """The admission queue's worker: lock (or copy) each record, then put it in DRAM.

        The records were verified by the read that queued them, and what is locked here are
        the same pages of the store's read-only map (the store is never written while it is
        served: the assumption under which a batch is copied from a record after its check),
        so DRAM holds verified bytes without a second checksum. A record the policy no longer
        places in DRAM (dropped or moved since) is let go.
        """
        ids = [sid for sid, _ in batch]
        held = self.dram.hold_many([view for _, view in batch])  # pages mapped in one call
        if self._admissions is not None and any(unpin is None for _, unpin in held):
            self._admissions.background()  # copies, not locks: serving comes first
        for lo in range(0, len(held), _ADMIT_CHUNK):  # short turns at the serving path's lock
            chunk = held[lo : lo + _ADMIT_CHUNK]
            try:
                with self._lock:
                    sids = ids[lo : lo + _ADMIT_CHUNK]
                    where = self.policy.lookup_many(np.asarray(sids, np.int64))
                    keep: dict[int, Held] = {}
                    for sid, h, placed in zip(sids, chunk, (where == DRAM).tolist(), strict=True):
                        gone = keep.pop(sid, None) if placed else h  # offered twice: the last
                        if gone is not None and gone[1] is not None:
                            gone[1]()
                        if placed:
                            keep[sid] = h
                    refused = self.dram.put_many(keep)  # too large for the tier (let go)
                    for sid in refused:
                        self.policy.forget(sid)
                    self.admitted_late += len(keep) - len(refused)
            except BaseException:
                for _, rest in held[lo + len(chunk) :]:  # never offered to the tier
                    if rest is not None:
                        rest()
                raise

    @property
    def loading(self) -> bool:
        """Whether the whole store is being brought into RAM (``map_loader.py``) right now."""
        return self._loader is not None and self._loader.running

    @property
    def in_ram_whole(self) -> bool:
        """Whether the whole store is, or is being brought, into RAM, its pages held.

        From the load's start until the tier stack closes, unless the load stopped short:
        nothing of the store is left for a read-ahead to read.
        """
        return self._loader is not None and (self._loader.running or self._loader.done)

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued DRAM admissions are done; False on timeout."""
        return self._admissions is None or self._admissions.flush(timeout_s)

    # ---- the arena writer ------------------------------------------------------------------

    def _queue_put(self, sid: int, rec: Record) -> bool:
        if self.arena is None or self._pending_bytes + len(rec) > _WRITE_QUEUE_BYTES:
            self.skipped_writes += 1
            return False
        old = self._pending.pop(sid, None)
        if old is not None:
            self._pending_bytes -= len(old)
        self._pending[sid] = rec
        self._pending_bytes += len(rec)
        self._ops.append(("put", sid, rec))
        self._wake.notify()
        return True

    def _queue_discard(self, sid: int) -> None:
        old = self._pending.pop(sid, None)
        if old is not None:
            self._pending_bytes -= len(old)
        self._ops.append(("discard", sid, None))
        self._wake.notify()

    def _run_writer(self) -> None:
        while True:
            with self._wake:
                while not self._ops and not self._stop.is_set():
                    self._idle = True
                    self._wake.notify_all()
                    self._wake.wait(timeout=1.0)
                if not self._ops:
                    self._idle = True
                    self._wake.notify_all()
                    return
                self._idle = False
                ops = list(self._ops)
                self._ops.clear()
            try:
                self._write(ops)
            except Exception:
                self.write_errors += 1
                logger.exception("arena writer: a batch failed; its records stay uncached")
                with self._lock:
                    for kind, sid, rec in ops:
                        if kind == "put" and self._pending.get(sid) is rec:
                            self._unpend(sid)
                            self.policy.forget(sid)

    def _unpend(self, sid: int) -> None:
        rec = self._pending.pop(sid)
        self._pending_bytes -= len(rec)

    def _write(self, ops: list[tuple[str, Any, Any]]) -> None:
        arena = self.arena
        assert arena is not None
        batch: list[tuple[int, Record]] = []
        size = 0
        for kind, sid, arg in ops:
            if kind == "put":
                batch.append((sid, arg))
                size += record_extent(len(arg))
                if size >= _WRITE_BATCH_BYTES:
                    self._put_batch(batch)
                    batch, size = [], 0
                continue
            self._put_batch(batch)
            batch, size = [], 0
            if kind == "discard":
                with self._lock:
                    if sid not in self._pending:  # a later put of it is still queued
                        arena.discard(sid)
            else:  # place: ``sid`` is the function that computes the ranking
                self.place(sid())
        self._put_batch(batch)

    def _put_batch(self, batch: list[tuple[int, Record]]) -> None:
        if not batch:
            return
        arena = self.arena
        assert arena is not None
        with self._lock:
            # Only records still wanted in the arena and not replaced since they were queued.
            batch = [(s, r) for s, r in batch if self._pending.get(s) is r]
        if not batch:
            return
        need = sum(record_extent(len(r)) for _, r in batch)
        margin = record_extent(self.record_bytes) * 4
        moving: dict[int, Record] = {}
        for _ in range(8):  # relocating records takes room too: look again, a few times
            extra = sum(record_extent(len(r)) for r in moving.values())
            with self._lock:
                wanted = [
                    s
                    for s in arena.ahead(need + extra + margin)
                    if s not in moving and self.policy.lookup(s) == ARENA and s not in self._pending
                ]
            if not wanted:
                break
            for s in wanted:
                rec = arena.get(s)
                if rec is not None:
                    moving[s] = rec
        self.relocated += len(moving)
        items = list(moving.items()) + batch
        # Records that are views of the store's map are read from its file into the log: the
        # daemon has not mapped their pages, and mapping them cost more than the read.
        read_from = self.store.file_extents([r for _, r in items])
        try:
            evicted = arena.put_many(items, read_from=read_from)
        finally:
            with self._lock:
                for s, r in batch:
                    if self._pending.get(s) is r:
                        self._unpend(s)
        with self._lock:
            for s in evicted:
                if self.policy.lookup(s) == ARENA and not self._in_arena(s):
                    self.policy.forget(s)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued arena work is written; False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: self._idle and not self._ops, timeout=timeout_s)

    # ---- stats and lifecycle ---------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """``cache`` (all tiers together), ``tiers`` (each), ``backing`` (the store), ``policy``."""
        with self._lock:
            tiers: list[dict[str, Any]] = []
            for t in range(len(self.policy.capacities)):
                s: dict[str, Any] = {"name": "dram" if t == DRAM else "nvram"}
                s.update(self.policy.stats(t))
                s["corrupt_dropped"] = 0
                lookups = s["hits"] + s["misses"]
                s["hit_rate"] = s["hits"] / lookups if lookups else 0.0
                tiers.append(s)
            pending = len(self._pending)
        if self.arena is not None:
            a = self.arena.stats()
            tiers[ARENA].update(
                {
                    "corrupt_dropped": a["corrupt_dropped"],
                    "path": a["path"],
                    "durability": a["durability"],
                    "recovered_items": a["recovered_items"],
                    "recovery_dropped": a["recovery_dropped"],
                    "rebuilt": a["rebuilt"],
                    "file_bytes": a["file_bytes"],
                    "lent": a["lent"],
                    "log_bytes": a["capacity_bytes"],
                    "log_used_bytes": a["used_bytes"],
                    "ring_evictions": a["evictions"],
                    "pending_writes": pending,
                    "relocated": self.relocated,
                    "skipped_writes": self.skipped_writes,
                    "write_errors": self.write_errors,
                }
            )
        hits = sum(t["hits"] for t in tiers)
        misses = tiers[-1]["misses"]
        cache = {
            "capacity_bytes": sum(t["capacity_bytes"] for t in tiers),
            "used_bytes": sum(t["used_bytes"] for t in tiers),
            "items": sum(t["items"] for t in tiers),
            "hits": hits,
            "misses": misses,
            "evictions": sum(t["evictions"] for t in tiers),
            "corrupt_dropped": sum(t["corrupt_dropped"] for t in tiers),
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "policy": self.policy.name,
            "placements": self.placements,
        }
        # Records held as the store's pages locked in RAM, not copies (``SampleStore.pin``).
        tiers[DRAM].update(
            pinned=self.dram.pinned,
            locked_bytes=self.store.locked_bytes,
            map_locked=self.store.map_locked,
            map_owned=self.store.map_owned,
        )
        if self._loader is not None:
            tiers[DRAM]["map_load"] = self._loader.stats()
        if self._admissions is not None:
            tiers[DRAM].update(self._admissions.stats(), admitted_late=self.admitted_late)
        return {
            "cache": cache,
            "tiers": tiers,
            "backing": {
                "reads": self.store.reads,
                "bytes_read": self.store.bytes_read,
                "corrupt": self.store.corrupt,
            },
        }

    def close(self) -> None:
        """Write what is queued, then close the arena and the store (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        if self._loader is not None:
            self._loader.close()  # before the store's map goes away
        if self._admissions is not None:
            self._admissions.close()  # before the store's map goes away
        if self._placer is not None:
            self._placer.shutdown(wait=True, cancel_futures=True)
        if self._writer is not None:
            self._stop.set()
            with self._wake:
                self._wake.notify_all()
            self._writer.join(timeout=60)
            if self._writer.is_alive():  # it may still copy from the store's map: keep it
                logger.warning("the arena writer did not stop; the store is left open")
                return
        if self.arena is not None:
            try:
                self.arena.close()
            except StorageError as e:
                logger.warning("closing the arena: %s", e)
        self.dram.clear()  # unlock its views of the store before the map goes away
        self.store.close()

    def __enter__(self) -> TierStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
