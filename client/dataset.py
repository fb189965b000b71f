"""``LoaderdDataset``: the ``IterableDataset`` a trainer swaps in to read from a loaderd daemon.

One full iteration is this rank's share of one epoch. Under ``DataLoader(num_workers=k)`` every
worker opens its own socket and asks the daemon for the rank's next batch, so the k workers
receive disjoint batches that together cover the rank's epoch exactly once. Batches arrive
ready-made (``batch_size`` of the DataLoader must be None).

Each worker keeps ``prefetch`` requests in flight (its credit window: the daemon sends no more
than that). A batch counts as delivered once the training loop has received it: the loop's own
process acknowledges it (client/loop_acks.py), which is what lets an interrupted epoch resume
exactly where the loop stopped.

The acknowledgement leaves the process before the loop has the batch but is not waited for:
without workers it rides on the GET_BATCH that refills the window (an ACK once the pass saw
END); with workers the main process sends an ACK. Replies are collected later
(client/unconfirmed.py), so a refusal still raises, at the latest at the end of the pass. A
SIGKILL in the instant after a yield may leave that batch's acknowledgement unsent in the
socket's queue: that one batch can come once more (a synchronous OK used to exclude it).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from loaderd.client.address import check_address, default_address
from loaderd.client.columns import check_lists, to_torch
from loaderd.client.errors import DaemonUnavailableError, RemoteError
from loaderd.client.fastpath import check_device, on_device, to_shared_tensors
from loaderd.client.loop_acks import BatchTag, HandedOver, TaggedBatch, TaggedValue, install
from loaderd.client.protocol import BatchArrays, MsgType, decode_batch
from loaderd.client.resume import (
    STATE_VERSION,
    Deadline,
    PassProgress,
    check_state,
    merge_worker_states,
    recoverable,
)
from loaderd.client.session import Session
from loaderd.client.slot_handover import WorkerHold, slot_ref, take_returned
from loaderd.client.slot_handover import held as handed_held
from loaderd.client.slot_handover import in_use as handing_in_use
from loaderd.client.unconfirmed import Unconfirmed

logger = logging.getLogger(__name__)
install()  # the main process acknowledges what the training loop received

# How often the loop's process says which handed slots it holds (client/slot_handover.py):
# slots that workers which moved on left it come back within about this long. Longer than
# the daemon's tick (0.5 s), in which it finds a DataLoader's old workers gone.
_HELD_EVERY_S = 1.0


def default_rank_world() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when initialised, else RANK / WORLD_SIZE."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class LoaderdDataset(Session, IterableDataset[dict[str, Any]]):
    """Batches of a loaderd job, streamed from the daemon at ``address``.

    Args:
        address: the daemon's endpoint, e.g. ``ipc:///run/loaderd/loaderd.sock``; None takes
            ``$LOADERD_SOCKET``, else the default of ``loaderd serve``.
        job: the job name; every rank and worker of one training run uses the same one.
        batch_size: samples per batch (batches are assembled by the daemon).
        rank: this trainer's rank; default from torch.distributed, RANK, else 0.
        world_size: the number of ranks; default from torch.distributed, WORLD_SIZE, else 1.
        seed: the job's seed; each epoch's plan is a function of (seed, epoch, importance).
        sampler: ``uniform`` (every sample), ``learnable``, ``importance``, ``unbiased`` or
            ``infobatch``; None takes the daemon's default (``uniform`` unless it was started
            with ``--sampler``).
        prefetch: requests kept in flight per worker (the credit window).
        timeout_s: how long to wait for the daemon before raising DaemonUnavailableError.
        reconnect_s: how long to keep reconnecting when the daemon goes away in the middle of
            a pass (it restarts, and the pass continues where this consumer was); 0 raises
            DaemonUnavailableError at once.
        curve_dir: the key directory for a ``tcp://`` daemon (``loaderd keys generate``):
            this client's ``client.key_secret`` and the daemon's ``server.key``.
        shm: take batches through the daemon's shared-memory ring when it runs on this host
            (ipc:// addresses only; falls back to the socket when the ring cannot be mapped).
        device: a CUDA device to deliver batches on (``DeviceBuffering``: pinned staging
            and copies on a side stream); None yields CPU tensors. Refused without CUDA.
        buffers: batches staged ahead in pinned memory when ``device`` is set.
        worker: this consumer's number within its rank, for processes that share a rank
            without being DataLoader workers; default: the DataLoader worker id, else 0.
            Consumers of one rank need distinct numbers: a consumer that opens a pass takes
            back the unacknowledged batches of its number.
        transform: called on each batch (the dict) in the process that received it, a
            DataLoader worker under ``num_workers`` > 0, before it is yielded: decoding and
            augmentation scale with the workers. Its result is what the loader yields.
        lists: how a variable-length list field is delivered: ``"offsets"`` (its values
            and ``<name>.offsets``, no copy) or ``"padded"`` (``[B, longest, ...]`` and
            ``<name>.lengths``); see ``loaderd.client.columns``.
        drop_last: PyTorch's rule for remainders. Every rank gets the same number of batches
            of exactly ``batch_size`` samples, except each rank's last of the epoch. False
            (as ``DistributedSampler``): the epoch is padded with its first samples up to a
            multiple of ``world_size`` and the last batch may be short. True: the epoch's
            remainder over the ranks and each rank's short last batch are dropped.
        **options: further importance options (``budget`` with ``epochs``, ``warmup_epochs``,
            ``keep_fraction``, ...; see ``loaderd.importance.ImportanceConfig``).

    Each batch is a dict: ``id`` (int64 [B]), ``weight`` (float32 [B]), and one entry per
    stored field: a tensor ``[B, *shape]`` for fixed-shape fields, a list of ``bytes`` / ``str``
    for variable-length ones. Tensors view the received message's memory and are read-only in
    spirit: clone one before writing to it in place. Through shared memory, a batch's slot goes
    back to the daemon once all its tensors are dropped, or when this dataset's next pass
    begins (``loaderd.client.shm.copy_batch`` makes an owned copy). The dict carries a delivery
    tag the DataLoader's main process needs: use ``batch_size=None`` and no ``collate_fn``.
    """

    def __init__(
        self,
        address: str | None,
        job: str,
        batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        sampler: str | None = None,
        prefetch: int = 4,
        timeout_s: float = 30.0,
        reconnect_s: float = 300.0,
        curve_dir: str | Path | None = None,
        shm: bool = True,
        device: str | torch.device | None = None,
        buffers: int = 3,
        worker: int | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        lists: str = "offsets",
        drop_last: bool = False,
        **options: Any,
    ) -> None:
        default_rank, default_world = default_rank_world()
        rank = default_rank if rank is None else rank
        world_size = default_world if world_size is None else world_size
        if sampler is not None:
            options["sampler"] = sampler
        if prefetch < 1:
            raise ValueError(f"`prefetch` must be >= 1, got {prefetch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"`rank` {rank} is outside [0, world_size={world_size})")
        if worker is not None and worker < 0:
            raise ValueError(f"`worker` must be >= 0, got {worker}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"`drop_last` must be a bool, got {drop_last!r}")
        super().__init__(
            check_address(default_address() if address is None else address),
            job,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            seed=seed,
            drop_last=drop_last,
            options=options,
            timeout_s=timeout_s,
            reconnect_s=reconnect_s,
            curve_dir=curve_dir,
            shm=shm,
        )
        self.prefetch = prefetch
        self.worker = worker
        self.transform = transform
        self.lists = check_lists(lists)
        self.device = check_device(device, buffers)
        self.buffers = buffers
        self._progress: dict[str, PassProgress] = {}
        # Ended passes' slots the trainer dropped after their last request: close() gives
        # them back (a new pass's OPEN_PASS takes every slot back by itself).
        self._late: deque[tuple[dict[str, Any], deque[int]]] = deque(maxlen=4)
        self._phase = "train"
        self.epoch: int | None = None  # the epoch of the last pass this process iterated
        self._acks_in_main = False  # set for workers whose main process acknowledges
        self._loop_pid: int | None = None  # that process, for workers (client/slot_handover.py)
        self._workers_hand_over = False  # this process started workers that hand slots over
        self._held_said_at = -_HELD_EVERY_S  # when the loop's process last said what it holds
        self._lost_here: set[tuple[int, int]] = set()  # (epoch, index) of handed batches lost
        self._leftovers: Iterator[Any] | None = None  # the loop's own fetch of them
        self._closed = False
        self._warned_worker_acks = False

    # --- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """This rank's share of the next epoch (or the rest of an interrupted one)."""
        return on_device(self._pass("train"), self.device, self.buffers, self._shm)

    def __len__(self) -> int:
        """The number of batches this rank gets in its coming training pass.

        What is left of an unfinished pass; for the next epoch, its full count when it trains
        every sample (``uniform``, warm-up, annealing) or is already planned.

        Raises:
            TypeError: the next epoch's size is not known yet (a selecting sampler draws it
                when the epoch is planned): frameworks then treat the length as unknown.
        """
        self._hello_retrying()
        meta = {"job": self.job, "rank": self.rank, "phase": "train"}
        reply = self._conn.request(MsgType.PASS_INFO, meta, expect=MsgType.PASS)
        batches = reply.meta.get("batches")
        if not isinstance(batches, int):
            raise TypeError(
                f"len() of job {self.job!r}: epoch {reply.meta.get('epoch')} selects its samples "
                "when it is planned, so its number of batches is not known yet"
            )
        return batches

    def rescore(self) -> Iterator[dict[str, Any]]:
        """The samples to re-score before the next epoch (seed 002), for a forward-only pass.

        Send their losses with ``feedback`` as usual. Empty while the importance engine is
        still classifying samples, or when the job's sampler does not re-score.
        """
        return on_device(self._pass("rescore"), self.device, self.buffers, self._shm)

    def _pass(self, phase: str, worker: int | None = None) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        if worker is None:
            worker = self.worker if self.worker is not None else info.id if info is not None else 0
        # Who acknowledges: the loop's own process, just before it yields; in a DataLoader
        # worker, the main process once the loop receives the batch (client/loop_acks.py).
        acks_here = info is None or not self._acks_in_main
        hand_over = self._hands_over()  # slots go to the loop's process with their batches
        if acks_here and info is not None and not self._warned_worker_acks:
            self._warned_worker_acks = True
            warnings.warn(
                "LoaderdDataset runs in a worker of a DataLoader iterator loaderd does not know: "
                "batches count as delivered when the worker fetches them, so those prefetched "
                "when the loop stops are not trained this epoch",
                stacklevel=2,
            )
        base = {"job": self.job, "rank": self.rank, "worker": worker, "phase": phase}
        # A pass interrupted in this process (or restored by load_state_dict) resumes.
        progress = self._progress.get(phase) or PassProgress(phase)
        if progress.over or not (acks_here or progress.restored):
            # A worker does not resume what an earlier iterator of its own fetched: only the
            # loop's process knows what was received, and the daemon what is complete.
            progress = PassProgress(phase)
        self._progress[phase] = progress
        try:
            self._hello()
            self._send_losses()  # losses of the last pass's steps go before its next one opens
            reply = self._conn.request(
                MsgType.OPEN_PASS, {**base, **progress.resume_meta()}, expect=MsgType.PASS
            )
            epoch, batches = int(reply.meta["epoch"]), int(reply.meta["batches"])
        except (DaemonUnavailableError, RemoteError) as e:
            # A daemon never reached is a configuration error: say so after timeout_s.
            if not recoverable(e) or self.reconnect_s <= 0 or not self._welcomed:
                raise
            epoch, batches = self._reconnect(base, progress)
        progress.begin(epoch)
        self.epoch = epoch
        request = {**base, "epoch": epoch}
        self._phase = phase
        self._late.clear()  # the OPEN_PASS above took their slots back
        release: list[int] = []  # shared-memory slots this process no longer reads
        freed: deque[int] = deque()  # filled as the trainer drops batches (slot_lifetime.py)
        kept_back: deque[list[Any]] = deque()  # the same, for slots a transform kept here
        in_flight: deque[int] = deque()
        # The loop's acknowledgements once no GET_BATCH is due to carry them (module doc).
        acks = Unconfirmed(self.prefetch)
        window = self.prefetch
        if hand_over and info is not None and self._shm.slots:
            # What the loop holds stays lent (slot_handover.py): the workers' windows take at
            # most half the ring together, so that the batches they ask for find slots.
            window = max(1, min(window, self._shm.slots // (2 * info.num_workers)))
        ended = False
        try:
            while True:
                try:
                    while freed:
                        release.append(freed.popleft())
                    while not ended and len(in_flight) < window:
                        meta = {**request, "acks": [], "release": release}
                        if kept_back:  # slots a transform kept, by id (slot_handover.py)
                            meta["returned"] = [kept_back.popleft() for _ in range(len(kept_back))]
                        in_flight.append(self._conn.send(MsgType.GET_BATCH, meta))
                        release = []
                    if not in_flight:
                        # The pass is over for this consumer once its acknowledgements and
                        # losses are recorded: the daemon plans a re-scored epoch only after
                        # that (jobs.py). A refused acknowledgement raises here at the latest.
                        acks.confirm_all(self._conn)
                        self.flush()
                        meta = {**request, "acks": [], "release": release, "end": True}
                        self._conn.request(MsgType.ACK, meta, expect=MsgType.OK)
                        release = []
                        break
                    msg = self._conn.wait(in_flight.popleft())
                    if msg.meta.get("instance", self._instance) != self._instance:
                        self._hello_again()
                    if msg.type == MsgType.END:
                        ended = True
                        continue
                    index = int(msg.meta["index"])
                    # At-least-once on the wire: drop duplicates. Where the loop's process
                    # acknowledges, it drops them: a batch it could not take from a worker
                    # (slot_handover.py: its daemon's ring gone) must reach a worker again.
                    if acks_here and index in progress.seen:
                        self.delivery.duplicates += 1
                        release.append(index)
                        continue
                    progress.seen.add(index)
                    # Through shared memory the frames view a slot, kept until dropped; a
                    # slot handed over is the loop's to give back, unless a transform in
                    # this worker keeps a view of it (slot_handover.WorkerHold).
                    hold = None
                    if hand_over and self.transform is not None:
                        hold = WorkerHold(kept_back.append)
                    give_back = functools.partial(freed.append, index)
                    on_free = hold.dropped if hold is not None else None if hand_over else give_back
                    slot = self._shm.resolve(msg, on_free)
                    batch: Any = self._to_torch(decode_batch(msg, self._schema), TaggedBatch())
                    if slot is not None and hand_over:
                        d = msg.meta["shm"]  # checked by resolve
                        where = (d["ring"], d["slot"], d["gen"])
                        batch.loaderd_slot = slot_ref(self.job, self.rank, where, slot)
                        if hold is not None:
                            hold.slot_id = list(where)
                    elif slot is not None and info is not None:  # pickled later: copy now
                        batch = TaggedBatch(to_shared_tensors(batch))
                    instance = msg.meta.get("instance")
                    del msg  # its frames would keep the slot
                    if self.transform is not None:  # in the worker: decode scales with workers
                        ref = batch.loaderd_slot
                        batch = self._transformed(batch, acks_here)
                        if hold is not None and ref is not None and slot is not None:
                            handed = HandedOver(batch, ref)
                            del batch  # what the result viewed of the slot is packed now
                            batch = handed.settle(hold, slot)
                    if isinstance(batch, TaggedBatch | TaggedValue | HandedOver):
                        tag = BatchTag(phase, epoch, index, worker, batches, instance)
                        batch.loaderd_tag = tag
                except (DaemonUnavailableError, RemoteError) as e:
                    if not recoverable(e) or self.reconnect_s <= 0:
                        raise
                    in_flight.clear()
                    acks.drop()  # the resume says what the loop received
                    release = []  # reopening the pass takes every slot back
                    ended = self._reconnect(base, progress)[0] != epoch
                    continue
                if acks_here:  # acknowledged before the loop has it, without waiting
                    progress.delivered.add(index)
                    while freed:
                        release.append(freed.popleft())
                    meta = {**request, "acks": [index], "loop": True, "release": release}
                    if not ended and len(in_flight) < window:
                        # On the request refilling the window; its BATCH (or END) comes after
                        # the acknowledgement is written, so waiting for it confirms both.
                        in_flight.append(self._conn.send(MsgType.GET_BATCH, meta))
                    else:
                        acks.send(self._conn, MsgType.ACK, meta)
                    release = []
                    self._delivered(progress, batches)
                yield batch
            if acks_here:
                if self._progress.get(phase) is progress:  # the pass is over: start afresh
                    self._progress.pop(phase)
            else:
                progress.over = True  # its state_dict still says what this worker handed on
        finally:
            self._phase = "train"
            for rid in in_flight:
                self._conn.ignore(rid)
            acks.drop(self._conn)  # a pass left early: a refused acknowledgement is logged
            # The last batch is still the trainer's when the pass ends (its loop variable).
            self._late.append(({**request, "acks": [], "release": release}, freed))

    def _transformed(self, batch: TaggedBatch, acks_here: bool) -> Any:
        """``transform(batch)``, in a form that carries the batch's tag to the loop's process.

        A dict result becomes a ``TaggedBatch``; anything else (``(x, y)``) travels from a
        DataLoader worker as a ``TaggedValue`` that the loop's process unwraps. Where the
        worker hands its slots over, ``HandedOver`` packs either: what the result still views
        of the slot crosses as a place in it, the rest as torch sends it.
        """
        assert self.transform is not None
        out = self.transform(batch)
        if isinstance(out, dict):
            return out if isinstance(out, TaggedBatch) else TaggedBatch(out)
        return out if acks_here else TaggedValue(out)

    def _delivered(self, progress: PassProgress, batches: int) -> None:
        """After each batch the loop received: once it has all, the next pass is the next one.

        A framework that knows ``len(ds)`` stops without exhausting the iterator, so the end
        of the pass is the last batch received, not the daemon's END. A checkpoint taken now
        says "the next epoch, nothing received yet".
        """
        if len(progress.delivered) < batches or self._progress.get(progress.phase) is not progress:
            return
        if progress.phase == "train":
            self._progress["train"] = PassProgress("train", (progress.epoch or 0) + 1)
        else:
            self._progress.pop(progress.phase)

    def _reconnect(self, base: dict[str, Any], progress: PassProgress) -> tuple[int, int]:
        """Open a fresh socket, say HELLO and resume the pass: the daemon's (epoch, batches).

        Raises:
            DaemonUnavailableError: the daemon did not come back within ``reconnect_s``.
        """
        deadline = Deadline(self.reconnect_s)
        logger.warning("loaderd at %s went away; resuming %s pass", self.address, progress.phase)
        while True:
            try:
                self._rehello()
                reply = self._conn.request(
                    MsgType.OPEN_PASS, {**base, **progress.resume_meta()}, expect=MsgType.PASS
                )
            except (DaemonUnavailableError, RemoteError) as e:
                if not recoverable(e) or deadline.passed():
                    raise
                continue
            self.delivery.reconnects += 1
            return int(reply.meta["epoch"]), int(reply.meta["batches"])

    # --- the loop's process, when DataLoader workers fetch (client/loop_acks.py) ---------------

    def _before_workers(self, worker_states: list[Any]) -> None:
        """A multi-process DataLoader iterator is about to start workers over this dataset.

        ``worker_states`` are the workers' ``state_dict``s a ``StatefulDataLoader`` resumes
        from: together they hold what the loop had received.
        """
        self._stop_leftovers()
        self._acks_in_main = True
        self._loop_pid = os.getpid()
        self._workers_hand_over = self.device is None  # as _hands_over says in each worker
        states = [check_state(w) for w in worker_states if w is not None]
        if states:
            self._restore(merge_worker_states(states, self.job, self.rank))
        progress = self._progress.get("train")
        if progress is not None and progress.rewind:
            # Rewind the rank's cursor to the checkpoint once, here, not in every worker.
            self._hello_retrying()
            meta = {"job": self.job, "rank": self.rank, "worker": self.worker or 0}
            reply = self._conn.request(
                MsgType.OPEN_PASS,
                {**meta, "phase": "train", **progress.resume_meta()},
                expect=MsgType.PASS,
            )
            progress.begin(int(reply.meta["epoch"]))

    def _workers_started(self) -> None:
        self._acks_in_main = False  # the workers have their copy; this object iterates itself
        self._loop_pid = None

    def _workers_gone(self) -> None:
        """The DataLoader's workers exited: the slots they left here and no batch holds go back.

        The daemon checks first that they are gone, then takes back the rest.
        """
        if self._hello_pid == os.getpid() and not self._closed:
            self._return_slots()

    def _hands_over(self) -> bool:
        """Whether this process is a DataLoader worker that hands its slots to the loop's.

        Not with a ``device``: the batch it yields is in device memory.
        """
        return (
            self._acks_in_main
            and self._loop_pid is not None
            and self.device is None
            and get_worker_info() is not None
        )

    def _handover_pid(self) -> int | None:
        return self._loop_pid if self._hands_over() else None

    def _slots_back(self, meta: dict[str, Any], held: bool | None = None) -> dict[str, Any]:
        """``meta`` with the handed slots whose batches the loop dropped (slot_handover.py).

        ``held`` (by default once every ``_HELD_EVERY_S``): also which this process still
        holds; the daemon takes back the rest of what workers that moved on left it.
        """
        returned = take_returned(self.job, self.rank)
        if returned:
            meta["returned"] = returned
        now = time.monotonic()
        if held is None:
            due = now >= self._held_said_at + _HELD_EVERY_S
            held = due and handing_in_use(self.job, self.rank)
        if held:
            meta["handed_held"] = handed_held(self.job, self.rank)
            self._held_said_at = now
        return meta

    def _return_slots(self) -> None:
        """Tell the daemon what ``_slots_back`` has to say, without waiting for its OK.

        Nothing is lost if it never arrives: what this process holds goes back when it exits.
        Said also when no batch came with its slot: a worker whose transform kept a view of
        its batch kept the slot, which the daemon leaves to this process once the worker
        moved on.
        """
        if not (self._workers_hand_over or handing_in_use(self.job, self.rank)):
            return
        meta = self._slots_back(self._loop_ack_meta(self._phase, self.epoch or 0, 0, []), True)
        self._conn.ignore(self._conn.send(MsgType.ACK, meta))

    def _loop_ack_meta(
        self, phase: str, epoch: int, worker: int, acks: list[int]
    ) -> dict[str, Any]:
        return {
            "job": self.job,
            "rank": self.rank,
            "worker": worker,
            "epoch": epoch,
            "phase": phase,
            "acks": acks,
            "loop": True,
        }

    def _loop_received(self, batch: Any) -> bool:
        """The loop is about to receive ``batch``: acknowledge it; False drops a duplicate.

        Raises:
            RuntimeError: the batch lost its tag (a ``collate_fn`` rebuilt it).
        """
        tag = getattr(batch, "loaderd_tag", None)
        if not isinstance(tag, BatchTag):
            raise RuntimeError(
                "a DataLoader over LoaderdDataset returned a batch without its delivery tag, so "
                "it cannot be acknowledged: use batch_size=None and no collate_fn (batches "
                "arrive ready-made)"
            )
        self._met(tag.instance)
        progress = self._progress.setdefault(tag.phase, PassProgress(tag.phase))
        if progress.epoch is not None and tag.epoch < progress.epoch:
            self.delivery.duplicates += 1  # of a pass the loop has whole already
            return False
        if progress.epoch != tag.epoch:
            progress.begin(tag.epoch)
        if tag.index in progress.delivered:
            self.delivery.duplicates += 1
            return False
        if getattr(batch, "loaderd_stale", False):
            # Its slot was lent again or its ring is gone: the daemon hands it out again.
            meta = self._slots_back(self._loop_ack_meta(tag.phase, tag.epoch, tag.worker, []))
            meta["lost"] = [tag.index]
            self._hello_retrying()
            self._loop_acks.send(self._conn, MsgType.ACK, meta)
            self.delivery.lost += 1
            self._lost_here.add((tag.epoch, tag.index))
            return False
        progress.delivered.add(tag.index)
        progress.seen.add(tag.index)
        self._delivered(progress, tag.batches)
        self.epoch = tag.epoch
        meta = self._slots_back(self._loop_ack_meta(tag.phase, tag.epoch, tag.worker, [tag.index]))
        # Sent before the loop has the batch, its OK collected later (client/unconfirmed.py).
        self._hello_retrying()
        self._loop_acks.send(self._conn, MsgType.ACK, meta)
        self._confirm_loop_acks(keep=self._loop_acks.limit)
        return True

    def _met(self, instance: str | None) -> None:
        """A worker's batch came from the daemon's run ``instance``: HELLO again if it is new.

        This process's own requests may reach a restarted daemon without a HELLO (ZeroMQ
        reconnects by itself, and nothing of this process was in flight): that daemon would
        not know its pid, and would ignore the slots it gives back (the ring filled up, and
        every later batch came over the socket).
        """
        if instance is None or instance in self._instances:
            return
        self._instances.add(instance)
        if instance != self._instance:
            self._hello_pid = -1  # the next request says HELLO first (_hello_retrying)

    def _loop_leftover(self, worker: int) -> Any | None:
        """Once the workers ended their pass: the next batch the loop lost on their way.

        A handed batch whose bytes were gone (its daemon died and the successor removed its
        ring) went back to the rank's queue, but the workers may all have had their END
        already. Then this process fetches what is left of the pass itself, acknowledging as
        a loop without workers does, as consumer ``worker`` (one no DataLoader worker is).
        None when nothing is left.
        """
        if self._leftovers is None:
            if self._lost_pending() is None:
                return None
            self._confirm_loop_acks()  # the daemon has them back in the queue
            self._leftovers = on_device(
                self._pass("train", worker), self.device, self.buffers, self._shm
            )
        try:
            return next(self._leftovers)
        except StopIteration:
            self._leftovers = None
            return None

    def _lost_pending(self) -> tuple[int, set[int]] | None:
        """(epoch, indices) of the batches lost on their way that the loop has not had since.

        Their workers handed them on, so a ``StatefulDataLoader``'s checkpoint, made of the
        workers' states, would count them delivered (``loop_acks.install`` takes them out).
        """
        progress = self._progress.get("train")
        if progress is None or progress.epoch is None:
            self._lost_here.clear()
            return None
        pending = {i for e, i in self._lost_here if e == progress.epoch} - progress.delivered
        if not pending:
            self._lost_here.clear()  # had again, or of an epoch the loop left
            return None
        return progress.epoch, pending

    def _loop_pass_ended(self) -> None:
        """Every worker finished its pass and the loop received all they sent."""
        progress = self._progress.get("train")
        if progress is not None and progress.delivered and not progress.rewind:
            self._progress.pop("train")  # not whole (else _delivered moved on): start afresh
        self._return_slots()
        self.flush()

    def state_dict(self) -> dict[str, Any]:
        """The position of the training loop in its passes, for a trainer's checkpoint.

        Call it in the training process, with or without DataLoader workers: it holds what
        the loop has received. ``load_state_dict`` then resumes the pass exactly there, in a
        new process, even if the daemon moved on or lost its state since.

        Inside a DataLoader worker (a ``StatefulDataLoader`` asks there) it is that worker's
        part, marked as such: what it handed on to the loop.
        """
        in_worker = get_worker_info() is not None and self._acks_in_main
        if not in_worker and self._hello_pid == os.getpid():
            self._confirm_loop_acks()  # what it says the loop received, the daemon recorded
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "job": self.job,
            "rank": self.rank,
            "progress": {
                # A worker's part: what it handed on (the loop received it by the time a
                # StatefulDataLoader keeps this state with the worker's batch).
                phase: {"epoch": p.epoch, "delivered": sorted(p.seen if in_worker else p.delivered)}
                for phase, p in self._progress.items()
                if p.epoch is not None
            },
        }
        if in_worker:
            state["scope"] = "worker"
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict``: the next pass resumes the saved one.

        Raises:
            ValueError: the state is not one of this job and rank.
        """
        state = check_state(state)
        if get_worker_info() is not None and self._acks_in_main:
            # A StatefulDataLoader's worker: the main process rewound the rank already.
            self._restore(state, rewind=False)
            return
        if state.get("scope") == "worker":
            raise ValueError(
                "this LoaderdDataset state is one DataLoader worker's part: restore the "
                "StatefulDataLoader's state, or ds.state_dict() taken in the training process"
            )
        self._restore(state)

    def _restore(self, state: dict[str, Any], rewind: bool = True) -> None:
        if (state.get("job"), state.get("rank")) != (self.job, self.rank):
            raise ValueError(
                f"state of job {state.get('job')!r} rank {state.get('rank')!r} does not fit "
                f"job {self.job!r} rank {self.rank}"
            )
        self._progress = {
            phase: PassProgress(
                phase, int(p["epoch"]), {int(i) for i in p["delivered"]}, rewind, restored=True
            )
            for phase, p in state["progress"].items()
        }

    def _to_torch(self, arrays: BatchArrays, into: TaggedBatch) -> TaggedBatch:
        to_torch(arrays, self._schema, self.lists, into)
        return into

    # --- feedback -----------------------------------------------------------------------------

    def feedback(self, ids: Any, losses: Any, kind: str | None = None) -> None:
        """Send per-sample losses to the daemon without waiting for it.

        They go a few batches' worth at a time, and always before a pass ends or the next
        one opens (``client/losses.py``); ``flush`` sends them and waits until recorded. Any
        thread may call it, e.g. the training loop while a thread of its own iterates.

        Args:
            ids: the batch's ``id`` tensor (or any int sequence).
            losses: one loss per id (a tensor is detached and moved to the CPU).
            kind: ``train`` or ``rescore``; by default ``rescore`` inside ``rescore()``.
        """
        self._hello_retrying()
        kind = kind or self._phase
        ids, losses = _as_numpy(ids, np.int64), _as_numpy(losses, np.float32)
        with self._losses_lock:  # from any thread: the batches may come through another
            if len(self._losses) and kind != self._losses.kind:
                self._send_losses()
            self._losses.add(ids, losses, kind)
            if self._losses.due():
                self._send_losses()

    # --- the rest -----------------------------------------------------------------------------

    def _release_late(self) -> None:
        """Give back the slots of ended passes whose batches the trainer has dropped since.

        Else the daemon keeps them lent for as long as this process lives: it cannot know
        whether a tensor still views them. A daemon that is gone has nothing to give back.
        """
        while self._late:
            meta, freed = self._late.popleft()
            release = [*meta["release"], *freed]
            if not release:
                continue
            try:
                rid = self._conn.send(MsgType.ACK, {**meta, "release": release})
                self._conn.wait(rid)
            except (DaemonUnavailableError, RemoteError) as e:
                logger.info("could not give loaderd back the slots of an ended pass: %s", e)
                return

    def _stop_leftovers(self) -> None:
        """Stop the loop's own fetch of lost batches (its iterator was left mid-way)."""
        if self._leftovers is not None:
            leftovers, self._leftovers = self._leftovers, None
            getattr(leftovers, "close", lambda: None)()  # its slots go back with _late's

    def close(self) -> None:
        """Flush feedback and acknowledgements, close this process's socket (safe twice)."""
        self._stop_leftovers()
        if self._hello_pid == os.getpid():
            self._return_slots()
            self.flush()
            self._release_late()
        self._closed = True
        self._conn.close()
        self._shm.close()


def _as_numpy(x: Any, dtype: type[np.generic]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32 if dtype is np.float32 else torch.int64).numpy()
    return np.ascontiguousarray(np.asarray(x).reshape(-1), dtype)
