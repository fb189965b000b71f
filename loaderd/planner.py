"""(seed, epoch, selection) -> each rank's batches for one pass: deterministic, even, complete.

The plan is a pure function of its inputs, so every rank (and a daemon restarted mid-epoch)
computes the same one; the acknowledged position in it is the only cursor that needs saving.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.random  # at import, not in a fresh daemon's first plan: ~11 ms, numpy loads it lazily

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


def shuffle(seed: int, epoch: int, phase: str, n: int) -> np.ndarray:
    """A pass's order of its ``n`` entries: a function of (seed, epoch, phase, n) alone."""
    order: np.ndarray = rng_for(seed, epoch, phase).permutation(n)
    return order


class ShuffleAhead:
    """A job's next shuffle, drawn on a thread while the current pass runs.

    The shuffle was most of planning a pass of every sample: ~40 ms at a million samples, at
    the epoch's start, on the server loop. It depends on (seed, epoch, phase, n) alone, so an
    epoch whose size is known before it starts (every sample) is shuffled ahead; numpy lets go
    of the GIL while it draws. One thread for every job of the daemon: a draw is short.
    """

    _pool: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._ahead: dict[tuple[int, str, int], Future[np.ndarray]] = {}

    def draw(self, epoch: int, phase: str, n: int) -> None:
        """Start drawing the shuffle of (epoch, phase) over ``n`` entries."""
        key = (epoch, phase, n)
        if key not in self._ahead:
            self._ahead[key] = self._thread().submit(shuffle, self.seed, epoch, phase, n)

    def take(self, epoch: int, phase: str, n: int) -> np.ndarray:
        """The shuffle of (epoch, phase) over ``n`` entries: the one drawn ahead, or drawn now.

        Draws for earlier epochs, or of another size, are dropped: they will not be asked for.
        """
        ahead = self._ahead.pop((epoch, phase, n), None)
        self._ahead = {k: f for k, f in self._ahead.items() if k[0] > epoch}
        return ahead.result() if ahead is not None else shuffle(self.seed, epoch, phase, n)

    @classmethod
    def _thread(cls) -> ThreadPoolExecutor:
        with cls._pool_lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(1, thread_name_prefix="loaderd-shuffle")
            return cls._pool


def plan_pass(
    ids: np.ndarray,
    weights: np.ndarray,
    *,
    seed: int,
    epoch: int,
    phase: str,
    world_size: int,
    batch_size: int,
    drop_last: bool = False,
    order: np.ndarray | None = None,
) -> list[RankPlan]:
    """Shuffle the selected samples and split them over ranks into batches, as PyTorch does.

    The rules are ``DistributedSampler``'s and ``DataLoader``'s: every rank gets the same
    number of samples and so of batches (collective ops in DDP never wait on a rank with one
    batch fewer), and every batch holds exactly ``batch_size`` samples except each rank's last.
    A re-score pass is split evenly instead, every sample once (``_even_split``). Without
    ``drop_last`` the shuffled order is padded with its own first entries up to a
    multiple of ``world_size`` (at most ``world_size - 1`` samples are trained twice in the
    epoch), and each rank's last batch may be short. With ``drop_last`` the order's tail is
    dropped down to a multiple of ``world_size`` and each rank's short last batch is dropped;
    what is dropped changes with every epoch's shuffle.

    Args:
        ids: the samples of this pass (int64; may repeat when a sampler draws with replacement).
        weights: a float32 weight per entry of ``ids``.
        seed: the job's seed.
        epoch: the epoch number.
        phase: ``"train"`` or ``"rescore"`` (shuffled independently).
        world_size: the number of ranks.
        batch_size: the batch size.
        drop_last: drop the remainders instead of padding and short batches.
        order: the pass's shuffle, where it was drawn already (``ShuffleAhead``); it must be
            ``shuffle(seed, epoch, phase, len(ids))``.

    Returns:
        One plan per rank.
    """
    if len(ids) != len(weights):
        raise ValueError(f"{len(ids)} ids but {len(weights)} weights")
    if order is None:
        order = shuffle(seed, epoch, phase, len(ids))
    elif len(order) != len(ids):
        raise ValueError(f"a shuffle of {len(order)} entries for a pass of {len(ids)}")
    if phase == "rescore":
        return _even_split(ids[order], weights[order], world_size, batch_size)
    if drop_last:
        share = len(ids) // world_size
        order = order[: share * world_size]
    else:
        share = -(-len(ids) // world_size)
        pad = share * world_size - len(ids)
        if pad:  # repeated as often as needed when there are fewer samples than ranks
            order = np.concatenate([order, np.resize(order, pad)])
    ids, weights = _in_order(ids, order), _in_order(weights, order)
    full, rest = divmod(share, batch_size)
    n_batches = full if drop_last or not rest else full + 1
    bounds = np.minimum(np.arange(n_batches + 1, dtype=np.int64) * batch_size, share)
    plans = []
    for r in range(world_size):
        lo, hi = r * share, r * share + int(bounds[-1])
        plans.append(RankPlan(ids[lo:hi], weights[lo:hi], bounds))
    return plans


def _in_order(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``values[order]``, without the gather where the result is known.

    Every sample (``0, 1, ..., n - 1``) in order is the order itself, and equal values in any
    order are the same values. At a million samples the two gathers of a pass of every
    sample took a third of its planning.
    """
    n = len(values)
    if n and values[0] == values[-1] and (values == values[0]).all():
        return values if len(order) == n else np.full(len(order), values[0], values.dtype)
    every = n and values.dtype.kind in "iu" and values[0] == 0 and values[-1] == n - 1
    if every and (values[1:] > values[:-1]).all():  # increasing from 0 to n - 1: all of them
        return order.astype(values.dtype, copy=False)
    gathered: np.ndarray = values[order]
    return gathered


def _even_split(
    ids: np.ndarray, weights: np.ndarray, world_size: int, batch_size: int
) -> list[RankPlan]:
    """A re-score pass: every sample exactly once (a second loss would skew its statistics).

    Ranks' shares differ by at most one sample and batch sizes by at most one, and every rank
    still gets the same number of batches.
    """
    share = -(-len(ids) // world_size)
    n_batches = -(-share // batch_size) if share else 0
    plans = []
    rank_bounds = np.linspace(0, len(ids), world_size + 1).round().astype(np.int64)
    for r in range(world_size):
        lo, hi = int(rank_bounds[r]), int(rank_bounds[r + 1])
        bounds = np.linspace(0, hi - lo, n_batches + 1).round().astype(np.int64)
        plans.append(RankPlan(ids[lo:hi], weights[lo:hi], bounds))
    return plans


def num_batches(n: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """How many batches each rank gets from a pass of ``n`` samples (``plan_pass``'s rule)."""
    share = n // world_size if drop_last else -(-n // world_size)
    return share // batch_size if drop_last else -(-share // batch_size)
