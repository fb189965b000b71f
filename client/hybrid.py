"""Train one model on the CPU and a GPU at once (seed 000).

A replica on each device, batches split by measured speed, parameters merged every k
iterations and kept in the daemon's arena.

A GPU alone leaves the host's cores idle during training. The seed puts them to work: the CPU
replica takes the share R = T_G / (T_C + T_G) of every batch (``hybrid_split``), both replicas
train their parts in parallel, and every k iterations they are averaged layer by layer,
W = R·W_C + (1 - R)·W_G (``hybrid_merge``), the average replacing both. Each merged model goes
to the daemon as a snapshot from a background thread (``snapshot_sender``), so slow NVRAM
writes never stall training.

The two replicas run on two Python threads: the second device's on the caller's, the first's
on a worker. PyTorch releases the GIL inside its kernels, not in the Python between them, so
the overlap is as good as the model is kernel-heavy (``HybridStats.overlap`` measures it).
Whether the CPU's share pays for the merges and the extra copies is the model's business:
with a modern GPU it rarely does (``benchmarks/results/hybrid.md``).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from loaderd.client.hybrid_merge import merge_replicas
from loaderd.client.hybrid_split import SplitMeter, batch_length, batch_to, slice_batch, split_sizes
from loaderd.client.snapshot_sender import SnapshotSender

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]


@dataclass(frozen=True)
class StepResult:
    """What one iteration did.

    Attributes:
        loss: the batch's mean loss (the parts' means weighted by their sizes).
        losses: per-sample losses in batch order on the CPU, when ``loss_fn`` returns them
            (ready for ``ds.feedback``); None when it returns a scalar.
        split: samples trained by (first, second) replica.
        seconds: busy seconds of each replica: copy in, forward, backward, optimizer step.
        wall_s: seconds of the whole iteration (both parts and the merge, if any).
        ratio: the first replica's share this iteration was split with.
        merged: whether the replicas were merged after it.
    """

    loss: float
    losses: torch.Tensor | None
    split: tuple[int, int]
    seconds: tuple[float, float]
    wall_s: float
    ratio: float
    merged: bool


@dataclass
class HybridStats:
    """Counters since construction.

    Attributes:
        steps: iterations trained.
        merges: merges done.
        samples: samples trained by each replica.
        busy_s: busy seconds of each replica.
        parallel_busy_s: busy seconds of each replica in iterations where both trained.
        parallel_wall_s: wall seconds of those iterations (without merges).
        merge_s: seconds spent merging and copying the snapshot state.
    """

    steps: int = 0
    merges: int = 0
    samples: list[int] = field(default_factory=lambda: [0, 0])
    busy_s: list[float] = field(default_factory=lambda: [0.0, 0.0])
    parallel_busy_s: list[float] = field(default_factory=lambda: [0.0, 0.0])
    parallel_wall_s: float = 0.0
    merge_s: float = 0.0

    @property
    def overlap(self) -> float | None:
        """How much of the shorter part ran hidden behind the longer one, in [0, 1].

        1.0: the two parts ran fully in parallel; 0.0: one after the other (the GIL or the
        cores serialised them). None before an iteration in which both trained.
        """
        shorter = min(self.parallel_busy_s)
        if shorter <= 0:
            return None
        hidden = sum(self.parallel_busy_s) - self.parallel_wall_s
        return min(1.0, max(0.0, hidden / shorter))


class HybridTrainer:
    """Data-parallel training of one model on two devices of one host (seed 000).

    ``model`` itself becomes the replica on ``devices[1]`` (the seed's GPU replica) and a deep
    copy goes to ``devices[0]`` (the CPU replica, which takes the share R of each batch).
    After ``merge()`` both hold the same parameters, buffers and optimizer state.

    Args:
        model: the model to train; moved to ``devices[1]``.
        make_optimizer: builds a replica's optimizer from the replica, e.g.
            ``lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)``.
        loss_fn: ``loss_fn(replica, part)``: the loss of a part of a batch (already on the
            replica's device): a scalar, or per-sample losses ``[n]`` (their mean is
            minimised and they come back in ``StepResult.losses``).
        devices: the (CPU, GPU) devices of the seed; two CPUs stand in for testing.
        merge_every: iterations between merges (the seed's k: 1/20 to 1/10 of an epoch).
        measure_every: iterations per timing interval after which the split is recomputed
            (the seed's M).
        initial_ratio: the first replica's share before both have been timed.
        min_part: the smallest part worth giving a replica; default 2 for models with
            BatchNorm (which cannot train on one sample), else 1.
        snapshots: where merged models go: a ``SnapshotSender`` (the caller's), or a
            ``LoaderdDataset`` (a sender to its daemon and job is made and closed here);
            None keeps no snapshots.
        snapshot_every: merges between snapshots.

    Raises:
        ValueError: an argument is out of range.
        RuntimeError: a CUDA device without CUDA.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: MakeOptimizer,
        loss_fn: LossFn,
        *,
        devices: tuple[str | torch.device, str | torch.device] = ("cpu", "cuda"),
        merge_every: int = 20,
        measure_every: int = 10,
        initial_ratio: float = 0.5,
        min_part: int | None = None,
        snapshots: SnapshotSender | Any | None = None,
        snapshot_every: int = 1,
    ) -> None:
        if len(devices) != 2:
            raise ValueError(f"`devices` must name two devices, got {devices!r}")
        self.devices = (torch.device(devices[0]), torch.device(devices[1]))
        for dev in self.devices:
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(f"device {dev} asked for, but CUDA is not available here")
        if merge_every < 1:
            raise ValueError(f"`merge_every` must be >= 1, got {merge_every}")
        if snapshot_every < 1:
            raise ValueError(f"`snapshot_every` must be >= 1, got {snapshot_every}")
        if min_part is None:
            has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
            min_part = 2 if has_bn else 1
        if min_part < 1:
            raise ValueError(f"`min_part` must be >= 1, got {min_part}")
        self.loss_fn = loss_fn
        self.merge_every, self.min_part, self.snapshot_every = merge_every, min_part, snapshot_every
        self.meter = SplitMeter(measure_every, initial_ratio)
        first = copy.deepcopy(model).to(self.devices[0])
        self.replicas: tuple[nn.Module, nn.Module] = (first, model.to(self.devices[1]))
        self.optimizers = (make_optimizer(self.replicas[0]), make_optimizer(self.replicas[1]))
        self.stats = HybridStats()
        self._since_merge = [0, 0]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loaderd-hybrid")
        self._owns_sender = snapshots is not None and not isinstance(snapshots, SnapshotSender)
        self.snapshots: SnapshotSender | None = (
            SnapshotSender.for_dataset(snapshots) if self._owns_sender else snapshots
        )
        self._closed = False

    @property
    def model(self) -> nn.Module:
        """The replica on ``devices[1]`` (the model passed in); the merged one after merge()."""
        return self.replicas[1]

    @property
    def ratio(self) -> float:
        """The first replica's current share of each batch."""
        return self.meter.ratio

    def step(self, batch: Any) -> StepResult:
        """Train one batch: split it, train both parts in parallel, merge every k iterations.

        Args:
            batch: a tensor, a dict (e.g. a ``LoaderdDataset`` batch), or a tuple or list of
                them; tensors and per-sample lists are split along their first dimension.

        Returns:
            What the iteration did, with the per-sample losses for ``ds.feedback``.
        """
        if self._closed:
            raise RuntimeError("step() on a closed HybridTrainer")
        t0 = time.perf_counter()
        n = batch_length(batch)
        if n == 0:
            raise ValueError("step() got an empty batch")
        ratio = self.meter.ratio
        sizes = split_sizes(n, ratio, self.min_part)
        parts = (slice_batch(batch, 0, sizes[0], n), slice_batch(batch, sizes[0], n, n))
        results: list[tuple[torch.Tensor, float] | None] = [None, None]
        if all(sizes):
            pending: Future[tuple[torch.Tensor, float]] = self._pool.submit(
                self._train_part, 0, parts[0]
            )
            try:
                results[1] = self._train_part(1, parts[1])
            finally:
                results[0] = pending.result()  # never leave the worker training alone
        else:
            i = 0 if sizes[0] else 1
            results[i] = self._train_part(i, parts[i])
        seconds = (results[0][1] if results[0] else 0.0, results[1][1] if results[1] else 0.0)
        parallel_wall = time.perf_counter() - t0
        losses, loss = self._gather_losses(results, sizes)
        self._account(sizes, seconds, parallel_wall)
        merged = self.stats.steps % self.merge_every == 0
        if merged:
            self.merge()
        return StepResult(
            loss=loss,
            losses=losses,
            split=sizes,
            seconds=seconds,
            wall_s=time.perf_counter() - t0,
            ratio=ratio,
            merged=merged,
        )

    def merge(self) -> None:
        """Average the replicas now and send the result as a snapshot.

        The weight of each is the share of the samples it trained since the last merge (R
        while the split stayed put); a snapshot goes every ``snapshot_every`` merges.
        """
        t0 = time.perf_counter()
        total = sum(self._since_merge)
        if total:
            weight = self._since_merge[0] / total
            merge_replicas(*self.replicas, weight, self.optimizers)
            self._since_merge = [0, 0]
            self.stats.merges += 1
            if self.snapshots is not None and self.stats.merges % self.snapshot_every == 0:
                # A copy, because training goes on in place while the sender serialises it.
                state = {
                    k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in self.replicas[0].state_dict().items()
                }
                self.snapshots.submit(state, self.stats.steps)
        self.stats.merge_s += time.perf_counter() - t0

    def close(self) -> None:
        """Stop the worker thread; send the pending snapshot of a sender made here. Safe twice."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        if self._owns_sender and self.snapshots is not None:
            self.snapshots.close()

    def __enter__(self) -> HybridTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the parts ----------------------------------------------------------------------------

    def _train_part(self, i: int, part: Any) -> tuple[torch.Tensor, float]:
        """Train replica ``i`` on its part; (its losses, detached on its device; busy seconds)."""
        t0 = time.perf_counter()
        device, replica, opt = self.devices[i], self.replicas[i], self.optimizers[i]
        replica.train()
        opt.zero_grad(set_to_none=True)
        out = self.loss_fn(replica, batch_to(part, device))
        torch.autograd.backward(out.mean() if out.dim() else out)
        opt.step()
        if device.type == "cuda":  # kernels are asynchronous: time them to their end
            torch.cuda.synchronize(device)
        return out.detach(), time.perf_counter() - t0

    @staticmethod
    def _gather_losses(
        results: list[tuple[torch.Tensor, float] | None], sizes: tuple[int, int]
    ) -> tuple[torch.Tensor | None, float]:
        outs = [r[0].to("cpu") for r in results if r is not None]
        if all(o.dim() == 1 for o in outs):
            losses = torch.cat(outs)
            return losses, float(losses.float().mean())
        means = [float(o.float().mean()) for o in outs]
        used = [s for s in sizes if s]
        return None, sum(m * s for m, s in zip(means, used, strict=True)) / sum(used)

    def _account(
        self, sizes: tuple[int, int], seconds: tuple[float, float], parallel_wall: float
    ) -> None:
        st = self.stats
        st.steps += 1
        for i in (0, 1):
            st.samples[i] += sizes[i]
            st.busy_s[i] += seconds[i]
            self._since_merge[i] += sizes[i]
        if all(sizes):
            st.parallel_wall_s += parallel_wall
            for i in (0, 1):
                st.parallel_busy_s[i] += seconds[i]
        if self.meter.record(seconds, sizes):
            logger.debug("hybrid split: first replica's share now %.3f", self.meter.ratio)
