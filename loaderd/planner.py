"""(seed, epoch, selection) -> each rank's batches for one pass: deterministic, even, complete.

The plan is a pure function of its inputs, so every rank (and a daemon restarted mid-epoch)
computes the same one; the acknowledged position in it is the only cursor that needs saving.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_PHASE_CODES = {"train": 0, "rescore": 1}


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One rank's batches: batch i is ``ids[bounds[i]:bounds[i + 1]]``."""

    ids: np.ndarray
    weights: np.ndarray
    bounds: np.ndarray

    @property
    def num_batches(self) -> int:
        """How many batches this rank gets."""
        return len(self.bounds) - 1

    def batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The ids and weights of batch ``index``."""
        lo, hi = int(self.bounds[index]), int(self.bounds[index + 1])
        return self.ids[lo:hi], self.weights[lo:hi]


def rng_for(seed: int, epoch: int, phase: str) -> np.random.Generator:
    """The one generator a pass's shuffle draws from."""
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([seed, epoch, _PHASE_CODES[phase]]))
    )


def plan_pass(
    ids: np.ndarray,
    weights: np.ndarray,
    *,
    seed: int,
    epoch: int,
    phase: str,
    world_size: int,
    batch_size: int,
) -> list[RankPlan]:
    """Shuffle the selected samples and split them over ranks into batches.

    Every rank gets the same number of batches (so collective ops in DDP never wait on a rank
    with one batch fewer), and every selected sample appears exactly once: ranks' shares differ
    by at most one sample and batch sizes within a rank by at most one.

    Args:
        ids: the samples of this pass (int64; may repeat when a sampler draws with replacement).
        weights: a float32 weight per entry of ``ids``.
        seed: the job's seed.
        epoch: the epoch number.
        phase: ``"train"`` or ``"rescore"`` (shuffled independently).
        world_size: the number of ranks.
        batch_size: the largest batch size.

    Returns:
        One plan per rank.
    """
    if len(ids) != len(weights):
        raise ValueError(f"{len(ids)} ids but {len(weights)} weights")
    order = rng_for(seed, epoch, phase).permutation(len(ids))
    ids, weights = ids[order], weights[order]
    share = -(-len(ids) // world_size)
    n_batches = -(-share // batch_size) if share else 0
    plans = []
    rank_bounds = np.linspace(0, len(ids), world_size + 1).round().astype(np.int64)
    for r in range(world_size):
        lo, hi = int(rank_bounds[r]), int(rank_bounds[r + 1])
        bounds = np.linspace(0, hi - lo, n_batches + 1).round().astype(np.int64)
        plans.append(RankPlan(ids[lo:hi], weights[lo:hi], bounds))
    return plans
