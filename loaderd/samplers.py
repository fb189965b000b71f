"""Pure selection kernels for the importance engine: two-cluster split, top-k, weighted draws.

Each function is vectorised numpy over the whole dataset (no Python loop per sample) and takes
its randomness from the ``numpy.random.Generator`` it is given, never from global state, so the
engine can make every epoch's selection a deterministic function of (seed, epoch, state).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

logger = logging.getLogger(__name__)

__all__ = [
    "TwoClusterSplit",
    "draw_unbiased",
    "loss_variance",
    "select_infobatch",
    "select_top",
    "split_two_clusters",
]


class TwoClusterSplit(NamedTuple):
    """The optimal two-means partition of a set of 1-D values.

    Attributes:
        threshold: values ``>= threshold`` form the high cluster; ``inf`` when the values cannot
            be split (fewer than two distinct values), in which case all of them are "low".
        low_size: number of values in the low cluster.
        high_size: number of values in the high cluster.
        low_mean: mean of the low cluster (NaN when empty).
        high_mean: mean of the high cluster (NaN when empty).
        cost: the within-cluster sum of squared deviations of this partition.
    """

    threshold: float
    low_size: int
    high_size: int
    low_mean: float
    high_mean: float
    cost: float


def loss_variance(history: NDArray[np.float32]) -> tuple[NDArray[np.float32], NDArray[np.int32]]:
    """Per-sample population variance over the recorded epochs of a loss history.

    Args:
        history: ``[epochs, N]`` losses, NaN where a sample has no loss for that epoch.

    Returns:
        The variance (NaN where fewer than two epochs were recorded) and the number of recorded
        epochs per sample.
    """
    n = history.shape[1]
    seen = np.zeros(n, dtype=np.int32)
    total = np.zeros(n, dtype=np.float32)
    for row in history:  # a loop over the few epochs, each step vectorised over samples
        ok = ~np.isnan(row)
        seen += ok
        total += np.where(ok, row, np.float32(0))
    denom = np.maximum(seen, 1).astype(np.float32)
    mean = total / denom
    sq = np.zeros(n, dtype=np.float32)
    for row in history:  # two passes: centring first avoids E[x^2] - E[x]^2 cancellation
        d = np.where(np.isnan(row), np.float32(0), row - mean)
        sq += d * d
    var = sq / denom
    var[seen < 2] = np.nan
    return var, seen


def split_two_clusters(values: NDArray[np.floating]) -> TwoClusterSplit:
    """Solve k-means with k=2 on 1-D values exactly, in O(n log n).

    In one dimension an optimal two-means partition is contiguous in sorted order, and it never
    separates equal values (moving one of them to the nearer centroid would lower the cost). So
    sorting, then scoring every boundary between distinct neighbours with prefix sums, finds the
    global optimum without the random restarts Lloyd's algorithm needs.

    Args:
        values: finite 1-D values (NaN or inf are the caller's to remove).

    Returns:
        The optimal split; ties between equally good boundaries go to the lowest one.

    Raises:
        ValueError: if ``values`` is not 1-D or holds a non-finite value.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"`values` must be 1-D, got shape {x.shape}")
    n = x.size
    if n == 0:
        return TwoClusterSplit(np.inf, 0, 0, np.nan, np.nan, 0.0)
    if not np.isfinite(x).all():
        raise ValueError(f"`values[{int(np.argmin(np.isfinite(x)))}]` is not finite")
    x = np.sort(x)
    mean = float(x.mean())
    # Centring first keeps the prefix-sum formula free of cancellation for large, tight values.
    c = x - mean
    total_ss = float(np.dot(c, c))
    if n == 1 or x[0] == x[-1]:
        return TwoClusterSplit(np.inf, n, 0, mean, np.nan, total_ss)
    s = np.cumsum(c)
    left = s[:-1]  # sum of the first i centred values, i = 1 .. n-1
    sizes = np.arange(1, n, dtype=np.float64)
    # SSE(split) = total_ss - between(split); maximise between = S_L^2/n_L + S_R^2/n_R.
    between = left * left / sizes + (s[-1] - left) ** 2 / (n - sizes)
    between[x[1:] == x[:-1]] = -np.inf  # a boundary inside a run of equal values is never optimal
    best = int(np.argmax(between))
    n_low = best + 1
    low_mean = float(s[best]) / n_low + mean
    high_mean = float(s[-1] - s[best]) / (n - n_low) + mean
    cost = max(total_ss - float(between[best]), 0.0)
    return TwoClusterSplit(float(x[n_low]), n_low, n - n_low, low_mean, high_mean, cost)


