"""What the importance samplers buy in learning: accuracy against sample-steps, per sampler.

The same small MLP is trained with each sampler, several seeds each, through a real daemon
and ``LoaderdDataset`` (the re-score pass included), on two tasks:

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, no download);
* ``noisy``: a generated 10-class task with easy samples (tight clusters), hard ones (wide
  clusters that overlap) and 10% of the training labels replaced by a random other class.
  The test set has clean labels.

Cost is counted in sample-steps: samples trained with a forward and a backward pass. The
re-score passes (forward only) are counted separately and folded into ``cost`` at 1/3 of a
training step each (a backward pass costs about twice a forward one). "Saved at target" is
``1 - cost to first reach (uniform's final accuracy - 0.5 points) / uniform's total cost``,
on the mean accuracy over seeds. Every sampler gets the same model, optimiser, learning-rate
schedule (cosine over the epochs), batch size and number of epochs.

Prints one JSON line per run and per (task, sampler) summary; writes
``benchmarks/results/importance.md`` and ``importance.png``.

    .venv/bin/python benchmarks/bench_importance.py               # ~6 minutes on 2 cores
    .venv/bin/python benchmarks/bench_importance.py --seeds 5 --noisy-samples 60000
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _timing import machine  # the script's folder is on sys.path
from torch import nn

from loaderd.client import LoaderdDataset
from loaderd.launch import start_daemon, stop_daemon, wait_ready

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_SLACK = 0.5  # accuracy points below uniform's final accuracy that still count as reached
RESCORE_COST = 1 / 3  # a forward pass, relative to a forward + backward training step


@dataclass(frozen=True)
class Task:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: int
    note: str


def digits_task() -> Task:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    note = f"sklearn digits, {len(ytr)} train / {len(yte)} test, 64 features"
    return Task("digits", xtr, ytr.astype(np.int64), xte, yte.astype(np.int64), 10, note)


def noisy_task(n_train: int, n_test: int, dim: int = 32, noise: float = 0.1) -> Task:
    """10 classes of 4 Gaussian blobs each; 60% easy (sigma 0.6), 40% hard (sigma 1.4).

    Blob centres are N(0, 0.6^2) per coordinate, so blobs of different classes overlap and an
    MLP keeps improving for many epochs; ``noise`` of the training labels are flipped to a
    random other class.
    """
    rng = np.random.default_rng(1234)
    classes, blobs = 10, 4
    centres = rng.normal(size=(classes * blobs, dim)) * 0.6

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        blob = rng.integers(0, classes * blobs, n)
        sigma = np.where(rng.random(n) < 0.6, 0.6, 1.4)
        x = centres[blob] + rng.normal(size=(n, dim)) * sigma[:, None]
        return x.astype(np.float32), (blob % classes).astype(np.int64)

    xtr, ytr = draw(n_train)
    flip = rng.random(n_train) < noise
    ytr[flip] = (ytr[flip] + rng.integers(1, classes, int(flip.sum()))) % classes
    xte, yte = draw(n_test)
    note = (
        f"generated, {n_train} train / {n_test} test, {dim} features, 10 classes x 4 blobs, "
        f"60% easy / 40% hard, {noise:.0%} of training labels wrong (test labels clean)"
    )
    return Task("noisy", xtr, ytr, xte, yte, classes, note)


def sampler_options(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The configurations compared; non-uniform ones share keep_fraction and warm-up."""
    common = {"keep_fraction": args.keep_fraction, "warmup_epochs": args.warmup_epochs}
    anneal = {"anneal_epochs": args.anneal_epochs, "epochs": args.epochs}
    configs: dict[str, dict[str, Any]] = {
        "uniform": {"sampler": "uniform"},
        "importance": {"sampler": "importance", **common},
        "importance+anneal": {"sampler": "importance", **common, **anneal},
        "unbiased": {"sampler": "unbiased", **common},
        "infobatch": {
            "sampler": "infobatch",
            **common,
            "prune_keep_prob": args.prune_keep_prob,
            **anneal,
        },
        # InfoBatch as published: training losses only, no re-score forward passes.
        "infobatch-norescore": {
            "sampler": "infobatch",
            **common,
            "prune_keep_prob": args.prune_keep_prob,
            **anneal,
            "rescore": False,
        },
    }
    return {k: v for k, v in configs.items() if k in args.samplers}


