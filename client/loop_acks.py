"""Acknowledge a batch when the training loop receives it, also through DataLoader workers.

A batch counts as delivered once the training loop has it, not once some process fetched it.
Without workers the dataset's own generator runs in the loop's process and acknowledges each
batch just before it yields it (sent, its reply collected later: client/unconfirmed.py). With
``DataLoader(num_workers=k)`` the generator runs in a worker, and a batch it yields may sit in
the DataLoader's queues (prefetched, or kept out of order) and never reach the loop when it
stops early; only the main process knows what the loop took. So workers do not acknowledge:
each batch carries a tag (its phase, epoch, batch index and worker), and the main process
acknowledges it through its own connection when the DataLoader iterator hands it to the loop
(without waiting: the OKs are collected at most 64 behind, and all at the pass end, in
``state_dict`` and ``close``). What a worker fetched and the loop never took stays with that
worker at the daemon and goes back to the rank's queue when the worker opens its next pass or
dies.

A handed batch the loop cannot take (its ring went with a killed daemon) is reported lost and
queued again at the daemon; when the workers have all ended their pass by then, the main process
fetches the rest of the pass itself before the iterator stops (``_loop_leftover``).

PyTorch offers no hook for "the loop received this batch", so the one method that returns it,
``_MultiProcessingDataLoaderIter._next_data``, is wrapped (once, at import; the same for
torchdata's ``StatefulDataLoader``). The wrappers do nothing for datasets that are not
loaderd's.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import dataloader, get_worker_info
from torch.utils.data._utils import pin_memory

from loaderd.client import output_pool, slot_handover
from loaderd.client.slot_handover import SlotRef


@dataclass(frozen=True, slots=True)
class BatchTag:
    """Which batch of which pass a worker fetched."""

    phase: str
    epoch: int
    index: int
    worker: int
    batches: int  # in the rank's pass
    instance: str | None = None  # the daemon's run that sent it (its WELCOME's "instance")


class TaggedBatch(dict[str, Any]):
    """A batch dict carrying its ``BatchTag`` (kept by ``copy.copy`` and pickling).

    In a worker that hands its slots over (``loaderd_slot`` set), pickling sends where the
    tensors lie in the slot, not their bytes (``client/slot_handover.py``); ``loaderd_stale``
    marks a batch whose slot was lent again before it was unpacked. In any other DataLoader
    worker (a batch that came over the socket) its tensors cross through the worker's output
    pool (``client/output_pool.py``).
    """

    loaderd_tag: BatchTag | None = None
    loaderd_slot: SlotRef | None = None
    loaderd_stale = False

    def __copy__(self) -> TaggedBatch:
        out = TaggedBatch(self)
        out.__dict__.update(self.__dict__)
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self.loaderd_slot is None and get_worker_info() is None:
            return super().__reduce_ex__(protocol)
        packed = slot_handover.pack(self, self.loaderd_slot)
        if self.loaderd_slot is None:
            packed = slot_handover.pooled(packed)
        return (_handed_batch, (packed, self.loaderd_tag))


def _handed_batch(packed: tuple[Any, ...], tag: BatchTag | None) -> TaggedBatch:
    values, stale = slot_handover.unpack(packed)
    out = TaggedBatch(values or {})
    out.loaderd_tag = tag
    out.loaderd_stale = stale
    return out


class TaggedValue:
    """What a ``transform`` made of a batch, when not a dict (e.g. ``(x, y)``), with its tag.

    It crosses from the worker to the loop's process, which acknowledges the tag and hands
    the loop ``value`` alone.
    """

    __slots__ = ("loaderd_stale", "loaderd_tag", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self.loaderd_tag: BatchTag | None = None
        self.loaderd_stale = False  # as TaggedBatch's, when it came through HandedOver

    def __reduce__(self) -> tuple[Any, ...]:
        if get_worker_info() is None:
            return (_tagged_value, (self.value, self.loaderd_tag))
        packed = slot_handover.pooled(slot_handover.pack(self.value, None))
        return (_handed_value, (packed, self.loaderd_tag))  # as a TaggedBatch's, in a worker

    def pin_memory(self) -> TaggedValue:
        """The value in pinned memory, still tagged (a DataLoader's pin-memory thread)."""
        pin: Callable[..., Any] = pin_memory.pin_memory  # untyped in torch
        out = _tagged_value(pin(self.value), self.loaderd_tag)
        out.loaderd_stale = self.loaderd_stale
        return out


class HandedOver:
    """A ``transform``'s result packed in the worker that hands its slot over, as it crosses.

    Packed (``slot_handover.pack``) before the worker yields it, so that the worker holds no
    view of the slot once its queue has the result (``slot_handover.WorkerHold``). The loop's
    process unpickles it as the ``TaggedBatch`` or ``TaggedValue`` it was.
    """

    __slots__ = ("is_batch", "loaderd_tag", "packed")

    def __init__(self, result: TaggedBatch | TaggedValue, ref: SlotRef) -> None:
        self.is_batch = isinstance(result, TaggedBatch)
        value = result if isinstance(result, TaggedBatch) else result.value
        self.packed = slot_handover.pack(value, ref)
        self.loaderd_tag: BatchTag | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_handed_batch if self.is_batch else _handed_value, (self.packed, self.loaderd_tag))

    def settle(
        self, hold: slot_handover.WorkerHold, slot: memoryview
    ) -> HandedOver | TaggedBatch | TaggedValue:
        """Itself when the worker views the slot no more; else the result, viewing it here.

        Itself with what the transform made placed in the worker's output pool.
        """
        if not hold.viewed():
            self.packed = slot_handover.pooled(self.packed)
            return self
        value = slot_handover.rebuild(self.packed, hold.keep(slot))
        return TaggedBatch(value) if self.is_batch else TaggedValue(value)


