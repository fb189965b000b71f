"""A job's ranks, their consumers, the pass cursors and acknowledgements, and its saved state.

Each rank walks a sequence of passes: ``[rescore e] -> train e -> [rescore e+1] -> train e+1``.
A pass is the deterministic plan of that (epoch, phase) for the rank plus the cursor through
it: batches not yet handed out, batches in flight to a consumer (a DataLoader worker), and
batches the consumer acknowledged. A pass is complete when every batch is acknowledged; only
then does the rank's next pass begin, so a restarted consumer resumes the pass it left.

What a pass holds is the epoch planner's (``loaderd.epoch_plan``): its barriers, the kept
selections, the plan cache and the source of a pass's samples. A job restored from its saved
state plans nothing: a restored cursor gets its plan when its pass is next opened or asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from loaderd import crashpoints
from loaderd.client.errors import ErrorCode
from loaderd.client.protocol import Phase
from loaderd.cursor_log import Cursor, CursorLog
from loaderd.epoch_plan import EpochPlanner, Inputs, SelectionGone
from loaderd.epoch_plan import NotReady as NotReady  # the callers' name for it, as before
from loaderd.importance import ImportanceConfig, ImportanceEngine
from loaderd.journal import (
    FeedbackEntry,
    FeedbackJournal,
    SelectionEntry,
    read_json,
    write_atomic,
    write_json_atomic,
)
from loaderd.pass_state import PassState
from loaderd.stats_cache import EngineStats
from loaderd.storage.safe_files import mkdir_durable

logger = logging.getLogger(__name__)

_LOG_LINES_PER_SAVE = 4096  # then job.json is written whole and the cursor log starts afresh
MAX_WORLD_SIZE = 1 << 16


class JobError(ValueError):
    """A request that does not fit the job (bad rank, conflicting spec, wrong order)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Resume:
    """A consumer continuing a pass after a reconnect, or a trainer after a checkpoint."""

    epoch: int
    delivered: list[int]  # batch indices its trainer already has
    rewind: bool = False  # the daemon's cursor goes back to exactly ``delivered``


