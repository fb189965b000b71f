"""A DataLoader worker sends the tensors it made through shared memory it reuses.

What a worker's ``transform`` made, and a batch that came over the socket, are the worker's
own tensors. torch sends such a tensor by moving its storage into a new shared-memory file: a
copy into memory touched for the first time, faulted in again by the receiver, and a file
descriptor passed per storage, per batch. A transform making floats of 100 KB samples ran
slower with 2 workers than with none. So each worker copies a batch's new storages into one
slot of a pool it made once (``OutputPool``: a few slots, grown when a batch needs more) and
sends where they lie; the loop's process maps the pool once (it travels with the batches,
as torch sends shared memory, until the loop says it has it) and views the slot.

A flag per slot, in the pool, says whose it is: the worker sets it when it fills the slot,
the loop's process clears it once the batch's last view of it dies. A worker finding no slot
free (the loop holds many of its batches) sends that batch's tensors as torch does.

A pool is shared memory that torch unlinks at once: it is freed when the worker and every view
of it in the loop's process are gone, a killed worker included. The loop's process forgets a
worker's pool when that worker sends a new one or has ended.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from loaderd.client.pids import PerProcess, current_pid, pid_alive

logger = logging.getLogger(__name__)

SLOTS = 4  # the loop holds a batch or two; DataLoader keeps ``prefetch_factor`` (2) in flight
MAX_POOL_BYTES = 1 << 30  # fewer slots for larger batches, down to 2; larger ones go as torch
MIN_SLOTS = 2  # sends them
_HEADER = 64  # int32 flags: [0] the loop's process has the pool, [1 + i] slot i is in flight
_ALIGN = 64
_GROW = 1.25  # a pool's slots fit a batch this much larger than the one that made it

# How a batch's pooled storages travel: the pool's key, the worker's pid, the slot, the
# slot's first byte and size in the pool, and the pool itself until the loop's process has it.
PoolRef = tuple[str, int, int, int, int, torch.Tensor | None]


class OutputPool:
    """A worker's slots of shared memory for the tensors it made."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        """A new pool of ``slots`` slots.

        Raises:
            OSError, RuntimeError: ``/dev/shm`` has no room for it.
        """
        self.key = os.urandom(8).hex()
        self.pid = current_pid()
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.memory = _shared_zeros(_HEADER + slots * slot_bytes)
        self.flags = self.memory[:_HEADER].numpy().view(np.int32)
        self._next = 0

    def take(self) -> int | None:
        """A free slot, now in flight; None when the loop's process holds them all."""
        for j in range(self.slots):
            s = (self._next + j) % self.slots
            if self.flags[1 + s] == 0:
                self.flags[1 + s] = 1
                self._next = s + 1
                return s
        return None

    def slot(self, s: int) -> torch.Tensor:
        """Slot ``s``'s bytes."""
        start = _HEADER + s * self.slot_bytes
        return self.memory[start : start + self.slot_bytes]

    def ref(self, s: int) -> PoolRef:
        """How a batch in slot ``s`` names it: with the pool until the loop's process has it."""
        attached = bool(self.flags[0])
        memory = None if attached else self.memory
        return self.key, self.pid, s, _HEADER + s * self.slot_bytes, self.slot_bytes, memory