def _tagged_value(value: Any, tag: BatchTag | None) -> TaggedValue:
    out = TaggedValue(value)
    out.loaderd_tag = tag
    return out


def _handed_value(packed: tuple[Any, ...], tag: BatchTag | None) -> TaggedValue:
    value, stale = slot_handover.unpack(packed)
    out = _tagged_value(value, tag)
    out.loaderd_stale = stale
    return out


def _dataset(it: Any) -> Any:
    """The iterator's dataset if it is one whose loop's process acknowledges, else None."""
    ds = getattr(it, "_dataset", None)
    return ds if hasattr(ds, "_loop_received") else None


def install() -> None:
    """Wrap the multi-process DataLoader iterators once (idempotent).

    PyTorch's, and torchdata's ``StatefulDataLoader`` one when torchdata is installed.
    """
    _wrap(dataloader._MultiProcessingDataLoaderIter, lambda args, kwargs: [])
    if importlib.util.find_spec("torchdata") is None:
        return
    try:
        sdl: Any = importlib.import_module("torchdata.stateful_dataloader.stateful_dataloader")
    except ImportError:  # an old torchdata without the stateful loader
        return
    if not sdl._StatefulMultiProcessingDataLoaderIter.__dict__.get("_loaderd_wrapped", False):
        _wrap_stateful(sdl)


