"""The hybrid trainer's parts (seed 000) with two CPU replicas standing in for CPU and GPU:
the split ratio from measured times, the merge rule, batch slicing, small batches."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loaderd.client.hybrid import HybridTrainer
from loaderd.client.hybrid_merge import merge_replicas
from loaderd.client.hybrid_split import (
    SplitMeter,
    batch_length,
    ratio_from_times,
    slice_batch,
    split_sizes,
)

CPUS = ("cpu", "cpu")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def per_sample_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def test_ratio_is_the_seeds_rule_and_balances_the_parts() -> None:
    # A CPU 3x slower per sample than the GPU gets a quarter: R = T_G / (T_C + T_G).
    assert ratio_from_times(3e-3, 1e-3) == pytest.approx(0.25)
    # At the split where both parts take equally long, the rule returns that split itself
    # (whatever fixed costs the devices have): 10 ms for 8 samples and for 24.
    assert ratio_from_times(0.010 / 8, 0.010 / 24) == pytest.approx(8 / 32)
    with pytest.raises(ValueError, match="positive"):
        ratio_from_times(0.0, 1.0)


def test_split_sizes_round_and_give_small_parts_to_one_replica() -> None:
    assert split_sizes(32, 0.25) == (8, 24)
    assert split_sizes(10, 0.33) == (3, 7)
    assert split_sizes(32, 0.02, min_part=2) == (0, 32)  # 1 sample is too few for BatchNorm
    assert split_sizes(32, 0.98, min_part=2) == (32, 0)
    assert split_sizes(3, 0.5, min_part=2) == (0, 3)  # too small to split at all
    assert split_sizes(1, 0.7) == (1, 0)
    with pytest.raises(ValueError, match="ratio"):
        split_sizes(8, 1.5)


def test_meter_recomputes_the_ratio_per_interval_from_per_sample_times() -> None:
    meter = SplitMeter(every=2, ratio=0.5)
    assert not meter.record((0.04, 0.01), (16, 16))
    assert meter.ratio == 0.5  # not yet a whole interval
    assert meter.record((0.02, 0.01), (16, 16))
    # 0.06 s / 32 samples against 0.02 s / 32 samples: R = 0.02 / 0.08
    assert meter.ratio == pytest.approx(0.25)
    # A replica that trains nothing keeps its last time; the other's is remeasured.
    assert not meter.record((0.0, 0.02), (0, 32))
    assert meter.record((0.0, 0.02), (0, 32))
    assert meter.s_per_sample == [pytest.approx(0.06 / 32), pytest.approx(0.04 / 64)]
    assert meter.ratio == pytest.approx(ratio_from_times(0.06 / 32, 0.04 / 64))


def test_merge_is_the_weighted_average_of_parameters_buffers_and_momentum() -> None:
    a, b = mlp(1), mlp(2)
    opts = (sgd(a), sgd(b))
    x = torch.randn(16, 6)
    y = torch.randint(0, 3, (16,))
    for model, opt in zip((a, b), opts, strict=True):  # two steps: momentum and BN stats
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x * (2 if model is b else 1)), y).backward()
            opt.step()
    b[1].num_batches_tracked.fill_(5)  # counters keep the larger
    r = 0.3
    expect = {
        k: (r * va + (1 - r) * b.state_dict()[k]) if va.is_floating_point() else torch.tensor(5)
        for k, va in copy.deepcopy(a.state_dict()).items()
    }
    moms = [
        r * opts[0].state[pa]["momentum_buffer"] + (1 - r) * opts[1].state[pb]["momentum_buffer"]
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    ]
    merge_replicas(a, b, r, opts)
    for model in (a, b):
        for k, v in model.state_dict().items():
            assert torch.allclose(v, expect[k], atol=1e-6), k
    for (pa, pb), m in zip(zip(a.parameters(), b.parameters(), strict=True), moms, strict=True):
        assert torch.allclose(opts[0].state[pa]["momentum_buffer"], m, atol=1e-6)
        assert torch.allclose(opts[1].state[pb]["momentum_buffer"], m, atol=1e-6)
        # each replica owns its state after the merge: no shared tensors
        assert opts[0].state[pa]["momentum_buffer"] is not opts[1].state[pb]["momentum_buffer"]


def test_merge_gives_a_replica_without_optimizer_state_the_others() -> None:
    a, b = mlp(1), mlp(1)
    opts = (torch.optim.Adam(a.parameters(), lr=0.01), torch.optim.Adam(b.parameters(), lr=0.01))
    F.cross_entropy(b(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
    opts[1].step()  # only the second replica has stepped
    merge_replicas(a, b, 0.0, opts)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
        sa, sb = opts[0].state[pa], opts[1].state[pb]
        assert float(sa["step"]) == float(sb["step"]) == 1.0
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and sa["exp_avg"] is not sb["exp_avg"]


def test_merge_refuses_different_models_and_bad_weights() -> None:
    with pytest.raises(ValueError, match="replicas differ"):
        merge_replicas(mlp(), nn.Linear(6, 3), 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        merge_replicas(mlp(), mlp(), 1.2)


def test_slicing_cuts_tensors_and_per_sample_lists_only() -> None:
    batch = {
        "x": torch.arange(10).reshape(5, 2),
        "name": [b"a", b"b", b"c", b"d", b"e"],
        "pair": (torch.arange(5), torch.zeros(5, 3)),
        "scale": torch.tensor(2.0),
        "tag": "run-1",
    }
    assert batch_length(batch) == 5
    part = slice_batch(batch, 1, 3, 5)
    assert torch.equal(part["x"], torch.tensor([[2, 3], [4, 5]]))
    assert part["name"] == [b"b", b"c"]
    assert isinstance(part["pair"], tuple) and torch.equal(part["pair"][0], torch.tensor([1, 2]))
    assert part["scale"] is batch["scale"] and part["tag"] == "run-1"
    with pytest.raises(ValueError, match="needs a tensor"):
        batch_length({"tag": "x"})


def test_trainer_splits_by_the_times_it_measured_and_merges_every_k() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    with HybridTrainer(
        mlp(), sgd, per_sample_ce, devices=CPUS, merge_every=4, measure_every=3
    ) as trainer:
        shadow = SplitMeter(every=3, ratio=0.5)  # the same rule fed from the reported times
        for step in range(1, 13):
            result = trainer.step({"x": x[:32], "y": y[:32]})
            assert result.ratio == shadow.ratio
            assert result.split == split_sizes(32, shadow.ratio, 2)
            shadow.record(result.seconds, result.split)
            assert result.merged == (step % 4 == 0)
            assert result.losses is not None and result.losses.shape == (32,)
        assert trainer.ratio == shadow.ratio
        assert trainer.stats.merges == 3 and trainer.stats.steps == 12
        assert sum(trainer.stats.samples) == 12 * 32
        # Right after a merge the replicas are one model.
        first, second = trainer.replicas
        for (k, va), vb in zip(
            first.state_dict().items(), second.state_dict().values(), strict=True
        ):
            assert torch.equal(va, vb), k


class Slow(nn.Module):
    """A model whose first replica can be made `extra` times heavier per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 128)
        self.hidden = nn.Linear(128, 128)
        self.out = nn.Linear(128, 3)
        self.extra = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(1 + self.extra):
            h = torch.tanh(self.hidden(h))
        return self.out(h)


def test_a_slower_replica_gets_the_smaller_share() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(256, 6), torch.randint(0, 3, (256,))
    trainer = HybridTrainer(
        Slow(), sgd, lambda m, b: F.cross_entropy(m(b[0]), b[1]), devices=CPUS, measure_every=2
    )
    trainer.replicas[0].extra = 30  # ~30x the work per sample on the first replica
    try:
        for _ in range(6):
            result = trainer.step((x, y))
        assert result.losses is None  # a scalar loss: nothing per sample to report
        assert trainer.ratio < 0.35, trainer.meter.s_per_sample
    finally:
        trainer.close()
        trainer.close()
    with pytest.raises(RuntimeError, match="closed"):
        trainer.step((x, y))


def test_trainer_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="merge_every"):
        HybridTrainer(mlp(), sgd, per_sample_ce, devices=CPUS, merge_every=0)
    with pytest.raises(ValueError, match="measure_every"):
        HybridTrainer(mlp(), sgd, per_sample_ce, devices=CPUS, measure_every=0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            HybridTrainer(mlp(), sgd, per_sample_ce, devices=("cpu", "cuda"))
