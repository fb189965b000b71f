"""Same-host delivery through a shared-memory ring: the daemon's slot bookkeeping.

A trainer on this host says ``"shm": true`` in HELLO; the daemon then creates its ring (once,
lazily, sized for that job's batches unless ``ShmConfig`` fixes the size) and answers
``"shm": {"ring": name}`` in WELCOME. Prefetch workers assemble batches straight into a lent
slot (one copy, out of the cache) and the BATCH carries a ``SlotDescriptor`` instead of
payload frames.

A slot goes back to the ring when:

* the consumer it was delivered to acknowledges the batch (the ``acks`` of its next
  GET_BATCH or ACK), so the trainer's tensors stay valid until it asks for the next batch;
* that consumer opens a pass again (what it held and never acknowledged is lost);
* that consumer's process is found dead (checked every tick by its HELLO pid);
* a batch assembled ahead of demand is dropped, or goes out over the socket instead.

When every slot is lent, assembly falls back to ordinary memory and the batch is packed into
a slot at delivery if one has come free by then, else sent over the socket: a full ring
costs a copy, never a stall or a deadlock between read-ahead and consumers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from loaderd.client.protocol import (
    BatchArrays,
    Buffer,
    Column,
    FieldSpec,
    batch_frames,
)
from loaderd.client.shm import (
    ShmError,
    ShmRing,
    SlotDescriptor,
    cleanup_stale,
    layout_bytes,
    process_alive,
)
from loaderd.config import ShmConfig
from loaderd.prefetch import Assembler, gather_fixed

logger = logging.getLogger(__name__)

BatchKey = tuple[Any, ...]  # job, rank, epoch, phase, batch index
_PREFETCH = "prefetch"  # ring owner of a slot assembled ahead of demand
_MAX_RING_BYTES = 1 << 30  # automatic sizing never takes more than this of /dev/shm...
_MAX_SHM_SHARE = 4  # ...nor more than a quarter of what is free there


@dataclass(slots=True)
class SlotBatch(BatchArrays):
    """A batch assembled in a ring slot: its arrays view the slot."""

    slot: int = -1
    desc: SlotDescriptor | None = None


@dataclass(slots=True)
class _Consumer:
    pid: int
    track_pid: bool  # the pid is visible here (same pid namespace), so death can be seen
    held: dict[BatchKey, int]  # delivered, not yet acknowledged: batch key -> slot


class ShmDelivery:
    """Lends ring slots to batches and takes them back; one per daemon, server thread only.

    ``assemble`` and ``discard`` may run on prefetch workers; everything else runs on the
    server loop's thread.

    Args:
        config: ring sizing and the on/off switch.
        schema: the store's fields, in wire order.
        mean_record_bytes: average stored record size (sizes slots for variable fields).
    """

    def __init__(self, config: ShmConfig, schema: list[FieldSpec], mean_record_bytes: int) -> None:
        self.config = config
        self.schema = schema
        self.mean_record_bytes = mean_record_bytes
        self.ring: ShmRing | None = None
        self._failed = False
        self._consumers: dict[bytes, _Consumer] = {}
        self.delivered = 0  # batches sent as descriptors
        self.socket_fallbacks = 0  # batches for shm consumers that went over the socket
        self.ring_full = 0  # assemblies that found no free slot
        self.reclaimed = 0  # slots taken back from consumers that went away
        if config.enabled:
            for name in cleanup_stale():
                logger.warning("removed stale shm ring %s of a dead daemon", name)

    # --- sizing and consumers -----------------------------------------------------------------

    def slot_bytes_for(self, batch_size: int) -> int:
        """Slot size that holds one batch of ``batch_size`` (ids, weights, every field)."""
        if self.config.slot_bytes is not None:
            return self.config.slot_bytes
        sizes = [8 * batch_size, 4 * batch_size]
        for f in self.schema:
            if f.variable:  # offsets, then the bytes: estimated at twice the mean record
                sizes += [8 * (batch_size + 1), 2 * self.mean_record_bytes * batch_size]
            else:
                sizes.append(batch_size * np.dtype(f.dtype).itemsize * int(np.prod(f.shape)))
        return layout_bytes(sizes)

    def _ensure_ring(self, batch_size: int) -> ShmRing | None:
        if self.ring is not None or self._failed or not self.config.enabled:
            return self.ring
        slot_bytes = self.slot_bytes_for(batch_size)
        slots = self.config.slots
        if slots is None:
            try:
                st = os.statvfs("/dev/shm")
                free = st.f_bavail * st.f_frsize
            except OSError:
                free = _MAX_RING_BYTES
            budget = min(_MAX_RING_BYTES, free // _MAX_SHM_SHARE)
            slots = max(4, min(self.config.auto_slots, budget // max(slot_bytes, 1)))
        try:
            self.ring = ShmRing.create(slots, slot_bytes)
        except (ShmError, ValueError) as e:
            self._failed = True
            logger.warning("shared-memory delivery off, batches go over the socket: %s", e)
        return self.ring

    def hello(self, identity: bytes, meta: dict[str, Any], batch_size: int) -> dict[str, Any]:
        """Register a consumer's HELLO; the extra WELCOME meta (``{"shm": {...}}`` or {})."""
        if meta.get("shm") is not True:
            self.reclaim(identity)
            self._consumers.pop(identity, None)
            return {}
        ring = self._ensure_ring(batch_size)
        if ring is None:
            return {}
        pid = meta.get("pid")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else -1
        old = self._consumers.get(identity)
        held = old.held if old is not None else {}
        self._consumers[identity] = _Consumer(pid, pid > 0 and process_alive(pid), held)
        return {"shm": {"ring": ring.name, "slot_bytes": ring.slot_bytes}}

    @property
    def active(self) -> bool:
        """Whether a ring exists and some consumer takes batches through it."""
        return self.ring is not None and bool(self._consumers)

    # --- assembly (prefetch workers) ----------------------------------------------------------

    def assembler(self, base: Assembler) -> SlotAssembler:
        """Wrap the daemon's assembler so that batches land in ring slots when they can."""
        return SlotAssembler(base, self)

    def discard(self, arrays: BatchArrays) -> None:
        """A batch that will never be delivered: give its slot back (thread-safe)."""
        if isinstance(arrays, SlotBatch) and self.ring is not None:
            self.ring.release(arrays.slot)

    # --- delivery (server thread) -------------------------------------------------------------

    def payload(
        self, identity: bytes, key: BatchKey, arrays: BatchArrays
    ) -> tuple[dict[str, Any] | None, list[Buffer], bool]:
        """How to send ``arrays`` to ``identity``: (descriptor or None, frames, copy).

        A slot batch goes to the first shm consumer that asks for it; any other receiver gets
        a copy of the bytes (``copy`` True: the slot may be reused once this returns).
        """
        consumer = self._consumers.get(identity)
        ring = self.ring
        in_slot = isinstance(arrays, SlotBatch) and ring is not None
        if consumer is not None and ring is not None:
            if (
                isinstance(arrays, SlotBatch)
                and arrays.desc is not None
                and ring.transfer(arrays.slot, identity, expected=_PREFETCH)
            ):
                return self._give(consumer, key, arrays.slot, arrays.desc)
            slot = ring.acquire(identity)
            if slot is not None:
                frames = batch_frames(arrays, self.schema)
                try:
                    desc = ring.pack(slot, frames)
                except ValueError:  # this batch is larger than a slot
                    ring.release(slot)
                else:
                    return self._give(consumer, key, slot, desc)
            else:
                self.ring_full += 1
            self.socket_fallbacks += 1
        return None, batch_frames(arrays, self.schema), in_slot

    def _give(
        self, consumer: _Consumer, key: BatchKey, slot: int, desc: SlotDescriptor
    ) -> tuple[dict[str, Any], list[Buffer], bool]:
        ring = self.ring
        assert ring is not None
        old = consumer.held.pop(key, None)
        if old is not None and old != slot:
            ring.release(old)  # delivered twice (requeued): the older copy is dead
        consumer.held[key] = slot
        self.delivered += 1
        return desc.to_json(), [], False

    def settle(self, arrays: BatchArrays) -> None:
        """After a batch was sent to all its waiters: free its slot unless a consumer has it."""
        ring = self.ring
        if (
            isinstance(arrays, SlotBatch)
            and ring is not None
            and ring.lent().get(arrays.slot) == _PREFETCH
        ):
            ring.release(arrays.slot)

    def release_acked(self, identity: bytes, meta: dict[str, Any]) -> None:
        """Give back the slots of the batches a GET_BATCH / ACK acknowledges."""
        consumer = self._consumers.get(identity)
        acks = meta.get("acks")
        if consumer is None or not consumer.held or not isinstance(acks, list):
            return
        head = (meta.get("job"), meta.get("rank"), meta.get("epoch"), meta.get("phase"))
        for index in acks:
            if isinstance(index, int) and not isinstance(index, bool):
                slot = consumer.held.pop((*head, index), None)
                if slot is not None and self.ring is not None:
                    self.ring.release(slot)

    def reclaim(self, identity: bytes) -> int:
        """Take back every slot delivered to ``identity`` (it reopened a pass or died)."""
        consumer = self._consumers.get(identity)
        if consumer is None or not consumer.held or self.ring is None:
            return 0
        n = len(consumer.held)
        for slot in consumer.held.values():
            self.ring.release(slot)
        consumer.held.clear()
        self.reclaimed += n
        logger.info("took back %d shm slots from a consumer (pid %d)", n, consumer.pid)
        return n

    def check_dead(self) -> None:
        """Reclaim the slots of consumers whose process has exited (called every tick)."""
        for identity, c in list(self._consumers.items()):
            if c.track_pid and not process_alive(c.pid):
                if c.held:
                    logger.warning("consumer pid %d is gone: reclaiming its shm slots", c.pid)
                self.reclaim(identity)
                del self._consumers[identity]

    # --- the rest -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The ``shm`` section of STATS."""
        ring = self.ring
        lent = ring.lent() if ring is not None else {}
        return {
            "enabled": self.config.enabled and not self._failed,
            "ring": ring.name if ring is not None else None,
            "slots": ring.slots if ring is not None else 0,
            "slot_bytes": ring.slot_bytes if ring is not None else 0,
            "bytes": ring.slots * ring.slot_bytes if ring is not None else 0,
            "lent": len(lent),
            "lent_to_consumers": sum(len(c.held) for c in self._consumers.values()),
            "consumers": len(self._consumers),
            "delivered": self.delivered,
            "socket_fallbacks": self.socket_fallbacks,
            "ring_full": self.ring_full,
            "reclaimed": self.reclaimed,
        }

    def close(self) -> None:
        """Unmap and remove the ring (safe to call twice)."""
        if self.ring is not None:
            self.ring.close()


