"""The daemon's side of a cluster: jobs whose history and plans are the same on every node.

A daemon of a cluster (``serve --cluster``) never applies its trainers' feedback to a job
directly: it queues it for the next exchange round (``loaderd.cluster``), and every node
applies every round's entries, in round order, to its copy of each job's importance engine.
Passes are decided the same way: a rank that opens a pass not yet decided waits (its status
says which pass it wants); the round in which some rank wants it decides it on every node, from
the same history and the same merged statuses (``loaderd.cluster_view.ready_passes``, which
also holds the re-score barrier across every node's ranks). Every node thus plans every pass of
every sampler identically, and the ranks' shares are disjoint across nodes.

Durability: the round log is the job's feedback journal. Each job's engine is snapshotted
with the round it reached (``cluster/jobs/<job>/state.npz``) when a round decides a pass and on
close; a restarted daemon loads the snapshot and the cluster replays the rounds after it, and
re-runs their decisions, so the engine goes through the same steps again. Decided passes are
kept (``pass-<epoch>-<phase>.npz``) so a restored cursor finds its plan.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loaderd.cluster import ClusterError, ClusterNode
from loaderd.cluster_view import (
    PassKey,
    job_progress,
    job_view,
    jobs_in,
    plan_digest,
    ready_passes,
)
from loaderd.cluster_wire import JobStatus, RankStatus, Round
from loaderd.config import ClusterConfig
from loaderd.epoch_plan import pass_inputs
from loaderd.jobs import Job, JobError, JobSpec, NotReady
from loaderd.journal import write_atomic

logger = logging.getLogger(__name__)

__all__ = ["ClusterError", "ClusterJobs"]

_PHASE_CODES = {"train": 0, "rescore": 1}
_KEEP_EPOCHS = 2  # decided passes kept on disk: a rank resumes at most this far back
_DIGESTS = 4  # recent plans each node reports, so a node that planned differently is named


@dataclass
class _Tracked:
    """A job as the cluster sees it on this node."""

    job: Job
    applied: int  # the last round whose entries and decisions the engine holds
    saved: int  # the round of the snapshot on disk
    decided: set[PassKey] = field(default_factory=set)
    inputs: dict[PassKey, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    wants: dict[int, PassKey] = field(default_factory=dict)  # local rank -> pass it waits for
    problems: set[str] = field(default_factory=set)
    progress: dict[str, Any] | None = None  # the job on every node, as the last round showed


class ClusterJobs:
    """This daemon's jobs kept identical with every other node's through exchange rounds.

    Args:
        config: the cluster configuration (``enabled``).
        fingerprint: the store's fingerprint (every node must serve the same store).
        state_dir: the daemon's state directory.
        open_job: creates (or returns) this daemon's job for a spec; called when a round brings
            a job no trainer of this node has opened yet. It must pass :meth:`inputs` to the Job.

    Raises:
        ClusterError: the state directory belongs to another node, or its round log does not
            reach back to the oldest job snapshot.
    """

    def __init__(
        self,
        config: ClusterConfig,
        fingerprint: bytes,
        state_dir: Path,
        open_job: Callable[[JobSpec], Job],
    ) -> None:
        self.dir = state_dir / "cluster" / "jobs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._open_job = open_job
        self._jobs: dict[str, _Tracked] = {}
        self._closed = False
        saved = [_snapshot_round(p) for p in self.dir.glob("*/state.npz")]
        self._applied = min(saved, default=0)
        self.node = ClusterNode(config, fingerprint, state_dir, applied_round=self._applied)

    @property
    def wake_fd(self) -> int:
        """Readable when rounds are ready (poll it next to the socket)."""
        return self.node.wake_fd

    def start(self) -> None:
        """Start forming the group (in the cluster's thread)."""
        self.node.start()

    # --- jobs ---------------------------------------------------------------------------------

    def attach(self, job: Job) -> None:
        """Give a newly made Job the cluster's engine state (its snapshot, else a fresh one)."""
        name = job.spec.name
        path = self.dir / name / "state.npz"
        if path.exists():
            with np.load(path) as z:
                state = {k[len("engine.") :]: z[k] for k in z.files if k.startswith("engine.")}
                round_ = int(z["round"])
                decided = {(int(e), _phase(int(p))) for e, p in z["decided"].reshape(-1, 2)}
            job.engine.load_state_dict(state)
            self._jobs[name] = _Tracked(job, round_, round_, decided)
            return
        # Whatever a job's own files hold (a job from before the cluster), the cluster's
        # history starts now for it: every node starts it from the same empty engine.
        job.engine.load_state_dict(
            type(job.engine)(job.num_samples, job.engine.config).state_dict()
        )
        self._jobs[name] = t = _Tracked(job, self._applied, -1)
        self._save(t)

    def inputs(self, job: Job, rank: int, epoch: int, phase: str) -> tuple[np.ndarray, np.ndarray]:
        """A pass's (ids, weights) as the cluster decided it (``Job``'s ``inputs`` hook).

        Raises:
            NotReady: not decided yet; the rank's status now asks for it.
        """
        t = self._jobs.get(job.spec.name)
        key = (epoch, phase)
        if t is not None and key in t.inputs:
            return t.inputs[key]
        path = self.dir / job.spec.name / f"pass-{epoch}-{phase}.npz"
        if path.exists():
            with np.load(path) as z:
                got = (z["ids"], z["weights"])
            if t is not None:
                t.inputs[key] = got
            return got
        if t is not None:
            t.wants[rank] = key
        why = f"epoch {epoch}'s {phase} pass waits for the cluster to decide it"
        stalled = self.node.stalled
        if stalled is not None:  # told to the trainer in its WAITING notes
            why += f", and the cluster is stalled: {stalled}"
        raise NotReady(why)

    def feedback(self, job: Job, ids: np.ndarray, losses: np.ndarray, kind: str) -> None:
        """Queue a trainer's feedback for the next round (acknowledge only after :meth:`sync`).

        Raises:
            JobError: an id outside the dataset or a non-finite loss.
        """
        for epoch, block_ids, block_losses in job.feedback_blocks(ids, losses):
            self.node.submit(job.spec.name, epoch, kind, block_ids, block_losses)

    def sync(self) -> None:
        """Make the queued feedback survive a crash."""
        self.node.sync()

    # --- the loop's turn ----------------------------------------------------------------------

    def apply(self) -> int:
        """Apply the rounds completed since the last call; returns how many passes were decided.

        Raises:
            ClusterError: the cluster failed (the daemon stops with this message).
        """
        if self.node.failure is not None:
            raise self.node.failure
        decided = 0
        for rnd in self.node.rounds():
            decided += self._apply(rnd)
        if decided:
            self.node.compact(min((t.saved for t in self._jobs.values()), default=self._applied))
        return decided

    def _apply(self, rnd: Round) -> int:
        names = jobs_in(rnd)
        for name in names:
            if name not in self._jobs:
                self._adopt(rnd, name)
        for block in rnd.entries():
            t = self._jobs.get(block.job)
            if t is not None and rnd.number > t.applied:
                t.job.engine.record(block.ids, block.losses, block.epoch, block.kind)
        decided = 0
        for name in names:
            t = self._jobs.get(name)
            if t is not None and rnd.number > t.applied:
                decided += self._decide(t, rnd)
        for t in self._jobs.values():
            t.applied = max(t.applied, rnd.number)
        self._applied = rnd.number
        return decided

    def _adopt(self, rnd: Round, name: str) -> None:
        """A job some other node serves: this node keeps its history too."""
        view = job_view(rnd, name)
        if view is None or view.spec is None:
            return
        try:
            job = self._open_job(JobSpec(**view.spec))
        except (JobError, TypeError, ValueError) as e:
            logger.error("cluster: cannot keep job %r here: %s", name, e)
            return
        if name not in self._jobs:  # open_job attaches through the Job it makes
            self.attach(job)
        self._jobs[name].applied = rnd.number - 1

    def _decide(self, t: _Tracked, rnd: Round) -> int:
        view = job_view(rnd, t.job.spec.name)
        if view is None:
            return 0
        t.progress = job_progress(view, rnd.number, t.job.spec.world_size)
        for problem in view.problems:
            if problem not in t.problems:
                t.problems.add(problem)
                logger.error("cluster: %s", problem)
        spec, engine = t.job.spec, t.job.engine
        ready = ready_passes(
            view,
            spec.world_size,
            t.decided,
            lambda e: len(engine.rescore_ids(e)) > 0,
            engine.plans_from_losses,
        )
        for epoch, phase in ready:
            ids, weights = pass_inputs(engine, spec.seed, epoch, phase)
            t.decided.add((epoch, phase))
            t.inputs = {k: v for k, v in t.inputs.items() if k[0] >= epoch - _KEEP_EPOCHS}
            t.inputs[(epoch, phase)] = (ids, weights)
            _write_npz(self.dir / spec.name / f"pass-{epoch}-{phase}.npz", ids=ids, weights=weights)
            logger.info(
                "cluster: job %s: %s pass of epoch %d decided in round %d (%d samples)",
                spec.name,
                phase,
                epoch,
                rnd.number,
                len(ids),
            )
        if ready:
            t.applied = rnd.number
            self._save(t)
            self._forget_old_passes(t, max(e for e, _ in ready))
        return len(ready)

    def publish(self, jobs: Mapping[str, Job]) -> None:
        """Tell the cluster where this node's ranks are (a change starts a round at once)."""
        for name, t in self._jobs.items():
            if name in jobs:
                self.node.set_status(name, self._status(t))

    def _status(self, t: _Tracked) -> JobStatus:
        ranks: dict[int, RankStatus] = {}
        for rank, p in enumerate(t.job.passes):
            want = t.wants.get(rank)
            if want is not None and p is not None and (p.epoch, p.phase) == want:
                del t.wants[rank]  # opened: the rank waits no more
                want = None
            if p is not None:
                ranks[rank] = RankStatus(p.epoch, p.phase, p.complete, want)
            elif want is not None:
                ranks[rank] = RankStatus(want[0], want[1], False, want)
        recent = sorted(t.inputs)[-_DIGESTS:]
        plans = {f"{e}:{p}": plan_digest(*t.inputs[(e, p)]) for e, p in recent}
        return JobStatus(asdict(t.job.spec), ranks, plans)

    # --- state --------------------------------------------------------------------------------

    def _save(self, t: _Tracked) -> None:
        state = {f"engine.{k}": v for k, v in t.job.engine.state_dict().items()}
        decided = np.array(sorted((e, _PHASE_CODES[p]) for e, p in t.decided), np.int64)
        _write_npz(
            self.dir / t.job.spec.name / "state.npz",
            round=np.array(t.applied, np.int64),
            decided=decided.reshape(-1, 2),
            **state,
        )
        t.saved = t.applied

    def _forget_old_passes(self, t: _Tracked, epoch: int) -> None:
        for path in (self.dir / t.job.spec.name).glob("pass-*.npz"):
            if int(path.stem.split("-")[1]) < epoch - _KEEP_EPOCHS:
                path.unlink(missing_ok=True)

    def stats(self) -> dict[str, Any]:
        """``loaderd stats``' ``cluster`` part: the node, and each job as the cluster sees it.

        ``agreed`` is the newest pass every node decided; ``progress`` the whole job on every
        node as the last round showed it (``cluster_view.job_progress``).
        """
        return {
            **self.node.stats(),
            "jobs": {
                name: {
                    "applied_round": t.applied,
                    "agreed": _newest(t.decided),
                    "progress": t.progress,
                    "decided": [f"{e}:{p}" for e, p in sorted(t.decided)[-_DIGESTS:]],
                    "waiting": {str(r): f"{e}:{p}" for r, (e, p) in sorted(t.wants.items())},
                    "problems": sorted(t.problems),
                }
                for name, t in self._jobs.items()
            },
        }

    def close(self) -> None:
        """Snapshot every job at the last round applied, then leave the cluster; safe twice."""
        if self._closed:
            return
        self._closed = True
        for t in self._jobs.values():
            if t.saved < t.applied:
                self._save(t)
        self.node.close()


def _newest(decided: set[PassKey]) -> str | None:
    """The newest decided pass as ``"epoch:phase"`` (an epoch's training after its re-score)."""
    if not decided:
        return None
    epoch, phase = max(decided, key=lambda k: (k[0], k[1] == "train"))
    return f"{epoch}:{phase}"


def _phase(code: int) -> str:
    return next(p for p, c in _PHASE_CODES.items() if c == code)


def _snapshot_round(path: Path) -> int:
    try:
        with np.load(path) as z:
            return int(z["round"])
    except (OSError, ValueError, KeyError) as e:
        raise ClusterError(f"{path}: unreadable cluster snapshot ({e})") from e


def _write_npz(path: Path, **arrays: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    write_atomic(path, buf.getvalue())
