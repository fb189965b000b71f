"""One rank's cursor through one pass: what is queued, in flight to which consumer, acknowledged.

The job (``jobs.py``) walks each rank through its passes and saves these cursors; a batch is
handed out from the front of ``queue``, and a consumer's batches that it never acknowledged go
back to the front when it dies or opens its pass again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loaderd.planner import RankPlan


@dataclass(slots=True)
class PassState:
    """One rank's cursor through one pass.

    A cursor restored from saved state knows its batch count, not yet its plan: the job plans
    it (``Job.get_pass``, ``Job.open_pass``) when the pass is next used.
    """

    epoch: int
    phase: str
    num_batches: int
    queue: deque[int] = field(default_factory=deque)
    inflight: dict[int, int] = field(default_factory=dict)  # batch index -> worker
    acked: set[int] = field(default_factory=set)
    # A consumer said the pass is over for it after its feedback was recorded: a batch is
    # acknowledged before the trainer sends its losses, so "complete" alone may come early.
    ended: bool = False
    planned: RankPlan | None = None  # None: restored, not planned yet

    @classmethod
    def start(
        cls,
        epoch: int,
        phase: str,
        plan: RankPlan,
        acked: set[int] | None = None,
        inflight: dict[int, int] | None = None,
    ) -> PassState:
        """A pass with every batch not in ``acked`` or ``inflight`` waiting to be handed out."""
        state = cls.restore(epoch, phase, plan.num_batches, acked, inflight)
        state.planned = plan
        return state

    @classmethod
    def restore(
        cls,
        epoch: int,
        phase: str,
        num_batches: int,
        acked: set[int] | None = None,
        inflight: dict[int, int] | None = None,
    ) -> PassState:
        """A saved cursor of ``num_batches`` batches, its plan not made yet (``start``'s rules)."""
        acked = acked or set()
        inflight = {i: w for i, w in (inflight or {}).items() if i not in acked}
        queue = deque(i for i in range(num_batches) if i not in acked and i not in inflight)
        return cls(epoch, phase, num_batches, queue, inflight, set(acked))

    @property
    def plan(self) -> RankPlan:
        """The rank's batches of this pass (planned: the job plans a restored pass when used)."""
        if self.planned is None:
            raise RuntimeError(
                f"{self.phase} pass of epoch {self.epoch} is not planned yet: "
                "Job.get_pass or Job.open_pass plans it"
            )
        return self.planned

    @property
    def complete(self) -> bool:
        """Whether every batch was acknowledged."""
        return len(self.acked) == self.num_batches

    def assign(self, worker: int) -> int | None:
        """Hand the next batch to ``worker``; None when nothing is left to hand out."""
        if not self.queue:
            return None
        index = self.queue.popleft()
        self.inflight[index] = worker
        return index

    def ack(self, indices: list[int]) -> int:
        """Mark batches delivered; returns how many were new (duplicates are ignored).

        A batch still queued may be acknowledged too: its consumer had it before a daemon
        restart or before it was declared gone, and says so when it comes back.
        """
        new = 0
        unqueue: set[int] = set()
        for i in indices:
            if self.inflight.pop(i, None) is not None:
                self.acked.add(i)
                new += 1
            elif i < self.num_batches and i not in self.acked:
                unqueue.add(i)
        if unqueue:
            unqueue &= set(self.queue)
            self.queue = deque(i for i in self.queue if i not in unqueue)
            self.acked |= unqueue
            new += len(unqueue)
        return new

    def requeue_lost(self, indices: list[int]) -> list[int]:
        """Put batches handed out but never received back at the front of the queue."""
        lost = [i for i in dict.fromkeys(indices) if self.inflight.pop(i, None) is not None]
        self.queue.extendleft(reversed(lost))
        return lost

    def requeue(self, worker: int) -> int:
        """Put a worker's unacknowledged batches back at the front of the queue."""
        lost = sorted(i for i, w in self.inflight.items() if w == worker)
        for i in lost:
            del self.inflight[i]
        self.queue.extendleft(reversed(lost))
        return len(lost)
