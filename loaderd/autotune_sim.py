"""A synthetic load for the knob controllers: known costs, so a controller can be checked.

The daemon's real knobs answer slowly and noisily; a controller is first judged where the best
setting is known. Here trainers ask for batches at a fixed rate, assembly workers supply them,
and read-ahead hides the jitter of assembly: the stall is the shortfall of supply plus the
jitter not yet hidden, and memory grows with both knobs. ``best()`` finds the cheapest
setting by trying every one.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from loaderd.autotune import Knob, Observation, round_cost


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticLoad:
    """Trainers pulling batches from a daemon with ``read_ahead`` and ``workers`` knobs.

    Args:
        trainers: trainers pulling at once.
        steps_per_s: batches each trainer asks for per second.
        worker_batches_per_s: batches one assembly worker makes per second.
        jitter: the stall share that assembly jitter causes with nothing read ahead.
        hide: batches of read-ahead that hide a factor e of the jitter.
        batch_bytes: memory per batch read ahead, per trainer.
        worker_bytes: memory per worker.
        base_bytes: memory held whatever the knobs.
        budget_bytes: the daemon's memory budget.
    """

    trainers: int = 2
    steps_per_s: float = 10.0
    worker_batches_per_s: float = 8.0
    jitter: float = 0.4
    hide: float = 1.5
    batch_bytes: float = 16e6
    worker_bytes: float = 40e6
    base_bytes: float = 200e6
    budget_bytes: float = 2e9

    def observe(self, read_ahead: float, workers: float) -> Observation:
        """What a round at these settings looks like."""
        demand = self.trainers * self.steps_per_s
        supply = workers * self.worker_batches_per_s
        shortfall = max(0.0, 1.0 - supply / demand)
        stall = min(
            1.0, shortfall + (1.0 - shortfall) * self.jitter * math.exp(-read_ahead / self.hide)
        )
        memory = (
            self.base_bytes
            + read_ahead * self.batch_bytes * self.trainers
            + workers * self.worker_bytes
        )
        return Observation(
            stall_fraction=stall, memory_bytes=memory, memory_budget_bytes=self.budget_bytes
        )


KNOBS = (
    Knob(name="read_ahead", low=0, high=16, step=1),
    Knob(name="workers", low=1, high=8, step=1),
)


def best(load: SyntheticLoad, memory_weight: float) -> tuple[dict[str, float], float]:
    """The cheapest setting of ``KNOBS`` under ``load`` and its cost (tried exhaustively)."""
    options = [
        {"read_ahead": r, "workers": w} for r, w in itertools.product(KNOBS[0].grid, KNOBS[1].grid)
    ]
    costs = [round_cost(load.observe(**o), memory_weight) for o in options]
    i = min(range(len(costs)), key=costs.__getitem__)
    return options[i], costs[i]
