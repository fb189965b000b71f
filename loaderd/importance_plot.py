"""What ``loaderd stats --plot`` draws: the importance engine of each job, in three panels.

Why samples are kept or dropped is a question about distributions that a table cannot answer,
and those distributions are skewed (most losses near zero, a thin tail of hard or mislabelled
samples), so the axes go logarithmic where the data is. Per job:

1. the seed's fluctuation groups: the histogram of loss variances with the two-means split;
2. what the sampler ranks by (the latest loss, or the ``learnable`` score), split at the keep
   threshold of the latest selection;
3. a map of latest loss against movement (the spread of ``exp(-loss)``): samples being
   learned move, easy ones sit at low loss, and the noisy tail (mislabelled or unlearnable
   samples) is the steady cluster at high loss. The keep boundary is drawn on it.

The daemon side (:func:`histograms`) bins in numpy and sends bin counts and edges, never N
floats. The client side (:func:`plot`) draws; matplotlib is imported only there: it is optional
(the ``plot`` extra), and the daemon never needs it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from loaderd.client.errors import LoaderdError

if TYPE_CHECKING:
    from loaderd.importance import ImportanceEngine

logger = logging.getLogger(__name__)

__all__ = ["histograms", "plot"]

DEFAULT_BINS = 60
MAP_BINS = (48, 32)  # loss x movement
_FLOOR_QUANTILE = 0.002  # a few near-zero values would stretch a log axis over many decades


def _skewed(v: NDArray[np.floating]) -> bool:
    """Positive values whose tail is an order of magnitude past their median: a log axis."""
    pos = v[v > 0]
    if pos.size < 2 or pos.size < 0.9 * v.size:
        return False
    p50, p99 = np.quantile(pos, [0.5, 0.99])
    return bool(p99 > 10 * p50)


def _edges(v: NDArray[np.floating], bins: int, *, log: bool) -> NDArray[np.float64]:
    lo, hi = float(v.min()), float(v.max())
    if log:
        lo = max(lo, float(np.quantile(v, _FLOOR_QUANTILE)))
    if lo == hi:
        lo, hi = (lo / 2, hi * 2) if log else (lo - 0.5, hi + 0.5)
    return np.geomspace(lo, hi, bins + 1) if log else np.linspace(lo, hi, bins + 1)


def _split_hist(
    values: NDArray[np.floating], threshold: float | None, bins: int, *, log: bool | None
) -> dict[str, Any]:
    """Counts below / at-or-above ``threshold`` on shared edges (geometric when ``log``).

    ``log=None`` chooses: geometric bins when the values are skewed (see :func:`_skewed`).
    """
    v = values[np.isfinite(values)]
    out: dict[str, Any] = {"count": int(v.size), "unknown": int(values.size - v.size)}
    log = _skewed(v) if log is None else log
    if log:
        out["zeros"] = int(np.count_nonzero(v <= 0))
        v = v[v > 0]
    if v.size == 0:
        return {**out, "edges": [], "low": [], "high": [], "log": log}
    edges = _edges(v, bins, log=log)
    v = np.clip(v, edges[0], edges[-1])  # values under a log floor are drawn in the first bin
    thr = -math.inf if threshold is None or math.isnan(threshold) else threshold
    low, _ = np.histogram(v[v < thr], edges)
    high, _ = np.histogram(v[v >= thr], edges)
    return {**out, "edges": edges.tolist(), "low": low.tolist(), "high": high.tolist(), "log": log}


def _loss_movement_map(engine: ImportanceEngine, cut: float | None) -> dict[str, Any]:
    """A 2-D histogram of (latest loss, movement) and what it takes to be kept on it."""
    loss, move = engine.losses(), engine.movement()
    ok = np.isfinite(loss) & np.isfinite(move) & (loss > 0)
    x, y = loss[ok], move[ok]
    sampler = engine.config.sampler
    rule = "learnable" if sampler == "learnable" else "none" if sampler == "unbiased" else "loss"
    out: dict[str, Any] = {
        "unknown": int(loss.size - np.count_nonzero(ok)),
        "rule": rule,
        "cut": cut,
        "reference": None,
    }
    if x.size == 0:
        return {**out, "x_edges": [], "y_edges": [], "counts": [], "x_log": False}
    x_log = _skewed(x)
    x_edges = _edges(x, MAP_BINS[0], log=x_log)
    moving = y[y > 0]
    y_lo = float(np.quantile(moving, _FLOOR_QUANTILE)) if moving.size else 1e-6
    y_hi = float(moving.max()) if moving.size else 1.0
    y_edges = np.geomspace(y_lo, max(y_hi, y_lo * 10), MAP_BINS[1] + 1)
    counts, _, _ = np.histogram2d(
        np.clip(x, x_edges[0], x_edges[-1]), np.clip(y, y_edges[0], y_edges[-1]), [x_edges, y_edges]
    )
    known = move[np.isfinite(move)]
    return {
        **out,
        "x_edges": x_edges.tolist(),
        "y_edges": y_edges.tolist(),
        "counts": counts.astype(np.int64).tolist(),
        "x_log": x_log,
        "steady": int(np.count_nonzero(y <= y_edges[0])),  # drawn on the bottom row
        "reference": float(np.median(known)) if known.size else None,
    }


def histograms(engine: ImportanceEngine, bins: int = DEFAULT_BINS) -> dict[str, Any]:
    """Bin one job's engine for the plot (JSON-ready, O(bins²) size).

    Args:
        engine: the job's importance engine.
        bins: bins per histogram.

    Returns:
        ``variance``: geometric bins of the variances at the last re-classification, counts of
        the ``low`` and ``high`` fluctuation groups per bin (samples without history are counted
        in ``unknown``, zero variances in ``zeros``), and ``threshold``; ``importance``: bins of
        what the sampler ranks by (geometric when skewed), counts below (``low``) and at or
        above (``high``) the keep threshold of the latest selection, and ``threshold`` (None
        when nothing was cut); ``loss_movement``: a 2-D histogram of latest loss against
        movement (``x_edges``, ``y_edges``, ``counts[x][y]``), the keep ``cut``, the ``rule``
        it applies to (``learnable``, ``loss`` or ``none``) and the median movement
        (``reference``) the learnable score divides by.
    """
    stats = engine.stats()
    var_thr, keep_thr = stats["variance_threshold"], stats["keep_threshold"]
    var_thr_f = float(var_thr) if isinstance(var_thr, int | float) else None
    keep_thr_f = float(keep_thr) if isinstance(keep_thr, int | float) else None
    variance = _split_hist(engine.variances(), var_thr_f, bins, log=True)
    importance = _split_hist(engine.importance(), keep_thr_f, bins, log=None)
    return {
        "variance": {**variance, "threshold": var_thr_f},
        "importance": {**importance, "threshold": keep_thr_f},
        "loss_movement": _loss_movement_map(engine, keep_thr_f),
    }


def plot(stats: dict[str, Any], path: Path) -> int:
    """Draw every job's panels from a detailed STATS reply into one image.

    Args:
        stats: a STATS reply asked for with ``{"detail": true}``.
        path: the image to write (format from the suffix, e.g. ``.png``).

    Returns:
        The number of jobs drawn.

    Raises:
        LoaderdError: matplotlib is not installed, or the daemon has no jobs to draw.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise LoaderdError(
            "--plot needs matplotlib: pip install 'loaderd[plot]' (or matplotlib)"
        ) from e
    jobs = {
        name: job for name, job in stats.get("jobs", {}).items() if job.get("importance_detail")
    }
    if not jobs:
        raise LoaderdError("the daemon has no jobs to plot")
    fig, axes = plt.subplots(len(jobs), 3, figsize=(18, 4.4 * len(jobs)), squeeze=False)
    for row, (name, job) in zip(axes, jobs.items(), strict=True):
        imp, detail = job["importance"], job["importance_detail"]
        title = f"job {name}: {imp['sampler']}, epoch {imp['epoch']}, {imp['phase']}"
        _draw_hist(
            row[0],
            detail["variance"],
            f"{title}\nfluctuation: {imp['high_group']:,} high / {imp['low_group']:,} low "
            f"(2-means split, groups of epoch {imp['groups_epoch']})",
            "loss variance over the last K epochs",
            ("low fluctuation", "high fluctuation"),
            "split",
        )
        kept = imp.get("kept_fraction")
        what = "learnable score" if imp["sampler"] == "learnable" else "latest loss"
        _draw_hist(
            row[1],
            detail["importance"],
            f"ranked by the {what}: "
            + (f"{kept:.0%} kept for epoch {imp['selected_epoch']}" if kept else "nothing selected")
            + ("\n(plus a random share below the cut)" if imp["sampler"] == "learnable" else ""),
            what,
            ("below the cut", "at or above the cut"),
            "keep threshold",
        )
        if "loss_movement" in detail:
            _draw_map(row[2], detail["loss_movement"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    logger.info("wrote %s (%d jobs)", path, len(jobs))
    return len(jobs)


def _draw_hist(
    ax: Any,
    h: dict[str, Any],
    title: str,
    xlabel: str,
    labels: tuple[str, str],
    line: str,
) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("samples")
    edges = np.asarray(h["edges"], dtype=np.float64)
    if edges.size < 2:
        ax.set_xlabel(xlabel)
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        return
    widths = np.diff(edges)
    low, high = np.asarray(h["low"]), np.asarray(h["high"])
    ax.bar(edges[:-1], low, widths, align="edge", color="tab:blue", alpha=0.75, label=labels[0])
    ax.bar(edges[:-1], high, widths, align="edge", color="tab:orange", alpha=0.75, label=labels[1])
    counts = np.concatenate([low, high])
    nonzero = counts[counts > 0]
    if nonzero.size and nonzero.max() > 100 * nonzero.min():  # a thin tail stays visible
        ax.set_yscale("log")
    if h["log"]:
        ax.set_xscale("log")
    if h.get("threshold") is not None and math.isfinite(h["threshold"]):
        ax.axvline(
            h["threshold"], color="black", ls="--", lw=1.4, label=f"{line} {h['threshold']:.3g}"
        )
    notes = [f"{h[k]:,} {k}" for k in ("unknown", "zeros") if h.get(k)]
    scale = " (log scale)" if h["log"] else ""
    # Notes go in the label, where they cannot cover a bar or the threshold line.
    ax.set_xlabel(f"{xlabel}{scale}" + (f"; not shown: {', '.join(notes)}" if notes else ""))
    ax.legend(fontsize=8, loc="best", framealpha=0.9)
    ax.grid(alpha=0.25)


def _draw_map(ax: Any, m: dict[str, Any]) -> None:
    from matplotlib.colors import LogNorm

    ax.set_title(
        "latest loss against movement: the noisy tail is the steady cluster at high loss",
        fontsize=10,
    )
    x_edges = np.asarray(m["x_edges"], dtype=np.float64)
    if x_edges.size < 2:
        ax.text(0.5, 0.5, "no history yet", ha="center", va="center", transform=ax.transAxes)
        return
    y_edges = np.asarray(m["y_edges"], dtype=np.float64)
    counts = np.asarray(m["counts"], dtype=np.float64)
    mesh = ax.pcolormesh(
        x_edges, y_edges, np.ma.masked_equal(counts.T, 0), norm=LogNorm(), cmap="viridis"
    )
    ax.figure.colorbar(mesh, ax=ax, label="samples")
    ax.set_yscale("log")
    if m["x_log"]:
        ax.set_xscale("log")
    cut, rule = m.get("cut"), m.get("rule")
    if cut is not None and math.isfinite(cut) and rule == "loss":
        ax.axvline(cut, color="red", ls="--", lw=1.5, label=f"keep: loss >= {cut:.3g}")
    elif cut is not None and math.isfinite(cut) and rule == "learnable" and m.get("reference"):
        # score = loss * (m / (m + M))^2 = cut  <=>  loss = cut * (1 + M / m)^2
        y = np.geomspace(y_edges[0], y_edges[-1], 200)
        x = cut * (1 + m["reference"] / y) ** 2
        ax.plot(x, y, color="red", ls="--", lw=1.5, label=f"keep boundary (score {cut:.3g})")
        ax.set_xlim(x_edges[0], x_edges[-1])
    ax.text(
        0.98,
        0.03,
        "high and steady:\nwrong labels, outliers",
        ha="right",
        va="bottom",
        fontsize=8,
        transform=ax.transAxes,
        bbox={"facecolor": "white", "alpha": 0.7, "lw": 0},
    )
    scale = " (log scale)" if m["x_log"] else ""
    ax.set_xlabel(
        f"latest loss{scale}"
        + (f"; not shown: {m['unknown']:,} without two epochs" if m.get("unknown") else "")
    )
    ax.set_ylabel("movement: std of exp(-loss) (log scale)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", framealpha=0.9)