def _shared_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` of new shared memory, zeros, held in ``/dev/shm`` now.

    A file there is sparse: where it cannot take the bytes (a container's 64 MB ``/dev/shm``)
    the first write past its room kills the process with SIGBUS. So the bytes are taken at
    once (``posix_fallocate``), and a pool that does not fit is not made.

    Raises:
        OSError: no room (``posix_fallocate``).
        RuntimeError: torch could not make the file that size.
    """
    storage: Any = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    if torch.multiprocessing.get_sharing_strategy() == "file_descriptor":  # type: ignore[no-untyped-call]
        fd, size = storage._share_fd_cpu_()
        os.posix_fallocate(fd, 0, size)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


_POOL: OutputPool | None = None
_POOL_OFF = False  # set once ``/dev/shm`` had no room for a pool: as torch sends them
_POOL_LOCK = threading.Lock()  # a worker packs in its generator and in its queue's feeder


def place(tensors: Sequence[torch.Tensor]) -> tuple[PoolRef | None, list[tuple[Any, ...]]]:
    """How each of a batch's new tensors travels, and the pool slot they were copied into.

    Each is ``("pool", offset, dtype, shape, stride, storage_offset, storage_bytes)``, its
    storage copied into the slot at ``offset``, or ``("value", tensor)``, as torch sends it.

    A storage is copied whole and once (torch sends them so): views of it keep their strides,
    and two views of one storage still share their bytes. Storages in shared memory already
    cost torch no copy and travel as they are.
    """
    offsets: dict[int, int] = {}  # storage address: its offset in the slot
    need = 0
    for t in tensors:
        storage = t.untyped_storage()
        if not storage.is_shared() and storage.data_ptr() not in offsets:
            offsets[storage.data_ptr()] = need
            need += -(-storage.nbytes() // _ALIGN) * _ALIGN
    taken = _take(need) if offsets else None
    if taken is None:
        return None, [("value", t) for t in tensors]
    ref, dst = taken
    entries: list[tuple[Any, ...]] = []
    copied: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        at = offsets.get(storage.data_ptr())
        if at is None:
            entries.append(("value", t))
            continue
        n = storage.nbytes()
        if at not in copied:
            dst[at : at + n].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            copied.add(at)
        shape, stride = tuple(t.shape), tuple(t.stride())
        entries.append(("pool", at, t.dtype, shape, stride, t.storage_offset(), n))
    return ref, entries


def _take(need: int) -> tuple[PoolRef, torch.Tensor] | None:
    """A slot of ``need`` bytes or more of this worker's pool (made or grown): ref and bytes.

    None where the loop's process holds every slot, or no pool can hold ``need``.
    """
    global _POOL, _POOL_OFF
    slot_bytes = -(-int(need * _GROW) // _ALIGN) * _ALIGN
    slots = min(SLOTS, MAX_POOL_BYTES // max(slot_bytes, 1))
    if slots < MIN_SLOTS or _POOL_OFF:
        return None
    with _POOL_LOCK:
        pool = _POOL if _POOL is not None and _POOL.pid == current_pid() else None
        if pool is None or pool.slot_bytes < need:
            _POOL = None  # the old one goes as the loop's process drops its batches
            try:
                pool = _POOL = OutputPool(slot_bytes, slots)
            except (OSError, RuntimeError) as e:  # torch's own resize fails with the latter
                logger.warning(
                    "DataLoader worker %d: no room in /dev/shm for a %d MiB output pool (%s); "
                    "its batches go as torch sends them",
                    current_pid(),
                    (_HEADER + slots * slot_bytes) >> 20,
                    e,
                )
                _POOL_OFF = True
                return None
        s = pool.take()
        return None if s is None else (pool.ref(s), pool.slot(s))


class _Mapped:
    """The loop's process: the pools of the workers it receives from (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pools: dict[str, tuple[int, torch.Tensor]] = {}  # key: (worker pid, memory)


_mapped = PerProcess(_Mapped).get


def receive(ref: PoolRef) -> np.ndarray | None:
    """The slot ``ref`` names, as bytes here; it goes back to its worker once they die.

    None where this process no longer has the pool (its worker was killed, and a later pool
    or the DataLoader's shutdown dropped it): the batch comes again, as any stale one.
    """
    key, pid, s, start, nbytes, memory = ref
    mapped = _mapped()
    with mapped.lock:
        if key in mapped.pools:
            memory = mapped.pools[key][1]
        elif memory is None:
            return None
        else:
            for k, (p, _) in list(mapped.pools.items()):
                if p == pid or not pid_alive(p):
                    del mapped.pools[k]
            mapped.pools[key] = (pid, memory)
    flags = memory[:_HEADER].numpy().view(np.int32)
    flags[0] = 1  # the worker sends slots by place alone from now on
    anchor = memory[start : start + nbytes].numpy()
    weakref.finalize(anchor, _give_back, flags, s)
    return anchor


def _give_back(flags: np.ndarray, s: int) -> None:
    flags[1 + s] = 0


def rebuild(entry: tuple[Any, ...], anchor: np.ndarray) -> torch.Tensor:
    """A ``("pool", ...)`` entry's tensor, viewing ``anchor`` (its slot, from ``receive``)."""
    _, at, dtype, shape, stride, storage_offset, n = entry
    if n < dtype.itemsize:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(anchor, dtype=dtype, count=n // dtype.itemsize, offset=at)
    return flat.as_strided(shape, stride, storage_offset)


def forget_ended() -> None:
    """Drop the pools of workers that have ended; their memory goes once no batch views it.

    The loop's process, after its DataLoader shut its workers down.
    """
    mapped = _mapped()
    with mapped.lock:
        for k, (p, _) in list(mapped.pools.items()):
            if not pid_alive(p):
                del mapped.pools[k]
