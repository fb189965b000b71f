"""A learned controller for the daemon's knobs (seed 001), and a hill-climber to beat.

The right read-ahead depth, assembly workers, DRAM/arena split or prefetch per consumer depend
on the load: how many trainers, how fast they step, whether the dataset fits in DRAM. Fixed
defaults are right for one load. Seed 001 schedules GPU memory swaps with a controller that
learns from each round's outcome; the same controller can turn the daemon's knobs. Each round
(some seconds of serving) the daemon reports what it saw, the controller scores it, learns,
and moves one knob one step up or down, or holds.

- Cost of a round (lower is better): the seed's r_time + w·(r_mem - r_time), with
  r_time = the trainers' stall fraction (time waiting for batches / wall time, in [0, 1]) and
  r_mem = the daemon's memory / its budget (1 at the budget, more above it), so
  cost = (1 - w)·stall + w·memory.
- Reward (higher is better) of the action taken before a round: how much cheaper the round
  was than the one before, previous cost - cost. Minus the cost itself (``reward="cost"``)
  makes a state's value mostly the cost of wherever the coarse state happens to stand,
  which aliases settings of different cost and drowns the few-percent differences between
  neighbouring moves; it also learns the rarely visited states slowly. On the synthetic
  changing load of ``benchmarks/bench_autotune.py`` it ends 16-27 % above the best cost of
  each phase, the improvement 4-5 % (``docs/design.md``).
- State: a coarse bucket of the stall fraction and one of the memory headroom
  (1 - memory / budget), so that what was learnt in one load carries over to a similar one.
- Actions: hold, or one knob one step up or down (a move past a bound is not offered).
- Learning: ε-greedy Q-learning, Q(s,a) <- Q(s,a) + alpha·[r + gamma·max_a' Q(s',a') - Q(s,a)]
  with the seed's alpha = 0.5, gamma = 0.9. ε decays to a floor and never to 0: the load
  changes, and the controller must notice.

Knobs are abstract (a name, bounds and a step) so the daemon binds them to whatever it can
change while it serves: ``step(observation)`` returns the action taken, and ``settings`` holds
every knob's value to apply. ``HillClimber`` has the same interface: it moves one knob while
the cost falls and reverts a move that did not help.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

State = tuple[int, int]
REWARDS = ("improvement", "cost")


MAX_GRID = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class Knob:
    """One setting the controller may move, on a grid from ``low`` to ``high``.

    A knob's values are ``low``, ``low + step``, ... (or ``low``, ``low·step``, ... when
    ``geometric``), capped by ``high``, so that a move down always undoes a move up.

    Args:
        name: how the daemon knows it, e.g. ``read_ahead_bytes``.
        low: its smallest value.
        high: its largest value.
        step: added per move up; with ``geometric``, the factor (> 1) multiplied by, for sizes
            that matter by their order of magnitude.
        initial: the value to start from (default ``low``; snapped to the grid).
        integer: values are whole numbers (counts, bytes).
        geometric: steps multiply rather than add.
    """

    name: str
    low: float
    high: float
    step: float
    initial: float | None = None
    integer: bool = True
    geometric: bool = False
    grid: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a knob needs a `name`")
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low <= self.high):
            raise ValueError(f"knob {self.name!r}: need low <= high, got {self.low}, {self.high}")
        if self.geometric and not (self.step > 1 and self.low > 0):
            raise ValueError(f"knob {self.name!r}: a geometric step must be > 1 with low > 0")
        if not (math.isfinite(self.step) and self.step > 0):
            raise ValueError(f"knob {self.name!r}: `step` must be positive, got {self.step}")
        if self.initial is not None and not self.low <= self.initial <= self.high:
            raise ValueError(
                f"knob {self.name!r}: `initial` {self.initial} outside [{self.low}, {self.high}]"
            )
        values: list[float] = []
        v = float(self.low)
        while v < self.high and len(values) <= MAX_GRID:
            values.append(float(round(v)) if self.integer else v)
            v = v * self.step if self.geometric else v + self.step
        values.append(float(self.high))
        if len(values) > MAX_GRID:
            raise ValueError(f"knob {self.name!r}: more than {MAX_GRID} steps from low to high")
        object.__setattr__(self, "grid", tuple(sorted(set(values))))

    @property
    def start(self) -> float:
        """The value the knob starts at: the grid value nearest ``initial``."""
        return self.grid[self._index(self.low if self.initial is None else self.initial)]

    def moved(self, value: float, direction: int) -> float:
        """The grid value ``direction`` steps from ``value`` (+1 up, -1 down), within bounds."""
        i = self._index(value) + direction
        return self.grid[min(len(self.grid) - 1, max(0, i))]

    def _index(self, value: float) -> int:
        i = bisect.bisect_left(self.grid, value)
        if i == len(self.grid) or (i > 0 and value - self.grid[i - 1] < self.grid[i] - value):
            i -= 1
        return i


class Action(NamedTuple):
    """Hold (``knob`` None) or move ``knob`` one step in ``direction`` (+1 up, -1 down)."""

    knob: str | None
    direction: int

    def __str__(self) -> str:
        return "hold" if self.knob is None else f"{self.knob}{'+' if self.direction > 0 else '-'}"


HOLD = Action(None, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Observation:
    """What one round of serving looked like.

    Args:
        stall_fraction: the share of the trainers' wall time spent waiting for a batch, in
            [0, 1] (e.g. summed GET_BATCH wait over consumers / (consumers x round length)).
        memory_bytes: the memory the daemon held (caches, rings, buffers).
        memory_budget_bytes: what it may hold; memory above it costs more than 1.
    """

    stall_fraction: float
    memory_bytes: float
    memory_budget_bytes: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.stall_fraction <= 1.0:
            raise ValueError(f"`stall_fraction` must be in [0, 1], got {self.stall_fraction}")
        if not (math.isfinite(self.memory_bytes) and self.memory_bytes >= 0):
            raise ValueError(f"`memory_bytes` must be >= 0, got {self.memory_bytes}")
        if not (math.isfinite(self.memory_budget_bytes) and self.memory_budget_bytes > 0):
            raise ValueError(
                f"`memory_budget_bytes` must be positive, got {self.memory_budget_bytes}"
            )

    @property
    def memory_fraction(self) -> float:
        """Memory held as a share of the budget (the seed's normalised r_mem)."""
        return self.memory_bytes / self.memory_budget_bytes


def round_cost(obs: Observation, memory_weight: float) -> float:
    """The seed's r = r_time + w·(r_mem - r_time): lower is better, 0 is no stall in no memory."""
    return obs.stall_fraction + memory_weight * (obs.memory_fraction - obs.stall_fraction)


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBuckets:
    """Edges of the coarse state: a bucket of stall fraction and one of memory headroom.

    Args:
        stall_edges: increasing stall fractions; bucket i holds values in [edge i-1, edge i).
        headroom_edges: increasing headrooms (1 - memory / budget; negative above budget).
    """

    stall_edges: tuple[float, ...] = (0.01, 0.05, 0.2)
    headroom_edges: tuple[float, ...] = (0.1, 0.25, 0.5)

    def __post_init__(self) -> None:
        for name, edges in (
            ("stall_edges", self.stall_edges),
            ("headroom_edges", self.headroom_edges),
        ):
            if list(edges) != sorted(set(edges)):
                raise ValueError(f"`{name}` must be strictly increasing, got {edges}")

    def state(self, obs: Observation) -> State:
        """(stall bucket, headroom bucket) of an observation."""
        headroom = 1.0 - obs.memory_fraction
        return (
            bisect.bisect_right(self.stall_edges, obs.stall_fraction),
            bisect.bisect_right(self.headroom_edges, headroom),
        )


class Tuner:
    """What both controllers share: the knobs, their settings, the cost and the round count.

    Args:
        knobs: the knobs, with distinct names.
        memory_weight: w in the cost, in [0, 1]: 0 minds only stalls, 1 only memory.
    """

    def __init__(self, knobs: Sequence[Knob], *, memory_weight: float = 0.3) -> None:
        if not knobs:
            raise ValueError("a tuner needs at least one knob")
        names = [k.name for k in knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"knob names must be distinct, got {names}")
        if not 0.0 <= memory_weight <= 1.0:
            raise ValueError(f"`memory_weight` must be in [0, 1], got {memory_weight}")
        self.knobs = {k.name: k for k in knobs}
        self.memory_weight = memory_weight
        self.settings: dict[str, float] = {k.name: k.start for k in knobs}
        self.actions: tuple[Action, ...] = (
            HOLD,
            *(Action(k.name, d) for k in knobs for d in (+1, -1)),
        )
        self.rounds = 0
        self.last_cost: float | None = None

    def cost(self, obs: Observation) -> float:
        """The round's cost under this tuner's memory weight."""
        return round_cost(obs, self.memory_weight)

    def allowed(self) -> list[Action]:
        """The actions that change something from the current settings, and hold."""
        return [
            a
            for a in self.actions
            if a.knob is None
            or self.knobs[a.knob].moved(self.settings[a.knob], a.direction) != self.settings[a.knob]
        ]

    def step(self, obs: Observation) -> Action:
        """Learn from the round just served (under ``settings``); choose and apply the next move.

        Returns:
            The action taken; ``settings[action.knob]`` is the knob's new value.
        """
        cost = self.cost(obs)
        action = self._choose(obs, cost)
        if action.knob is not None:
            knob = self.knobs[action.knob]
            self.settings[action.knob] = knob.moved(self.settings[action.knob], action.direction)
        self.rounds += 1
        self.last_cost = cost
        logger.debug("round %d: cost %.4f -> %s %s", self.rounds, cost, action, self.settings)
        return action

    def _choose(self, obs: Observation, cost: float) -> Action:
        raise NotImplementedError


class QLearningTuner(Tuner):
    """ε-greedy Q-learning over (stall, headroom) buckets (seed 001).

    Args:
        knobs: the knobs, with distinct names.
        memory_weight: w in the cost, in [0, 1].
        alpha: the learning rate (the seed's 0.5).
        gamma: the discount (the seed's 0.9).
        epsilon: the first rounds' exploration probability ε.
        epsilon_min: the floor ε decays to (kept above 0, so a changed load is noticed).
        epsilon_decay: ε's factor per round.
        buckets: the state's bucket edges.
        reward: ``improvement`` (the previous round's cost minus this one's) or ``cost``
            (minus this round's cost).
        seed: the seed of the exploration's random choices (runs are reproducible).
    """

    def __init__(
        self,
        knobs: Sequence[Knob],
        *,
        memory_weight: float = 0.3,
        alpha: float = 0.5,
        gamma: float = 0.9,
        epsilon: float = 0.3,
        epsilon_min: float = 0.02,
        epsilon_decay: float = 0.99,
        buckets: StateBuckets | None = None,
        reward: str = "improvement",
        seed: int = 0,
    ) -> None:
        super().__init__(knobs, memory_weight=memory_weight)
        if reward not in REWARDS:
            raise ValueError(f"`reward` must be one of {', '.join(REWARDS)}, got {reward!r}")
        self.reward = reward
        for name, value in (("alpha", alpha), ("epsilon", epsilon), ("epsilon_min", epsilon_min)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"`{name}` must be in [0, 1], got {value}")
        if not 0.0 <= gamma < 1.0:
            raise ValueError(f"`gamma` must be in [0, 1), got {gamma}")
        if not 0.0 < epsilon_decay <= 1.0:
            raise ValueError(f"`epsilon_decay` must be in (0, 1], got {epsilon_decay}")
        self.alpha, self.gamma = alpha, gamma
        self.epsilon, self.epsilon_min, self.epsilon_decay = epsilon, epsilon_min, epsilon_decay
        self.buckets = buckets or StateBuckets()
        self.q: dict[State, dict[Action, float]] = {}
        self._rng = random.Random(seed)
        self._last: tuple[State, Action] | None = None

    def values(self, state: State) -> dict[Action, float]:
        """Q of every action in ``state`` (0 where never tried)."""
        return self.q.setdefault(state, dict.fromkeys(self.actions, 0.0))

    def update(self, state: State, action: Action, reward: float, next_state: State) -> float:
        """One Q-learning update, Q(s,a) += alpha·[r + gamma·max Q(s',·) - Q(s,a)]; returns Q(s,a).

        The max runs over the actions allowed from the current settings (a move past a bound
        is never taken, so its Q says nothing).
        """
        row = self.values(state)
        ahead = self.values(next_state)
        best_next = max(ahead[a] for a in self.allowed())
        row[action] += self.alpha * (reward + self.gamma * best_next - row[action])
        return row[action]

    def greedy(self, state: State) -> Action:
        """The best allowed action in ``state`` by the current Q (ties: the first listed)."""
        row = self.values(state)
        return max(self.allowed(), key=lambda a: row[a])

    def _choose(self, obs: Observation, cost: float) -> Action:
        state = self.buckets.state(obs)
        if self._last is not None and self.last_cost is not None:
            reward = self.last_cost - cost if self.reward == "improvement" else -cost
            self.update(*self._last, reward, state)
        allowed = self.allowed()
        if self._rng.random() < self.current_epsilon:
            action = self._rng.choice(allowed)
        else:  # ties broken at random, so no action is favoured by its place in the list
            row = self.values(state)
            best = max(row[a] for a in allowed)
            action = self._rng.choice([a for a in allowed if row[a] == best])
        self._last = (state, action)
        return action

    @property
    def current_epsilon(self) -> float:
        """ε this round: ``epsilon·decay^rounds``, not below ``epsilon_min``."""
        return max(self.epsilon_min, self.epsilon * self.epsilon_decay**self.rounds)

    def state_dict(self) -> dict[str, Any]:
        """The learnt table, settings and round count, as JSON-ready values."""
        return {
            "rounds": self.rounds,
            "settings": dict(self.settings),
            "q": [
                [list(state), str(action), value]
                for state, row in self.q.items()
                for action, value in row.items()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: a daemon restarted keeps what it learnt.

        Raises:
            ValueError: the state names a knob or action this tuner does not have.
        """
        by_name = {str(a): a for a in self.actions}
        unknown = set(state["settings"]) - set(self.settings)
        if unknown:
            raise ValueError(f"the saved tuner has knobs this one lacks: {sorted(unknown)}")
        self.q = {}
        for s, name, value in state["q"]:
            if name not in by_name:
                raise ValueError(f"the saved tuner has an action this one lacks: {name}")
            self.values((int(s[0]), int(s[1])))[by_name[name]] = float(value)
        for name, value in state["settings"].items():
            knob = self.knobs[name]
            self.settings[name] = min(knob.high, max(knob.low, float(value)))
        self.rounds = int(state["rounds"])
        self._last = None


class HillClimber(Tuner):
    """The baseline: move one knob while the cost falls, revert a move that does not help.

    Each trial moves one knob one step and is judged by the next round: kept (and repeated
    in the same direction) if the cost fell by more than ``min_gain``, else reverted. After
    every move has failed in a row it holds for ``patience`` rounds, then tries again, since
    the load may have changed.

    Args:
        knobs: the knobs, with distinct names.
        memory_weight: w in the cost, in [0, 1].
        min_gain: the least cost decrease that counts as better (noise margin).
        patience: rounds to hold once no move helps.
    """

    def __init__(
        self,
        knobs: Sequence[Knob],
        *,
        memory_weight: float = 0.3,
        min_gain: float = 0.005,
        patience: int = 10,
    ) -> None:
        super().__init__(knobs, memory_weight=memory_weight)
        if min_gain < 0:
            raise ValueError(f"`min_gain` must be >= 0, got {min_gain}")
        if patience < 0:
            raise ValueError(f"`patience` must be >= 0, got {patience}")
        self.min_gain, self.patience = min_gain, patience
        self._moves = [a for a in self.actions if a.knob is not None]
        self._next = 0  # the next move to try, round robin
        self._trial: Action | None = None  # a move made last round, to be judged now
        self._base_cost: float | None = None  # the cost of the settings the trial left
        self._failures = 0
        self._resting = 0

    def _choose(self, obs: Observation, cost: float) -> Action:
        if self._trial is not None:
            trial, self._trial = self._trial, None
            assert self._base_cost is not None
            if cost < self._base_cost - self.min_gain:
                self._base_cost, self._failures = cost, 0
                if trial in self.allowed():  # it helped: go on the same way
                    self._trial = trial
                    return trial
                return HOLD
            self._failures += 1
            return Action(trial.knob, -trial.direction)  # revert; the next round re-measures
        self._base_cost = cost  # a round at settings that are not a trial: the new base
        if self._resting > 0:
            self._resting -= 1
            return HOLD
        if self._failures >= len(self._moves):
            self._failures, self._resting = 0, self.patience
            return HOLD
        for _ in range(len(self._moves)):
            move = self._moves[self._next]
            self._next = (self._next + 1) % len(self._moves)
            if move in self.allowed():
                self._trial = move
                return move
            self._failures += 1  # a move past a bound counts as one that did not help
        return HOLD
