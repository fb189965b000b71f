"""Does importance sampling pay off against an honest baseline, on tasks it was not tuned on?

A sampler that trains on part of the data each epoch saves sample-steps; the honest question is
whether it learns more than uniform training given the same number of them. So every family is
trained, per seed, with:

* uniform for the full budget (``--epochs`` epochs, cosine learning rate over them);
* uniform at each budget b (``round(b * epochs)`` epochs, the cosine compressed to them): the
  budget-matched baseline;
* each sampler at each budget b: ``--epochs`` epochs under its own schedule, with
  ``budget=b`` telling the engine how many sample-steps it may spend in all.

A sampler's gain is its test accuracy minus the budget-matched uniform's, paired by seed (same
data draw, same initialisation). Cost is counted in sample-steps: trained samples, plus re-score
forwards at 1/3 of a step. Every run goes through a real daemon and ``LoaderdDataset`` with the
same training function; several jobs share one daemon per (family, seed).

Prints one JSON line per run and per summary row; writes ``benchmarks/results/importance.md``,
``importance.json`` and ``importance.png``.

    nice -n 19 .venv/bin/python benchmarks/bench_importance.py            # everything
    nice -n 19 .venv/bin/python benchmarks/bench_importance.py --quick    # a smoke run
    .venv/bin/python benchmarks/bench_importance.py --families noisy10 --samplers learnable
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _timing import machine  # the script's folder is on sys.path
from bench_importance_report import summarise, write_markdown, write_plot
from bench_importance_tasks import FAMILIES, HELD_OUT, NOT_TUNED, TUNED_ON, Task, make_model
from bench_importance_tasks import make_task as draw_task
from torch import nn

from loaderd.client import LoaderdDataset
from loaderd.importance import RESCORE_COST
from loaderd.launch import start_daemon, stop_daemon, wait_ready

RESULTS = Path(__file__).resolve().parent / "results"

Options = Callable[[float, int], dict[str, Any]]
# The samplers compared, as a user would configure them for a budget and a number of epochs.
SAMPLERS: dict[str, Options] = {
    # The recommended setting: nothing but the sampler, the budget and the epochs.
    "learnable": lambda b, e: {"sampler": "learnable", "budget": b, "epochs": e},
    # The seed's method: re-score the volatile samples, train the top of the latest loss.
    "importance": lambda b, e: {"sampler": "importance", "budget": b, "epochs": e},
    "infobatch": lambda b, e: {"sampler": "infobatch", "budget": b, "epochs": e},
}
RECOMMENDED = "learnable"


def uniform(_: float, __: int) -> dict[str, Any]:
    return {"sampler": "uniform"}


@contextmanager
def serve(task: Task, workdir: Path) -> Iterator[str]:
    """Ingest the task's training set and run a daemon on it; yields its address."""
    from loaderd.storage.ingest import ingest

    name = f"{task.family}-{task.seed}"
    src = workdir / f"{name}.npz"
    np.savez(src, x=task.x_train, y=task.y_train)
    db = workdir / f"{name}.db"
    ingest(src, db, progress=False)
    sock_dir = Path(tempfile.mkdtemp(prefix="ldb-", dir="/tmp"))
    address = f"ipc://{sock_dir}/d.sock"
    proc = start_daemon(db, address, state_dir=workdir / f"{name}.state", log=workdir / "d.log")
    try:
        wait_ready(address, timeout_s=30, proc=proc)
        yield address
    finally:
        stop_daemon(proc)
        shutil.rmtree(sock_dir, ignore_errors=True)


def train_run(
    address: str,
    task: Task,
    job: str,
    options: dict[str, Any],
    epochs: int,
    batch_size: int,
) -> dict[str, Any]:
    """Train one model through the daemon: the one training loop of every arm.

    SGD with momentum, the learning rate on a cosine over ``epochs``, the loss weighted by
    ``batch["weight"]``, per-sample losses sent back, re-score passes run when the job has any.
    """
    torch.manual_seed(task.seed)
    model = make_model(task)
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9, weight_decay=5e-4)
    per_sample = nn.CrossEntropyLoss(reduction="none")
    ds = LoaderdDataset(address, job=job, batch_size=batch_size, seed=task.seed, **options)
    trained = rescored = 0
    t0 = time.perf_counter()
    for epoch in range(epochs):
        for group in opt.param_groups:
            group["lr"] = task.lr * 0.5 * (1 + math.cos(math.pi * epoch / epochs))
        model.eval()
        with torch.no_grad():
            for batch in ds.rescore():
                ds.feedback(batch["id"], per_sample(model(batch["x"]), batch["y"]))
                rescored += len(batch["id"])
        model.train()
        for batch in ds:
            loss = per_sample(model(batch["x"]), batch["y"])
            opt.zero_grad(set_to_none=True)
            (loss * batch["weight"]).mean().backward()
            opt.step()
            ds.feedback(batch["id"], loss.detach())
            trained += len(loss)
    wall = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(task.x_test))
        acc = float((logits.argmax(1) == torch.from_numpy(task.y_test)).float().mean()) * 100
    job_stats = ds.stats()["jobs"][job]
    ds.close()
    n = len(task.y_train)
    return {
        "train_steps": trained,
        "rescore_forwards": rescored,
        "served": job_stats["samples_served"],  # the daemon's count: every step went through it
        "sampler": job_stats["importance"]["sampler"],  # what the daemon applied
        "cost": (trained + RESCORE_COST * rescored) / n,  # in epochs of data
        "acc": round(acc, 3),
        "wall_s": round(wall, 2),
    }