def _wrap_stateful(sdl: Any) -> None:
    """``StatefulDataLoader``'s iterator: its checkpoint is its workers' dataset states.

    Each holds what its worker had handed on as of the worker's last batch the loop received,
    so their union is what the loop received, and the main process rewinds the rank to it once
    before the workers start. A batch a worker handed on and the loop lost on the way (its
    ring gone) is taken out of them until the loop has it again.
    """
    it_cls: Any = sdl._StatefulMultiProcessingDataLoaderIter

    def workers_of(state: dict[str, Any]) -> dict[str, Any]:
        return dict(state.get(it_cls._SNAPSHOT, {}).get(it_cls._WORKER_SNAPSHOTS, {}))

    def worker_states(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        state = args[0] if args else kwargs.get("next_iter_state")
        if not isinstance(state, dict):
            return []
        workers = workers_of(state).values()
        return [w.get(sdl._DATASET_STATE) for w in workers if isinstance(w, dict)]

    _wrap(it_cls, worker_states)
    snapshot_state: Callable[[Any], dict[str, Any]] = it_cls.state_dict

    @functools.wraps(snapshot_state)
    def state_dict(self: Any) -> dict[str, Any]:
        state = snapshot_state(self)
        ds = _dataset(self)
        pending = ds._lost_pending() if ds is not None else None
        if pending is None:
            return state
        epoch, lost = pending
        state = copy.deepcopy(state)  # the iterator's own snapshot stays as it is
        for w in workers_of(state).values():
            part = w.get(sdl._DATASET_STATE) if isinstance(w, dict) else None
            train = part.get("progress", {}).get("train") if isinstance(part, dict) else None
            if isinstance(train, dict) and train.get("epoch") == epoch:
                train["delivered"] = [i for i in train.get("delivered", []) if i not in lost]
        return state

    it_cls.state_dict = state_dict


def _wrap(cls: Any, resume_states: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]) -> None:
    if cls.__dict__.get("_loaderd_wrapped", False):
        return
    init: Callable[..., None] = cls.__init__
    next_data: Callable[[Any], Any] = cls._next_data
    shutdown: Callable[[Any], None] = cls._shutdown_workers

    @functools.wraps(init)
    def __init__(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        ds = loader.dataset
        if hasattr(ds, "_before_workers"):
            # Before the workers are forked or pickled: they see the flag, and a rewind to a
            # checkpoint happens once, here, not in each worker.
            ds._before_workers(resume_states(args, kwargs))
        try:
            init(self, loader, *args, **kwargs)
        finally:
            if hasattr(ds, "_workers_started"):
                ds._workers_started()

    @functools.wraps(next_data)
    def _next_data(self: Any) -> Any:
        ds = _dataset(self)
        while True:
            try:
                data = next_data(self)
            except StopIteration:
                if ds is None:
                    raise
                left = ds._loop_leftover(getattr(self, "_num_workers", 0))
                if left is not None:  # fetched here, acknowledged already
                    _no_step_to_replay(self)
                    return _pinned(self, left)
                ds._loop_pass_ended()
                raise
            if ds is None or ds._loop_received(data):
                return data.value if isinstance(data, TaggedValue) else data
            # a duplicate (a batch requeued after a daemon restart and sent again): drop it

    @functools.wraps(shutdown)
    def _shutdown_workers(self: Any) -> None:
        was = getattr(self, "_shutdown", True)
        shutdown(self)
        if was or not getattr(self, "_shutdown", False):
            return
        output_pool.forget_ended()  # also where loaderd's dataset is wrapped in another
        ds = _dataset(self)
        if ds is not None:
            ds._workers_gone()  # the slots they handed over and the loop does not hold
            _feeders_gone(self)

    cls.__init__ = __init__
    cls._next_data = _next_data
    cls._shutdown_workers = _shutdown_workers
    cls._loaderd_wrapped = True


def _no_step_to_replay(it: Any) -> None:
    """A ``StatefulDataLoader`` resumes by replaying the steps since its last snapshot.

    A batch the main process fetched itself is none of its workers' steps (their states hold
    its index already): counted into the snapshot, it is not replayed.
    """
    snapshot, key = getattr(it, "_snapshot", None), getattr(it, "_SNAPSHOT_STEP", None)
    if isinstance(snapshot, dict) and isinstance(snapshot.get(key), int):
        snapshot[key] += 1


def _pinned(it: Any, batch: Any) -> Any:
    """``batch`` in pinned memory if the iterator pins what its workers send."""
    if not getattr(it, "_pin_memory", False):
        return batch
    pin: Callable[..., Any] = pin_memory.pin_memory  # untyped in torch
    return pin(batch, getattr(it, "_pin_memory_device", None) or None)


def _feeders_gone(it: Any) -> None:
    """Wait (briefly) for the closed index queues' feeder threads to end.

    PyTorch closes them without joining, and a framework starts the next epoch's workers at
    once: CPython 3.11 forks a child that deadlocks in ``PyOS_AfterFork_Child`` when a thread
    of the parent was ending at that moment (seen: a Lightning DDP rank's new worker hung
    for good in ``_PyThreadState_DeleteExcept``).
    """
    for q in getattr(it, "_index_queues", []):
        thread = getattr(q, "_thread", None)
        if thread is not None:
            thread.join(timeout=1.0)
