"""What ``loaderd stats --plot`` draws: the importance engine's histograms, and the figure.

The daemon side (:func:`histograms`) bins the per-sample loss variances and importances in
numpy and sends bin counts and edges, never N floats. The client side (:func:`plot`) draws,
per job, the variance histogram split into the two fluctuation groups and the importance
histogram split at the keep threshold. matplotlib is imported only there: it is optional
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


def _split_hist(
    values: NDArray[np.floating], threshold: float | None, bins: int, *, log: bool
) -> dict[str, Any]:
    """Counts below / at-or-above ``threshold`` on shared edges (geometric when ``log``)."""
    v = values[np.isfinite(values)]
    out: dict[str, Any] = {"count": int(v.size), "unknown": int(values.size - v.size)}
    if log:
        out["zeros"] = int(np.count_nonzero(v <= 0))
        v = v[v > 0]
    if v.size == 0:
        return {**out, "edges": [], "low": [], "high": [], "log": log}
    lo, hi = float(v.min()), float(v.max())
    if log:  # a few near-zero variances would stretch the axis over 15 decades: clip them
        lo = max(lo, float(np.quantile(v, 0.002)))
        v = np.maximum(v, lo)
    if lo == hi:
        lo, hi = (lo / 2, hi * 2) if log else (lo - 0.5, hi + 0.5)
    edges = np.geomspace(lo, hi, bins + 1) if log else np.linspace(lo, hi, bins + 1)
    thr = -math.inf if threshold is None or math.isnan(threshold) else threshold
    low, _ = np.histogram(v[v < thr], edges)
    high, _ = np.histogram(v[v >= thr], edges)
    return {
        **out,
        "edges": edges.tolist(),
        "low": low.tolist(),
        "high": high.tolist(),
        "log": log,
    }


def histograms(engine: ImportanceEngine, bins: int = DEFAULT_BINS) -> dict[str, Any]:
    """Bin one job's loss variances and importances for the plot (JSON-ready, O(bins) size).

    Args:
        engine: the job's importance engine.
        bins: bins per histogram.

    Returns:
        ``variance``: geometric bins of the variances at the last re-classification, counts of
        the ``low`` and ``high`` fluctuation groups per bin (samples without history are counted
        in ``unknown``, zero variances in ``zeros``), and ``threshold``; ``importance``: linear
        bins of the current importance, counts below (``low``) and at or above (``high``) the
        keep threshold of the latest selection, and ``threshold`` (None when nothing was cut).
    """
    stats = engine.stats()
    var_thr = stats["variance_threshold"]
    keep_thr = stats["keep_threshold"]
    var_thr_f = float(var_thr) if isinstance(var_thr, int | float) else None
    keep_thr_f = float(keep_thr) if isinstance(keep_thr, int | float) else None
    variance = _split_hist(engine.variances(), var_thr_f, bins, log=True)
    importance = _split_hist(engine.importance(), keep_thr_f, bins, log=False)
    return {
        "variance": {**variance, "threshold": var_thr_f},
        "importance": {**importance, "threshold": keep_thr_f},
    }


def plot(stats: dict[str, Any], path: Path) -> int:
    """Draw every job's histograms from a detailed STATS reply into one PNG.

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
    fig, axes = plt.subplots(len(jobs), 2, figsize=(12, 3.8 * len(jobs)), squeeze=False)
    for row, (name, job) in zip(axes, jobs.items(), strict=True):
        imp, detail = job["importance"], job["importance_detail"]
        title = f"job {name}: {imp['sampler']}, epoch {imp['epoch']}, {imp['phase']}"
        _draw(
            row[0],
            detail["variance"],
            f"{title}\nloss variance: {imp['high_group']:,} high / {imp['low_group']:,} low "
            f"(2-means split, groups of epoch {imp['groups_epoch']})",
            "loss variance over the last K epochs (log scale)",
            ("low fluctuation", "high fluctuation"),
            "split",
        )
        kept = imp.get("kept_fraction")
        _draw(
            row[1],
            detail["importance"],
            f"{title}\nimportance (latest loss): "
            + (f"kept {kept:.0%} in epoch {imp['selected_epoch']}" if kept else "nothing selected"),
            "importance (latest loss per sample)",
            ("below the cut", "kept (at or above the cut)"),
            "keep threshold",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    logger.info("wrote %s (%d jobs)", path, len(jobs))
    return len(jobs)


def _draw(
    ax: Any,
    h: dict[str, Any],
    title: str,
    xlabel: str,
    labels: tuple[str, str],
    line: str,
) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("samples")
    edges = np.asarray(h["edges"], dtype=np.float64)
    if edges.size < 2:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        return
    widths = np.diff(edges)
    low, high = np.asarray(h["low"]), np.asarray(h["high"])
    ax.bar(edges[:-1], low, widths, align="edge", color="tab:blue", alpha=0.8, label=labels[0])
    ax.bar(
        edges[:-1],
        high,
        widths,
        bottom=low,
        align="edge",
        color="tab:orange",
        alpha=0.8,
        label=labels[1],
    )
    if h["log"]:
        ax.set_xscale("log")
    if h.get("threshold") is not None and math.isfinite(h["threshold"]):
        ax.axvline(
            h["threshold"], color="black", ls="--", lw=1.2, label=f"{line} {h['threshold']:.3g}"
        )
    notes = [f"{h[k]:,} {k}" for k in ("unknown", "zeros") if h.get(k)]
    if notes:  # in the label, where it cannot cover a bar or the threshold line
        ax.set_xlabel(f"{xlabel}; not shown: {', '.join(notes)}")
    ax.legend(fontsize=8, loc="best", framealpha=0.9)
    ax.grid(alpha=0.25)
