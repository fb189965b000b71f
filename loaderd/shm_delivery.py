"""Same-host delivery through shared-memory rings: which slot holds which batch, for whom.

A trainer on this host says ``"shm": true`` in HELLO; the daemon then makes sure a ring with
slots large enough for that job's batches exists (one ring per slot size that some job needs,
so a later job with bigger batches gets its own ring instead of the socket) and answers
``"shm": {"ring": name}`` in WELCOME. All rings together stay within ``ShmConfig.max_bytes``
(``--shm-bytes``, 1 GiB by default) and a quarter of what /dev/shm has free: a job whose
ring would not fit, however large its ``batch_size``, is answered without ``"shm"`` and
served over the socket, its reason logged and kept in stats (``socket_jobs``). A fixed slot
count (``--shm-slots``) is a most: where the cap holds fewer (but at least 4, or the count
asked for if smaller), the ring gets those and the log says so.

The assembler writes the batches of a job with a ring straight into a slot
(``allocator_for``: one copy, out of the cache or the store) and the BATCH carries a
``SlotDescriptor`` instead of payload frames.

A slot goes back to its ring when:

* the consumer it was delivered to acknowledges the batch (the ``acks`` of its next
  GET_BATCH or ACK), so the trainer's tensors stay valid until it asks for the next batch;
* that consumer opens a pass again (what it held and never acknowledged is lost);
* that consumer's process is found dead (``loaderd.consumers`` is the one judge of that: its
  pid, checked only inside the daemon's own pid namespace);
* the training loop's process gives back a slot its DataLoader worker handed it (below);
* a batch assembled ahead of demand is dropped, or goes out over the socket instead.

A DataLoader worker that hands its batches to the loop's process whole, slot and all
(``client/slot_handover.py``), names that process in HELLO (``"handover": <pid>``). Its
slots do not come back with its acknowledgements, next pass or death while that process
lives: the loop may hold any batch the worker yielded. Those it had when it moved on wait in
``_loops`` for the loop's process to give each back (``"returned"``: ring, slot and
generation, so a slot lent again since is never touched), to say it holds none of the rest
(``"handed_held"``, about once a second and when its DataLoader's workers exit; the daemon
first looks whether they are gone), or to die. A worker whose ``transform`` kept a view of its
batch keeps that slot and gives it back itself, by the same ``"returned"``: by index, a batch
delivered to it again after a daemon restart would name the wrong slot.

A consumer's entry goes when its process is found dead, or when its connection closed
(``loaderd.connections`` tells ``loaderd.consumers``) and it holds no slot, so short-lived
clients leave nothing behind. A closed connection's slots stay lent while its process may
live: the trainer's tensors may still view them (at most the ring's slots stay so).

A ring sized automatically takes at most half of what the cap has left (but 16 slots, what
one job holds at once), so the first job's ring leaves room for later jobs' batch sizes. When
every slot of a job's ring is lent, or a batch outgrew its slots (variable-length fields), the
batch borrows a free slot of another ring whose slots hold it, the smallest first. Only when
no ring has one is it assembled in fresh memory and sent over the socket: a full ring costs a
copy, never a stall or a deadlock between read-ahead and consumers. So that the read-ahead
does not fill a ring that the batches asked for then find full, it takes slots only while a
quarter of them stays free (``room_ahead``).

A ring is removed once no consumer has used it for ``_IDLE_S`` (no consumer of a job that
maps to it, none holding one of its slots) and none of its slots is lent: one job with huge
batches does not keep the cap for good, and a later job gets a ring. Its jobs lose their
mapping first, so nothing new is assembled into it, and ``check_dead`` names them so that the
daemon drops the batches they had assembled ahead (their slots come back). The ring is
retired under its own lock (``LentRing.retire``), the one a prefetch worker takes to acquire a
slot, so no worker writes into a ring that is going; a trainer that still maps it keeps its
memory until it unmaps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loaderd.client.errors import ProtocolError
from loaderd.client.pids import pid_alive
from loaderd.client.protocol import Buffer
from loaderd.client.shm import (
    GEN,
    GEN_TABLE_OFFSET,
    MAX_SLOT_BYTES,
    MAX_SLOTS,
    PAGE,
    ShmError,
    SlotDescriptor,
    is_uint,
    layout_bytes,
)
from loaderd.config import ShmConfig
from loaderd.consumers import Consumers
from loaderd.prefetch import Batch, Placed
from loaderd.shm_ring import LentRing, cleanup_stale
from loaderd.stats import human_bytes

logger = logging.getLogger(__name__)

BatchKey = tuple[Any, ...]  # opaque here but for its first two elements, job and rank
SlotId = tuple[str, int, int]  # ring name, slot, generation: one lending of one slot
_PREFETCH = "prefetch"  # ring owner of a slot assembled ahead of demand
_MAX_SHM_SHARE = 4  # rings never take more than a quarter of what is free in /dev/shm
_MIN_SLOTS = 4  # fewer (automatic sizing) and the socket serves the job as well
# An automatic ring may take more than half of what the cap has left up to this many slots:
# a job's read-ahead (8 batches) plus what a DataLoader's workers hold; fewer cost copies.
_HALF_FLOOR_SLOTS = 16
_MAX_REASONS = 256  # jobs whose reason for the socket path stats remember
_MAX_CONSUMERS = 1 << 12  # entries kept; past it the oldest holding nothing are forgotten
_MAX_SLOT_IDS = 1 << 16  # slots one "returned" / "handed_held" may name
# A ring unused this long is removed: long enough for a trainer's DataLoader workers to come
# back for the next epoch without a new ring each time.
_IDLE_S = 5.0


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _ring_bytes(slots: int, slot_bytes: int) -> int:
    """The size of a ring's file in /dev/shm (``LentRing.create``'s layout)."""
    header = _round_up(GEN_TABLE_OFFSET + GEN.size * slots, PAGE)
    return header + slots * _round_up(slot_bytes, PAGE)


@dataclass(frozen=True, slots=True)
class SlotLease:
    """A ring slot lent to one batch (``Placed.lease``)."""

    ring: LentRing
    slot: int
    desc: SlotDescriptor

    def release(self) -> None:
        """Give the slot back (it must still be lent to the prefetcher)."""
        self.ring.release(self.slot)


@dataclass(frozen=True, slots=True)
class BlankSlot:
    """A slot lent before its batch's size is known (``loaderd.miss_workers`` fills it).

    ``place`` then lays it out for the batch's frames, or ``release`` gives it back unfilled.
    """

    delivery: ShmDelivery
    ring: LentRing
    slot: int

    def place(self, sizes: Sequence[int]) -> Placed:
        """The slot's frames for a batch of these frame sizes (they fit: checked by the filler).

        Raises:
            ValueError: the frames do not fit in the slot.
        """
        return self.delivery._place(self.ring, self.slot, sizes)

    def release(self) -> None:
        """Give the slot back unfilled."""
        self.ring.release(self.slot)


@dataclass(frozen=True, slots=True)
class RingAllocator:
    """``Allocate`` for one job, from its ring or another's (prefetch workers call it)."""

    delivery: ShmDelivery
    ring: LentRing

    def __call__(self, sizes: Sequence[int]) -> Placed | None:
        """A slot laid out for frames of these sizes; None: no ring has a free slot that big."""
        got = self.delivery._acquire(self.ring, layout_bytes(sizes))
        return None if got is None else self.delivery._place(*got, sizes)

    def lend(self, least: int = 0) -> BlankSlot | None:
        """A free slot of the job's size or ``least`` bytes, laid out once its batch is measured.

        None: none free (not counted: the daemon's own assembly then asks again).
        """
        got = self.delivery._acquire(self.ring, max(self.ring.slot_bytes, least), count=False)
        return None if got is None else BlankSlot(self.delivery, *got)