class SlotAssembler:
    """Assembles fixed-shape batches straight into a ring slot (one copy out of the cache).

    Falls back to the plain assembler when no consumer takes shared memory, when the schema
    has variable-length fields, when the batch does not fit a slot, or when the ring is full.
    """

    def __init__(self, base: Assembler, delivery: ShmDelivery) -> None:
        """Wrap ``base``; batches go into ``delivery``'s ring."""
        self.base = base
        self.delivery = delivery

    def assemble(self, ids: np.ndarray, weights: np.ndarray) -> BatchArrays:
        """Read and pack one batch, into a slot when possible."""
        ring = self.delivery.ring
        base = self.base
        if ring is None or not self.delivery.active or base.codec.layout.variable:
            return base.assemble(ids, weights)
        n = len(ids)
        sizes = [8 * n, 4 * n, *(n * nbytes for *_, nbytes in base.fixed)]
        if layout_bytes(sizes) > ring.slot_bytes:
            return base.assemble(ids, weights)
        slot = ring.acquire(_PREFETCH)
        if slot is None:
            self.delivery.ring_full += 1
            return base.assemble(ids, weights)
        try:
            records = base.tiers.get_many(ids)
            desc = ring.layout(slot, sizes)
            views = [ring.view(slot, off, nb) for off, nb in desc.frames]
            out_ids = np.frombuffer(views[0], np.int64)
            out_ids[:] = ids
            out_w = np.frombuffer(views[1], np.float32)
            out_w[:] = weights
            columns: dict[str, Column] = {}
            outs = []
            for (name, dtype, shape, off, nbytes), view in zip(base.fixed, views[2:], strict=True):
                flat = np.frombuffer(view, np.uint8).reshape(n, nbytes)
                outs.append((flat, off))
                columns[name] = flat.view(dtype).reshape(n, *shape)
            gather_fixed(records, outs)
        except BaseException:
            ring.release(slot)
            raise
        return SlotBatch(out_ids, out_w, columns, slot=slot, desc=desc)
