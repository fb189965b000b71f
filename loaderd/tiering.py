"""The daemon's side of the tier stack: building it from the config, and re-placing it.

``storage/tiers.py`` knows the tiers; this module knows the daemon: where the arena file lives
and when a new epoch's ranking exists. When any job's training pass of a new epoch opens, its
selection is known, and the ranking goes to the tier stack (computed on the stack's background
thread). Several jobs on one daemon: the most recent epoch boundary of any job wins; jobs
sharing a store mostly share their important samples, and a merge would need weights we do
not have.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from loaderd.config import CacheConfig
from loaderd.storage.arena import Arena
from loaderd.storage.store import SampleStore
from loaderd.storage.tiers import TierStack

if TYPE_CHECKING:
    from loaderd.jobs import Job, PassState

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


class Placement:
    """Calls ``tiers.place`` once per new epoch of any job (the most recent one wins)."""

    def __init__(self, tiers: TierStack) -> None:
        self.tiers = tiers
        self._placed: dict[str, int] = {}

    def on_pass(self, job: Job, state: PassState) -> None:
        """A pass opened: on a job's first training pass of an epoch, re-place by its ranking."""
        name = job.spec.name
        if state.phase != "train" or self._placed.get(name, -1) >= state.epoch:
            return
        self._placed[name] = state.epoch
        selected, _ = job.selection(state.epoch)  # computed once per epoch and cached
        rescored = job.engine.rescore_ids(state.epoch)  # the group, as select() left it
        importance = job.engine.importance()  # a copy: the ranking is built on another thread
        logger.info("job %s epoch %d: re-placing the cache tiers", name, state.epoch)
        self.tiers.place_async(lambda: ranking(importance, selected, rescored))
