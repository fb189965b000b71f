"""loaderd/cluster_view.py and cluster.plan_catch_up: pure decisions every node shares."""

from __future__ import annotations

import numpy as np
import pytest

from loaderd.cluster_group import ClusterError
from loaderd.cluster_rounds import plan_catch_up
from loaderd.cluster_view import (
    job_progress,
    job_view,
    jobs_in,
    missing_rescores,
    plan_digest,
    ready_passes,
    still_in,
)
from loaderd.cluster_wire import Contribution, JobStatus, RankStatus, Round

SPEC = {"name": "j", "world_size": 4, "seed": 0}


def rnd(*statuses: dict[str, JobStatus]) -> Round:
    return Round(1, tuple(Contribution(i, 0, 0, s, ()) for i, s in enumerate(statuses)))


def ranks(**by_rank: RankStatus) -> dict[int, RankStatus]:
    return {int(k[1:]): v for k, v in by_rank.items()}


def test_job_view_merges_every_nodes_ranks() -> None:
    r = rnd(
        {
            "j": JobStatus(
                SPEC, ranks(r0=RankStatus(2, "train", True), r1=RankStatus(2, "train", False))
            )
        },
        {"k": JobStatus({"name": "k"}, {})},
        {"j": JobStatus(SPEC, ranks(r2=RankStatus(3, "rescore", False, (3, "rescore"))))},
    )
    assert jobs_in(r) == ["j", "k"]
    view = job_view(r, "j")
    assert view is not None and not view.problems and view.spec == SPEC
    assert sorted(view.ranks) == [0, 1, 2] and view.node_of == {0: 0, 1: 0, 2: 2}
    assert view.wanted() == [(3, "rescore")]
    assert job_view(r, "nobody") is None


def test_job_progress_is_the_whole_job_on_every_node() -> None:
    r = rnd(
        {
            "j": JobStatus(
                SPEC, ranks(r0=RankStatus(3, "train", True), r1=RankStatus(3, "train", True))
            )
        },
        {"j": JobStatus(SPEC, ranks(r2=RankStatus(3, "rescore", True, (3, "train"))))},
    )
    view = job_view(r, "j")
    assert view is not None
    assert job_progress(view, 7, 4) == {
        "round": 7,
        "ranks_reporting": 3,  # rank 3's node has not reported yet
        "world_size": 4,
        "epoch": 3,
        "nodes": {
            "0": {"ranks": [0, 1], "at": "3:train", "complete": 2, "waiting": 0},
            "1": {"ranks": [2], "at": "3:rescore", "complete": 1, "waiting": 1},
        },
    }


def test_job_view_names_disagreements() -> None:
    r = rnd(
        {"j": JobStatus(SPEC, ranks(r0=RankStatus(0, "train", False)))},
        {"j": JobStatus({**SPEC, "seed": 1}, ranks(r0=RankStatus(0, "train", False)))},
    )
    view = job_view(r, "j")
    assert view is not None and view.spec is None
    assert any("node 1 has spec" in p for p in view.problems)
    assert any("rank 0 is served by node 0 and node 1" in p for p in view.problems)


def test_job_view_names_nodes_that_planned_differently() -> None:
    ids, weights = np.arange(10), np.ones(10, np.float32)
    same, other = plan_digest(ids, weights), plan_digest(ids, weights * 2)
    assert same == plan_digest(ids.astype(np.int32), weights) and same != other
    r = rnd(
        {"j": JobStatus(SPEC, {}, {"4:train": same, "5:rescore": same})},
        {"j": JobStatus(SPEC, {}, {"4:train": same})},
        {"j": JobStatus(SPEC, {}, {"4:train": other, "5:rescore": same})},
    )
    view = job_view(r, "j")
    assert view is not None
    assert view.problems == [
        "job 'j': node 2 planned pass 4:train differently from node 0 (same history, "
        "different result: mixed CPUs or numpy builds?)"
    ]


def test_wanted_in_plan_order() -> None:
    r = rnd(
        {
            "j": JobStatus(
                SPEC,
                ranks(
                    r0=RankStatus(3, "train", True, (4, "train")),
                    r1=RankStatus(3, "train", True, (4, "rescore")),
                    r2=RankStatus(2, "train", False, (2, "train")),
                ),
            )
        }
    )
    view = job_view(r, "j")
    assert view is not None and view.wanted() == [(2, "train"), (4, "rescore"), (4, "train")]


WANT = (6, "train")


