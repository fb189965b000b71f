"""Batches each connection holds and has not acknowledged, bounded per connection.

A GET_BATCH hands a batch to the connection that asked: it is assembled, sent, and held in
the daemon's queues until the client reads it. A client that sends GET_BATCH after GET_BATCH
and never reads nor acknowledges would make the daemon assemble and queue whole epochs for
it. So each connection may hold at most ``max_outstanding_batches`` unacknowledged batches;
past that its GET_BATCH is refused with an error naming the bound, and the daemon serves on.

A batch stops counting when anyone acknowledges it (the training loop's process acknowledges
for its DataLoader workers), when it is handed to another connection (its consumer came
back on a new socket), or when its pass is no longer the rank's or it went back to the queue
(found by ``prune``, run on the daemon's tick: a refusal itself costs O(1), however
many a client sends).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from loaderd.client.protocol import BatchKey
from loaderd.jobs import Job
from loaderd.limits import LimitError

# Whether a batch is still handed out (to the worker it was handed to): the job's view.
StillOut = Callable[[BatchKey, int], bool]


class Outstanding:
    """Unacknowledged batches per connection identity.

    Args:
        limit: the most one connection may hold.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[bytes, dict[BatchKey, int]] = {}  # identity -> {batch: worker}
        self._owner: dict[BatchKey, bytes] = {}
        self.refused = 0

    def __len__(self) -> int:
        return len(self._owner)

    def check(self, identity: bytes) -> None:
        """Refuse one more batch to ``identity`` if it holds ``limit`` already.

        Raises:
            LimitError: the connection is at its bound.
        """
        held = self._held.get(identity)
        if held is not None and len(held) >= self.limit:
            self.refused += 1
            raise LimitError(
                f"this connection holds {len(held)} unacknowledged batches, at most "
                f"{self.limit} (max_outstanding_batches): read and acknowledge batches "
                "before asking for more"
            )

    def handed(self, identity: bytes, key: BatchKey, worker: int) -> None:
        """``key`` was handed to ``identity`` (a previous holder no longer counts it)."""
        previous = self._owner.get(key)
        if previous is not None and previous != identity:
            self._forget(previous, key)
        self._owner[key] = identity
        self._held.setdefault(identity, {})[key] = worker

    def acked(self, job: str, rank: int, epoch: int, phase: str, indices: Iterable[int]) -> None:
        """Batches of one pass were acknowledged (by any connection)."""
        for index in indices:
            key = BatchKey(job, rank, epoch, phase, index)
            owner = self._owner.pop(key, None)
            if owner is not None:
                self._forget(owner, key, owned=False)

    def prune(self, still_out: StillOut) -> None:
        """Forget every batch no longer handed out (its pass moved on, it was requeued)."""
        for identity, held in list(self._held.items()):
            self._prune(identity, held, still_out)

    def forget_job(self, job: str) -> None:
        """A job was reset: none of its batches count any more."""
        for key in [k for k in self._owner if k.job == job]:
            self._forget(self._owner.pop(key), key, owned=False)

    def _prune(self, identity: bytes, held: dict[BatchKey, int], still_out: StillOut) -> None:
        for key, worker in list(held.items()):
            if not still_out(key, worker):
                self._forget(identity, key)

    def _forget(self, identity: bytes, key: BatchKey, owned: bool = True) -> None:
        held = self._held.get(identity)
        if held is not None:
            held.pop(key, None)
            if not held:
                del self._held[identity]
        if owned and self._owner.get(key) == identity:
            del self._owner[key]


def still_out_in(jobs: Mapping[str, Job]) -> StillOut:
    """``StillOut`` over the daemon's jobs: in its rank's current pass, in flight to the worker."""

    def still_out(key: BatchKey, worker: int) -> bool:
        job = jobs.get(key.job)
        if job is None or not 0 <= key.rank < len(job.passes):
            return False
        state = job.passes[key.rank]
        return (
            state is not None
            and (state.epoch, state.phase) == (key.epoch, key.phase)
            and state.inflight.get(key.batch_index) == worker
        )

    return still_out