@contextmanager
def serve(task: Task, workdir: Path) -> Iterator[str]:
    """Ingest the task's training set and run a daemon on it; yields its address."""
    from loaderd.storage.ingest import ingest

    src = workdir / f"{task.name}.npz"
    np.savez(src, x=task.x_train, y=task.y_train)
    db = workdir / f"{task.name}.db"
    ingest(src, db, progress=False)
    sock_dir = Path(tempfile.mkdtemp(prefix="ldb-", dir="/tmp"))
    address = f"ipc://{sock_dir}/d.sock"
    log = workdir / f"{task.name}.log"
    proc = start_daemon(db, address, state_dir=workdir / f"{task.name}.state", log=log)
    try:
        wait_ready(address, timeout_s=30, proc=proc)
        yield address
    finally:
        stop_daemon(proc)
        shutil.rmtree(sock_dir, ignore_errors=True)


def make_model(dim: int, classes: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean()) * 100


def train_run(
    address: str,
    task: Task,
    name: str,
    options: dict[str, Any],
    seed: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Train one model with one sampler; returns per-epoch accuracy and cumulative costs."""
    torch.manual_seed(seed)
    model = make_model(task.x_train.shape[1], task.classes, args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    per_sample = nn.CrossEntropyLoss(reduction="none")
    job = f"{task.name}-{name}-s{seed}"
    ds = LoaderdDataset(address, job=job, batch_size=args.batch_size, seed=seed, **options)
    x_test, y_test = torch.from_numpy(task.x_test), torch.from_numpy(task.y_test)
    trained = rescored = 0
    acc, train_steps, rescore_steps = [], [], []
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        for group in opt.param_groups:  # cosine by epoch: every sampler sees the same schedule
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs))
        with torch.no_grad():
            for batch in ds.rescore():
                loss = per_sample(model(batch["x"]), batch["y"])
                ds.feedback(batch["id"], loss)
                rescored += len(loss)
        for batch in ds:
            loss = per_sample(model(batch["x"]), batch["y"])
            opt.zero_grad(set_to_none=True)
            (loss * batch["weight"]).mean().backward()
            opt.step()
            ds.feedback(batch["id"], loss.detach())
            trained += len(loss)
        acc.append(accuracy(model, x_test, y_test))
        train_steps.append(trained)
        rescore_steps.append(rescored)
    wall = time.perf_counter() - t0
    imp = ds.stats()["jobs"][job]["importance"]
    ds.close()
    return {
        "task": task.name,
        "sampler": name,
        "seed": seed,
        "options": options,
        "acc": [round(a, 3) for a in acc],
        "train_steps": train_steps,
        "rescore_steps": rescore_steps,
        "wall_s": round(wall, 2),
        "high_group": imp["high_group"],
        "kept_fraction": imp["kept_fraction"],
    }


def summarise(runs: list[dict[str, Any]], n_train: int) -> list[dict[str, Any]]:
    """Mean over seeds per (task, sampler), with costs relative to uniform on that task."""
    out = []
    for task in dict.fromkeys(r["task"] for r in runs):
        by: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            if r["task"] == task:
                by.setdefault(r["sampler"], []).append(r)
        curves = {}
        for name, rs in by.items():
            acc = np.mean([r["acc"] for r in rs], axis=0)
            train = np.mean([r["train_steps"] for r in rs], axis=0)
            rescore = np.mean([r["rescore_steps"] for r in rs], axis=0)
            curves[name] = (acc, train, rescore, train + RESCORE_COST * rescore)
        base_acc, _, _, base_cost = curves["uniform"]
        target = base_acc[-1] - TARGET_SLACK
        # Uniform's own cost to first reach the target: a plateau early in the baseline's run
        # must not count as savings for the others.
        base_at_target = float(base_cost[np.flatnonzero(base_acc >= target)[0]])
        for name, (acc, train, rescore, cost) in curves.items():
            finals = [r["acc"][-1] for r in by[name]]
            reached = np.flatnonzero(acc >= target)
            at_target = float(cost[reached[0]]) if reached.size else None
            out.append(
                {
                    "task": task,
                    "sampler": name,
                    "seeds": len(finals),
                    "final_acc": round(float(np.mean(finals)), 2),
                    "final_acc_std": round(float(np.std(finals)), 2),
                    "delta_vs_uniform": round(float(np.mean(finals) - base_acc[-1]), 2),
                    "acc_per_epoch": [round(float(a), 2) for a in acc],
                    "train_sample_steps": int(train[-1]),
                    "rescore_forwards": int(rescore[-1]),
                    "cost": int(cost[-1]),
                    "cost_epochs": round(float(cost[-1]) / n_train, 2),
                    "saved_total": round(1 - float(cost[-1] / base_cost[-1]), 3),
                    "target_acc": round(float(target), 2),
                    "epoch_at_target": int(reached[0]) + 1 if reached.size else None,
                    "saved_at_target": (
                        round(1 - at_target / base_at_target, 3) if at_target is not None else None
                    ),
                    "wall_s": round(float(np.mean([r["wall_s"] for r in by[name]])), 2),
                    "_curve": (cost / n_train).tolist(),
                }
            )
    return out


def goal(summary: list[dict[str, Any]]) -> dict[str, Any]:
    """Samplers meeting the bar on every task: the whole run costs >= 30% less than uniform's
    (re-score forwards included) and ends within 0.5 points of uniform's final accuracy."""
    tasks = list(dict.fromkeys(s["task"] for s in summary))
    met = {}
    for name in dict.fromkeys(s["sampler"] for s in summary):
        if name == "uniform":
            continue
        rows = [s for s in summary if s["sampler"] == name]
        ok = len(rows) == len(tasks) and all(
            s["saved_total"] >= 0.30 and s["delta_vs_uniform"] >= -TARGET_SLACK for s in rows
        )
        met[name] = ok
    return met


def write_markdown(
    path: Path, summary: list[dict[str, Any]], tasks: list[Task], args: argparse.Namespace
) -> None:
    cmd = "python benchmarks/bench_importance.py " + shlex.join(sys.argv[1:])
    m = machine()
    lines = [
        "# Importance samplers: accuracy against sample-steps",
        "",
        f"Command: `{cmd.strip()}` (`make bench-importance` runs the defaults).",
        f"Machine: {m['nproc']} cores, {m['cpu']}; Python {m['python']}, torch {m['torch']}.",
        "",
        f"Model: MLP (hidden {args.hidden}), SGD momentum 0.9, lr {args.lr} cosine over "
        f"{args.epochs} epochs, batch {args.batch_size}, seeds {list(range(args.seeds))}. "
        f"Non-uniform samplers: keep_fraction {args.keep_fraction}, warmup_epochs "
        f"{args.warmup_epochs}; infobatch prune_keep_prob {args.prune_keep_prob}; annealed "
        f"variants train on everything in the last {args.anneal_epochs} epochs.",
        "",
        "Cost = training sample-steps (forward + backward) + re-score forwards x 1/3 (a "
        "forward is about a third of a forward + backward). *Saved (total)*: 1 - the whole "
        "run's cost / uniform's whole run. *Saved at target*: 1 - cost to first reach "
        f"uniform's final accuracy - {TARGET_SLACK} points / uniform's own cost to first reach "
        "it (mean curves over seeds). Accuracy is on the held-out test set, in percent.",
        "",
    ]
    for task in tasks:
        rows = [s for s in summary if s["task"] == task.name]
        lines += [
            f"## {task.name}: {task.note}",
            "",
            "| sampler | final acc | vs uniform | train steps | re-score fwd | cost (epochs) "
            "| saved (total) | reached target at epoch | saved at target | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in rows:
            at = s["saved_at_target"]
            lines.append(
                f"| {s['sampler']} | {s['final_acc']:.2f} ± {s['final_acc_std']:.2f} "
                f"| {s['delta_vs_uniform']:+.2f} | {s['train_sample_steps']:,} "
                f"| {s['rescore_forwards']:,} | {s['cost_epochs']:.2f} "
                f"| {s['saved_total']:.1%} | {s['epoch_at_target'] or '—'} "
                f"| {'—' if at is None else f'{at:.1%}'} | {s['wall_s']:.1f} |"
            )
        lines += ["", "Test accuracy per epoch (mean over seeds):", ""]
        lines += ["| sampler | " + " | ".join(str(e + 1) for e in range(args.epochs)) + " |"]
        lines += ["|---|" + "---|" * args.epochs]
        for s in rows:
            lines.append(
                f"| {s['sampler']} | " + " | ".join(f"{a:.1f}" for a in s["acc_per_epoch"]) + " |"
            )
        lines.append("")
    met = goal(summary)
    winners = [k for k, v in met.items() if v]
    lines += [
        "## Goal",
        "",
        "The whole run costs at least 30% less than uniform's (re-score forwards included) and "
        f"ends within {TARGET_SLACK} points of uniform's final accuracy (mean over seeds), on "
        "both tasks (the noisy one included): "
        + (", ".join(f"**{w}**" for w in winners) + " meet it." if winners else "not met."),
        "",
    ]
    path.write_text("\n".join(lines))


def write_plot(path: Path, summary: list[dict[str, Any]], tasks: list[Task]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        rows = [s for s in summary if s["task"] == task.name]
        for s in rows:
            style: dict[str, Any] = {"lw": 1.6}
            if s["sampler"] == "uniform":
                style = {"color": "black", "lw": 2.2}
            elif "anneal" in s["sampler"]:
                style["ls"] = "--"  # the same as its base sampler until the last epochs
            ax.plot(s["_curve"], s["acc_per_epoch"], marker="o", ms=3, label=s["sampler"], **style)
        target = rows[0]["target_acc"]
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.1f}%")
        final = [s["final_acc"] for s in rows]
        lo = min(min(s["acc_per_epoch"][len(s["acc_per_epoch"]) // 3 :]) for s in rows)
        ax.set_ylim(max(lo - 1, 0), max(final) + 1.0)
        ax.set_title(f"{task.name} (mean over seeds)")
        ax.set_xlabel("cost: training sample-steps + re-score forwards / 3, in epochs of data")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    tasks = []
    if "digits" in args.tasks:
        tasks.append(digits_task())
    if "noisy" in args.tasks:
        tasks.append(noisy_task(args.noisy_samples, args.noisy_test))
    configs = sampler_options(args)
    if "uniform" not in configs:
        raise SystemExit("bench_importance: the uniform baseline is required (--samplers)")
    runs: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-importance-"))
    try:
        for task in tasks:
            with serve(task, workdir) as address:
                for name, options in configs.items():
                    for seed in range(args.seeds):
                        run = train_run(address, task, name, options, seed, args)
                        runs.append(run)
                        print(json.dumps(run), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = []
    for task in tasks:
        rows = summarise([r for r in runs if r["task"] == task.name], len(task.y_train))
        summary += rows
        for row in rows:
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("_")}), flush=True)
    print(json.dumps({"goal_met_by": goal(summary), "machine": machine()}), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_markdown(args.out / "importance.md", summary, tasks, args)
        try:
            write_plot(args.out / "importance.png", summary, tasks)
        except ImportError:
            print("bench_importance: matplotlib not installed; no plot", file=sys.stderr)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tasks", nargs="+", default=["digits", "noisy"], choices=["digits", "noisy"])
    p.add_argument(
        "--samplers",
        nargs="+",
        default=[
            "uniform",
            "importance",
            "importance+anneal",
            "unbiased",
            "infobatch",
            "infobatch-norescore",
        ],
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--keep-fraction", type=float, default=0.35)
    p.add_argument("--warmup-epochs", type=int, default=3)
    p.add_argument("--prune-keep-prob", type=float, default=0.3)
    p.add_argument("--anneal-epochs", type=int, default=2)
    p.add_argument("--noisy-samples", type=int, default=20000)
    p.add_argument("--noisy-test", type=int, default=10000)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the daemon uses a core)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the .md and .png go")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