@pytest.mark.parametrize(
    ("statuses", "missing"),
    [
        ([RankStatus(5, "train", True)] * 4, 0),  # nobody re-scores epoch 6 yet
        ([RankStatus(6, "rescore", True, WANT)] * 4, 0),
        ([RankStatus(6, "rescore", True, WANT)] * 3 + [RankStatus(6, "rescore", False)], 1),
        # acknowledged but not asking: its last losses may still be on their way
        ([RankStatus(6, "rescore", True, WANT)] * 3 + [RankStatus(6, "rescore", True)], 1),
        ([RankStatus(6, "rescore", True, WANT)] * 2 + [RankStatus(5, "train", True)] * 2, 2),
        ([RankStatus(6, "rescore", True, WANT), RankStatus(6, "train", False)], 2),  # 2 of 4
    ],
)
def test_missing_rescores(statuses: list[RankStatus], missing: int) -> None:
    assert missing_rescores(dict(enumerate(statuses)), 6, 4) == missing


def test_ready_passes_waits_for_every_rank_on_every_node() -> None:
    want = (6, "train")
    node0 = JobStatus(
        SPEC,
        ranks(r0=RankStatus(6, "rescore", True, want), r1=RankStatus(6, "rescore", True, want)),
    )
    slow = JobStatus(
        SPEC, ranks(r2=RankStatus(6, "rescore", True, want), r3=RankStatus(6, "rescore", False))
    )
    done = JobStatus(
        SPEC,
        ranks(r2=RankStatus(6, "rescore", True, want), r3=RankStatus(6, "rescore", True, want)),
    )
    asked: list[int] = []

    def rescores(epoch: int) -> bool:
        asked.append(epoch)
        return True

    view = job_view(rnd({"j": node0}, {"j": slow}), "j")
    assert view is not None and ready_passes(view, 4, set(), rescores, every_pass) == []
    view = job_view(rnd({"j": node0}, {"j": done}), "j")
    assert view is not None and ready_passes(view, 4, set(), rescores, every_pass) == [want]
    assert ready_passes(view, 4, {want}, rescores, every_pass) == []  # planned already
    assert ready_passes(view, 4, set(), lambda e: False, every_pass) == [
        want
    ]  # nothing to re-score
    assert asked == [6, 6]


def every_pass(epoch: int, phase: str) -> bool:  # every pass planned from losses
    return True


def test_a_pass_planned_from_losses_waits_until_every_rank_left_the_epoch_before() -> None:
    # Rank 1 acknowledged its last batch of epoch 5 but has not asked for epoch 6: its last
    # losses may still be on their way, and epoch 6's re-score pass classifies from them.
    asking = RankStatus(5, "train", True, (6, "rescore"))
    behind = JobStatus(SPEC, ranks(r0=asking, r1=RankStatus(5, "train", True)))
    left = JobStatus(SPEC, ranks(r0=asking, r1=asking))
    asked: list[int] = []

    def rescores(epoch: int) -> bool:
        asked.append(epoch)  # classifying reads the history: never before the barrier
        return True

    view = job_view(rnd({"j": behind}), "j")
    assert view is not None and ready_passes(view, 2, set(), rescores, every_pass) == []
    assert asked == []
    # A pass not planned from losses (warm-up, uniform) does not wait.
    assert ready_passes(view, 2, set(), rescores, lambda e, p: False) == [(6, "rescore")]
    view = job_view(rnd({"j": left}), "j")
    assert view is not None and ready_passes(view, 2, set(), rescores, every_pass) == [
        (6, "rescore")
    ]
    assert still_in(view.ranks, 5, 2) == 0 and still_in(view.ranks, 5, 3) == 1


def test_plan_catch_up_picks_the_lowest_node_that_keeps_each_round() -> None:
    assert plan_catch_up([5, 5, 5], [1, 1, 1]) == []
    assert plan_catch_up([5, 3, 5], [1, 1, 1]) == [(0, 4, 5)]
    # node 0 dropped round 4: node 2 sends it, node 0 sends the rest
    assert plan_catch_up([7, 3, 7], [5, 1, 1]) == [(2, 4, 4), (0, 5, 7)]
    assert plan_catch_up([2, 6, 4], [1, 1, 1]) == [(1, 3, 6)]  # one run, node 2 takes 5-6


def test_plan_catch_up_refuses_a_gap_nobody_keeps() -> None:
    with pytest.raises(
        ClusterError, match="node 1 holds rounds through 3, and no node keeps round 4"
    ):
        plan_catch_up([9, 3, 9], [6, 1, 7])
