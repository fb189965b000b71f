"""What a round says about one job across the nodes, and which of its passes may be planned.

A pass's plan is a function of the engine's state at the moment it is made, so on many nodes
it must be made at the same point of the replicated history: right after a round's entries
are applied, from that round's merged statuses. Everything here is a pure function of a
:class:`Round` (plus the engine's answer to "does this epoch re-score?", itself a function of
the history), so every node reaches the same decisions in the same round.

The rules mirror the one-node barriers: a pass planned from recorded losses (a re-score pass
that classifies, a selecting training pass) waits until every rank of the job, on every node,
has left the epoch before; a training pass of a selecting epoch also waits until every rank
has finished re-scoring that epoch (if any rank re-scores it). Other passes are planned in the
first round in which a rank asks for them.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from loaderd.cluster_wire import KINDS, RankStatus, Round

PassKey = tuple[int, str]  # (epoch, phase)


@dataclass(frozen=True, slots=True)
class JobView:
    """One job as the whole cluster sees it after a round.

    Attributes:
        name: the job.
        spec: the spec every reporting node agrees on (None when they disagree).
        ranks: each global rank's status, from the node that serves it.
        node_of: the node serving each rank.
        problems: one line per disagreement (specs, plans, a rank served by two nodes).
    """

    name: str
    spec: Mapping[str, Any] | None
    ranks: dict[int, RankStatus]
    node_of: dict[int, int]
    problems: list[str] = field(default_factory=list)

    def wanted(self) -> list[PassKey]:
        """The passes some rank waits to open, in plan order (epoch, re-score first)."""
        keys = {s.want for s in self.ranks.values() if s.want is not None}
        return sorted(keys, key=lambda k: (k[0], -KINDS.index(k[1])))


def plan_digest(ids: np.ndarray, weights: np.ndarray) -> str:
    """The digest a node reports for a pass it planned (``JobStatus.plans``)."""
    h = xxhash.xxh3_64(np.ascontiguousarray(ids, np.int64).tobytes())
    h.update(np.ascontiguousarray(weights, np.float32).tobytes())
    return h.hexdigest()


def jobs_in(rnd: Round) -> list[str]:
    """Every job some node reports, sorted."""
    return sorted({name for c in rnd.contributions for name in c.status})


def job_view(rnd: Round, job: str) -> JobView | None:
    """The merged view of ``job`` in ``rnd``; None when no node reports it."""
    spec: Mapping[str, Any] | None = None
    spec_node = -1
    plans: dict[str, tuple[str, int]] = {}  # pass -> (digest, first node reporting it)
    ranks: dict[int, RankStatus] = {}
    node_of: dict[int, int] = {}
    problems: list[str] = []
    for c in rnd.contributions:
        js = c.status.get(job)
        if js is None:
            continue
        if spec_node < 0:
            spec, spec_node = js.spec, c.node
        elif spec is not None and dict(js.spec) != dict(spec):
            problems.append(
                f"job {job!r}: node {c.node} has spec {dict(js.spec)}, "
                f"node {spec_node} has {dict(spec)}"
            )
            spec = None
        for key, digest in sorted(js.plans.items()):
            seen = plans.setdefault(key, (digest, c.node))
            if seen[0] != digest:
                problems.append(
                    f"job {job!r}: node {c.node} planned pass {key} differently from node "
                    f"{seen[1]} (same history, different result: mixed CPUs or numpy builds?)"
                )
        for rank, status in js.ranks.items():
            if rank in node_of:
                problems.append(
                    f"job {job!r}: rank {rank} is served by node {node_of[rank]} and node {c.node}"
                )
                continue
            ranks[rank] = status
            node_of[rank] = c.node
    if spec_node < 0:
        return None
    return JobView(job, spec, ranks, node_of, problems)


def missing_rescores(ranks: Mapping[int, RankStatus], epoch: int, world_size: int) -> int:
    """How many ranks the training plan of ``epoch`` still waits for (0: it may be made).

    Args:
        ranks: each rank's status.
        epoch: a selecting epoch whose training pass some rank wants.
        world_size: the job's ranks on all nodes.

    A rank is done when it asks for the training pass (or is in it), not merely when its
    re-score pass is acknowledged: its trainer flushes the pass's feedback before it asks, and
    the round that shows the ask carries that feedback (a node's entries and status go into a
    round together), while an acknowledged pass's last losses may still be on their way.
    """
    at_epoch = [s for s in ranks.values() if s.epoch == epoch]
    if not any(s.phase == "rescore" for s in at_epoch):
        return 0  # nobody re-scores this epoch: the latest losses stand
    done = sum(1 for s in at_epoch if s.phase == "train" or s.want == (epoch, "train"))
    return max(world_size - done, 0)


def still_in(ranks: Mapping[int, RankStatus], epoch: int, world_size: int) -> int:
    """How many ranks have not yet left ``epoch`` (0: every rank's losses of it are in).

    A rank has left an epoch when it is in a later one or asks for a pass of one: its trainer
    flushed the epoch's feedback before asking, and the round that shows the ask carries it.
    """
    left = sum(
        1 for s in ranks.values() if s.epoch > epoch or (s.want is not None and s.want[0] > epoch)
    )
    return max(world_size - left, 0)


def ready_passes(
    view: JobView,
    world_size: int,
    decided: Container[PassKey],
    rescores: Callable[[int], bool],
    from_losses: Callable[[int, str], bool],
) -> list[PassKey]:
    """The passes to plan now, in order: wanted, not yet decided, and past the barriers.

    Args:
        view: the job after the round whose entries were just applied.
        world_size: the job's ranks on all nodes.
        decided: passes already planned (their plans are persisted).
        rescores: whether an epoch has samples to re-score (the engine's ``rescore_ids``,
            called here so it runs at the same point of the history on every node, and only
            once every rank's losses of the epoch before are in: it classifies from them).
        from_losses: whether a pass is planned from recorded losses (the engine's
            ``plans_from_losses``, which reads no history); such a pass of epoch e waits
            until every rank has left epoch e - 1.
    """
    ready = []
    for epoch, phase in view.wanted():
        if (epoch, phase) in decided:
            continue
        if epoch > 0 and from_losses(epoch, phase) and still_in(view.ranks, epoch - 1, world_size):
            continue
        waits = phase == "train" and rescores(epoch)
        if waits and missing_rescores(view.ranks, epoch, world_size):
            continue
        ready.append((epoch, phase))
    return ready


def job_progress(view: JobView, round_number: int, world_size: int) -> dict[str, Any]:
    """The job's global progress as ``round_number`` showed it, JSON-ready (``loaderd stats``).

    Every node derives the same figures from the same round, so each node's stats show the
    whole cluster's view, not only its own share.

    Returns:
        ``round``; ``ranks_reporting`` of ``world_size``; ``epoch``, the slowest rank's; and
        per node (by node rank, as a string): its ``ranks``, the slowest one's pass ``at``
        (``"epoch:phase"``), how many have their current pass ``complete``, and how many are
        ``waiting`` for a pass to be decided.
    """
    nodes: dict[str, dict[str, Any]] = {}
    for node in sorted(set(view.node_of.values())):
        ranks = sorted(r for r, n in view.node_of.items() if n == node)
        statuses = [view.ranks[r] for r in ranks]
        slowest = min(statuses, key=lambda s: (s.epoch, -KINDS.index(s.phase)))
        nodes[str(node)] = {
            "ranks": ranks,
            "at": f"{slowest.epoch}:{slowest.phase}",
            "complete": sum(s.complete for s in statuses),
            "waiting": sum(s.want is not None for s in statuses),
        }
    return {
        "round": round_number,
        "ranks_reporting": len(view.ranks),
        "world_size": world_size,
        "epoch": min((s.epoch for s in view.ranks.values()), default=None),
        "nodes": nodes,
    }