def arms(args: argparse.Namespace) -> list[tuple[str, float, int, dict[str, Any]]]:
    """(name, budget, epochs, options): uniform full and budget-matched, then each sampler."""
    e = args.epochs
    out = [("uniform", 1.0, e, uniform(1.0, e))]
    out += [("uniform", b, max(1, round(b * e)), uniform(b, e)) for b in args.budgets]
    out += [(s, b, e, SAMPLERS[s](b, e)) for s in args.samplers for b in args.budgets]
    return out


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-importance-"))
    try:
        for family in args.families:
            for seed in range(args.seeds):
                task = draw_task(family, seed, args.scale)
                with serve(task, workdir) as address:
                    for name, budget, epochs, options in arms(args):
                        job = f"{name}-b{budget:g}-s{seed}"
                        run = train_run(address, task, job, options, epochs, args.batch_size)
                        run = {
                            "family": family,
                            "seed": seed,
                            "arm": name,
                            "budget": budget,
                            "epochs": epochs,
                            "options": options,
                            "train_samples": len(task.y_train),
                            **run,
                        }
                        runs.append(run)
                        print(json.dumps(run), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return runs


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    runs = run_all(args)
    wall = time.perf_counter() - t0
    rows, goals = summarise(runs, RECOMMENDED)
    for row in rows + goals:
        print(json.dumps(row), flush=True)
    report = {
        "command": "python benchmarks/bench_importance.py " + shlex.join(sys.argv[1:]),
        "machine": machine(),
        "wall_s": round(wall, 1),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "notes": {f: draw_task(f, 0, args.scale).note for f in args.families},
        "tuned_on": list(TUNED_ON),
        "not_tuned": list(NOT_TUNED),
        "held_out": list(HELD_OUT),
        "recommended": RECOMMENDED,
        "summary": rows,
        "goals": goals,
        "runs": runs,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "importance.json").write_text(json.dumps(report, indent=1) + "\n")
        write_markdown(args.out / "importance.md", report)
        try:
            write_plot(args.out / "importance.png", report)
        except ImportError:
            print("bench_importance: matplotlib not installed; no plot", file=sys.stderr)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    every = [*TUNED_ON, *NOT_TUNED, *HELD_OUT]
    p.add_argument("--families", nargs="+", default=every, choices=list(FAMILIES))
    p.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=list(SAMPLERS))
    p.add_argument(
        "--extra",
        nargs="+",
        default=[],
        metavar="NAME=JSON",
        help='more samplers to compare, e.g. \'mine={"sampler": "learnable", "explore": 0.5}\' '
        "(budget and epochs are added)",
    )
    p.add_argument("--budgets", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the generated set sizes")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the daemon uses a core)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the results go ('' for none)")
    p.add_argument(
        "--quick", action="store_true", help="2 seeds, 50%% budget, the recommended sampler only"
    )
    args = p.parse_args(argv)
    for spec in args.extra:
        name, _, text = spec.partition("=")
        extra = json.loads(text)
        SAMPLERS[name] = lambda b, e, extra=extra: {**extra, "budget": b, "epochs": e}
        args.samplers.append(name)
    if args.quick:
        args.seeds, args.budgets, args.samplers = 2, [0.5], [RECOMMENDED]
        if args.out == RESULTS:
            args.out = None  # a smoke run does not replace the published results
    if str(args.out) in ("", "."):
        args.out = None
    if RECOMMENDED not in args.samplers:
        raise SystemExit(f"bench_importance: the recommended sampler {RECOMMENDED} is required")
    return args


if __name__ == "__main__":
    sys.exit(main(parse_args()))
