"""A job's epoch planner: what each pass of each epoch holds, decided once, in one place.

A pass's samples come from one source: the job's own importance engine (``pass_inputs``), or,
in a cluster of daemons, the pass the cluster decided (the ``source`` hook of
``loaderd.cluster_jobs``). The planner owns what sits between that source and a rank's cursor:

- the barriers, pure checks over the ranks' pass states: a pass planned from losses waits until
  every rank has left the epoch before (``check_left``), and a selecting epoch waits until every
  rank re-scored it (``check_rescored``); a cluster's barriers span every node and are its own;
- the selections: an epoch's selection is computed once and shared by all ranks; one that
  chose (not every sample) is persisted as ``selection-<epoch>.npz``, and the newest
  ``keep_selections`` are kept, so a checkpoint that old replays its epoch exactly
  (``check_replayable``);
- the plan cache: ``plan_pass`` over a pass's inputs, once per (epoch, phase) for every rank;
  the next epoch's shuffle is drawn ahead where its size is known (``ShuffleAhead``).

Nothing here runs until a pass is opened or asked for: restoring a job plans nothing.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from loaderd.importance import ImportanceEngine
from loaderd.journal import write_atomic
from loaderd.planner import RankPlan, ShuffleAhead, num_batches, plan_pass

logger = logging.getLogger(__name__)

Inputs = tuple[np.ndarray, np.ndarray]  # a pass's (ids, weights), before the shuffle
PassKey = tuple[int, str]  # (epoch, phase)
# (rank, epoch, phase) -> the pass's inputs as another part decided them; NotReady until then.
PassSource = Callable[[int, int, str], Inputs]


class NotReady(Exception):  # a state, not a failure: the caller retries later
    """The pass cannot start yet (other ranks are still re-scoring its epoch)."""


class SelectionGone(ValueError):
    """A rewind to a selected epoch whose selection is no longer kept."""


def pass_inputs(engine: ImportanceEngine, seed: int, epoch: int, phase: str) -> Inputs:
    """What a pass is planned over: the epoch's selection, or its samples to re-score.

    The one place a pass's samples come from, for a daemon alone (``EpochPlanner``) and for a
    cluster (``loaderd.cluster_jobs``, which calls it at the same point of the history on every
    node).
    """
    if phase == "train":
        return engine.select(epoch, seed)
    ids = engine.rescore_ids(epoch).astype(np.int64)
    return ids, np.ones(len(ids), np.float32)


class RankPass(Protocol):
    """What the barriers read of a rank's pass (``jobs.PassState``)."""

    @property
    def epoch(self) -> int:
        """The pass's epoch."""
        ...

    @property
    def phase(self) -> str:
        """``"train"`` or ``"rescore"``."""
        ...

    @property
    def complete(self) -> bool:
        """Whether every batch was acknowledged."""
        ...

    @property
    def ended(self) -> bool:
        """Whether a consumer said the pass is over after its feedback was recorded."""
        ...


@dataclass(frozen=True, slots=True)
class _Planned:
    inputs: Inputs
    plans: list[RankPlan]


