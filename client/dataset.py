"""``LoaderdDataset``: the ``IterableDataset`` a trainer swaps in to read from a loaderd daemon.

One full iteration is this rank's share of one epoch. Under ``DataLoader(num_workers=k)`` every
worker opens its own socket and asks the daemon for the rank's next batch, so the k workers
receive disjoint batches that together cover the rank's epoch exactly once. Batches arrive
ready-made (``batch_size`` of the DataLoader must be None).

Each worker keeps ``prefetch`` requests in flight (its credit window: the daemon sends no more
than that) and acknowledges each batch once the trainer has taken it, which is what lets an
interrupted epoch resume where it stopped.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from loaderd.client.connection import Connection
from loaderd.client.errors import DaemonUnavailableError, RemoteError
from loaderd.client.fastpath import ShmReceiver, check_device, on_device, to_shared_tensors
from loaderd.client.protocol import (
    PROTOCOL_VERSION,
    BatchArrays,
    FieldSpec,
    MsgType,
    VarColumn,
    decode_batch,
    feedback_frames,
)
from loaderd.client.resume import (
    STATE_VERSION,
    Deadline,
    DeliveryStats,
    PassProgress,
    check_state,
    recoverable,
)

logger = logging.getLogger(__name__)

_MAX_FEEDBACK_IN_FLIGHT = 64


def default_rank_world() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when initialised, else RANK / WORLD_SIZE."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class LoaderdDataset(IterableDataset[dict[str, Any]]):
    """Batches of a loaderd job, streamed from the daemon at ``address``.

    Args:
        address: the daemon's endpoint, e.g. ``ipc:///run/loaderd/loaderd.sock``.
        job: the job name; every rank and worker of one training run uses the same one.
        batch_size: samples per batch (batches are assembled by the daemon).
        rank: this trainer's rank; default from torch.distributed, RANK, else 0.
        world_size: the number of ranks; default from torch.distributed, WORLD_SIZE, else 1.
        seed: the job's seed; each epoch's plan is a function of (seed, epoch, importance).
        sampler: ``uniform``, ``importance``, ``unbiased`` or ``infobatch``; None takes the
            daemon's default.
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
        **options: further importance options (``warmup_epochs``, ``keep_fraction``, ...).

    Each batch is a dict: ``id`` (int64 [B]), ``weight`` (float32 [B]), and one entry per
    stored field: a tensor ``[B, *shape]`` for fixed-shape fields, a list of ``bytes`` / ``str``
    for variable-length ones. Tensors view the received message's memory and are read-only in
    spirit: clone one before writing to it in place. Through shared memory, a batch's tensors
    are valid until the next batch is asked for (the daemon then reuses the slot): a trainer
    that keeps them longer copies them on purpose (``loaderd.client.shm.copy_batch``).
    """

    def __init__(
        self,
        address: str,
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
        **options: Any,
    ) -> None:
        super().__init__()
        default_rank, default_world = default_rank_world()
        self.address = address
        self.job = job
        self.batch_size = batch_size
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        self.seed = seed
        if sampler is not None:
            options["sampler"] = sampler
        self.options = options
        if prefetch < 1:
            raise ValueError(f"`prefetch` must be >= 1, got {prefetch}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"`rank` {self.rank} is outside [0, world_size={self.world_size})")
        self.prefetch = prefetch
        if worker is not None and worker < 0:
            raise ValueError(f"`worker` must be >= 0, got {worker}")
        self.worker = worker
        self._conn = Connection(address, timeout_s, curve_dir)
        # Fast path (client/fastpath.py): shared memory for same-host daemons, device copies.
        self._shm = ShmReceiver(shm and address.startswith("ipc://"))
        self.device = check_device(device, buffers)
        self.buffers = buffers
        self._hello_pid = -1
        self._schema: list[FieldSpec] = []
        self._feedback: deque[int] = deque()
        self._pending_feedback: dict[int, tuple[dict[str, Any], list[Any]]] = {}
        self.reconnect_s = reconnect_s
        self._progress: dict[str, PassProgress] = {}
        self.delivery = DeliveryStats()
        self._welcomed = False  # reached the daemon once (here or in a parent process)
        self._phase = "train"
        self.epoch: int | None = None  # the epoch of the last pass this process iterated

    # --- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """This rank's share of the next epoch (or the rest of an interrupted one)."""
        return on_device(self._pass("train"), self.device, self.buffers)

    def rescore(self) -> Iterator[dict[str, Any]]:
        """The samples to re-score before the next epoch (seed 002), for a forward-only pass.

        Send their losses with ``feedback`` as usual. Empty while the importance engine is
        still classifying samples, or when the job's sampler does not re-score.
        """
        return on_device(self._pass("rescore"), self.device, self.buffers)

    def _pass(self, phase: str) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = self.worker if self.worker is not None else info.id if info is not None else 0
        base = {"job": self.job, "rank": self.rank, "worker": worker, "phase": phase}
        # A pass interrupted in this process (or restored by load_state_dict) resumes.
        progress = self._progress.setdefault(phase, PassProgress(phase))
        try:
            self._hello()
            reply = self._conn.request(
                MsgType.OPEN_PASS, {**base, **progress.resume_meta()}, expect=MsgType.PASS
            )
            epoch = int(reply.meta["epoch"])
        except (DaemonUnavailableError, RemoteError) as e:
            # A daemon never reached is a configuration error: say so after timeout_s.
            if not recoverable(e) or self.reconnect_s <= 0 or not self._welcomed:
                raise
            epoch = self._reconnect(base, progress)
        progress.begin(epoch)
        self.epoch = epoch
        request = {**base, "epoch": epoch}
        self._phase = phase
        seen = progress.seen  # survives reconnects: the dedup set of (epoch, batch index)
        acks: list[int] = []
        in_flight: deque[int] = deque()
        ended = False
        try:
            while True:
                try:
                    while not ended and len(in_flight) < self.prefetch:
                        rid = self._conn.send(MsgType.GET_BATCH, {**request, "acks": acks})
                        in_flight.append(rid)
                        acks = []
                    if not in_flight:
                        ack = {**request, "acks": acks}
                        self._conn.request(MsgType.ACK, ack, expect=MsgType.OK)
                        acks = []
                        break
                    msg = self._conn.wait(in_flight.popleft())
                except (DaemonUnavailableError, RemoteError) as e:
                    if not recoverable(e) or self.reconnect_s <= 0:
                        raise
                    in_flight.clear()
                    acks = []  # the resume below carries every delivered index
                    ended = self._reconnect(base, progress) != epoch
                    continue
                if msg.type == MsgType.END:
                    ended = True
                    continue
                index = int(msg.meta["index"])
                if index in seen:  # delivery is at-least-once on the wire; drop duplicates
                    self.delivery.duplicates += 1
                    continue
                seen.add(index)
                shared = self._shm.resolve(msg)  # through shared memory: frames view a slot
                batch = self._to_torch(decode_batch(msg, self._schema))
                if shared and info is not None:  # pickled by a feeder thread after our ack
                    batch = to_shared_tensors(batch)
                acks.append(index)  # handed to the trainer: delivered, even if it stops here
                yield batch
            self._progress.pop(phase, None)  # the pass is over: the next one starts afresh
            self.flush()
        finally:
            self._phase = "train"
            if acks:  # left early: what the trainer took is delivered; the rest goes back
                self._conn.ignore(self._conn.send(MsgType.ACK, {**request, "acks": acks}))
            for rid in in_flight:
                self._conn.ignore(rid)

    def _reconnect(self, base: dict[str, Any], progress: PassProgress) -> int:
        """Open a fresh socket, say HELLO and resume the pass; returns the daemon's epoch.

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
            return int(reply.meta["epoch"])

    def state_dict(self) -> dict[str, Any]:
        """This process's position in its passes, for a trainer's checkpoint.

        Use it when the dataset is iterated in the training process (``num_workers=0``):
        ``load_state_dict`` then resumes the pass exactly there, even if the daemon moved on
        or lost its state since.
        """
        return {
            "version": STATE_VERSION,
            "job": self.job,
            "rank": self.rank,
            "progress": {
                phase: {"epoch": p.epoch, "delivered": sorted(p.seen)}
                for phase, p in self._progress.items()
                if p.epoch is not None
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict``: the next pass resumes the saved one.

        Raises:
            ValueError: the state is not one of this job and rank.
        """
        state = check_state(state)
        if (state.get("job"), state.get("rank")) != (self.job, self.rank):
            raise ValueError(
                f"state of job {state.get('job')!r} rank {state.get('rank')!r} does not fit "
                f"job {self.job!r} rank {self.rank}"
            )
        self._progress = {
            phase: PassProgress(phase, int(p["epoch"]), {int(i) for i in p["delivered"]}, True)
            for phase, p in state["progress"].items()
        }

    def _to_torch(self, arrays: BatchArrays) -> dict[str, Any]:
        with warnings.catch_warnings():
            # The arrays view the received frames, which numpy marks read-only.
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            batch: dict[str, Any] = {
                "id": torch.from_numpy(arrays.ids),
                "weight": torch.from_numpy(arrays.weights),
            }
            for spec in self._schema:
                col = arrays.columns[spec.name]
                if isinstance(col, VarColumn):
                    items = [bytes(col.item(i)) for i in range(len(col))]
                    batch[spec.name] = (
                        [b.decode() for b in items] if spec.dtype == "string" else items
                    )
                else:
                    batch[spec.name] = torch.from_numpy(col)
        return batch

    # --- feedback -----------------------------------------------------------------------------

    def feedback(self, ids: Any, losses: Any, kind: str | None = None) -> None:
        """Send per-sample losses to the daemon without waiting for it.

        Args:
            ids: the batch's ``id`` tensor (or any int sequence).
            losses: one loss per id (a tensor is detached and moved to the CPU).
            kind: ``train`` or ``rescore``; by default ``rescore`` inside ``rescore()``.
        """
        self._hello_retrying()
        frames = feedback_frames(_as_numpy(ids, np.int64), _as_numpy(losses, np.float32))
        meta = {"job": self.job, "kind": kind or self._phase}
        rid = self._conn.send(MsgType.FEEDBACK, meta, frames)
        self._feedback.append(rid)
        self._pending_feedback[rid] = (meta, frames)
        while len(self._feedback) > _MAX_FEEDBACK_IN_FLIGHT:
            self._wait_feedback()  # bounded memory, and errors surface

    def _wait_feedback(self) -> None:
        """Wait for the oldest feedback; if the daemon went away, send it all again.

        Feedback is at-least-once: what a crashed daemon had journalled but not confirmed is
        recorded twice, which only adds one more loss sample to the importance history.
        """
        rid = self._feedback[0]
        try:
            self._conn.wait(rid)
        except RemoteError:
            self._feedback.popleft()  # refused: it will not be sent again
            self._pending_feedback.pop(rid, None)
            raise
        except DaemonUnavailableError:
            if self.reconnect_s <= 0:
                raise
            self._hello_retrying(again=True)
            return
        self._feedback.popleft()
        self._pending_feedback.pop(rid, None)

    def _hello_retrying(self, again: bool = False) -> None:
        """HELLO, reconnecting for up to ``reconnect_s`` while the daemon is away."""
        if not again:
            try:
                self._hello()
                return
            except DaemonUnavailableError:
                if self.reconnect_s <= 0 or not self._welcomed:
                    raise
        deadline = Deadline(self.reconnect_s)
        while True:
            try:
                self._rehello()
                break
            except DaemonUnavailableError:
                if deadline.passed():
                    raise
        self.delivery.reconnects += 1

    def _rehello(self) -> None:
        """A fresh socket and HELLO, then every unconfirmed feedback sent again."""
        self._conn.reset()  # replies to the old socket are lost: their requests go again
        self._hello_pid = -1
        self._hello()
        pending = [self._pending_feedback.pop(r) for r in self._feedback]
        self._feedback.clear()
        for meta, frames in pending:
            r = self._conn.send(MsgType.FEEDBACK, meta, frames)
            self._feedback.append(r)
            self._pending_feedback[r] = (meta, frames)

    def flush(self) -> None:
        """Wait until the daemon has recorded every feedback sent so far.

        Raises:
            RemoteError: the daemon refused some feedback (e.g. an id out of range).
        """
        while self._feedback:
            self._wait_feedback()

    # --- the rest -----------------------------------------------------------------------------

    def _hello(self) -> None:
        if self._hello_pid == os.getpid():
            return
        if self._hello_pid != -1:  # requests of the parent process are not ours to wait for
            self._feedback.clear()
            self._pending_feedback.clear()
        meta = {
            "job": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "options": self.options,
            "version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "pidns": _pid_namespace(),  # the daemon checks the pid only inside its own
            "shm": self._shm.wanted,
        }
        reply = self._conn.request(MsgType.HELLO, meta, expect=MsgType.WELCOME)
        if not self._shm.accept(reply.meta):  # cannot map the ring: ask for the socket path
            meta["shm"] = False
            reply = self._conn.request(MsgType.HELLO, meta, expect=MsgType.WELCOME)
        self._schema = [FieldSpec.from_json(f) for f in reply.meta["schema"]]
        self._welcomed = True
        self.num_samples = int(reply.meta["num_samples"])
        self._hello_pid = os.getpid()

    def save_snapshot(self, obj: Any, step: int) -> None:
        """Send a snapshot (e.g. a ``state_dict``) to the daemon's NVRAM arena.

        Returns once the daemon holds the bytes; it writes them in the background, atomically
        (``load_snapshot`` finds the previous or the new one, never a mix).

        Args:
            obj: anything ``torch.save`` can write.
            step: the training step it belongs to.

        Raises:
            RemoteError: the daemon refused it (no ``--nvram-dir``, or too large).
        """
        from loaderd.client.snapshot import send_snapshot

        send_snapshot(self._conn, self.job, obj, step)

    @staticmethod
    def load_snapshot(
        address: str, job: str, *, timeout_s: float = 30.0, weights_only: bool = True
    ) -> Any | None:
        """The job's newest whole snapshot from the daemon at ``address``, or None."""
        from loaderd.client.snapshot import load_snapshot

        return load_snapshot(address, job, timeout_s=timeout_s, weights_only=weights_only)

    def connect(self) -> None:
        """Say HELLO now, to check the job's parameters early.

        It also lets DataLoader workers forked afterwards wait for a daemon that restarts
        while they start (a dataset that never reached its daemon fails after ``timeout_s``).

        Raises:
            DaemonUnavailableError: no daemon answered within ``timeout_s``.
            RemoteError: the daemon refused the job (e.g. JOB_CONFLICT).
        """
        self._hello()

    def stats(self) -> dict[str, Any]:
        """The daemon's statistics (the same object as ``loaderd stats --json``)."""
        return dict(self._conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta)

    def close(self) -> None:
        """Flush feedback and close this process's socket (safe to call twice)."""
        if self._hello_pid == os.getpid():
            self.flush()
        self._conn.close()
        self._shm.close()


def _as_numpy(x: Any, dtype: type[np.generic]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32 if dtype is np.float32 else torch.int64).numpy()
    return np.ascontiguousarray(np.asarray(x).reshape(-1), dtype)


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
