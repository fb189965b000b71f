"""The hybrid trainer's merge (seed 000): W = R·W_1 + (1 - R)·W_2, layer by layer.

Every k iterations the two replicas are averaged with the weight R of the first (the share of
samples it trained since the last merge) and the result replaces both. Beyond the seed's
parameters, everything else a replica carries is merged too, so that after a merge the two are
one model in one training state and the next k iterations start from the same point:

- floating-point buffers (BatchNorm's running mean and variance) are statistics of the data
  each replica saw, so they get the same weighted average;
- integer buffers are counters (BatchNorm's ``num_batches_tracked``): the larger is kept;
- optimizer state shaped like its parameter (SGD's momentum, Adam's two moments) is averaged
  with the same weights, because it is a running average of the gradients each replica saw;
  resetting it at every merge would throw away momentum every k steps;
- other optimizer state (Adam's ``step``) comes from the replica with the larger weight, and a
  replica that has no state yet (it has not stepped) takes the other's.

Each optimizer keeps its own ``param_groups`` (learning rate, schedules). The arithmetic runs
on the second replica's device (the seed's GPU, which has the faster memory), and the result
is copied back to the first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _pairs(first: nn.Module, second: nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, tensor of the first, tensor of the second) for every parameter and buffer."""
    a: dict[str, torch.Tensor] = dict(first.named_parameters())
    a.update(first.named_buffers())
    b: dict[str, torch.Tensor] = dict(second.named_parameters())
    b.update(second.named_buffers())
    if a.keys() != b.keys():
        raise ValueError(f"the replicas differ: {sorted(a.keys() ^ b.keys())[:5]}")
    for name, ta in a.items():
        yield name, ta, b[name]


def _average_into(target: torch.Tensor, other: torch.Tensor, weight_other: float) -> None:
    """Set target <- weight_other·other + (1 - weight_other)·target, in place."""
    if weight_other == 0.0:
        return
    if weight_other == 1.0:
        target.copy_(other)
        return
    target.mul_(1.0 - weight_other).add_(other.to(target.device), alpha=weight_other)


@torch.no_grad()
def merge_replicas(
    first: nn.Module,
    second: nn.Module,
    first_weight: float,
    optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer] | None = None,
) -> None:
    """Replace both replicas (and their optimizers' state) by their weighted average.

    Args:
        first: the first replica (the seed's CPU replica).
        second: the second replica (the seed's GPU replica); the merge is computed here.
        first_weight: R, the first replica's weight in [0, 1].
        optimizers: the replicas' optimizers, in the same order, whose parameters are the
            replicas' parameters in ``parameters()`` order; None leaves optimizer state alone.

    Raises:
        ValueError: the replicas do not have the same parameters and buffers, or the weight
            is outside [0, 1].
    """
    if not 0.0 <= first_weight <= 1.0:
        raise ValueError(f"the merge weight must be in [0, 1], got {first_weight}")
    for _, ta, tb in _pairs(first, second):
        if tb.is_floating_point() or tb.is_complex():
            _average_into(tb, ta, first_weight)
        else:
            tb.copy_(torch.maximum(tb, ta.to(tb.device)))
        ta.copy_(tb)
    if optimizers is not None:
        for pa, pb in zip(first.parameters(), second.parameters(), strict=True):
            _merge_state(optimizers[0].state, optimizers[1].state, pa, pb, first_weight)


def _merge_state(
    state_a: Any, state_b: Any, pa: torch.Tensor, pb: torch.Tensor, first_weight: float
) -> None:
    """Merge one parameter's optimizer state into the second's, then copy it to the first."""
    sa: dict[str, Any] = state_a.get(pa, {})
    sb: dict[str, Any] = state_b.get(pb, {})
    if not sa and not sb:
        return
    if not sb or not sa:  # one replica has not stepped yet: it takes the other's state
        merged = {k: _to(v, pb.device) for k, v in (sa or sb).items()}
    else:
        merged = {}
        for key in sa.keys() | sb.keys():
            va, vb = sa.get(key), sb.get(key)
            if va is None or vb is None:
                merged[key] = _to(vb if va is None else va, pb.device)
            elif (
                key != "step"
                and isinstance(vb, torch.Tensor)
                and isinstance(va, torch.Tensor)
                and vb.is_floating_point()
                and vb.shape == pb.shape
                and va.shape == pa.shape
            ):
                _average_into(vb, va, first_weight)
                merged[key] = vb
            else:
                merged[key] = _to(va if first_weight > 0.5 else vb, pb.device)
    state_b[pb] = merged
    state_a[pa] = {k: _to(v, pa.device, copy=True) for k, v in merged.items()}


def _to(value: Any, device: torch.device, copy: bool = False) -> Any:
    if isinstance(value, torch.Tensor):
        # Optimizers keep some scalars (Adam's ``step``) on the CPU on purpose: leave those.
        if value.dim() == 0 and value.device.type == "cpu":
            return value.clone() if copy else value
        return value.to(device, copy=copy)
    return value