def select_top(
    importance: NDArray[np.float32], keep: int, rng: np.random.Generator
) -> tuple[NDArray[np.bool_], float]:
    """Mark the ``keep`` most important samples.

    Args:
        importance: per-sample importance; NaN (never scored) ranks above everything, since a
            sample the trainer has not seen yet is the least known.
        keep: how many to mark, clipped to ``[0, len(importance)]``.
        rng: breaks ties at the cut at random, so equal scores do not favour low ids.

    Returns:
        A boolean mask with exactly ``keep`` set, and the importance at the cut (``inf`` when the
        cut falls among never-scored samples, ``-inf`` when everything is kept).
    """
    n = importance.size
    keep = min(max(int(keep), 0), n)
    if keep == n:
        return np.ones(n, dtype=np.bool_), -np.inf
    mask = np.zeros(n, dtype=np.bool_)
    if keep == 0:
        return mask, np.inf
    score = np.where(np.isnan(importance), np.float32(np.inf), importance)
    cut = score[np.argpartition(score, n - keep)[n - keep]]  # the keep-th largest score
    np.greater(score, cut, out=mask)
    need = keep - int(np.count_nonzero(mask))
    if need > 0:
        ties = np.flatnonzero(score == cut)
        mask[rng.choice(ties, size=need, replace=False, shuffle=False)] = True
    return mask, float(cut)


def draw_unbiased(
    importance: NDArray[np.float32], count: int, mix: float, rng: np.random.Generator
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """Draw ``count`` samples with probability ∝ importance mixed with uniform, with weights.

    ``p_i = (1 - mix) * imp_i / sum(imp) + mix / N`` and the weight is ``1 / (N * p_i)``, so
    ``mean(weight * loss)`` over the draw is an unbiased estimate of the full-data mean loss.
    Draws use systematic sampling (one uniform offset, ``count`` evenly spaced points on the
    cumulative distribution): each sample appears ``floor`` or ``ceil`` of ``count * p_i``
    times, which keeps the expectation of multinomial draws with much less variance.

    Args:
        importance: per-sample importance; NaN (never scored) takes the mean of the known
            values, negatives count as zero.
        count: number of draws (ids may repeat).
        mix: share of the uniform distribution in ``p``, in ``[0, 1]``; it bounds every weight
            by ``1 / mix``.
        rng: source of the single random offset.

    Returns:
        Drawn ids in ascending order (int64) and their float32 weights.
    """
    n = importance.size
    imp = importance.astype(np.float64)
    known = ~np.isnan(imp)
    fill = float(imp[known].mean()) if known.any() else 1.0
    imp[~known] = fill
    np.maximum(imp, 0.0, out=imp)
    total = float(imp.sum())
    if not np.isfinite(total) or total <= 0.0:
        p = np.full(n, 1.0 / n)  # nothing to prefer: plain uniform
    else:
        p = imp
        p *= (1.0 - mix) / total
        p += mix / n
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    points = (rng.random() + np.arange(count, dtype=np.float64)) / count
    # side="right": sample i owns [cdf[i-1], cdf[i]), so a zero-probability sample is never drawn.
    ids = np.minimum(np.searchsorted(cdf, points, side="right"), n - 1).astype(np.int64)
    weights = (1.0 / (n * p[ids])).astype(np.float32)
    return ids, weights


def select_infobatch(
    importance: NDArray[np.float32], keep: int, share: float, rng: np.random.Generator
) -> tuple[NDArray[np.int64], NDArray[np.float32], float]:
    """Top-k plus a random, up-weighted share of the rest (InfoBatch, Qin et al. 2024).

    A hard top-k cut biases the gradient towards hard (and mislabelled) samples. Keeping a
    uniformly random subset of the pruned part and scaling its weight by ``pruned / kept``
    restores the expected gradient of the pruned part, at a fraction of its cost.

    Args:
        importance: per-sample importance, as for :func:`select_top`.
        keep: how many top samples to keep at weight 1.
        share: share of the remaining samples kept, in ``(0, 1]``.
        rng: breaks ties at the cut and draws the kept share.

    Returns:
        Selected ids in ascending order (int64, no repeats), their float32 weights, and the
        importance at the cut as :func:`select_top` reports it.
    """
    top, cut = select_top(importance, keep, rng)
    weight = top.astype(np.float32)
    rest = np.flatnonzero(~top)
    kept = min(round(share * rest.size), rest.size)
    if kept > 0:
        chosen = rng.choice(rest, size=kept, replace=False, shuffle=False)
        weight[chosen] = np.float32(rest.size / kept)
    ids = np.flatnonzero(weight).astype(np.int64)
    return ids, weight[ids], cut
