"""The importance engine (seed 002): loss history -> variance -> two groups -> ranked selection.

Per job and per sample the engine keeps the losses of the last K epochs (a ``[K, N]`` float32
ring, NaN where nothing was recorded), the latest loss and a feedback count. Epochs ``0..K-1``
are the classification phase: every sample, weight 1. At epoch K, and again every K epochs, each
sample's loss variance over the previous K epochs is split into two clusters by an exact 1-D
two-means; the cluster with the larger mean is the high-fluctuation group, which the client
re-scores with a forward pass before each selection while the low group keeps its latest
training loss. The top ``keep_fraction`` by importance is trained (or drawn, or pruned softly,
depending on the sampler).

Everything is vectorised numpy with no sockets and no threads: the daemon owns the locking, the
planning (shuffle and split over ranks) and the persistence of :meth:`state_dict`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from loaderd.samplers import (
    draw_unbiased,
    learnable_score,
    loss_movement,
    loss_variance,
    select_infobatch,
    select_learnable,
    select_top,
    split_sorted,
)

logger = logging.getLogger(__name__)

__all__ = ["RESCORE_COST", "SAMPLERS", "ImportanceConfig", "ImportanceEngine"]

SAMPLERS = ("uniform", "learnable", "importance", "unbiased", "infobatch")
# A re-score forward pass, in training sample-steps: a backward costs about two forwards.
RESCORE_COST = 1 / 3
_KINDS = ("train", "rescore")
_MAX_EPOCH = 2**31 - 2  # epochs are stored as int32 per sample; -1 means "never"
_MAX_WINDOW = 64  # the history is [window, N] float32: a bound on what one option can allocate
_STATE_FORMAT = 2


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass, but `warmup_epochs=True` is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"`{name}` must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}")


def _check_fraction(name: str, value: object, *, zero_ok: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"`{name}` must be a number, got {value!r}")
    v = float(value)
    low_ok = v >= 0.0 if zero_ok else v > 0.0
    if not (math.isfinite(v) and low_ok and v <= 1.0):
        interval = "[0, 1]" if zero_ok else "(0, 1]"
        raise ValueError(f"`{name}` must be in {interval}, got {value!r}")
    return v


@dataclass(frozen=True, kw_only=True, slots=True)
class ImportanceConfig:
    """How one job chooses its samples each epoch.

    The default trains every sample every epoch (``uniform``) and still keeps the statistics;
    ``sampler="learnable", budget=0.5, epochs=E`` is the measured way to spend half the
    sample-steps of ``E`` full epochs (``benchmarks/results/importance.md``). Options left at
    None take the sampler's own default.

    Attributes:
        sampler: ``"uniform"`` (every sample, statistics still tracked), ``"learnable"`` (the
            samples still being learned: high loss that moves, see
            :func:`loaderd.samplers.learnable_score`, plus a random share), ``"importance"``
            (the seed's hard top-k of the latest loss), ``"unbiased"`` (draw ∝ importance,
            weighted by 1/(N·p)) or ``"infobatch"`` (top-k plus an up-weighted random share of
            the rest).
        warmup_epochs: K, the classification phase length and the re-classification period
            (None: 0 for ``learnable``, 3 for the others).
        window: epochs of loss history kept per sample, from which its variance and movement
            are computed (None: 2 for ``learnable``, else K within [1, 64]). With fewer than 2
            no sample has two losses in its window, so all land in the high group and none has
            a movement.
        keep_fraction: share of the dataset trained per epoch after the warm-up, in (0, 1];
            ignored when ``budget`` is set.
        budget: share of the sample-steps of ``epochs`` full epochs the whole job may spend, in
            (0, 1] (needs ``epochs``). Warm-up and annealing epochs train everything; the other
            epochs share the rest evenly, each less its re-score forwards (counted at
            :data:`RESCORE_COST` of a training step).
        rescore: re-score the high group by a forward pass before each selection; without it the
            latest training loss stands for everyone (None: off for ``learnable``, which
            explores instead, on for the others).
        mix: ``unbiased`` only: share of the uniform distribution in the draw probability, in
            [0, 1]; every weight is at most ``1 / mix``.
        prune_keep_prob: ``infobatch`` only: share of the samples below the cut that are kept
            anyway, each weighted by about ``1 / prune_keep_prob``; in (0, 1].
        explore: ``learnable`` only: expected share of each epoch's selection drawn uniformly at
            random (weight 1), which keeps every sample's statistics fresh; in [0, 1].
        anneal_epochs: train on every sample in the last ``anneal_epochs`` epochs (needs
            ``epochs``); applies to every sampler but ``uniform``, which trains on all anyway.
        epochs: total epochs of the job, when known; used for ``budget`` and annealing.
    """

    sampler: str = "uniform"
    warmup_epochs: int | None = None
    window: int | None = None
    keep_fraction: float = 0.7
    budget: float | None = None
    rescore: bool | None = None
    mix: float = 0.3
    prune_keep_prob: float = 0.5
    explore: float = 0.3
    anneal_epochs: int = 0
    epochs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampler, str) or self.sampler not in SAMPLERS:
            raise ValueError(
                f"`sampler` must be one of {', '.join(SAMPLERS)}; got {self.sampler!r}"
            )
        if self.warmup_epochs is not None:
            _check_int("warmup_epochs", self.warmup_epochs, 0)
            if self.warmup_epochs > _MAX_EPOCH:
                raise ValueError(
                    f"`warmup_epochs` must be <= {_MAX_EPOCH}, got {self.warmup_epochs}"
                )
        if self.window is not None:
            _check_int("window", self.window, 1)
            if self.window > _MAX_WINDOW:
                raise ValueError(f"`window` must be <= {_MAX_WINDOW}, got {self.window}")
        # JSON sends 1 for 1.0: store floats as floats so equality and repr stay predictable.
        fractions = (
            ("keep_fraction", False),
            ("mix", True),
            ("prune_keep_prob", False),
            ("explore", True),
        )
        for name, zero_ok in fractions:
            object.__setattr__(
                self, name, _check_fraction(name, getattr(self, name), zero_ok=zero_ok)
            )
        if self.rescore is not None and not isinstance(self.rescore, bool):
            raise ValueError(f"`rescore` must be true or false, got {self.rescore!r}")
        _check_int("anneal_epochs", self.anneal_epochs, 0)
        if self.epochs is not None:
            _check_int("epochs", self.epochs, 1)
        for name, value in (("anneal_epochs", self.anneal_epochs), ("budget", self.budget)):
            if value and self.epochs is None:
                raise ValueError(f"`{name}` needs `epochs` (the job's total epochs)")
        if self.anneal_epochs > 0 and self.epochs is not None and self.anneal_epochs > self.epochs:
            raise ValueError(
                f"`anneal_epochs` ({self.anneal_epochs}) must not exceed `epochs` ({self.epochs})"
            )
        if self.budget is not None and self.rescoring and self.history < 2:
            raise ValueError(
                "`rescore` with a `window` under 2 epochs re-scores every sample every epoch, "
                "which no `budget` can pay for: set window >= 2 or rescore false"
            )
        if self.budget is not None:
            budget = _check_fraction("budget", self.budget, zero_ok=False)
            object.__setattr__(self, "budget", budget)
            assert self.epochs is not None
            full = min(self.warmup + self.anneal_epochs, self.epochs)
            if full < self.epochs and budget * self.epochs <= full:
                raise ValueError(
                    f"`budget` {budget:g} of {self.epochs} epochs is {budget * self.epochs:g} "
                    f"epochs of data, but warm-up ({self.warmup}) and annealing "
                    f"({self.anneal_epochs}) alone train {full}: raise the budget or lower them"
                )

    @classmethod
    def from_options(
        cls, options: Mapping[str, object], defaults: ImportanceConfig
    ) -> ImportanceConfig:
        """Apply a job's options (decoded JSON) over the daemon-wide defaults.

        Args:
            options: field name -> value, as a client sent them.
            defaults: the daemon's configuration, used for every field not in ``options``.

        Returns:
            The job's validated configuration.

        Raises:
            ValueError: naming the unknown keys, or the field whose value is invalid.
        """
        if not isinstance(options, Mapping):
            raise ValueError(f"importance options must be an object, got {type(options).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in options if k not in names)
        if unknown:
            raise ValueError(
                f"unknown importance option(s) {', '.join(unknown)}; known: {', '.join(names)}"
            )
        changes: dict[str, Any] = dict(options)
        return dataclasses.replace(defaults, **changes)

    @property
    def warmup(self) -> int:
        """K: ``warmup_epochs``, or the sampler's default."""
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        return 0 if self.sampler == "learnable" else 3

    @property
    def history(self) -> int:
        """Epochs of loss history kept per sample (and the re-classification period)."""
        if self.window is not None:
            return self.window
        if self.sampler == "learnable":
            return 2
        return min(max(self.warmup, 1), _MAX_WINDOW)  # a long warm-up does not size the ring

    @property
    def rescoring(self) -> bool:
        """Whether the high group is re-scored: ``rescore``, or the sampler's default."""
        return self.rescore if self.rescore is not None else self.sampler != "learnable"