class PassInputs(Protocol):
    """Where a job's passes come from when another part decides them (a cluster of daemons)."""

    def __call__(self, job: Job, rank: int, epoch: int, phase: str) -> Inputs:
        """The pass's (ids, weights); raises NotReady until it is decided."""
        ...


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What identifies a job; every client of the job must agree on it."""

    name: str
    world_size: int
    seed: int
    batch_size: int
    options: dict[str, Any] = field(default_factory=dict)
    drop_last: bool = False  # PyTorch's rule: each rank's short last batch is dropped

    def check(self, max_batch_size: int) -> None:
        """Validate the numbers (ValueError naming the field)."""
        if not self.name or len(self.name) > 128 or "/" in self.name or self.name.startswith("."):
            raise JobError(f"job name {self.name!r} must be 1-128 characters without '/'")
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:  # checked before passes are allocated
            raise JobError(
                f"`world_size` must be >= 1 and at most {MAX_WORLD_SIZE}, got {self.world_size}"
            )
        if not 1 <= self.batch_size <= max_batch_size:
            raise JobError(f"`batch_size` must be in [1, {max_batch_size}], got {self.batch_size}")
        if not isinstance(self.drop_last, bool):
            raise JobError(f"`drop_last` must be a bool, got {self.drop_last!r}")


class Job:
    """One training job: its spec, per-rank cursors, importance engine and durable state.

    What each pass holds is asked of ``self.planner`` (``loaderd.epoch_plan.EpochPlanner``).

    Args:
        spec: the job's identity.
        num_samples: the store's sample count.
        engine_defaults: the daemon-wide importance defaults, overridden by ``spec.options``.
        state_dir: where the job's state lives (created); None keeps it in memory only.
        inputs: decides the passes instead of this job's own engine (a cluster of daemons:
            its re-score barrier spans every node's ranks, so the job's own is not used).
        store: the fingerprint of the store the job is built on; saved state of another
            store is refused (JOB_CONFLICT), never silently continued.
        keep_selections: the newest epochs whose selections are kept (on disk and in
            memory): a checkpoint that old replays its epoch exactly, an older one is refused.
        engine_type: the importance engine's class.
    """

    # The feedback journal is emptied into a snapshot once it holds this much (or four
    # snapshots' worth, if more): see ``_journal_bound``.
    journal_min_bytes = 16 << 20

    def __init__(
        self,
        spec: JobSpec,
        num_samples: int,
        engine_defaults: ImportanceConfig,
        state_dir: Path | None,
        inputs: PassInputs | None = None,
        store: str = "",
        keep_selections: int = 4,
        engine_type: type[ImportanceEngine] = ImportanceEngine,
    ) -> None:
        if keep_selections < 1:
            raise ValueError(f"`keep_selections` must be >= 1, got {keep_selections}")
        self.keep_selections = keep_selections
        self.spec = spec
        self.inputs = inputs
        self.store = store
        self.last_active = time.time()  # of the last request; the retention rule reads it
        self.num_samples = num_samples
        try:
            config = ImportanceConfig.from_options(spec.options, engine_defaults)
        except ValueError as e:
            raise JobError(f"job {spec.name!r}: {e}") from e
        self.config = config
        self.engine = engine_type(num_samples, config)
        self.engine_stats = EngineStats(self.engine)  # STATS in a loop must not scan each time
        self.passes: list[PassState | None] = [None] * spec.world_size
        self.served_epoch = np.full(num_samples, -1, np.int32)
        self.batches_served = 0
        self.samples_served = 0
        self.duplicate_acks = 0
        self.planner = EpochPlanner(
            spec.name,
            self.engine,
            seed=spec.seed,
            world_size=spec.world_size,
            batch_size=spec.batch_size,
            drop_last=spec.drop_last,
            state_dir=state_dir,
            source=None if inputs is None else self._decided,
            keep_selections=keep_selections,
            on_selection=self._journal_selection,
        )
        self.dir = state_dir
        self.journal: FeedbackJournal | None = None
        self._journal_bound_bytes: int | None = None
        self.cursor_log: CursorLog | None = None
        self._dirty = False
        self._new_pass = False  # a pass started since job.json was written
        self._generation = 0  # of job.json, which the cursor log continues
        if state_dir is not None:
            mkdir_durable(state_dir)  # a power loss must not drop the job with its feedback
            self._load()
            self.journal = FeedbackJournal(state_dir / "feedback.log")
            self.cursor_log = CursorLog(state_dir / "cursors.log", self._generation)

    # --- passes -------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The newest epoch any rank has reached."""
        return max((p.epoch for p in self.passes if p is not None), default=0)

    def check_rank(self, rank: int) -> None:
        """Refuse a rank outside [0, world_size)."""
        if not 0 <= rank < self.spec.world_size:
            raise JobError(
                f"rank {rank} out of range for job {self.spec.name!r} "
                f"(world_size {self.spec.world_size})",
                ErrorCode.BAD_RANK,
            )

    def open_pass(
        self,
        rank: int,
        worker: int,
        phase: str,
        resume: Resume | None = None,
    ) -> PassState:
        """Start or resume the rank's pass of ``phase``; the worker's lost batches go back.

        ``resume`` comes from a consumer that reconnects in the middle of a pass: the batch
        indices it already handed to its trainer count as acknowledged, and a pass of that
        epoch that is complete by now stays open (it will answer END) rather than starting
        the next one under the consumer's feet. With ``rewind`` (a trainer restored from a
        checkpoint) the rank's cursor is set back to exactly what the checkpoint delivered.

        Raises:
            JobError: the phase cannot follow the rank's current pass.
            NotReady: the epoch's training plan waits for other ranks' re-scoring.
        """
        self.check_rank(rank)
        if phase not in Phase.__members__.values():
            raise JobError(f"unknown phase {phase!r}, expected one of {[p.value for p in Phase]}")
        cur = self.passes[rank]
        if cur is not None and cur.complete:
            cur.ended = True  # the consumer moved on: its feedback came before this request
        if resume is not None and resume.rewind:
            if phase == "train":
                self._check_replayable(resume.epoch)
                self.planner.check_rescored(self.passes, resume.epoch)
            plan = self.planner.plan(rank, resume.epoch, phase)
            state = PassState.start(resume.epoch, phase, plan, set(resume.delivered))
            self.passes[rank] = state
            self._dirty = self._new_pass = True
            logger.info(
                "job %s rank %d: %s pass of epoch %d rewound to a checkpoint (%d batches done)",
                self.spec.name,
                rank,
                phase,
                resume.epoch,
                len(state.acked),
            )
            return state
        epoch, delivered = self._target(cur, phase, resume)
        if cur is not None and (cur.epoch, cur.phase) == (epoch, phase):
            cur = self._planned(rank)  # a restored cursor is planned when it is used
            if cur is None:  # its plan cannot be made again: as if nothing was restored
                epoch, delivered = self._target(cur, phase, resume)
        if cur is not None and (cur.epoch, cur.phase) == (epoch, phase):
            if delivered:  # a consumer back after a restart: what it already had is done
                self.ack(cur, delivered)
            self._requeue(rank, cur, worker)  # this worker starts over: what it held, unacked
            return cur
        self.planner.check_left(self.passes, epoch - 1, phase)
        if phase == "train":
            self.planner.check_rescored(self.passes, epoch)
        plan = self.planner.plan(rank, epoch, phase)
        state = PassState.start(epoch, phase, plan)
        self.passes[rank] = state
        self._dirty = self._new_pass = True
        crashpoints.hit("open-pass")
        if delivered:  # the daemon lost this pass's start: the consumer remembers it
            self.ack(state, delivered)
        logger.info(
            "job %s rank %d: %s pass of epoch %d (%d batches)",
            self.spec.name,
            rank,
            phase,
            epoch,
            plan.num_batches,
        )
        return state

    def _target(
        self, cur: PassState | None, phase: str, resume: Resume | None
    ) -> tuple[int, list[int]]:
        """The epoch of the pass to open, and which of its batches the consumer already had."""
        if resume is None:
            return self._next_epoch(cur, phase), []
        if cur is not None and (cur.epoch, cur.phase) == (resume.epoch, phase):
            return resume.epoch, resume.delivered
        epoch = self._next_epoch(cur, phase)
        # another pass by now: the indices are not of it
        return epoch, resume.delivered if epoch == resume.epoch else []

    def _planned(self, rank: int) -> PassState | None:
        """The rank's pass with its plan; a restored cursor is planned now.

        None when the plan cannot be made again (a cluster's decision that is gone): the rank
        forgets the cursor and opens its pass again.
        """
        cur = self.passes[rank]
        if cur is None or cur.planned is not None:
            return cur
        try:
            plan = self.planner.plan(rank, cur.epoch, cur.phase)
        except NotReady:
            logger.warning("job %s rank %d: pass not decided", self.spec.name, rank)
            self.passes[rank] = None
            return None
        if plan.num_batches == cur.num_batches:
            cur.planned = plan
            return cur
        logger.warning(
            "job %s rank %d: %s pass of epoch %d was saved with %d batches, planned with %d",
            self.spec.name,
            rank,
            cur.phase,
            cur.epoch,
            cur.num_batches,
            plan.num_batches,
        )
        state = PassState.start(cur.epoch, cur.phase, plan, cur.acked, cur.inflight)
        state.ended = cur.ended and state.complete
        self.passes[rank] = state
        return state

    def _decided(self, rank: int, epoch: int, phase: str) -> Inputs:
        """The planner's source when another part decides the passes (``inputs``)."""
        assert self.inputs is not None
        return self.inputs(self, rank, epoch, phase)

    @staticmethod
    def _next_epoch(cur: PassState | None, phase: str) -> int:
        if cur is None:
            return 0
        if cur.phase == "rescore":
            return cur.epoch  # train after re-scoring the same epoch, or resume the re-score
        if phase == "train":
            return cur.epoch + 1 if cur.complete else cur.epoch
        if not cur.complete:
            raise JobError(f"epoch {cur.epoch} is not finished: cannot re-score the next one yet")
        return cur.epoch + 1

    def _check_replayable(self, epoch: int) -> None:
        """Refuse a rewind to an epoch whose selection is gone (``EpochPlanner.check_replayable``).

        Raises:
            JobError: the epoch was selected and its selection is no longer kept.
        """
        try:
            self.planner.check_replayable(epoch, self.epoch)
        except SelectionGone as e:
            raise JobError(str(e)) from None

    def kept_selections(self) -> list[int]:
        """The epochs whose selections are kept, oldest first."""
        return self.planner.kept_selections()

    def get_pass(self, rank: int, epoch: int, phase: str) -> PassState | None:
        """The rank's current pass if it is (epoch, phase); None for a stale request.

        Raises:
            JobError: UNKNOWN_PASS, the pass is later than any this daemon knows of the rank
                (it restarted and lost the pass's start): the consumer opens it again.
        """
        self.check_rank(rank)
        cur = self.passes[rank]
        if cur is not None and (cur.epoch, cur.phase) == (epoch, phase):
            cur = self._planned(rank)  # a restored cursor is planned when it is used
        if cur is None or _order(epoch, phase) > _order(cur.epoch, cur.phase):
            raise JobError(
                f"rank {rank} of job {self.spec.name!r} has no {phase} pass of epoch {epoch}: "
                "open it again",
                ErrorCode.UNKNOWN_PASS,
            )
        if (cur.epoch, cur.phase) != (epoch, phase):
            return None
        return cur

    def assign(
        self, rank: int, state: PassState, worker: int
    ) -> tuple[int, np.ndarray, np.ndarray] | None:
        """Hand the next batch of a pass to a worker: (index, ids, weights), or None."""
        index = state.assign(worker)
        if index is None:
            return None
        ids, weights = state.plan.batch(index)
        self.served_epoch[ids] = state.epoch
        self.batches_served += 1
        self.samples_served += len(ids)
        self._dirty = True
        if self.cursor_log is not None:
            self.cursor_log.assign(rank, state.epoch, state.phase, index, worker)
        crashpoints.hit("assign")
        return index, ids, weights

    def requeue(self, rank: int, worker: int) -> int:
        """Put a gone consumer's unacknowledged batches back in its rank's queue."""
        cur = self.passes[rank] if 0 <= rank < self.spec.world_size else None
        return self._requeue(rank, cur, worker) if cur is not None else 0

    def _requeue(self, rank: int, state: PassState, worker: int) -> int:
        n = state.requeue(worker)
        if n:
            self._dirty = True
            if self.cursor_log is not None:
                self.cursor_log.requeue(rank, state.epoch, state.phase, worker)
        return n

    def lost(self, rank: int, state: PassState, indices: list[int]) -> int:
        """Batches the training loop never got (their bytes were lost on the way): again."""
        lost = state.requeue_lost(indices)
        if lost:
            self._dirty = True
            if self.cursor_log is not None:
                self.cursor_log.lost(rank, state.epoch, state.phase, lost)
        return len(lost)

    def ack(self, state: PassState, indices: list[int]) -> None:
        """Record acknowledgements; duplicates are counted, not applied twice."""
        new = state.ack(indices)
        self.duplicate_acks += len(indices) - new
        if new:
            self._dirty = True
            if self.cursor_log is not None:
                rank = next(r for r, p in enumerate(self.passes) if p is state)
                done = [i for i in indices if i in state.acked]
                self.cursor_log.ack(rank, state.epoch, state.phase, done)
            crashpoints.hit("ack")

    def coming_batches(self, rank: int) -> tuple[int, int | None]:
        """(epoch, batches) of the rank's coming training pass, without planning it.

        An unfinished pass counts what is not yet acknowledged. The next epoch's count is
        known when it trains every sample or its selection is made; None otherwise (a
        selecting sampler draws its size).
        """
        self.check_rank(rank)
        cur = self.passes[rank]
        if cur is not None and cur.phase == "train" and not cur.complete:
            return cur.epoch, cur.num_batches - len(cur.acked)
        epoch = self._next_epoch(cur, "train")
        return epoch, self.planner.train_batches(rank, epoch)

    def selection(self, epoch: int) -> Inputs:
        """The epoch's selected samples: computed once, then persisted, so all ranks agree."""
        return self.planner.selection(epoch)

    # --- feedback -----------------------------------------------------------------------------

    def record_feedback(self, ids: np.ndarray, losses: np.ndarray, kind: str) -> None:
        """Record per-sample losses under the epoch in which each sample was last served.

        Raises:
            JobError: an id is outside the dataset or a loss is not finite.
        """
        blocks = self.feedback_blocks(ids, losses)
        if self.journal is not None and self.journal.size_bytes >= self._journal_bound():
            self.save_engine()  # before anything changes: a failure refuses this FEEDBACK whole
        for e, sel_ids, sel_losses in blocks:
            if self.journal is not None:  # journalled first: a failed append changes nothing
                self.journal.append(e, kind, sel_ids, sel_losses)
                crashpoints.hit("journal-append")
            self.engine.record(sel_ids, sel_losses, e, kind)

    def feedback_blocks(
        self, ids: np.ndarray, losses: np.ndarray
    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Validated feedback split by the epoch in which each sample was last served here.

        Raises:
            JobError: an id is outside the dataset or a loss is not finite.
        """
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_samples):
            bad = int(ids[(ids < 0) | (ids >= self.num_samples)][0])
            raise JobError(f"feedback for sample {bad}, but the dataset has {self.num_samples}")
        if not np.all(np.isfinite(losses)):
            bad = int(ids[~np.isfinite(losses)][0])
            raise JobError(f"feedback for sample {bad} has a non-finite loss")
        epochs = self.served_epoch[ids]
        epochs = np.where(epochs < 0, self.epoch, epochs)
        blocks = []
        for e in np.unique(epochs):
            mask = epochs == e
            blocks.append((int(e), *((ids, losses) if mask.all() else (ids[mask], losses[mask]))))
        return blocks

    # --- state --------------------------------------------------------------------------------

    @property
    def counters(self) -> dict[str, int]:
        """The counters saved in job.json and shown in stats (feedback is the engine's)."""
        return {
            "batches_served": self.batches_served,
            "samples_served": self.samples_served,
            "duplicate_acks": self.duplicate_acks,
        }

    def stats(self) -> dict[str, Any]:
        """The job's counters and its importance engine's view."""
        importance = self.engine_stats.get()
        return {
            "epoch": self.epoch,
            "sampler": self.config.sampler,
            "last_active": self.last_active,
            "store": self.store,
            "world_size": self.spec.world_size,
            "batch_size": self.spec.batch_size,
            "seed": self.spec.seed,
            **self.counters,
            "feedback_samples": importance["feedback_samples"],
            "stats_scans": self.engine_stats.scans,  # the daemon's work, not the job's history
            "ranks": [
                None
                if p is None
                else {
                    "epoch": p.epoch,
                    "phase": p.phase,
                    "batches": p.num_batches,
                    "acked": len(p.acked),
                    "inflight": len(p.inflight),
                }
                for p in self.passes
            ],
            "importance": importance,
        }

    def commit_cursors(self) -> None:
        """Make every cursor change so far survive a crash of the daemon (not of the machine).

        The changes go to the cursor log; a new pass, or a long log, writes job.json whole.
        """
        if self.cursor_log is None or not self._dirty:
            return
        if self._new_pass or self.cursor_log.lines >= _LOG_LINES_PER_SAVE:
            self.save(sync=False)
        else:
            self.cursor_log.flush()

    def save(self, force: bool = False, sync: bool = True) -> None:
        """Persist the spec, counters and every rank's cursor (atomically), and sync feedback.

        With ``sync=False`` the file is replaced without fsync (and the journal is left alone):
        that survives a crash of the daemon, which is what the per-turn cursor commit needs,
        though not a crash of the machine, which the fsynced save on the tick covers.
        """
        if self.dir is None:
            return
        if sync and self.journal is not None:
            self.journal.sync()
        if not (self._dirty or force):
            return
        generation = self._generation + 1
        write_json_atomic(
            self.dir / "job.json",
            {
                "spec": asdict(self.spec),
                "store": self.store,
                "last_active": self.last_active,
                "cursor_generation": generation,
                "counters": self.counters,
                "ranks": [
                    None
                    if p is None
                    else {
                        "epoch": p.epoch,
                        "phase": p.phase,
                        "batches": p.num_batches,
                        "acked": sorted(p.acked),
                        "inflight": [[i, w] for i, w in sorted(p.inflight.items())],
                    }
                    for p in self.passes
                ],
            },
            sync=sync,
        )
        self._generation = generation
        if self.cursor_log is not None:
            self.cursor_log.reset(generation)  # job.json now holds all it had
        self._dirty = self._new_pass = False

    def _journal_bound(self) -> int:
        """The journal's size past which the engine is snapshotted and the journal emptied.

        The journal is otherwise emptied only at close: feedback and selections would grow
        it, and every restart's replay, without end. Past a few snapshots' worth, rewriting
        the snapshot is cheaper (a run of feedback replays at hundreds of MB/s).
        """
        if self._journal_bound_bytes is None:  # the engine's arrays are sized once, at start
            snapshot = sum(a.nbytes for a in self.engine.state_dict().values())
            self._journal_bound_bytes = max(self.journal_min_bytes, 4 * snapshot)
        return self._journal_bound_bytes

    def _journal_selection(self, epoch: int) -> None:
        """Make the selection of ``epoch`` durable, as what it did to the engine.

        Synced before the selection's file is written: a restart that finds the file finds
        the engine as the selection left it. A snapshot here (the engine's arrays, tens of
        MB at a million samples) held every epoch's start for a quarter of a second.
        """
        if self.journal is not None:
            last = self.engine.last_selection
            assert last[0] == epoch, f"journalling epoch {epoch}'s selection, not {last[0]}'s"
            self.journal.append_selection(*last)
            self.journal.sync()

    def save_engine(self) -> None:
        """Snapshot the engine's arrays and empty the journal they now contain."""
        if self.dir is None:
            return
        self._save_arrays(self.dir / "importance.npz", self.engine.state_dict())
        if self.journal is not None:
            self.journal.reset()

    @staticmethod
    def _save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
        import io

        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy's stub confuses **kwds
        write_atomic(path, buf.getvalue())

    def _load(self) -> None:
        assert self.dir is not None
        saved = read_json(self.dir / "job.json")
        if saved is None:
            return
        old = JobSpec(**saved["spec"])
        if old != self.spec:
            raise JobError(
                f"job {self.spec.name!r} exists with {asdict(old)}, not {asdict(self.spec)}: "
                f"{reset_hint(self.spec.name)}",
                ErrorCode.JOB_CONFLICT,
            )
        saved_store = str(saved.get("store", ""))
        if saved_store and self.store and saved_store != self.store:
            raise JobError(
                f"job {self.spec.name!r} was built on another store (fingerprint {saved_store}, "
                f"this daemon serves {self.store}): {reset_hint(self.spec.name)}",
                ErrorCode.JOB_CONFLICT,
            )
        last = saved.get("last_active")
        if isinstance(last, int | float):
            self.last_active = float(last)
        counters = saved.get("counters", {})
        self.batches_served = int(counters.get("batches_served", 0))
        self.samples_served = int(counters.get("samples_served", 0))
        self.duplicate_acks = int(counters.get("duplicate_acks", 0))
        npz = self.dir / "importance.npz"
        if npz.exists():
            with np.load(npz) as z:
                self.engine.load_state_dict({k: z[k] for k in z.files})
        replayed = 0
        for entry in _runs(FeedbackJournal.replay(self.dir / "feedback.log")):
            if isinstance(entry, SelectionEntry):
                self.engine.selected(entry.epoch, entry.selected, entry.cut)
            else:
                self.engine.record(entry.ids, entry.losses, entry.epoch, entry.kind)
                replayed += len(entry.ids)
        cursors = load_cursors(self.dir, saved, self.spec.world_size)
        self._generation = int(saved.get("cursor_generation", 0))
        for rank, c in enumerate(cursors):
            if c is not None:  # planned when its pass is next used (``_planned``), not here
                state = PassState.restore(
                    c["epoch"], c["phase"], c["batches"], c["acked"], c["inflight"]
                )
                state.ended = state.complete  # its consumers may be waiting for the next pass
                self.passes[rank] = state
        logger.info(
            "job %s: restored at epoch %d (%d feedback samples replayed)",
            self.spec.name,
            self.epoch,
            replayed,
        )

    def discard(self) -> None:
        """Close the job's files without writing anything (it is being reset)."""
        if self.journal is not None and not self.journal.closed:
            self.journal.close()
        if self.cursor_log is not None:
            self.cursor_log.close()
        self.journal = None
        self.cursor_log = None
        self.dir = None  # whatever still holds this object can no longer write the state
        self.planner.detach()

    def close(self) -> None:
        """Persist everything and close the journal (safe to call twice)."""
        if self.dir is not None and self.journal is not None and not self.journal.closed:
            self.save(force=True)
            self.save_engine()
            self.journal.close()
            if self.cursor_log is not None:
                self.cursor_log.close()


def _runs(
    entries: Iterable[FeedbackEntry | SelectionEntry],
) -> Iterator[FeedbackEntry | SelectionEntry]:
    """The journal's entries with each run of feedback of one epoch and kind joined.

    ``ImportanceEngine.record`` of the joined arrays leaves the state that recording them
    one by one does (a repeated id keeps its last loss and counts each time), and a joined
    run costs one call, not one per batch: ~30 us each, 20k of them an epoch at a million
    samples.
    """
    run: list[FeedbackEntry] = []
    for entry in entries:
        if run and (
            isinstance(entry, SelectionEntry)
            or (entry.epoch, entry.kind) != (run[0].epoch, run[0].kind)
        ):
            yield _joined(run)
            run = []
        if isinstance(entry, SelectionEntry):
            yield entry
        else:
            run.append(entry)
    if run:
        yield _joined(run)


def _joined(run: list[FeedbackEntry]) -> FeedbackEntry:
    if len(run) == 1:
        return run[0]
    ids = np.concatenate([e.ids for e in run])
    losses = np.concatenate([e.losses for e in run])
    return FeedbackEntry(run[0].epoch, run[0].kind, ids, losses)


def reset_hint(name: str) -> str:
    """How to get out of a job conflict: said by every JOB_CONFLICT."""
    return f"`loaderd jobs reset {name}` forgets the old job, or use another job name"


def load_cursors(state_dir: Path, saved: dict[str, Any], world_size: int) -> list[Cursor | None]:
    """Each rank's cursor as a restarted daemon sees it: job.json, then the cursor log."""
    cursors: list[Cursor | None] = [
        None
        if r is None
        else {
            "epoch": int(r["epoch"]),
            "phase": r["phase"],
            "batches": int(r["batches"]),
            "acked": {int(i) for i in r["acked"]},
            "inflight": {int(i): int(w) for i, w in r.get("inflight", [])},
        }
        for r in saved.get("ranks", [])[:world_size]
    ]
    cursors += [None] * (world_size - len(cursors))
    generation = int(saved.get("cursor_generation", 0))
    CursorLog.replay(state_dir / "cursors.log", generation, cursors)
    return cursors


def _order(epoch: int, phase: str) -> tuple[int, int]:
    """Passes in the order a rank walks them: re-score of an epoch, then its training."""
    return epoch, 0 if phase == "rescore" else 1
