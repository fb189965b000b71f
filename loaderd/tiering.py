"""The daemon's side of the tier stack: building it from the config, and re-placing it.

``storage/tiers.py`` knows the tiers; this module knows the daemon: where the arena file lives
and when a new epoch's ranking exists. When any job's training pass of a new epoch opens, its
selection is known, and the ranking goes to the tier stack (computed on the stack's background
thread). Several jobs on one daemon: the most recent epoch boundary of any job wins; jobs
sharing a store mostly share their important samples, and a merge would need weights we do
not have.

In a cluster (``serve --cluster``) every node knows the whole job's plan, but only its own
ranks read from it, so a node ranks only what its ranks read: the samples of the training
plans of the ranks that opened the epoch's pass here (``node_ranking``). Ranks open their pass
one after the other, so the node re-places as its share grows; a placement still queued when a
newer one comes is skipped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from loaderd.config import CacheConfig
from loaderd.storage.arena import Arena
from loaderd.storage.store import SampleStore
from loaderd.storage.tiers import TierStack

if TYPE_CHECKING:
    from loaderd.jobs import Job
    from loaderd.pass_state import PassState
    from loaderd.planner import RankPlan

logger = logging.getLogger(__name__)

ARENA_FILE = "loaderd.arena"


def build_tiers(config: CacheConfig, store: SampleStore) -> TierStack:
    """The tier stack for ``config``: DRAM, then the arena when ``nvram_dir`` is set.

    The arena file is ``nvram_dir/loaderd.arena``. Its header carries the store's
    fingerprint: the same store finds its surviving records (a warm restart), another store,
    another format version or garbage rebuilds the file with a warning.

    Raises:
        StoreFullError: the file system has no room for the arena.
        StorageError: another process holds the arena, or it cannot be opened.
    """
    arena = None
    if config.nvram_dir is not None:
        config.nvram_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        arena = Arena(
            config.nvram_dir / ARENA_FILE,
            config.nvram_bytes,
            store.fingerprint,
            snapshot_bytes=config.snapshot_region_bytes,
        )
    try:
        return TierStack(
            store,
            config.dram_bytes,
            arena,
            policy=config.policy,
            admit_queue_bytes=config.admit_queue_bytes,
            lock_pages=config.lock_pages,
            load_map=config.load_map,
        )
    except BaseException:
        if arena is not None:
            arena.close()
        raise


def ranking(
    importance: np.ndarray, selected: np.ndarray, rescored: np.ndarray | None = None
) -> np.ndarray | None:
    """Ids ordered for placement: by expected reads per epoch, then by importance.

    A selected sample is read once this epoch; one in the re-score group is read once more
    by each re-score pass (the group changes only at re-classification, every K epochs), so
    a selected, re-scored sample is worth two reads. Unscored samples (NaN) rank last within
    their group. When every sample is selected and none is re-scored (``uniform``, warm-up
    and annealing epochs) each is read once whatever is cached, so the current placement is
    kept (None): re-placing by noisy losses would only churn.

    Args:
        importance: per-sample importance (the engine's latest losses; NaN: never scored).
        selected: the epoch's selected ids (may repeat).
        rescored: the ids the re-score passes read (the high-fluctuation group), if any.
    """
    n = len(importance)
    reads = np.zeros(n, np.int8)
    reads[selected] = 1
    if rescored is not None and len(rescored):
        reads[rescored] += 1
    elif reads.all():
        return None
    score = np.where(np.isnan(importance), -np.inf, importance)
    return np.lexsort((-score, -reads)).astype(np.int64)


def node_ranking(
    importance: np.ndarray, share: np.ndarray, rescored: np.ndarray | None = None
) -> np.ndarray | None:
    """The ids of one node's share ordered for placement, and nothing else (a cluster's node).

    The share's samples are read once this epoch, those of the re-score group once more by a
    later re-score pass (on some node; a sample this node trains is as likely as any to be
    re-scored here), then by importance, as in :func:`ranking`. When the share is every sample
    and none is re-scored (a cluster of one node training everything) the placement is kept.

    Args:
        importance: per-sample importance (NaN: never scored).
        share: the sorted, unique ids this node's ranks read in the epoch's training pass.
        rescored: the sorted ids of the re-score group, if any.
    """
    none_rescored = rescored is None or not len(rescored)
    if none_rescored and len(share) == len(importance):
        return None
    reads = np.ones(len(share), np.int8)
    if not none_rescored:
        assert rescored is not None
        reads += np.isin(share, rescored, assume_unique=True)
    score = importance[share]
    score = np.where(np.isnan(score), -np.inf, score)
    return share[np.lexsort((-score, -reads))]


@dataclass(frozen=True, slots=True)
class _Placed:
    """What the latest placement was computed for."""

    job: str
    epoch: int
    ranks: list[int]  # the ranks whose plans it holds (a single daemon: all)
    share: np.ndarray  # sorted unique ids those ranks read in the epoch's training pass


class Placement:
    """Re-places the tiers once per new epoch of any job (the most recent one wins).

    Args:
        tiers: the tier stack.
        node_local: this daemon is a node of a cluster: rank only its own ranks' samples.
    """

    def __init__(self, tiers: TierStack, node_local: bool = False) -> None:
        self.tiers = tiers
        self.node_local = node_local
        self._placed: dict[str, int] = {}
        self._shares: dict[str, tuple[int, dict[int, RankPlan]]] = {}  # job -> (epoch, plans)
        self._generation = 0  # of the newest placement handed to the tiers
        self._lock = threading.Lock()
        self._latest: _Placed | None = None
        self._summary: tuple[_Placed, np.ndarray | None, dict[str, Any]] | None = None

    def on_pass(self, job: Job, rank: int, state: PassState) -> None:
        """A pass opened: re-place when a job's training pass of a new epoch opens.

        On a node of a cluster also when another of this node's ranks opens the same epoch's
        training pass (the node's share grew).
        """
        if state.phase != "train":
            return
        if self.node_local:
            self._on_node_pass(job, rank, state)
            return
        name = job.spec.name
        if self._placed.get(name, -1) >= state.epoch:
            return
        self._placed[name] = state.epoch
        selected, _ = job.selection(state.epoch)  # computed once per epoch and cached
        rescored = job.engine.rescore_ids(state.epoch)  # the group, as select() left it
        importance = job.engine.importance()  # a copy: the ranking is built on another thread
        logger.info("job %s epoch %d: re-placing the cache tiers", name, state.epoch)
        ranks = list(range(job.spec.world_size))
        self._place(
            lambda: ranking(importance, selected, rescored),
            lambda: _Placed(name, state.epoch, ranks, _distinct(selected, len(importance))),
        )

    def _on_node_pass(self, job: Job, rank: int, state: PassState) -> None:
        name = job.spec.name
        epoch, plans = self._shares.get(name, (-1, {}))
        if state.epoch < epoch or (state.epoch == epoch and plans.get(rank) is state.plan):
            return  # an older epoch (a rewind), or this rank's plan is placed already
        if state.epoch > epoch:
            plans = {}
            self._shares[name] = (state.epoch, plans)
        plans[rank] = state.plan
        ids = [p.ids for p in plans.values()]
        ranks = sorted(plans)
        # Within the pass the cluster decided: the groups are those its decision made.
        rescored = job.engine.rescore_ids(state.epoch)
        importance = job.engine.importance()
        logger.info(
            "job %s epoch %d: re-placing the cache tiers for this node's ranks %s",
            name,
            state.epoch,
            ranks,
        )
        share: list[np.ndarray] = []  # filled on the tiers' thread, before the ranking is made

        def order() -> np.ndarray | None:
            share.append(_distinct(np.concatenate(ids), len(importance)))
            return node_ranking(importance, share[0], rescored)

        self._place(order, lambda: _Placed(name, state.epoch, ranks, share[0]))

    def _place(self, order: Callable[[], np.ndarray | None], placed: Callable[[], _Placed]) -> None:
        """Rank and place on the tiers' thread, skipped when a newer placement is queued."""
        self._generation += 1
        generation = self._generation

        def run() -> None:
            if generation != self._generation:
                return  # a newer placement follows in the queue: it alone counts
            self.tiers.place(order())
            with self._lock:
                self._latest = placed()  # after the policy has it: stats pair the two

        self.tiers.place_async(run)

    def stats(self) -> dict[str, Any]:
        """The ``placement`` section of STATS: what the tiers are placed for, and checks of it.

        ``job``, ``epoch`` and ``ranks`` of the latest placement, ``share_samples`` the
        distinct samples those ranks read in the epoch's training pass; ``targeted`` how many
        ids the policy's ranking puts in each tier, ``outside_share`` how many of them those
        ranks do not read (0 on a node of a cluster), and ``target_digest`` an xxh3 of the
        targeted ids in ascending order (int64). Computed once per placement.
        """
        with self._lock:
            latest = self._latest
        out: dict[str, Any] = {
            "node_local": self.node_local,
            "job": None,
            "epoch": None,
            "ranks": [],
            "share_samples": 0,
            "targeted": {},
            "outside_share": 0,
            "target_digest": None,
        }
        if latest is None:
            return out
        targets = self.tiers.policy.targets()
        cached = self._summary
        if cached is None or cached[0] is not latest or cached[1] is not targets:
            cached = self._summary = (latest, targets, _summary(latest, targets))
        return {**out, **cached[2]}


def _distinct(ids: np.ndarray, n: int) -> np.ndarray:
    """The distinct ids, ascending (a mask over the n ids: linear, no sort)."""
    mask = np.zeros(n, np.bool_)
    mask[ids] = True
    return np.flatnonzero(mask).astype(np.int64, copy=False)


def _summary(placed: _Placed, targets: np.ndarray | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "job": placed.job,
        "epoch": placed.epoch,
        "ranks": placed.ranks,
        "share_samples": len(placed.share),
    }
    if targets is None:
        return out
    ids = np.flatnonzero(targets >= 0).astype(np.int64)
    tiers = ("dram", "nvram")
    out["targeted"] = {tiers[t]: int(np.count_nonzero(targets == t)) for t in range(2)}
    out["outside_share"] = int(np.count_nonzero(~np.isin(ids, placed.share, assume_unique=True)))
    out["target_digest"] = xxhash.xxh3_64(ids.tobytes()).hexdigest()
    return out
