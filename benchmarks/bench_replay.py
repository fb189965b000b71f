"""A job's restart after a kill: its snapshot loaded and its feedback journal replayed.

The journal is emptied only when it outgrows its bound (four engine snapshots' worth, at least
16 MiB) and at a clean stop, so a start after ``kill -9`` may replay many epochs of feedback.
This fills a job's journal as a trainer does (FEEDBACKs of ``--feedback-samples`` samples, one
epoch after another, each epoch's selection journalled between) until it is just under its
bound, drops the job as a kill does (the files as they are), and times the restart; then the
same restart with each entry replayed by itself (the engine's state compared with the first).
Writes ``results/<--name>.json`` and ``.md``. Example:

    python benchmarks/bench_replay.py --samples 1281167 --samplers uniform importance
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _timing import header, machine, write_results  # the script's folder is on sys.path

from loaderd import jobs
from loaderd.importance import ImportanceConfig
from loaderd.jobs import Job, JobSpec

HERE = Path(__file__).resolve().parent


def filled(state_dir: Path, spec: JobSpec, n: int, per_feedback: int) -> dict[str, Any]:
    """A job's directory with its journal just under the bound, left as a kill leaves it."""
    job = Job(spec, n, ImportanceConfig(), state_dir)
    assert job.journal is not None and job.cursor_log is not None
    bound = job._journal_bound()
    rng = np.random.default_rng(0)
    epochs = 0
    while job.journal.size_bytes < 0.9 * bound and epochs < 100:
        state = job.open_pass(0, 0, "train")
        for index in range(state.num_batches):
            job.assign(0, state, 0)
            job.ack(state, [index])
        order = state.plan.ids
        for lo in range(0, len(order), per_feedback):
            ids = order[lo : lo + per_feedback]
            job.record_feedback(ids, rng.random(len(ids), np.float32), "train")
        state.ended = True
        epochs += 1
    size = job.journal.size_bytes
    job.save()
    job.journal.close()
    job.cursor_log.close()
    return {"bound_mib": bound / 2**20, "journal_mib": size / 2**20, "epochs": epochs}


def timed_restart(state_dir: Path, spec: JobSpec, n: int) -> tuple[float, Job]:
    t = time.perf_counter()
    job = Job(spec, n, ImportanceConfig(), state_dir)
    return time.perf_counter() - t, job


def one(sampler: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = JobSpec("replay", world_size=1, seed=1, batch_size=64, options={"sampler": sampler})
    with tempfile.TemporaryDirectory(prefix="replay-", dir=args.dir) as tmp:
        state_dir = Path(tmp) / "job"
        row = {"sampler": sampler, **filled(state_dir, spec, args.samples, args.feedback_samples)}
        saved = Path(tmp) / "saved"
        shutil.copytree(state_dir, saved)  # a replay cuts nothing here, but starts from the same
        row["restart_s"], joined = timed_restart(state_dir, spec, args.samples)
        runs, jobs._runs = jobs._runs, lambda entries: entries  # each entry by itself
        try:
            row["restart_one_by_one_s"], single = timed_restart(saved, spec, args.samples)
        finally:
            jobs._runs = runs
        a, b = joined.engine.state_dict(), single.engine.state_dict()
        row["same_state"] = all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)
    print(row, flush=True)
    return row


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], command: str, n: int) -> str:
    lines = [
        *header(f"A job's restart after a kill: {n:,} samples", info, command),
        "The journal filled to just under its bound by whole epochs of feedback, then the job "
        "dropped as a kill leaves it and started again: the snapshot loaded (none here) and "
        "the journal replayed, each run of one epoch's feedback joined into one `record`; "
        "then the same with every entry replayed by itself.",
        "",
        "| sampler | bound MiB | journal MiB | epochs | restart s | one by one s | same state |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r['sampler']} | {r['bound_mib']:.0f} | {r['journal_mib']:.0f} | {r['epochs']} "
        f"| {r['restart_s']:.2f} | {r['restart_one_by_one_s']:.2f} | {r['same_state']} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    info = machine()
    rows = [one(s, args) for s in args.samplers]
    write_results(
        args.out, args.name, info, rows, lambda cmd: markdown(rows, info, cmd, args.samples)
    )
    return 0 if all(r["same_state"] for r in rows) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--samples", type=int, default=1_281_167)
    p.add_argument("--samplers", nargs="+", default=["uniform", "importance"])
    p.add_argument("--feedback-samples", type=int, default=512, help="samples a FEEDBACK")
    p.add_argument("--dir", default=None, help="where the job's files go (default: the temp dir)")
    p.add_argument("--name", default="journal_replay")
    p.add_argument("--out", default=str(HERE / "results"))
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
