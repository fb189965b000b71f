"""A DataLoader worker hands a shared-memory batch to the loop's process, slot and all.

Under ``num_workers > 0`` a worker's queue pickles each batch, and torch moves its tensors
into a fresh shared-memory file to send them: a copy out of the ring slot into memory touched
for the first time, per batch (100 KB samples: 13k samples/s with 2 workers, 121k with none).
The slot is shared memory already. So the worker pickles where each tensor lies in it (ring,
slot, generation, and each tensor's offset, dtype, shape and strides, ``pack``), and the
loop's process maps the ring and views the same bytes (``unpack``).

Who holds the slot (``loaderd.shm_delivery``): the worker's HELLO names the loop's process
(``"handover": <pid>``), and the worker never gives back a slot it yielded. While that
process lives, the worker's next pass or death leaves such slots to it. The loop's process
gives each back once it drops the batch's last tensor: ``returned`` (ring, slot,
generation) with its next acknowledgement. About once a second it also says which slots it
still holds (``handed_held``): the rest of what workers that moved on left it never reached
it (what they fetched ahead, a queue thrown away after a ``break``) and goes back too.

A ``transform``'s result crosses the same way (``pack`` walks its dicts, lists and tuples):
what still views the slot by place, what the transform made through the worker's pool of
shared memory (``pooled``, ``client/output_pool.py``). A transform that keeps a view of its
batch keeps the slot in its worker (``WorkerHold``).

A batch whose slot was lent again before the loop's process unpacked it (its worker died or
moved on first, and the daemon sent the batch anew), or whose ring is gone (its daemon was
killed, and the one started since removed the ring; the batch was never acknowledged, so it
comes again), comes out empty and ``stale``: the loop drops it, as a duplicate.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loaderd.client import output_pool
from loaderd.client.errors import ProtocolError
from loaderd.client.fastpath import ShmReceiver
from loaderd.client.pids import PerProcess
from loaderd.client.shm import RingGone

# A tensor outside the slot this small travels by value; a larger one as torch sends it.
_BY_VALUE_BYTES = 64 << 10

SlotId = tuple[str, int, int]  # ring, slot, generation: the daemon's name of one lending


@dataclass(frozen=True, slots=True)
class SlotRef:
    """Where a worker's batch lies: its job and rank, its slot, and the slot's bytes here."""

    job: str
    rank: int
    slot: SlotId
    address: int  # of the slot's first byte in the worker (offsets are counted from it)
    nbytes: int


def slot_ref(job: str, rank: int, slot: SlotId, view: memoryview) -> SlotRef:
    """The ``SlotRef`` of a batch whose frames lie in ``view``, the whole slot."""
    address = int(np.frombuffer(view, np.uint8).ctypes.data) if view.nbytes else 0
    return SlotRef(job, rank, slot, address, view.nbytes)


def pack(value: Any, ref: SlotRef | None) -> tuple[Any, ...]:
    """What crosses to the loop's process: the slot, and each tensor by place or by value.

    ``value`` is a batch, or what a ``transform`` made of it: tensors inside dicts, lists
    and tuples are found; anything else travels as pickle sends it. Tensors outside the slot
    (all, with ``ref`` None: a batch that came over the socket) travel as torch sends them
    until ``pooled`` places them in the worker's pool.
    """
    top = dict(value) if isinstance(value, dict) else value  # a TaggedBatch: a plain dict
    made: list[torch.Tensor] = []
    tree = _packed(top, ref, made)
    head = (ref.job, ref.rank, ref.slot) if ref is not None else (None, None, None)
    return *head, tree, (None, [("value", t) for t in made])


def pooled(packed: tuple[Any, ...]) -> tuple[Any, ...]:
    """``packed`` with the worker's own tensors copied into its output pool.

    What a transform made, or a batch that came over the socket, where a slot of the pool is
    free (``client/output_pool.py``); else as torch sends it.
    """
    *head, (_, made) = packed
    return (*head, output_pool.place([e[1] for e in made]))


def _packed(v: Any, ref: SlotRef | None, made: list[torch.Tensor]) -> tuple[Any, ...]:
    if type(v) is dict:  # not a subclass (OrderedDict...): rebuilt only by its own pickle
        return ("dict", [(k, _packed(x, ref, made)) for k, x in v.items()])
    if type(v) in (list, tuple):  # not a namedtuple: rebuilt only by its own pickle
        return (type(v).__name__, [_packed(x, ref, made) for x in v])
    return _entry(v, ref, made)


def _entry(v: Any, ref: SlotRef | None, made: list[torch.Tensor]) -> tuple[Any, ...]:
    if _plain(v):
        # A 0-dim tensor has no strides; a batch that came over the socket, no slot.
        if ref is not None and v.numel() and min(v.stride(), default=0) >= 0:
            offset = v.data_ptr() - ref.address
            extent = sum((n - 1) * s for n, s in zip(v.shape, v.stride(), strict=True)) + 1
            if offset >= 0 and offset + extent * v.element_size() <= ref.nbytes:
                return ("slot", offset, v.dtype, tuple(v.shape), tuple(v.stride()), extent)
        if v.numel() * v.element_size() <= _BY_VALUE_BYTES:  # e.g. a list field's offsets
            raw = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return ("bytes", raw, v.dtype, tuple(v.shape))
        made.append(v)
        return ("made", len(made) - 1)
    return ("value", v)


def _plain(v: Any) -> bool:
    """A tensor this module may send by place or by value: anything else goes as torch sends it.

    Not a subclass (torchvision's ``tv_tensors``), a sparse or quantized tensor, or one that
    requires grad: rebuilt here, they would lose what makes them so.
    """
    return (
        type(v) is torch.Tensor
        and v.device.type == "cpu"
        and v.layout == torch.strided
        and not v.is_quantized
        and not v.requires_grad
    )


class WorkerHold:
    """A worker's own views of a slot whose batch a ``transform`` turned into its result.

    The slot goes to the loop's process with the result, and comes back to the daemon once
    the loop drops it: the worker must not view it after that. A transform may keep a view of
    the batch it was given (a tensor stored for its next call), and would then read what the
    daemon wrote there since. So the worker packs the result before it yields it, drops it,
    and looks whether any view of its own is left: if one is, the slot stays the worker's
    (``keep``) until the last dies (``release``: the worker's next request gives it back by
    its ring, slot and generation), and the result crosses as torch sends any worker's batch.
    """

    def __init__(self, release: Callable[[list[Any]], None]) -> None:
        self._release = release  # called with the slot's [ring, slot, generation]
        self._lock = threading.Lock()
        self._live = 1  # the batch's frames (``slot_lifetime.hold_slot`` calls ``dropped``)
        self._kept = False
        self.slot_id: list[Any] | None = None  # set once the batch came through the slot

    def dropped(self) -> None:
        """One anchor of the worker's views died (a finalizer, on any thread)."""
        with self._lock:
            self._live -= 1
            release = self._kept and self._live == 0
        if release and self.slot_id is not None:
            self._release(self.slot_id)

    def viewed(self) -> bool:
        """Whether the worker views the slot still."""
        with self._lock:
            return self._live > 0

    def keep(self, slot: memoryview) -> np.ndarray:
        """Keep the slot here: an anchor to view it through, counted as the frames are."""
        anchor = np.frombuffer(slot, np.uint8)
        with self._lock:
            self._live += 1
            self._kept = True
        weakref.finalize(anchor, self.dropped)
        return anchor


class _Handed:
    """This process's part: rings mapped, slots held, slots to give back (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.receiver = ShmReceiver(True)
        self.held: Counter[tuple[str, int, SlotId]] = Counter()
        self.returned: list[tuple[str, int, SlotId]] = []
        self.ranks: set[tuple[str, int]] = set()  # (job, rank) of every batch unpacked

    def dropped(self, key: tuple[str, int, SlotId]) -> None:
        """The last tensor of a batch is gone (a ``weakref.finalize`` callback, any thread)."""
        with self.lock:
            self.held[key] -= 1
            if self.held[key] <= 0:
                del self.held[key]
            self.returned.append(key)


_STATE = PerProcess(_Handed)  # the loop's thread and a pin-memory thread unpack
_state = _STATE.get


def in_use(job: str, rank: int) -> bool:
    """Whether this process has unpacked a batch ``job``'s ``rank`` handed over."""
    state = _STATE.peek()
    return state is not None and (job, rank) in state.ranks


def unpack(packed: tuple[Any, ...]) -> tuple[Any, bool]:
    """What a worker packed, its tensors viewing the slot here; and whether it came ``stale``.

    Raises:
        ShmError: the ring is there but cannot be mapped.
    """
    job, rank, slot, _, (pool, _) = packed
    # First: a stale batch's pool slot goes back to its worker as this anchor dies.
    made = output_pool.receive(pool) if pool is not None else None
    if pool is not None and made is None:
        return None, True  # its worker's pool is gone: the batch comes anew
    if slot is None:  # it came over the socket
        return rebuild(packed, None, made), False
    state = _state()
    try:
        view = state.receiver.slot(*slot)
    except (ProtocolError, RingGone):
        return None, True  # lent again, or its daemon is gone: the batch comes anew
    anchor = np.frombuffer(view, np.uint8)
    key = (job, rank, slot)
    with state.lock:
        state.held[key] += 1
        state.ranks.add((job, rank))
    weakref.finalize(anchor, state.dropped, key)  # at once when no tensor views the slot
    return rebuild(packed, anchor, made), False


def rebuild(
    packed: tuple[Any, ...], anchor: np.ndarray | None, made: np.ndarray | None = None
) -> Any:
    """What ``pack`` packed, its tensors viewing ``anchor`` (the slot, as mapped here).

    What the transform made views ``made``, its pool slot, where ``pooled`` placed it.
    """
    _, entries = packed[4]
    tensors = [
        output_pool.rebuild(e, made) if e[0] == "pool" and made is not None else e[1]
        for e in entries
    ]
    return _value(packed[3], anchor, tensors)


def _value(entry: tuple[Any, ...], anchor: np.ndarray | None, made: list[Any]) -> Any:
    kind = entry[0]
    if kind == "dict":
        return {k: _value(e, anchor, made) for k, e in entry[1]}
    if kind in ("list", "tuple"):
        items = [_value(e, anchor, made) for e in entry[1]]
        return items if kind == "list" else tuple(items)
    if kind == "slot" and anchor is not None:  # a batch packed with its slot
        _, offset, dtype, shape, stride, extent = entry
        flat = torch.frombuffer(anchor, dtype=dtype, count=extent, offset=offset)
        return flat.as_strided(shape, stride)
    if kind == "bytes":
        _, raw, dtype, shape = entry
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if kind == "made":
        return made[entry[1]]
    return entry[1]


def take_returned(job: str, rank: int) -> list[list[Any]]:
    """The slots of ``job``'s ``rank`` this process dropped since last asked, for a request."""
    state = _state()
    with state.lock:
        mine = [k for k in state.returned if k[:2] == (job, rank)]
        state.returned = [k for k in state.returned if k[:2] != (job, rank)]
    return [list(k[2]) for k in mine]


def held(job: str, rank: int) -> list[list[Any]]:
    """The slots of ``job``'s ``rank`` this process holds a batch of now."""
    state = _state()
    with state.lock:
        return [list(k[2]) for k in state.held if k[:2] == (job, rank)]