@dataclass(slots=True)
class _Consumer:
    job: str
    held: dict[BatchKey, SlotLease] = field(default_factory=dict)  # delivered, not acked
    loop: int | None = None  # the pid of the loop's process it hands its batches to


def _slot_id(lease: SlotLease) -> SlotId:
    return lease.ring.name, lease.slot, lease.desc.generation


def slot_ids(name: str, value: Any) -> list[SlotId]:
    """A request's list of [ring, slot, generation], checked.

    Raises:
        ProtocolError: not such a list, or longer than ``_MAX_SLOT_IDS``.
    """
    if (
        not isinstance(value, list)
        or len(value) > _MAX_SLOT_IDS
        or not all(
            isinstance(v, list)
            and len(v) == 3
            and isinstance(v[0], str)
            and is_uint(v[1])
            and is_uint(v[2])
            for v in value
        )
    ):
        raise ProtocolError(
            f"field {name!r} must be a list of at most {_MAX_SLOT_IDS} [ring, slot, generation]"
        )
    return [(v[0], v[1], v[2]) for v in value]


class ShmDelivery:
    """Lends ring slots to batches and takes them back; one per daemon.

    ``allocator_for`` runs on the server loop, the allocations it returns and ``discard`` on
    prefetch workers; everything else on the server loop's thread.

    Args:
        config: ring sizing and the on/off switch.
        slot_bytes_for: bytes one batch of a job with this batch size needs in a slot.
        consumers: the daemon's judge of which consumer processes are alive.
    """

    def __init__(
        self,
        config: ShmConfig,
        slot_bytes_for: Callable[[int], list[int]],
        consumers: Consumers,
    ) -> None:
        self.config = config
        self._slot_bytes_for = slot_bytes_for
        self._liveness = consumers
        self.rings: list[LentRing] = []
        self._job_ring: dict[str, LentRing] = {}
        self._consumers: dict[bytes, _Consumer] = {}
        # Slots a loop's process (pid) may hold, whose worker moved on: (batch key, lease).
        self._loops: dict[int, dict[SlotId, tuple[BatchKey, SlotLease]]] = {}
        self._failed = False
        self.socket_jobs: dict[str, str] = {}  # job -> why it goes over the socket
        self.delivered = 0  # batches sent as descriptors
        self.socket_fallbacks = 0  # batches for shm consumers that went over the socket
        self.ring_full = 0  # assemblies that found every slot large enough lent
        self.too_big = 0  # assemblies of a batch larger than any ring's slots
        self.reclaimed = 0  # slots taken back from consumers that went away
        self.handed = 0  # slots left to a loop's process by a worker that moved on
        self.returned = 0  # slots a loop's process gave back
        self.removed = 0  # rings removed once no consumer used them
        self._idle_since: dict[str, float] = {}  # ring name -> when it was last seen unused
        if config.enabled:
            for name in cleanup_stale():
                logger.warning("removed stale shm ring %s of a dead daemon", name)

    # --- rings and consumers ------------------------------------------------------------------

    def slot_bytes(self, batch_size: int) -> int:
        """Slot size for one batch of ``batch_size`` (the configured size, if fixed)."""
        if self.config.slot_bytes is not None:
            return self.config.slot_bytes
        return layout_bytes(self._slot_bytes_for(batch_size))

    def _ring_for(self, job: str, batch_size: int) -> LentRing | None:
        """A ring whose slots hold a batch of this size, made if none fits.

        None when no ring can be had within the cap; the reason is logged and kept for the
        job's entry in ``socket_jobs`` (stats), and the job is served over the socket.
        """
        if self._failed or not self.config.enabled:
            return None
        need = self.slot_bytes(batch_size)
        fits = [r for r in self.rings if need <= r.slot_bytes <= max(2 * need, 1 << 20)]
        if fits:
            return min(fits, key=lambda r: r.slot_bytes)
        if self.config.slot_bytes is not None and self.rings:
            return self._refuse(job, f"the fixed {need}-byte slots are in use by another ring")
        slot = _round_up(need, PAGE)
        if slot > MAX_SLOT_BYTES:
            return self._refuse(job, f"a batch of {batch_size} needs {need}-byte slots")
        left = self._budget() - sum(_ring_bytes(r.slots, r.slot_bytes) for r in self.rings)
        want = self.config.slots or self.config.auto_slots
        room = left
        if self.config.slots is None:  # leave half to the jobs that come later
            room = min(left, max(left // 2, _ring_bytes(_HALF_FLOOR_SLOTS, slot)))
        slots = min(want, MAX_SLOTS, max(room, 0) // slot)
        while slots and _ring_bytes(slots, slot) > room:
            slots -= 1
        # Fewer slots than asked for still beat the socket, by far for large batches: a fixed
        # --shm-slots is a most, down to what the automatic sizing would refuse.
        least = min(want, _MIN_SLOTS)
        if slots < least:
            return self._refuse(
                job,
                f"{least} slots of {human_bytes(slot)} (batch size {batch_size}) do not fit "
                f"in the {human_bytes(max(left, 0))} left of the shm cap "
                f"({human_bytes(self.config.max_bytes)}, --shm-bytes)",
            )
        if slots < want and self.config.slots is not None:
            logger.warning(
                "job %s gets a ring of %d slots of %s, not %d (--shm-slots): no more fit in "
                "the %s left of the shm cap (--shm-bytes)",
                job, slots, human_bytes(slot), want, human_bytes(max(left, 0)),
            )  # fmt: skip
        try:
            ring = LentRing.create(slots, need)
        except (ShmError, ValueError) as e:
            if not self.rings and need <= 1 << 20:
                self._failed = True  # not even a small ring: /dev/shm is unusable here
            return self._refuse(job, str(e))
        self.rings.append(ring)
        return ring

    def _refuse(self, job: str, reason: str) -> LentRing | None:
        """Log and keep why ``job`` gets no ring; None (the caller's answer)."""
        logger.warning("job %s goes over the socket, not shared memory: %s", job, reason)
        self.socket_jobs.pop(job, None)
        self.socket_jobs[job] = reason
        while len(self.socket_jobs) > _MAX_REASONS:
            del self.socket_jobs[next(iter(self.socket_jobs))]
        return None

    def _budget(self) -> int:
        """Bytes all rings together may take: the cap, and a share of what /dev/shm has free."""
        try:
            st = os.statvfs("/dev/shm")
            ours = sum(_ring_bytes(r.slots, r.slot_bytes) for r in self.rings)
            free = st.f_bavail * st.f_frsize + ours
        except OSError:
            return self.config.max_bytes
        return min(self.config.max_bytes, free // _MAX_SHM_SHARE)

    def hello(self, identity: bytes, meta: dict[str, Any], batch_size: int) -> dict[str, Any]:
        """Register a consumer's HELLO; the extra WELCOME meta (``{"shm": {...}}`` or {})."""
        if meta.get("shm") is not True:
            self.reclaim(identity)
            self._consumers.pop(identity, None)
            return {}
        job = str(meta.get("job"))
        ring = self._job_ring.get(job) or self._ring_for(job, batch_size)
        if ring is None:
            return {}
        self.socket_jobs.pop(job, None)
        self._job_ring[job] = ring
        old = self._consumers.get(identity)
        if old is None and not self._make_room():
            self._refuse(job, f"{len(self._consumers)} shm consumers hold slots")
            return {}
        loop = meta.get("handover")
        if not (is_uint(loop) and loop > 0 and self._liveness.alive(identity) is not None):
            loop = None  # only a process the daemon can check for life may hold slots
        self._consumers[identity] = _Consumer(job, old.held if old is not None else {}, loop)
        return {"shm": {"ring": ring.name, "slot_bytes": ring.slot_bytes}}

    def _make_room(self) -> bool:
        """Keep the consumer entries bounded: forget the oldest that hold no slot."""
        if len(self._consumers) < _MAX_CONSUMERS:
            return True
        idle = [i for i, c in self._consumers.items() if not c.held]
        for identity in idle[: len(self._consumers) - _MAX_CONSUMERS + 1]:
            del self._consumers[identity]
        return len(self._consumers) < _MAX_CONSUMERS

    @property
    def active(self) -> bool:
        """Whether some consumer takes batches through a ring."""
        return bool(self._consumers)

    # --- assembly (the allocator runs on prefetch workers) ------------------------------------

    def allocator_for(self, key: BatchKey) -> RingAllocator | None:
        """Where batch ``key`` is assembled: a slot of its job's ring, or None (fresh memory)."""
        ring = self._job_ring.get(key[0])
        if ring is None or not self._consumers:
            return None
        return RingAllocator(self, ring)

    def room_ahead(self, job: str) -> int | None:
        """How many of ``job``'s batches may hold a slot of its ring at once; None: no bound.

        The ring's slots less those its consumers hold and a quarter kept free for batches
        asked for. Where a consumer's window and the batches assembled ahead of it outnumbered
        the slots (16 slots of 64 MB batches: 1 MB samples), the read-ahead took them all, and
        a batch asked for then found the ring full and went out over the socket from fresh
        memory: two such batches a pass halved a hit epoch's rate.
        """
        ring = self._job_ring.get(job)
        if ring is None or not self._consumers:  # (``allocator_for``: then no slot is used)
            return None
        held = sum(owner != _PREFETCH for owner in ring.lent().values())
        return ring.slots - max(1, ring.slots // 4) - held

    def _acquire(self, own: LentRing, need: int, count: bool = True) -> tuple[LentRing, int] | None:
        """A free slot of at least ``need`` bytes: the job's own ring's, else a borrowed one.

        Borrowed from the ring with the smallest such slots. ``self.rings`` is read as a
        snapshot: prefetch workers call this while the server loop adds and removes rings.
        ``count``: a failure is counted, as a full ring or as a batch too big for any.
        """
        rings = [r for r in list(self.rings) if r.slot_bytes >= need]
        for ring in sorted(rings, key=lambda r: (r is not own, r.slot_bytes)):
            slot = ring.acquire(_PREFETCH)  # None when every slot is lent, or it is retired
            if slot is not None:
                return ring, slot
        if count and rings:
            self.ring_full += 1
        elif count:
            self.too_big += 1
        return None

    def _place(self, ring: LentRing, slot: int, sizes: Sequence[int]) -> Placed:
        desc = ring.layout(slot, sizes)
        frames = [ring.view(slot, off, n) for off, n in desc.frames]
        return Placed(frames, SlotLease(ring, slot, desc))

    def ring_names(self) -> list[str]:
        """The rings in use (a miss worker unmaps any other it still maps)."""
        return [r.name for r in self.rings]

    def discard(self, batch: Batch) -> None:
        """A batch that will never be delivered: give its slot back (thread-safe)."""
        if isinstance(batch.lease, SlotLease):
            batch.lease.release()

    # --- delivery (server thread) -------------------------------------------------------------

    def payload(
        self, identity: bytes, key: BatchKey, batch: Batch
    ) -> tuple[dict[str, Any] | None, list[Buffer], bool]:
        """How to send ``batch`` to ``identity``: (descriptor or None, frames, copy).

        A slot batch goes to the first shm consumer that asks for it; any other receiver gets
        a copy of the bytes (``copy`` True: the slot may be reused once this returns).
        """
        lease = batch.lease if isinstance(batch.lease, SlotLease) else None
        consumer = self._consumers.get(identity)
        if consumer is not None:
            if lease is not None and lease.ring.transfer(lease.slot, identity, expected=_PREFETCH):
                old = consumer.held.pop(key, None)
                if old is not None and old != lease:  # delivered twice (requeued)
                    self._let_go(consumer, {key: old})
                consumer.held[key] = lease
                self.delivered += 1
                return lease.desc.to_json(), [], False
            self.socket_fallbacks += 1
        assert batch.frames is not None
        return None, list(batch.frames), lease is not None

    def settle(self, batch: Batch) -> None:
        """After a batch was sent to all its waiters: free its slot unless a consumer has it."""
        lease = batch.lease
        if isinstance(lease, SlotLease) and lease.ring.lent().get(lease.slot) == _PREFETCH:
            lease.release()

    def release_acked(self, identity: bytes, meta: dict[str, Any]) -> None:
        """Give back the slots a GET_BATCH / ACK says its consumer no longer reads.

        Those are the batches in ``release``, and those in ``acks`` unless the ACK comes from
        the training loop (``loop``), which says what the loop received, not what is unread;
        and the slots handed to the loop's process that it gives back (``returned``) or does
        not hold (``handed_held``, module doc).

        Raises:
            ProtocolError: ``returned`` or ``handed_held`` is malformed.
        """
        if "returned" in meta or "handed_held" in meta:
            self._returned(identity, meta)
        consumer = self._consumers.get(identity)
        release = meta.get("release", [])
        acks = [] if meta.get("loop") is True else meta.get("acks", [])
        if consumer is None or not consumer.held:
            return
        if not isinstance(release, list) or not isinstance(acks, list):
            return
        head = (meta.get("job"), meta.get("rank"), meta.get("epoch"), meta.get("phase"))
        for index in [*acks, *release]:
            if isinstance(index, int) and not isinstance(index, bool):
                lease = consumer.held.pop((*head, index), None)
                if lease is not None:
                    lease.ring.release(lease.slot)

    def _returned(self, identity: bytes, meta: dict[str, Any]) -> None:
        """The slots the loop's process behind ``identity`` gives back or says it holds."""
        back = slot_ids("returned", meta.get("returned", []))
        kept = meta.get("handed_held")
        held_now = None if kept is None else set(slot_ids("handed_held", kept))
        pid = self._liveness.pid(identity)
        if pid is None:
            return  # nothing is handed to a process the daemon cannot check
        loop = self._loops.get(pid, {})
        # The loop's process gives back what its workers handed it; a worker, a slot it kept
        # (a transform viewed it): its own, under any socket of its process.
        workers = [
            c
            for ident, c in self._consumers.items()
            if c.held and pid in (c.loop, self._liveness.pid(ident))
        ]
        for sid in back:
            lease = loop.pop(sid, (None, None))[1]
            for c in workers if lease is None else []:
                key = next((k for k, held in c.held.items() if _slot_id(held) == sid), None)
                if key is not None:
                    lease = c.held.pop(key)
                    break
            if lease is not None:
                lease.ring.release(lease.slot)
                self.returned += 1
        if held_now is not None:
            for worker, c in list(self._consumers.items()):
                if c.loop == pid and self._liveness.alive(worker) is False:
                    self.reclaim(worker)  # a DataLoader's exited workers: found gone now
            loop = self._loops.get(pid, {})
            mine = (meta.get("job"), meta.get("rank"))
            for sid in [s for s, (key, _) in loop.items() if key[:2] == mine and s not in held_now]:
                lease = loop.pop(sid)[1]
                lease.ring.release(lease.slot)
                self.reclaimed += 1
        if not loop:
            self._loops.pop(pid, None)

    def _let_go(self, consumer: _Consumer, leases: dict[BatchKey, SlotLease]) -> bool:
        """Free slots a consumer no longer reads (True), or leave them to its loop's process."""
        if consumer.loop is not None and pid_alive(consumer.loop):
            loop = self._loops.setdefault(consumer.loop, {})
            loop.update((_slot_id(lease), (key, lease)) for key, lease in leases.items())
            self.handed += len(leases)
            return False
        for lease in leases.values():
            lease.ring.release(lease.slot)
        return True

    def reclaim(self, identity: bytes) -> int:
        """Take back every slot delivered to ``identity`` (it reopened a pass or died).

        A worker's slots that its loop's process may hold wait for that process instead.
        """
        consumer = self._consumers.get(identity)
        if consumer is None or not consumer.held:
            return 0
        n = len(consumer.held)
        freed = self._let_go(consumer, consumer.held)
        consumer.held = {}
        if not freed:
            return 0
        self.reclaimed += n
        logger.info("took back %d shm slots from a consumer of job %s", n, consumer.job)
        return n

    def check_dead(self) -> set[str]:
        """Forget the consumers that are gone, and the rings none uses (called every tick).

        A consumer whose process exited loses its slots. One whose connection closed while
        its process may live (or cannot be checked) keeps the slots it holds, since its
        tensors may still view them, and is forgotten once it holds none; one that holds
        nothing is forgotten at once.

        Returns:
            The jobs whose ring is going: drop the batches they assembled ahead of demand
            (and nobody waits for), so that its slots come back.
        """
        for identity, consumer in list(self._consumers.items()):
            dead = self._liveness.alive(identity) is False
            if dead or (self._liveness.is_closed(identity) and not consumer.held):
                if dead and consumer.held:
                    logger.warning("an shm consumer's process is gone: reclaiming its slots")
                self.reclaim(identity)
                del self._consumers[identity]
                self._liveness.forget(identity)
        for pid in [p for p in self._loops if not pid_alive(p)]:
            gone = self._loops.pop(pid)
            for _, lease in gone.values():
                lease.ring.release(lease.slot)
            self.reclaimed += len(gone)
        return self._remove_idle_rings(time.monotonic())

    def _remove_idle_rings(self, now: float) -> set[str]:
        """Unmap the jobs of rings unused for ``_IDLE_S`` and remove those with no slot lent."""
        used = {id(self._job_ring.get(c.job)) for c in self._consumers.values()}
        used |= {id(lease.ring) for c in self._consumers.values() for lease in c.held.values()}
        used |= {id(lease.ring) for loop in self._loops.values() for _, lease in loop.values()}
        idle = [r for r in self.rings if id(r) not in used]
        self._idle_since = {r.name: self._idle_since.get(r.name, now) for r in idle}
        going = [r for r in idle if now - self._idle_since[r.name] >= _IDLE_S]
        jobs = {job for job, ring in self._job_ring.items() if ring in going}
        for job in jobs:
            del self._job_ring[job]
        for ring in going:
            if ring.retire():  # else slots are lent still: tried again next tick
                self.rings.remove(ring)
                del self._idle_since[ring.name]
                ring.close()
                self.removed += 1
                logger.info(
                    "removed shm ring %s: no consumer used it for %.0f s", ring.name, _IDLE_S
                )
        return jobs

    # --- the rest -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The ``shm`` section of STATS."""
        lent = sum(len(r.lent()) for r in self.rings)
        first = self.rings[0] if self.rings else None
        return {
            "enabled": self.config.enabled and not self._failed,
            "ring": first.name if first is not None else None,
            "slots": sum(r.slots for r in self.rings),
            "slot_bytes": max((r.slot_bytes for r in self.rings), default=0),
            "bytes": sum(r.slots * r.slot_bytes for r in self.rings),
            "rings": [
                {"name": r.name, "slots": r.slots, "slot_bytes": r.slot_bytes} for r in self.rings
            ],
            "lent": lent,
            "lent_to_consumers": sum(len(c.held) for c in self._consumers.values()),
            "consumers": len(self._consumers),
            "delivered": self.delivered,
            "socket_fallbacks": self.socket_fallbacks,
            "ring_full": self.ring_full,
            "too_big": self.too_big,
            "reclaimed": self.reclaimed,
            "handed": self.handed,
            "returned": self.returned,
            "lent_to_loops": sum(map(len, self._loops.values())),
            "rings_removed": self.removed,
            "max_bytes": self.config.max_bytes,
            "socket_jobs": dict(self.socket_jobs),
        }

    def close(self) -> None:
        """Unmap and remove the rings (safe to call twice)."""
        for ring in self.rings:
            ring.close()