def _check_epoch(epoch: object) -> int:
    _check_int("epoch", epoch, 0)
    assert isinstance(epoch, int)
    if epoch > _MAX_EPOCH:
        raise ValueError(f"`epoch` must be <= {_MAX_EPOCH}, got {epoch}")
    return epoch


class ImportanceEngine:
    """One job's loss history, fluctuation groups and per-epoch selection.

    Not thread-safe: the daemon serialises calls per job.

    Args:
        num_samples: N, the dataset size; ids are ``0 .. N-1``.
        config: the job's validated configuration.

    Raises:
        ValueError: if ``num_samples`` is not a positive integer.
    """

    def __init__(self, num_samples: int, config: ImportanceConfig) -> None:
        _check_int("num_samples", num_samples, 1)
        self._n = num_samples
        self._config = config
        h = config.history
        self._ring = np.full((h, num_samples), np.nan, dtype=np.float32)
        # Each sample keeps its own last h epochs of loss (row = its epoch count mod h), so a
        # sample left out of training keeps the history it had instead of looking unknown.
        self._slots = np.zeros(num_samples, dtype=np.int32)  # epochs recorded per sample
        self._last_loss = np.full(num_samples, np.nan, dtype=np.float32)
        self._last_epoch = np.full(num_samples, -1, dtype=np.int32)
        self._count = np.zeros(num_samples, dtype=np.int32)
        self._rescored_epoch = np.full(num_samples, -1, dtype=np.int32)
        self._high = np.zeros(num_samples, dtype=np.bool_)
        self._variance = np.full(num_samples, np.nan, dtype=np.float32)
        self._split = np.array([np.inf, np.nan, np.nan])  # threshold, low mean, high mean
        self._groups_epoch = -1
        self._epoch = -1
        self._feedback = 0
        self._rescore_feedback = 0
        self._selected_epoch = -1
        self._all: tuple[NDArray[np.int64], NDArray[np.float32]] | None = None
        self._selected = 0
        self._keep_threshold = np.nan

    @property
    def num_samples(self) -> int:
        """N, the dataset size."""
        return self._n

    @property
    def config(self) -> ImportanceConfig:
        """The job's configuration."""
        return self._config

    def phase(self, epoch: int) -> str:
        """Return ``"classify"`` for the first K epochs, ``"select"`` after them."""
        return "classify" if _check_epoch(epoch) < self._config.warmup else "select"

    def record(
        self,
        ids: NDArray[np.integer],
        losses: NDArray[np.floating],
        epoch: int,
        kind: str = "train",
    ) -> None:
        """Ingest per-sample losses from training (or re-scoring) feedback.

        Feedback for an epoch older than a sample's latest loss does not replace that loss nor
        its history; it only updates the count.

        Args:
            ids: 1-D integer sample ids in ``[0, N)``; a repeated id keeps its last loss.
            losses: 1-D losses aligned with ``ids``; must be finite in float32.
            epoch: the epoch the losses were measured in.
            kind: ``"train"`` for losses of trained samples, ``"rescore"`` for the forward-only
                pass over the high group, which becomes their importance for ``epoch``.

        Raises:
            ValueError: naming the argument and, for ids and losses, the first bad entry.
        """
        if kind not in _KINDS:
            raise ValueError(f"`kind` must be one of {', '.join(_KINDS)}; got {kind!r}")
        epoch = _check_epoch(epoch)
        ids_in = np.asarray(ids)
        losses_in = np.asarray(losses)
        if ids_in.ndim != 1 or losses_in.ndim != 1 or ids_in.size != losses_in.size:
            raise ValueError(
                f"`ids` and `losses` must be 1-D and aligned, got shapes {ids_in.shape} and "
                f"{losses_in.shape}"
            )
        if ids_in.size == 0:
            return
        if ids_in.dtype.kind not in "iu":
            raise ValueError(f"`ids` must be integers, got dtype {ids_in.dtype}")
        if losses_in.dtype.kind not in "fiu":
            raise ValueError(f"`losses` must be numbers, got dtype {losses_in.dtype}")
        if ids_in.min() < 0 or ids_in.max() >= self._n:
            i = int(np.argmax((ids_in < 0) | (ids_in >= self._n)))
            raise ValueError(f"`ids[{i}]` = {ids_in[i]} is outside [0, {self._n})")
        with np.errstate(over="ignore"):  # overflow shows up as inf, refused just below
            loss = losses_in.astype(np.float32)
        finite = np.isfinite(loss)
        if not finite.all():
            i = int(np.argmin(finite))
            raise ValueError(
                f"`losses[{i}]` = {float(losses_in[i])} (id {ids_in[i]}) is not finite in float32"
            )
        idx = ids_in.astype(np.intp, copy=False)

        # Re-classify before this epoch's feedback can overwrite history the grouping needs.
        self._ensure_groups(epoch)
        last = self._last_epoch[idx]
        fresh = last < epoch  # a new epoch for the sample takes the next row of its ring
        current = fresh | (last == epoch)  # feedback for an older epoch never rewrites history
        idx_c, loss_c = (idx, loss) if current.all() else (idx[current], loss[current])
        slots = self._slots[idx_c] + fresh[current]
        self._ring[(slots - 1) % self._config.history, idx_c] = loss_c
        self._slots[idx_c] = slots

        newer = self._last_epoch[idx] <= epoch
        if not newer.all():
            idx_new, loss_new = idx[newer], loss[newer]
        else:
            idx_new, loss_new = idx, loss
        self._last_loss[idx_new] = loss_new
        self._last_epoch[idx_new] = epoch
        if kind == "rescore":
            self._rescored_epoch[idx_new] = epoch
            self._rescore_feedback += idx.size
        else:
            self._feedback += idx.size

        # Fancy `+=` counts a repeated id once (and np.add.at is slow), so count runs of equal
        # ids in the sorted batch when it repeats one: a 65536-batch over 10M ids usually does.
        ordered = np.sort(idx)
        new_run = ordered[1:] != ordered[:-1]
        if new_run.all():
            self._count[idx] += 1
        else:
            starts = np.flatnonzero(np.concatenate(([True], new_run)))
            runs = np.diff(starts, append=idx.size).astype(np.int32)
            self._count[ordered[starts]] += runs
        self._epoch = max(self._epoch, epoch)

    def rescore_ids(self, epoch: int) -> NDArray[np.int64]:
        """Ids to re-score by a forward pass before ``epoch``'s selection.

        Args:
            epoch: the epoch about to be selected.

        Returns:
            The high-fluctuation group as sorted int64 ids; empty in the classification phase,
            when ``rescore`` is off, for the ``uniform`` sampler, and in annealing epochs (where
            everything is trained anyway).
        """
        if not self.plans_from_losses(epoch, "rescore"):
            return np.empty(0, dtype=np.int64)
        self._ensure_groups(epoch)
        return np.flatnonzero(self._high).astype(np.int64)

    def plans_from_losses(self, epoch: int, phase: str) -> bool:
        """Whether ``epoch``'s ``phase`` pass is planned from recorded losses (known beforehand).

        Such a plan must wait for every rank's losses of the epoch before it: made as soon as
        the first rank asks, it would depend on whose feedback happened to arrive first.
        """
        epoch = _check_epoch(epoch)
        if phase == "train":
            return not self.selects_all(epoch)
        cfg = self._config
        return (
            cfg.rescoring
            and cfg.sampler != "uniform"
            and epoch >= cfg.warmup
            and not self._annealing(epoch)
        )

    def selects_all(self, epoch: int) -> bool:
        """Whether ``epoch`` trains every sample (known before it is planned)."""
        cfg = self._config
        return cfg.sampler == "uniform" or epoch < cfg.warmup or self._annealing(epoch)

    def select(self, epoch: int, seed: int) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
        """Choose ``epoch``'s samples and their loss weights.

        A deterministic function of ``(seed, epoch, state)``: randomness (ties at the cut, the
        unbiased draw, InfoBatch's kept share) comes from a generator seeded with both.

        Args:
            epoch: the epoch to plan.
            seed: the job's non-negative seed.

        Returns:
            Sample ids (int64, ascending, repeated for multiple ``unbiased`` draws) and float32
            weights aligned with them. Not shuffled: the planner shuffles and splits over ranks.

        Raises:
            ValueError: if ``epoch`` or ``seed`` is not a non-negative integer.
        """
        epoch = _check_epoch(epoch)
        _check_int("seed", seed, 0)
        cfg = self._config
        self._epoch = max(self._epoch, epoch)
        self._ensure_groups(epoch)
        cut = -np.inf
        if self.selects_all(epoch):
            ids, weights = self._every_sample()
        else:
            rng = np.random.default_rng([seed, epoch])
            keep = self._keep_count()
            if cfg.rescoring:
                missing = int(np.count_nonzero(self._high & (self._rescored_epoch != epoch)))
                if missing:
                    logger.debug(
                        "epoch %d: %d high-fluctuation samples not re-scored; latest loss stands",
                        epoch,
                        missing,
                    )
            if cfg.sampler == "learnable":
                ids, weights, cut = select_learnable(self._score(), keep, cfg.explore, rng)
            elif cfg.sampler == "importance":
                mask, cut = select_top(self._last_loss, keep, rng)
                ids = np.flatnonzero(mask).astype(np.int64)
                weights = np.ones(ids.size, dtype=np.float32)
            elif cfg.sampler == "unbiased":
                ids, weights = draw_unbiased(self._last_loss, keep, cfg.mix, rng)
                cut = np.nan
            else:
                top, share = keep, cfg.prune_keep_prob
                if cfg.budget is not None:  # the budget pays for the top and the random share
                    free = (keep - share * self._n) / (1.0 - share) if share < 1.0 else 0.0
                    top = max(0, round(free))
                    share = share if top > 0 else min(share, keep / self._n)
                ids, weights, cut = select_infobatch(self._last_loss, top, share, rng)
        self.selected(epoch, int(ids.size), cut)
        logger.debug("epoch %d: selected %d of %d samples", epoch, ids.size, self._n)
        return ids, weights

    def _every_sample(self) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
        """The selection of an epoch that trains every sample: one read-only pair, made once.

        Made anew, its 12 bytes a sample were fresh memory at every such epoch's start.
        """
        if self._all is None:
            ids = np.arange(self._n, dtype=np.int64)
            weights = np.ones(self._n, dtype=np.float32)
            ids.flags.writeable = weights.flags.writeable = False
            self._all = (ids, weights)
        return self._all

    def selected(self, epoch: int, count: int, cut: float) -> None:
        """Leave the state ``select`` leaves, from what it decided (a journal's replay).

        A selection moves the groups to ``epoch`` and records its count and cut; replayed in
        its place among the feedback, it leaves the engine as ``select`` did, without
        choosing again.
        """
        self._epoch = max(self._epoch, epoch)
        self._ensure_groups(epoch)
        self._selected_epoch = epoch
        self._selected = count
        self._keep_threshold = cut

    @property
    def last_selection(self) -> tuple[int, int, float]:
        """(epoch, count, cut) of the latest selection, as ``selected`` takes them."""
        return self._selected_epoch, self._selected, float(self._keep_threshold)

    def _keep_count(self) -> int:
        """How many samples a selecting epoch trains (after its groups are current)."""
        cfg, n = self._config, self._n
        if cfg.budget is None:
            return max(1, round(cfg.keep_fraction * n))
        assert cfg.epochs is not None  # the config checks it
        full = cfg.warmup + cfg.anneal_epochs
        share = cfg.budget
        if cfg.epochs > full:  # the epochs that select share what warm-up and annealing leave
            share = (cfg.budget * cfg.epochs - full) / (cfg.epochs - full)
        rescored = int(np.count_nonzero(self._high)) if cfg.rescoring else 0
        return min(n, max(1, round(share * n - RESCORE_COST * rescored)))

    def _score(self) -> NDArray[np.float32]:
        """Per-sample ranking score of the sampler (the latest loss, or the learnable score)."""
        if self._config.sampler == "learnable":
            return learnable_score(self._last_loss, loss_movement(self._ring))
        return self._last_loss.copy()

    def variances(self) -> NDArray[np.float32]:
        """Per-sample loss variance at the last re-classification (NaN: too little history)."""
        return self._variance.copy()

    def losses(self) -> NDArray[np.float32]:
        """Per-sample latest loss, training or re-score (NaN: never scored)."""
        return self._last_loss.copy()

    def movement(self) -> NDArray[np.float32]:
        """Per-sample spread of ``exp(-loss)`` over its window (NaN: under two epochs).

        See :func:`loaderd.samplers.loss_movement`.
        """
        return loss_movement(self._ring)

    def importance(self) -> NDArray[np.float32]:
        """Per-sample current importance, what the sampler ranks by (NaN: never scored).

        The latest loss, or for ``learnable`` the latest loss discounted by how steady the
        sample's fit is (:func:`loaderd.samplers.learnable_score`).
        """
        return self._score()

    def stats(self, scan: bool = True) -> dict[str, object]:
        """Summarise the engine for ``loaderd stats``; every value is JSON-serialisable.

        Args:
            scan: include the figures that scan every sample (``scan_stats``); without them
                the summary costs O(1).

        Returns:
            ``sampler``, ``phase``, ``epoch``, ``groups_epoch``, ``high_mean_variance``/
            ``low_mean_variance``, ``variance_threshold``, ``selected_epoch``, ``selected``,
            ``kept_fraction``, ``keep_threshold``, ``feedback_samples`` and
            ``rescore_samples``, and with ``scan`` those of ``scan_stats``. Unknown floats are
            ``None``.
        """
        out: dict[str, object] = {
            "sampler": self._config.sampler,
            "phase": self.phase(max(self._epoch, 0)),
            "epoch": self._epoch,
            "num_samples": self._n,
            "groups_epoch": self._groups_epoch,
            "high_mean_variance": _finite(self._split[2]),
            "low_mean_variance": _finite(self._split[1]),
            "variance_threshold": _finite(self._split[0]),
            "selected_epoch": self._selected_epoch,
            "selected": self._selected,
            "kept_fraction": self._selected / self._n if self._selected_epoch >= 0 else None,
            "keep_threshold": _finite(self._keep_threshold),
            "feedback_samples": self._feedback,
            "rescore_samples": self._rescore_feedback,
        }
        if scan:
            out.update(self.scan_stats())
        return out

    def scan_stats(self) -> dict[str, object]:
        """The summary figures that scan every sample (O(samples)).

        Returns:
            ``high_group``/``low_group`` sizes, ``rescored`` (samples re-scored for the latest
            epoch), ``loss_p10``/``loss_p50``/``loss_p90`` over scored samples and
            ``seen_samples``.
        """
        grouped = self._groups_epoch >= 0
        high = int(np.count_nonzero(self._high)) if grouped else 0
        scored = self._last_loss[~np.isnan(self._last_loss)]
        quantiles = np.quantile(scored, [0.1, 0.5, 0.9]) if scored.size else np.full(3, np.nan)
        rescored = (
            int(np.count_nonzero(self._rescored_epoch == self._epoch)) if self._epoch >= 0 else 0
        )
        return {
            "high_group": high,
            "low_group": self._n - high if grouped else 0,
            "rescored": rescored,
            "loss_p10": _finite(quantiles[0]),
            "loss_p50": _finite(quantiles[1]),
            "loss_p90": _finite(quantiles[2]),
            "seen_samples": int(np.count_nonzero(self._count)),
        }

    def _annealing(self, epoch: int) -> bool:
        cfg = self._config
        return (
            cfg.anneal_epochs > 0
            and cfg.epochs is not None
            and epoch >= cfg.epochs - cfg.anneal_epochs
        )

    def _ensure_groups(self, epoch: int) -> None:
        k = self._config.warmup
        if epoch < k:
            return
        period = self._config.history
        at = k + (epoch - k) // period * period  # the latest re-classification epoch <= epoch
        # Groups only move forward: an older epoch's window may already be overwritten.
        if at > self._groups_epoch:
            self._regroup(at)

    def _regroup(self, at: int) -> None:
        """Split samples by the variance of each one's last K recorded epochs of loss."""
        n = self._n
        var, seen = loss_variance(self._ring)
        known = seen >= 2
        known_var = var[known]
        known_var.sort()  # in place: a fresh copy is already in hand, don't let the split copy it
        split = split_sorted(known_var)
        # Too little history means unknown fluctuation: re-score it rather than trust one loss.
        self._high = ~known | (var >= split.threshold)
        self._variance = var
        self._split = np.array([split.threshold, split.low_mean, split.high_mean])
        self._groups_epoch = at
        logger.info(
            "re-classified at epoch %d: %d high-fluctuation (%d without history), %d low",
            at,
            int(np.count_nonzero(self._high)),
            n - int(np.count_nonzero(known)),
            n - int(np.count_nonzero(self._high)),
        )

    def state_dict(self) -> dict[str, NDArray[Any]]:
        """Everything the engine knows, as arrays for ``np.savez`` (copies, safe to write later).

        Returns:
            Arrays by name; :meth:`load_state_dict` accepts exactly this set.
        """
        scalars = {
            "format": _STATE_FORMAT,
            "num_samples": self._n,
            "groups_epoch": self._groups_epoch,
            "epoch": self._epoch,
            "feedback": self._feedback,
            "rescore_feedback": self._rescore_feedback,
            "selected_epoch": self._selected_epoch,
            "selected": self._selected,
        }
        state: dict[str, NDArray[Any]] = {
            k: np.array(v, dtype=np.int64) for k, v in scalars.items()
        }
        state["keep_threshold"] = np.array(self._keep_threshold, dtype=np.float64)
        for name in _STATE_ARRAYS:
            state[name] = getattr(self, "_" + name).copy()
        return state

    def load_state_dict(self, state: Mapping[str, NDArray[Any]]) -> None:
        """Restore a :meth:`state_dict`, e.g. from ``np.load``, after validating all of it.

        Nothing changes unless the whole state is valid.

        Args:
            state: arrays by name, as :meth:`state_dict` returned them.

        Raises:
            ValueError: for missing or unknown keys, a state from another dataset size or history
                length, or an array of the wrong shape or type.
        """
        expected = set(_STATE_ARRAYS) | set(_STATE_SCALARS)
        missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unknown:
            raise ValueError(f"bad importance state: missing {missing}, unknown {unknown}")
        arrays = {k: np.asarray(state[k]) for k in expected}
        for name, kind in _STATE_SCALARS.items():
            if arrays[name].shape != () or arrays[name].dtype.kind not in kind:
                raise ValueError(
                    f"state `{name}` must be a scalar of kind {kind!r}, got shape "
                    f"{arrays[name].shape} dtype {arrays[name].dtype}"
                )
        if int(arrays["format"]) != _STATE_FORMAT:
            raise ValueError(f"state `format` {int(arrays['format'])}, expected {_STATE_FORMAT}")
        if int(arrays["num_samples"]) != self._n:
            raise ValueError(
                f"state is for {int(arrays['num_samples'])} samples, this engine has {self._n}"
            )
        h = self._config.history
        for name, dtype in _STATE_ARRAYS.items():
            want = {"ring": (h, self._n), "split": (3,)}.get(name, (self._n,))
            got = arrays[name]
            if got.shape != want or not np.can_cast(got.dtype, dtype, casting="same_kind"):
                raise ValueError(
                    f"state `{name}` must have shape {want} and dtype {np.dtype(dtype)}, got "
                    f"{got.shape} {got.dtype} (was warmup_epochs changed?)"
                )
        for name, dtype in _STATE_ARRAYS.items():
            setattr(self, "_" + name, arrays[name].astype(dtype, copy=True))
        for name in _STATE_SCALARS:
            if name not in ("format", "num_samples", "keep_threshold"):
                setattr(self, "_" + name, int(arrays[name]))
        self._keep_threshold = float(arrays["keep_threshold"])
        logger.info("loaded importance state: epoch %d, %d samples", self._epoch, self._n)


# Per-sample (and ring) arrays in the persisted state, with their dtypes.
_STATE_ARRAYS: dict[str, type[np.generic]] = {
    "ring": np.float32,
    "slots": np.int32,
    "last_loss": np.float32,
    "last_epoch": np.int32,
    "count": np.int32,
    "rescored_epoch": np.int32,
    "high": np.bool_,
    "variance": np.float32,
    "split": np.float64,
}
# 0-d entries and the dtype kinds they accept.
_STATE_SCALARS = {
    "format": "iu",
    "num_samples": "iu",
    "groups_epoch": "iu",
    "epoch": "iu",
    "feedback": "iu",
    "rescore_feedback": "iu",
    "selected_epoch": "iu",
    "selected": "iu",
    "keep_threshold": "f",
}


def _finite(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None
