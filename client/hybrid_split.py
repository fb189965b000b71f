"""How the hybrid trainer divides work (seed 000): the split ratio and the batch slices.

The seed times M batches on each replica and gives the CPU the share R = T_G / (T_C + T_G) of
every batch, so both finish an iteration together. Here T is measured per sample over the last
interval, from the parts each replica really trained: if time grows linearly with the batch,
that is the seed's rule exactly, and if it does not (a GPU's fixed launch cost), the rule's
fixed point is still the split at which both replicas take equally long, because there
R·T_C(share) = (1 - R)·T_G(share) makes the per-sample formula return R itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


def ratio_from_times(first_s_per_sample: float, second_s_per_sample: float) -> float:
    """The first replica's share of a batch, R = T_2 / (T_1 + T_2) (per-sample times).

    Args:
        first_s_per_sample: seconds per sample on the first replica (the seed's CPU).
        second_s_per_sample: seconds per sample on the second replica (the seed's GPU).

    Raises:
        ValueError: a time is not positive.
    """
    if not first_s_per_sample > 0 or not second_s_per_sample > 0:
        raise ValueError(
            f"per-sample times must be positive, got {first_s_per_sample} and {second_s_per_sample}"
        )
    return second_s_per_sample / (first_s_per_sample + second_s_per_sample)


def split_sizes(batch_size: int, ratio: float, min_part: int = 1) -> tuple[int, int]:
    """Samples for (first, second) replica: ``round(batch_size * ratio)`` and the rest.

    A part smaller than ``min_part`` (e.g. 2 for BatchNorm, which cannot train on one sample)
    is not worth a replica's fixed cost: the whole batch then goes to the replica with the
    larger share, and the other sits this iteration out.

    Args:
        batch_size: samples in the batch (>= 0).
        ratio: the first replica's share, in [0, 1].
        min_part: the smallest part a replica is given (>= 1).
    """
    if batch_size < 0:
        raise ValueError(f"`batch_size` must be >= 0, got {batch_size}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"`ratio` must be in [0, 1], got {ratio}")
    if min_part < 1:
        raise ValueError(f"`min_part` must be >= 1, got {min_part}")
    first = round(batch_size * ratio)
    if min(first, batch_size - first) < min_part:
        first = batch_size if ratio > 0.5 else 0
    return first, batch_size - first


@dataclass
class SplitMeter:
    """Measured seconds per sample of both replicas, and the split ratio they imply.

    Each interval of ``every`` iterations adds up each replica's busy seconds and samples; at
    its end a replica that trained anything gets a new per-sample time (one that sat the
    interval out keeps its last one) and the ratio is recomputed from both.

    Args:
        every: iterations per measuring interval (the seed's M).
        ratio: the ratio used until both replicas have been measured.
    """

    every: int
    ratio: float = 0.5
    s_per_sample: list[float | None] = field(default_factory=lambda: [None, None])
    _seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _samples: list[int] = field(default_factory=lambda: [0, 0])
    _iterations: int = 0

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"`measure_every` must be >= 1, got {self.every}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"`initial_ratio` must be in [0, 1], got {self.ratio}")

    def record(self, seconds: tuple[float, float], samples: tuple[int, int]) -> bool:
        """Add one iteration's busy seconds and samples; True when the ratio was updated."""
        for i in (0, 1):
            self._seconds[i] += seconds[i]
            self._samples[i] += samples[i]
        self._iterations += 1
        if self._iterations < self.every:
            return False
        for i in (0, 1):
            if self._samples[i] > 0 and self._seconds[i] > 0:
                self.s_per_sample[i] = self._seconds[i] / self._samples[i]
        self._seconds, self._samples, self._iterations = [0.0, 0.0], [0, 0], 0
        first, second = self.s_per_sample
        if first is None or second is None:
            # One replica has never trained (the start ratio gave it nothing): let it try a
            # share, or it would never be measured.
            self.ratio = min(max(self.ratio, 0.1), 0.9)
            return False
        self.ratio = ratio_from_times(first, second)
        return True


def batch_length(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (searched depth-first).

    Raises:
        ValueError: the batch holds no tensor with a first dimension.
    """
    n = _first_dim(batch)
    if n is None:
        raise ValueError(f"a batch needs a tensor to split, got {type(batch).__name__}")
    return n


def _first_dim(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(batch, (Mapping, list, tuple)):
        for value in values:
            n = _first_dim(value)
            if n is not None:
                return n
    return None


def slice_batch(batch: Any, start: int, stop: int, length: int) -> Any:
    """Samples ``start:stop`` of a batch of ``length`` samples.

    Tensors and per-sample lists are cut along their first dimension, dicts, tuples and lists
    of them recursively; anything else (a scalar, a list of another length) is passed as it
    is. Tensors come back as views.
    """
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() and batch.shape[0] == length else batch
    if isinstance(batch, Mapping):
        return {k: slice_batch(v, start, stop, length) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        if any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in batch):
            parts = [slice_batch(v, start, stop, length) for v in batch]
            return tuple(parts) if isinstance(batch, tuple) else parts
        return batch[start:stop] if len(batch) == length else batch  # e.g. a list of bytes
    return batch


def batch_to(batch: Any, device: torch.device) -> Any:
    """The batch with its tensors on ``device`` (no copy for those already there)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: batch_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in batch):
        moved = [batch_to(v, device) for v in batch]
        return tuple(moved) if isinstance(batch, tuple) else moved
    return batch
