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

_BLOCK = 1 << 16  # samples per block in the O(N) kernels: 512 KiB per float64 buffer

__all__ = [
    "TwoClusterSplit",
    "draw_unbiased",
    "loss_movement",
    "loss_variance",
    "learnable_score",
    "select_learnable",
    "select_infobatch",
    "select_top",
    "split_sorted",
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


def _window_spread(
    history: NDArray[np.float32], *, likelihood: bool
) -> tuple[NDArray[np.float32], NDArray[np.int32]]:
    """Per-sample population variance of the recorded epochs (of ``exp(-loss)`` if asked)."""
    n = history.shape[1]
    var = np.empty(n, dtype=np.float32)
    seen = np.empty(n, dtype=np.int32)
    # Blocks of samples keep the temporaries cache-resident; within a block, a loop over the
    # few epochs. Two passes (mean, then squared deviations) avoid E[x^2] - E[x]^2 cancellation.
    for a in range(0, n, _BLOCK):
        h = history[:, a : a + _BLOCK]
        ok = ~np.isnan(h)
        if likelihood:  # NaN stays NaN; a loss below -30 (not a log-likelihood) is clipped
            h = np.exp(-np.maximum(h, np.float32(-30)))
        cnt = ok.sum(axis=0, dtype=np.int32)
        denom = np.maximum(cnt, 1).astype(np.float32)
        mean = np.where(ok, h, np.float32(0)).sum(axis=0) / denom
        d = h - mean
        np.multiply(d, d, out=d)
        d[~ok] = 0
        v = d.sum(axis=0) / denom
        v[cnt < 2] = np.nan
        var[a : a + _BLOCK] = v
        seen[a : a + _BLOCK] = cnt
    return var, seen


def loss_variance(history: NDArray[np.float32]) -> tuple[NDArray[np.float32], NDArray[np.int32]]:
    """Per-sample population variance over the recorded epochs of a loss history.

    Args:
        history: ``[epochs, N]`` losses, NaN where a sample has no loss for that epoch.

    Returns:
        The variance (NaN where fewer than two epochs were recorded) and the number of recorded
        epochs per sample.
    """
    return _window_spread(history, likelihood=False)


def loss_movement(history: NDArray[np.float32]) -> NDArray[np.float32]:
    """How much each sample's fit moves: the std over its recorded epochs of ``exp(-loss)``.

    Read as a negative log-likelihood (cross-entropy is one), ``exp(-loss)`` is the probability
    the model gives the sample's label. A sample being learned moves on that scale; an easy one
    (near 1) and a mislabelled or unlearnable one (near 0) stay put. On the loss scale the
    mislabelled ones would look the most volatile, because their losses are the largest.

    Args:
        history: ``[epochs, N]`` losses, NaN where a sample has no loss for that epoch.

    Returns:
        The standard deviation per sample, NaN where fewer than two epochs were recorded.
    """
    var, _ = _window_spread(history, likelihood=True)
    return np.sqrt(var, out=var)


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
    x = np.asarray(values)
    if x.ndim != 1:
        raise ValueError(f"`values` must be 1-D, got shape {x.shape}")
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    n = x.size
    if n == 0:
        return TwoClusterSplit(np.inf, 0, 0, np.nan, np.nan, 0.0)
    if not np.isfinite(x).all():
        raise ValueError(f"`values[{int(np.argmin(np.isfinite(x)))}]` is not finite")
    # Sort in the caller's dtype (float32 sorts ~2x faster than float64), sum in float64.
    return split_sorted(np.sort(x))


def split_sorted(xs: NDArray[np.floating]) -> TwoClusterSplit:
    """:func:`split_two_clusters` for finite values already sorted ascending (not checked)."""
    n = xs.size
    if n == 0:
        return TwoClusterSplit(np.inf, 0, 0, np.nan, np.nan, 0.0)
    mean = float(xs.mean(dtype=np.float64))
    # Blocks keep every float64 temporary small and cache-resident: at 10M samples, whole-array
    # temporaries (five of 80 MB) cost more in page faults than the arithmetic does. Values are
    # centred first, which keeps the prefix sums free of cancellation for large, tight values.
    block = min(n, _BLOCK)
    left = np.empty(block, dtype=np.float64)
    right = np.empty(block, dtype=np.float64)
    size = np.empty(block, dtype=np.float64)
    total = total_ss = 0.0
    for a in range(0, n, block):  # a loop over blocks, each vectorised
        c = left[: min(block, n - a)]
        np.subtract(xs[a : a + c.size], mean, out=c, dtype=np.float64)
        total += float(c.sum())
        total_ss += float(np.dot(c, c))
    if xs[0] == xs[-1]:
        return TwoClusterSplit(np.inf, n, 0, mean, np.nan, total_ss)
    # Boundary i (1 <= i < n) puts xs[:i] low; SSE(i) = total_ss - between(i), where
    # between(i) = S_i^2 / i + (total - S_i)^2 / (n - i) and S_i is the centred prefix sum.
    best, best_between, carry = -1, -np.inf, 0.0
    for a in range(0, n - 1, block):
        m = min(block, n - 1 - a)
        s_i, r, sz = left[:m], right[:m], size[:m]
        np.subtract(xs[a : a + m], mean, out=s_i, dtype=np.float64)
        np.cumsum(s_i, out=s_i)
        s_i += carry
        carry = float(s_i[-1])
        sz[:] = np.arange(a + 1, a + m + 1, dtype=np.float64)
        np.subtract(total, s_i, out=r)
        np.square(r, out=r)
        np.subtract(n, sz, out=sz)
        r /= sz  # (total - S_i)^2 / (n - i)
        np.subtract(n, sz, out=sz)  # back to i
        np.square(s_i, out=s_i)
        s_i /= sz
        r += s_i
        r[xs[a + 1 : a + m + 1] == xs[a : a + m]] = -np.inf  # never split a run of equal values
        j = int(np.argmax(r))
        if r[j] > best_between:
            best, best_between = a + j, float(r[j])
    n_low = best + 1
    low_sum = float(np.sum(xs[:n_low], dtype=np.float64))
    low_mean = low_sum / n_low
    high_mean = (float(xs.sum(dtype=np.float64)) - low_sum) / (n - n_low)
    cost = max(total_ss - best_between, 0.0)
    return TwoClusterSplit(float(xs[n_low]), n_low, n - n_low, low_mean, high_mean, cost)


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
    unknown = np.isnan(importance)
    score = importance
    if unknown.any():
        score = importance.copy()
        score[unknown] = np.inf
    # np.partition of the values beats np.argpartition: no int64 index array to build.
    cut = np.partition(score, n - keep)[n - keep]  # the keep-th largest score
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
    times, which keeps the expectation of multinomial draws (``count * p_i``) with much less
    variance.

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
    # Pass 1: the mean of the known scores (stand-in for unknown ones) and the total.
    known_sum, known_pos, n_known = 0.0, 0.0, 0
    for a in range(0, n, _BLOCK):
        blk = importance[a : a + _BLOCK]
        ok = ~np.isnan(blk)
        vals = blk[ok].astype(np.float64)
        n_known += vals.size
        known_sum += float(vals.sum())
        known_pos += float(np.maximum(vals, 0.0).sum())
    fill = max(known_sum / n_known if n_known else 1.0, 0.0)
    total = known_pos + (n - n_known) * fill
    if not np.isfinite(total) or total <= 0.0:
        scale, fill, offset = 0.0, 0.0, 1.0 / n  # nothing to prefer: plain uniform
    else:
        scale, offset = (1.0 - mix) / total, mix / n
    # Pass 2: point j = 0 .. count-1 sits at (u + j) / count on the cumulative distribution and
    # sample i owns [cdf[i-1], cdf[i]), so it holds ceil(count*cdf[i] - u) - (the same for i-1)
    # points. Counting per sample is O(N), where a binary search per point is O(count log N).
    u = rng.random()
    ids = np.empty(count, dtype=np.int64)
    weights = np.empty(count, dtype=np.float32)
    carry, done = 0.0, 0
    for a in range(0, n, _BLOCK):
        p = importance[a : a + _BLOCK].astype(np.float64)
        p[np.isnan(p)] = fill
        np.maximum(p, 0.0, out=p)
        p *= scale
        p += offset
        ends = np.cumsum(p)
        ends += carry
        carry = float(ends[-1])
        ends *= count
        ends -= u
        np.ceil(ends, out=ends)
        bounds = np.minimum(ends, count).astype(np.int64)
        if a + p.size == n:
            bounds[-1] = count  # rounding in the cumulative sum must not lose or add a point
        hits = np.diff(bounds, prepend=done)
        m = int(bounds[-1]) - done
        ids[done : done + m] = np.repeat(np.arange(a, a + p.size, dtype=np.int64), hits)
        with np.errstate(divide="ignore"):  # p = 0 (mix 0, score 0) is never drawn anyway
            w = (1.0 / (n * p)).astype(np.float32)
        weights[done : done + m] = np.repeat(w, hits)
        done += m
    return ids, weights


def select_infobatch(
    importance: NDArray[np.float32], keep: int, share: float, rng: np.random.Generator
) -> tuple[NDArray[np.int64], NDArray[np.float32], float]:
    """Top-k plus a random, up-weighted share of the rest (InfoBatch, Qin et al. 2024).

    A hard top-k cut biases the gradient towards hard (and mislabelled) samples. Keeping each
    pruned sample with probability ``share`` and scaling its weight by ``1 / share`` restores
    the expected gradient of the pruned part, at a fraction of its cost.

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
    # Independent coin flips give every pruned sample inclusion probability exactly `share`, so
    # weight 1/share is exactly unbiased (as in InfoBatch); the kept count varies by ~sqrt(N).
    # That is also 4x faster than drawing an exact-size subset without replacement.
    extra = rng.random(importance.size, dtype=np.float32) < np.float32(share)
    extra &= ~top
    weight = top.astype(np.float32)
    weight[extra] = np.float32(1.0 / share)
    ids = np.flatnonzero(weight).astype(np.int64)
    return ids, weight[ids], cut


def learnable_score(
    importance: NDArray[np.float32], movement: NDArray[np.float32]
) -> NDArray[np.float32]:
    """Latest loss, discounted by how steady the sample's fit is: ``loss * (m / (m + M))**2``.

    ``m`` is the sample's :func:`loss_movement` and ``M`` the median movement over the samples
    that have one. A sample that moves as much as the typical one keeps a quarter of its loss,
    one that moves much more keeps nearly all of it, and one whose loss is high and steady (a
    wrong label, an outlier) keeps almost none: high loss alone no longer earns a place.
    Samples without two recorded epochs keep their loss (and NaN, never scored, stays NaN,
    which :func:`select_top` ranks first).

    Args:
        importance: per-sample latest loss (NaN: never scored).
        movement: per-sample movement (NaN: fewer than two recorded epochs).

    Returns:
        The score per sample, float32.
    """
    known = movement[~np.isnan(movement)]
    # The median of an evenly strided sample: deterministic, and O(1) in N past 2^17 samples.
    step = max(1, known.size >> 17)
    ref = float(np.median(known[::step])) if known.size else 0.0
    score = importance.copy()
    if ref <= 0.0:  # nothing moves (or nothing known): the loss alone ranks
        return score
    has = ~np.isnan(movement)
    m = movement[has]
    factor = m / (m + np.float32(ref))
    score[has] *= factor * factor
    return score


def select_learnable(
    score: NDArray[np.float32], keep: int, explore: float, rng: np.random.Generator
) -> tuple[NDArray[np.int64], NDArray[np.float32], float]:
    """``keep`` samples: about ``explore * keep`` drawn at random, the rest the best by score.

    The random share refreshes the statistics of samples the score leaves out (a pruned
    sample's loss and movement are only as new as its last training) and keeps the model from
    forgetting them. Every weight is 1: the selection is biased on purpose, towards samples that
    are still being learned and away from steady high-loss ones.

    Args:
        score: per-sample :func:`learnable_score`.
        keep: how many samples to select, clipped to ``[0, len(score)]``.
        explore: expected share of ``keep`` drawn uniformly at random, in ``[0, 1]``.
        rng: draws the random share and breaks ties at the cut.

    Returns:
        Selected ids in ascending order (int64, no repeats), float32 weights (ones), and the
        score at the cut as :func:`select_top` reports it.
    """
    n = score.size
    keep = min(max(int(keep), 0), n)
    drawn = rng.random(n, dtype=np.float32) < np.float32(explore * keep / n)
    if int(np.count_nonzero(drawn)) > keep:  # a draw beyond keep (tiny n): trim at random
        extra = rng.choice(np.flatnonzero(drawn), int(np.count_nonzero(drawn)) - keep, False)
        drawn[extra] = False
    rest = score.copy()
    rest[drawn] = -np.inf  # below every score, NaN included (select_top ranks NaN first)
    top, cut = select_top(rest, keep - int(np.count_nonzero(drawn)), rng)
    top |= drawn
    ids = np.flatnonzero(top).astype(np.int64)
    return ids, np.ones(ids.size, dtype=np.float32), cut
