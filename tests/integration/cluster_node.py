"""One node of a test cluster: a ClusterNode driven by a stand-in for the epoch planner.

python -m tests.integration.cluster_node --cluster tcp://127.0.0.1:PORT --nodes 3 \
    --node-rank R --db STORE --state DIR --out RESULT.json [--epochs 5] [--pace 0.01]

Each node serves ``--ranks`` global ranks of one job per sampler (ranks R*k .. R*k+k-1) and
walks them through ``[rescore e] -> train e`` for every epoch the way a daemon's planner will:
a rank asks for a pass in its status, the pass is planned only when a round says so
(``cluster_view.ready_passes``, with the real ImportanceEngine and ``plan_pass``), then the
rank feeds back one deterministic loss per sample of its share, batch by batch. Every round's
entries go into the node's engines in round order. Progress is saved after each batch's
feedback is synced, so a node killed with SIGKILL and started again with the same command
goes on where it was (re-sending at most the batches not yet saved).

It ends once a round shows every rank of every job done with the last epoch, writing what it
decided (digests of every pass's sample ids and weights), each engine's final state digest and
its feedback counts to ``--out``. A ClusterError, or a node missing past the timeout (which a
daemon reports and outlives, as this does with ``--keep-trying``), ends it with
``loaderd: error: ...`` and 1.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import select
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loaderd.cluster import ClusterError, ClusterNode
from loaderd.cluster_view import job_view, plan_digest, ready_passes
from loaderd.cluster_wire import JobStatus, RankStatus, Round
from loaderd.config import ClusterConfig
from loaderd.importance import SAMPLERS, ImportanceConfig, ImportanceEngine
from loaderd.journal import read_json, write_json_atomic
from loaderd.planner import RankPlan, plan_pass
from loaderd.storage.store import SampleStore


def losses_for(ids: np.ndarray, epoch: int, kind: str) -> np.ndarray:
    """A deterministic loss per sample: a per-sample level plus per-epoch noise."""
    x = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x ^= np.uint64((epoch * 0xBF58476D1CE4E5B9 + (kind == "rescore")) % 2**64)
    x ^= x >> np.uint64(31)
    return ((ids % 11) + (x % np.uint64(1000)).astype(np.float64) / 500.0).astype(np.float32)


def digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


@dataclass
class RankState:
    epoch: int
    phase: str
    done: int  # batches fed back
    total: int  # batches in the pass (-1: not opened)
    finished: bool = False

    @property
    def complete(self) -> bool:
        return self.total >= 0 and self.done >= self.total


class Job:
    def __init__(self, sampler: str, args: argparse.Namespace, n: int, ranks: list[int]) -> None:
        self.name = f"job-{sampler}"
        options = {"sampler": sampler, "warmup_epochs": 2, "keep_fraction": 0.5}
        if sampler == "infobatch":
            options["prune_keep_prob"] = 0.5
        self.world_size = args.nodes * args.ranks
        self.spec = {
            "name": self.name,
            "world_size": self.world_size,
            "seed": 7,
            "batch_size": args.batch,
            "options": options,
        }
        self.engine = ImportanceEngine(
            n, ImportanceConfig.from_options(options, ImportanceConfig())
        )
        self.epochs = args.epochs
        self.batch = args.batch
        self.ranks = {r: RankState(0, "rescore", 0, -1) for r in ranks}
        self.inputs: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
        self.plans: dict[tuple[int, str], list[RankPlan]] = {}
        self.done = False

    def want(self, s: RankState) -> tuple[int, str] | None:
        return None if s.finished or s.total >= 0 else (s.epoch, s.phase)

    def status(self) -> JobStatus:
        recent = sorted(self.inputs)[-4:]
        return JobStatus(
            self.spec,
            {
                r: RankStatus(s.epoch, s.phase, s.complete or s.finished, self.want(s))
                for r, s in self.ranks.items()
            },
            {f"{e}:{p}": plan_digest(*self.inputs[(e, p)]) for e, p in recent},
        )

    def apply(self, rnd: Round) -> None:
        view = job_view(rnd, self.name)
        if view is None:
            return
        assert not view.problems, view.problems
        ready = ready_passes(
            view,
            self.world_size,
            self.inputs,
            lambda e: len(self.engine.rescore_ids(e)) > 0,
            self.engine.plans_from_losses,
        )
        for epoch, phase in ready:
            if phase == "rescore":
                ids = self.engine.rescore_ids(epoch)
                weights = np.ones(len(ids), np.float32)
            else:
                ids, weights = self.engine.select(epoch, 7)
            self.inputs[(epoch, phase)] = (ids, weights)
            self.plans[(epoch, phase)] = plan_pass(
                ids,
                weights,
                seed=7,
                epoch=epoch,
                phase=phase,
                world_size=self.world_size,
                batch_size=self.batch,
            )
        last = self.epochs - 1
        self.done = len(view.ranks) == self.world_size and all(
            s.epoch == last and s.phase == "train" and s.complete for s in view.ranks.values()
        )

    def step(self, cluster: ClusterNode) -> bool:
        """One batch per local rank at most; True if anything moved."""
        moved = False
        for rank, s in self.ranks.items():
            if s.finished:
                continue
            key = (s.epoch, s.phase)
            if s.total < 0:
                if key in self.plans:
                    s.total = self.plans[key][rank].num_batches
                    moved = True
                continue
            if key not in self.plans:
                continue  # restarted mid-pass: its plan comes with the rounds replayed
            if not s.complete:
                ids, _ = self.plans[key][rank].batch(s.done)
                cluster.submit(self.name, s.epoch, s.phase, ids, losses_for(ids, *key))
                s.done += 1
                moved = True
                continue
            if s.phase == "rescore":
                self.ranks[rank] = RankState(s.epoch, "train", 0, -1)
            elif s.epoch + 1 < self.epochs:
                self.ranks[rank] = RankState(s.epoch + 1, "rescore", 0, -1)
            else:
                s.finished = True
            moved = True
        return moved

    def result(self) -> dict[str, object]:
        state = self.engine.state_dict()
        return {
            # Samples the ranks' plans hand out (a train pass is padded to a multiple of the
            # world size, as DistributedSampler does), and the digest of what was selected.
            "passes": {
                f"{e}:{p}": [sum(len(r.ids) for r in self.plans[(e, p)]), digest(i, w)]
                for (e, p), (i, w) in self.inputs.items()
            },
            "engine": digest(*(state[k] for k in sorted(state))),
            "feedback": int(state["feedback"]),
            "rescore_feedback": int(state["rescore_feedback"]),
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--db", type=Path, required=True)
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--samplers", default=",".join(SAMPLERS))
    p.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per batch turn")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--keep-trying", action="store_true", help="outlive stalls, as a daemon does")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s node{args.node_rank} %(message)s")
    with SampleStore(args.db) as store:
        fingerprint, n = store.fingerprint, store.num_samples
    config = ClusterConfig(
        address=args.cluster,
        nodes=args.nodes,
        node_rank=args.node_rank,
        timeout_s=args.timeout,
        round_interval_s=args.interval,
    )
    local = list(range(args.node_rank * args.ranks, (args.node_rank + 1) * args.ranks))
    jobs = [Job(s, args, n, local) for s in args.samplers.split(",")]
    progress_path = args.state / "progress.json"
    args.state.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        for r, saved in (read_json(progress_path) or {}).get(job.name, {}).items():
            job.ranks[int(r)] = RankState(**saved)
    cluster = ClusterNode(config, fingerprint, args.state)
    cluster.start()
    try:
        while not all(j.done for j in jobs):
            if cluster.failure is not None:
                raise cluster.failure
            if cluster.stalled is not None and not args.keep_trying:  # a daemon keeps trying
                stalled = cluster.stalled
                cluster.close()  # its thread's next attempt would log after the error line
                raise stalled
            select.select([cluster.wake_fd], [], [], 0.05)
            for rnd in cluster.rounds():
                for block in rnd.entries():
                    job = next(j for j in jobs if j.name == block.job)
                    job.engine.record(block.ids, block.losses, block.epoch, block.kind)
                for job in jobs:
                    job.apply(rnd)
            moved = [job.step(cluster) for job in jobs]
            for job in jobs:
                cluster.set_status(job.name, job.status())
            if any(moved):
                cluster.sync()
                write_json_atomic(
                    progress_path,
                    {j.name: {r: vars(s) for r, s in j.ranks.items()} for j in jobs},
                    sync=False,
                )
                if args.pace:
                    time.sleep(args.pace)
        result = {
            "node": args.node_rank,
            "jobs": {j.name: j.result() for j in jobs},
            "cluster": cluster.stats(),
        }
        write_json_atomic(args.out, result)
    except ClusterError as e:
        print(f"loaderd: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
