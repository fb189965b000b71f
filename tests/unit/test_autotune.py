"""The knob controllers (seed 001): the Q-learning update on known transitions, convergence
on synthetic loads whose best setting is known, the hill-climber, knobs and validation."""

from __future__ import annotations

import json
import statistics

import pytest

from loaderd.autotune import (
    HOLD,
    Action,
    HillClimber,
    Knob,
    Observation,
    QLearningTuner,
    StateBuckets,
    round_cost,
)
from loaderd.autotune_sim import KNOBS, SyntheticLoad, best

READ_AHEAD = Knob(name="read_ahead", low=0, high=8, step=1)
UP, DOWN = Action("read_ahead", +1), Action("read_ahead", -1)
# One knob whose stall vanishes at 3 batches ahead while memory grows by a tenth per batch:
# the best setting is 3 (cost 0.09 at w = 0.3), and every setting up to 4 has its own state.
STALL = [0.6, 0.3, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
BUCKETS = StateBuckets(stall_edges=(0.05, 0.2, 0.45), headroom_edges=(0.15, 0.35, 0.55, 0.65))


def ladder(settings: dict[str, float]) -> Observation:
    ra = settings["read_ahead"]
    return Observation(stall_fraction=STALL[int(ra)], memory_bytes=0.1 * ra, memory_budget_bytes=1)


def obs(stall: float, memory: float) -> Observation:
    return Observation(stall_fraction=stall, memory_bytes=memory, memory_budget_bytes=100.0)


def test_cost_is_the_seeds_weighting_and_lower_is_better() -> None:
    o = obs(0.2, 50.0)  # 20 % stalled, half the memory budget
    assert round_cost(o, 0.0) == pytest.approx(0.2)  # w = 0: only time counts
    assert round_cost(o, 1.0) == pytest.approx(0.5)  # w = 1: only memory
    assert round_cost(o, 0.3) == pytest.approx(0.2 + 0.3 * (0.5 - 0.2))
    assert BUCKETS.state(o) == (2, 2)  # edges are lower bounds: 0.2 is in [0.2, 0.45)
    assert StateBuckets().state(obs(0.0, 120.0)) == (0, 0)  # over budget: no headroom


def test_update_rule_on_known_transitions() -> None:
    t = QLearningTuner([READ_AHEAD], alpha=0.5, gamma=0.9)
    s, s2 = (3, 3), (1, 3)
    # Q(s,a) <- Q + 0.5 * (r + 0.9 * max Q(s', .) - Q), from zeros: 0.5 * 0.2
    assert t.update(s, UP, 0.2, s2) == pytest.approx(0.1)
    assert t.update(s, UP, 0.2, s2) == pytest.approx(0.1 + 0.5 * (0.2 - 0.1))
    t.values(s2)[HOLD] = 1.0
    t.values(s2)[DOWN] = 5.0  # not allowed at read_ahead = 0: the max must ignore it
    assert t.update(s, HOLD, -0.1, s2) == pytest.approx(0.5 * (-0.1 + 0.9 * 1.0))
    # step() feeds the update with the improvement of the round over the one before.
    t = QLearningTuner([READ_AHEAD], epsilon=0.0, epsilon_min=0.0, seed=3)
    first = t.step(obs(0.5, 10.0))
    t.step(obs(0.25, 10.0))
    improvement = round_cost(obs(0.5, 10.0), 0.3) - round_cost(obs(0.25, 10.0), 0.3)
    state = StateBuckets().state(obs(0.5, 10.0))
    assert t.values(state)[first] == pytest.approx(0.5 * improvement)


def test_q_learning_converges_to_the_known_best_setting_and_actions() -> None:
    t = QLearningTuner([READ_AHEAD], buckets=BUCKETS, seed=0)
    at_best = 0
    for r in range(600):
        at_best += r >= 300 and t.settings["read_ahead"] == 3
        t.step(ladder(t.settings))
    assert at_best / 300 > 0.9
    for ra, want in ((1, UP), (2, UP), (3, HOLD), (4, DOWN)):
        t.settings = {"read_ahead": float(ra)}
        assert t.greedy(BUCKETS.state(ladder(t.settings))) == want, ra


def test_hill_climber_reaches_the_best_setting_and_holds() -> None:
    h = HillClimber([READ_AHEAD], patience=10)
    actions = [h.step(ladder(h.settings)) for _ in range(40)]
    assert h.settings == {"read_ahead": 3.0}
    assert actions[:3] == [UP, UP, UP]  # each step up cut the cost
    assert actions[3:5] == [UP, DOWN]  # 4 was worse: reverted
    assert actions.count(HOLD) >= 10  # then it rests, probing now and then


@pytest.mark.parametrize("trainers", [2, 4])
def test_both_settle_near_the_best_of_a_synthetic_load(trainers: int) -> None:
    load = SyntheticLoad(trainers=trainers)
    _, best_cost = best(load, 0.3)
    start_cost = round_cost(load.observe(read_ahead=0, workers=1), 0.3)
    for tuner in (QLearningTuner(KNOBS, seed=1), HillClimber(KNOBS)):
        costs = []
        for _ in range(600):
            tuner.step(load.observe(**tuner.settings))
            assert tuner.last_cost is not None
            costs.append(tuner.last_cost)
        late = statistics.fmean(costs[300:])
        assert late < 1.2 * best_cost, (type(tuner).__name__, late, best_cost)
        assert late < 0.3 * start_cost


def test_same_seed_same_run_and_state_dict_round_trip() -> None:
    def run(seed: int) -> tuple[list[Action], QLearningTuner]:
        t = QLearningTuner(KNOBS, seed=seed)
        return [t.step(SyntheticLoad().observe(**t.settings)) for _ in range(200)], t

    (a, ta), (b, _), (c, _) = run(5), run(5), run(6)
    assert a == b and a != c
    saved = json.loads(json.dumps(ta.state_dict()))
    fresh = QLearningTuner(KNOBS, seed=5)
    fresh.load_state_dict(saved)
    assert fresh.settings == ta.settings and fresh.q == ta.q and fresh.rounds == 200
    with pytest.raises(ValueError, match="knobs this one lacks"):
        QLearningTuner([READ_AHEAD]).load_state_dict(saved)


def test_knobs_move_on_a_grid_within_bounds() -> None:
    ra = Knob(name="read_ahead_bytes", low=1 << 20, high=1 << 30, step=2, geometric=True)
    assert ra.grid[:3] == (1 << 20, 2 << 20, 4 << 20) and ra.grid[-1] == 1 << 30
    assert ra.moved(1 << 30, +1) == 1 << 30  # the top stays the top
    assert ra.moved(ra.moved(8 << 20, +1), -1) == 8 << 20  # down undoes up
    frac = Knob(name="dram_share", low=0.1, high=0.9, step=0.25, integer=False, initial=0.4)
    assert frac.grid == pytest.approx((0.1, 0.35, 0.6, 0.85, 0.9))
    assert frac.start == pytest.approx(0.35)  # snapped to the grid
    t = QLearningTuner([READ_AHEAD])
    assert DOWN not in t.allowed() and UP in t.allowed()  # no move past a bound


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Knob(name="k", low=2, high=1, step=1), "low <= high"),
        (lambda: Knob(name="k", low=0, high=4, step=0), "step"),
        (lambda: Knob(name="k", low=0, high=4, step=2, geometric=True), "geometric"),
        (lambda: Knob(name="k", low=0, high=4, step=1, initial=9), "initial"),
        (lambda: Observation(stall_fraction=1.5, memory_bytes=0, memory_budget_bytes=1), "stall"),
        (lambda: Observation(stall_fraction=0, memory_bytes=1, memory_budget_bytes=0), "budget"),
        (lambda: QLearningTuner([READ_AHEAD, READ_AHEAD]), "distinct"),
        (lambda: QLearningTuner([READ_AHEAD], gamma=1.0), "gamma"),
        (lambda: QLearningTuner([READ_AHEAD], reward="speed"), "reward"),
        (lambda: HillClimber([READ_AHEAD], memory_weight=2), "memory_weight"),
        (lambda: StateBuckets(stall_edges=(0.2, 0.1)), "increasing"),
    ],
)
def test_bad_settings_are_refused_by_name(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]