class EpochPlanner:
    """Plans a job's passes: barriers, kept selections, the plan cache and the inputs' source.

    Args:
        name: the job's name (for messages).
        engine: the job's importance engine (the local source, and what the barriers ask).
        seed, world_size, batch_size, drop_last: the job's spec numbers.
        state_dir: where selections are persisted; None keeps them in memory only.
        source: decides the passes instead of ``engine`` (a cluster of daemons: its barrier
            spans every node's ranks, so the planner's own barriers are off).
        keep_selections: the newest epochs whose selections are kept.
        on_selection: called with the epoch of a new selection, before it is persisted (the
            job journals what the selection did to its engine).
    """

    def __init__(
        self,
        name: str,
        engine: ImportanceEngine,
        *,
        seed: int,
        world_size: int,
        batch_size: int,
        drop_last: bool,
        state_dir: Path | None,
        source: PassSource | None = None,
        keep_selections: int = 4,
        on_selection: Callable[[int], None] | None = None,
    ) -> None:
        if keep_selections < 1:
            raise ValueError(f"`keep_selections` must be >= 1, got {keep_selections}")
        self.name = name
        self.engine = engine
        self.seed = seed
        self.world_size = world_size
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.dir = state_dir
        self.source = source
        self.keep_selections = keep_selections
        self._on_selection = on_selection
        self._cache: dict[PassKey, _Planned] = {}
        self._selections: dict[int, Inputs] = {}
        self._shuffles = ShuffleAhead(seed)

    def detach(self) -> None:
        """Write nothing more to the state directory (the job is being reset)."""
        self.dir = None

    # --- barriers -----------------------------------------------------------------------------

    def check_left(self, passes: Sequence[RankPass | None], epoch: int, phase: str) -> None:
        """Plan the next epoch's ``phase`` from losses only once every rank has left ``epoch``.

        A rank's last losses of an epoch may still be on their way when it acknowledged its
        last batch; it has left the epoch once it asks for a later pass (its feedback came
        first). Planned earlier, a re-score pass's classification or an epoch's selection
        would depend on whose feedback happened to arrive first.

        Raises:
            NotReady: naming the ranks still in ``epoch``.
        """
        nxt = epoch + 1
        if self.source is not None or epoch < 0 or self.planned(passes, nxt, phase):
            return  # a cluster's barrier (``loaderd.cluster_view``) decides, or it is planned
        if phase == "train" and self.has_selection(nxt):
            return
        if not self.engine.plans_from_losses(nxt, phase):
            return
        waiting = [r for r, p in enumerate(passes) if not _left(p, epoch)]
        if waiting:
            raise NotReady(
                f"job {self.name!r} epoch {nxt}'s {phase} pass is planned from every "
                f"rank's losses of epoch {epoch}: waiting for rank(s) {_shown(waiting)} to "
                "finish it"
            )

    def check_rescored(self, passes: Sequence[RankPass | None], epoch: int) -> None:
        """Plan a selecting epoch only after every rank has re-scored it, if any rank does.

        Waiting for all ranks, not only for those already re-scoring, keeps the plan a function
        of (seed, epoch, statistics): otherwise the first rank to finish its share would rank
        the samples before a slower rank's re-scores arrived, and the plan would depend on timing.

        Raises:
            NotReady: naming the ranks still re-scoring (or not yet at) ``epoch``.
        """
        if self.source is not None:
            return  # the cluster's barrier (``loaderd.cluster_view``) decides
        if epoch in self._selections or not len(self.engine.rescore_ids(epoch)):
            return
        if self.has_selection(epoch):
            return  # selected before a restart
        at_epoch = [p for p in passes if p is not None and p.epoch == epoch]
        if not any(p.phase == "rescore" for p in at_epoch):
            return  # nobody re-scores this epoch: the latest losses stand
        done = {
            r
            for r, p in enumerate(passes)
            if p is not None
            and p.epoch == epoch
            and (p.phase == "train" or (p.complete and p.ended))
        }
        if len(done) < len(passes):
            waiting = [r for r in range(len(passes)) if r not in done]
            raise NotReady(
                f"job {self.name!r} epoch {epoch} is planned from every rank's re-scores: "
                f"waiting for rank(s) {_shown(waiting)} to finish re-scoring it"
            )

    def check_replayable(self, epoch: int, newest: int) -> None:
        """Refuse a rewind to an epoch whose selection is gone: it would train other samples.

        A selection is a function of the statistics at the time it was made; made again
        today it would pick other samples, so the checkpoint's epoch could not be replayed.
        Epochs that train every sample need nothing kept, nor do epochs from ``newest`` on
        (the job's newest epoch) or a cluster's (it keeps its decided passes).

        Raises:
            SelectionGone: the epoch was selected and its selection is no longer kept.
        """
        if self.source is not None or epoch >= newest or self.has_selection(epoch):
            return
        if self.engine.selects_all(epoch):
            return
        kept = self.kept_selections()
        oldest = f"the oldest kept is epoch {kept[0]}" if kept else "none is kept"
        raise SelectionGone(
            f"job {self.name!r}: cannot replay epoch {epoch} of a checkpoint, its "
            f"selection is no longer kept ({oldest}; the daemon keeps the newest "
            f"{self.keep_selections}, --keep-selections): restore a newer checkpoint"
        )

    # --- plans --------------------------------------------------------------------------------

    def plan(self, rank: int, epoch: int, phase: str) -> RankPlan:
        """The rank's share of the (epoch, phase) pass, planned once for every rank.

        Raises:
            NotReady: the source has not decided the pass yet (a cluster).
        """
        return self._planned(rank, epoch, phase).plans[rank]

    def planned(self, passes: Sequence[RankPass | None], epoch: int, phase: str) -> bool:
        """Whether (epoch, phase) is decided: planned here, or some rank's pass already is it."""
        if (epoch, phase) in self._cache:
            return True
        return any(p is not None and (p.epoch, p.phase) == (epoch, phase) for p in passes)

    @property
    def cached(self) -> list[PassKey]:
        """The passes whose plans are held, oldest first."""
        return sorted(self._cache, key=lambda k: (k[0], k[1] == "train"))

    def train_batches(self, rank: int, epoch: int) -> int | None:
        """The rank's batch count of ``epoch``'s training pass where known without planning it.

        Known when it is planned, when the epoch's selection is made, or when it trains every
        sample; None otherwise (a selecting sampler draws its size).
        """
        got = self._cache.get((epoch, "train"))
        if got is not None:
            return got.plans[rank].num_batches
        size: int | None = None
        if self.source is None and self.has_selection(epoch):
            size = len(self.selection(epoch)[0])
        elif self.engine.selects_all(epoch):
            size = self.engine.num_samples
        if size is None:
            return None
        return num_batches(size, self.world_size, self.batch_size, self.drop_last)

    def _planned(self, rank: int, epoch: int, phase: str) -> _Planned:
        key = (epoch, phase)
        got = self._cache.get(key)
        if got is None:
            inputs = self.inputs(rank, epoch, phase)
            plans = plan_pass(
                *inputs,
                seed=self.seed,
                epoch=epoch,
                phase=phase,
                world_size=self.world_size,
                batch_size=self.batch_size,
                drop_last=self.drop_last,
                order=self._shuffles.take(epoch, phase, len(inputs[0])),
            )
            got = _Planned(inputs, plans)
            self._cache = {k: v for k, v in self._cache.items() if k[0] >= epoch - 1}
            self._cache[key] = got
            if phase == "train" and self.engine.selects_all(epoch + 1):  # its size is known
                self._shuffles.draw(epoch + 1, "train", self.engine.num_samples)
        return got

    def inputs(self, rank: int, epoch: int, phase: str) -> Inputs:
        """A pass's (ids, weights): the source's decision, else the selection or re-score group.

        Raises:
            NotReady: the source has not decided the pass yet (a cluster).
        """
        if self.source is not None:
            return self.source(rank, epoch, phase)
        if phase == "train":
            return self.selection(epoch)
        return pass_inputs(self.engine, self.seed, epoch, phase)

    # --- selections ---------------------------------------------------------------------------

    def selection(self, epoch: int) -> Inputs:
        """The epoch's selected samples: computed once, then persisted, so all ranks agree.

        In a cluster it is the training pass the cluster decided (planned by now, where a pass
        of the epoch was opened; NotReady before it is decided).
        """
        if self.source is not None:
            got = self._cache.get((epoch, "train"))
            return got.inputs if got is not None else self.source(0, epoch, "train")
        sel = self._selections.get(epoch)
        if sel is None:
            path = self._path(epoch)
            if path is not None and path.exists():
                with np.load(path) as z:
                    sel = (z["ids"], z["weights"])
            else:
                sel = pass_inputs(self.engine, self.seed, epoch, "train")
                if path is not None:
                    if self._on_selection is not None:
                        self._on_selection(epoch)
                    # A selection of every sample is made again the same: no file for it.
                    if not self.engine.selects_all(epoch):
                        _save_arrays(path, {"ids": sel[0], "weights": sel[1]})
            self._selections[epoch] = sel
            self._forget_old_selections()
        return sel

    def has_selection(self, epoch: int) -> bool:
        """Whether the epoch's selection is made (in memory or on disk)."""
        if epoch in self._selections:
            return True
        path = self._path(epoch)
        return path is not None and path.exists()

    def kept_selections(self) -> list[int]:
        """The epochs whose selections are kept, oldest first."""
        epochs = set(self._selections)
        if self.dir is not None:
            for path in self.dir.glob("selection-*.npz"):
                try:
                    epochs.add(int(path.stem.split("-")[1]))
                except (IndexError, ValueError):
                    continue
        return sorted(epochs)

    def _forget_old_selections(self) -> None:
        """Keep the newest ``keep_selections`` epochs' selections, in memory and on disk."""
        kept = self.kept_selections()
        if len(kept) <= self.keep_selections:
            return
        for epoch in kept[: len(kept) - self.keep_selections]:
            self._selections.pop(epoch, None)
            path = self._path(epoch)
            if path is not None:
                path.unlink(missing_ok=True)

    def _path(self, epoch: int) -> Path | None:
        return self.dir / f"selection-{epoch}.npz" if self.dir is not None else None


def _save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy's stub confuses **kwds
    write_atomic(path, buf.getvalue())


def _left(p: RankPass | None, epoch: int) -> bool:
    """Whether a rank has left ``epoch``: in a later one, or its training pass done and ended."""
    if p is None:
        return False
    return p.epoch > epoch or (p.epoch == epoch and p.phase == "train" and p.complete and p.ended)


def _shown(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")
