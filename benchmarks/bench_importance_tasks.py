"""The task families of the importance benchmark: generated (or bundled) data and their models.

Every family is drawn from a seed with numpy, so a run needs no download and each seed is a new
draw of the data as well as of the model's initialisation. Test labels are always clean (and
balanced where the training set is not): a sampler is judged on what the model learned, not on
how well it fits noise.

The families differ in what they stress: label noise (a raw-loss ranking keeps the mislabelled
samples), class imbalance (the rare classes hold the high losses), redundancy (most of the data
repeats a few samples, so uniform training spends steps on copies), an image task with a small
CNN (another model and loss landscape), and real handwriting with noisy labels. The tabular
tasks are labelled by a random teacher network, which a student MLP learns slowly: more epochs
keep paying, so a budget matters, and easy samples (far from the teacher's boundaries) mix with
hard ones (near them) as in real data. Which families the recommended setting was tuned on is
recorded in ``TUNED_ON``; the others were first run after the rule was committed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
from torch import nn

__all__ = ["FAMILIES", "HELD_OUT", "NOT_TUNED", "TUNED_ON", "Task", "make_model", "make_task"]

CLASSES = 10
TEACHER = "12 features labelled by a random 2-layer tanh teacher (10 classes)"


@dataclass(frozen=True)
class Task:
    """One family drawn with one seed: training and test arrays and how to model them."""

    family: str
    seed: int
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    model: str  # "mlp" or "cnn"
    lr: float  # the peak learning rate, chosen for uniform training of the family
    note: str
    flipped: np.ndarray  # training samples whose label was replaced (for analysis only)


class _Teacher:
    """A random two-layer tanh network whose arg-max labels its inputs: the function to learn."""

    def __init__(self, rng: np.random.Generator, dim: int = 12, hidden: int = 48) -> None:
        self.dim = dim
        self.w1 = rng.normal(size=(dim, hidden)) * 1.5 / np.sqrt(dim)
        self.b1 = rng.normal(size=hidden) * 0.5
        self.w2 = rng.normal(size=(hidden, CLASSES)) / np.sqrt(hidden)

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.normal(size=(n, self.dim)).astype(np.float32)
        return x, (np.tanh(x @ self.w1 + self.b1) @ self.w2).argmax(1).astype(np.int64)

    def draw_sized(
        self, rng: np.random.Generator, sizes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``sizes[c]`` samples of each class ``c``, in random order."""
        xs, ys, have = [], [], np.zeros(CLASSES, dtype=np.int64)
        while (have < sizes).any():
            x, y = self.draw(rng, 20000)
            xs.append(x)
            ys.append(y)
            have += np.bincount(y, minlength=CLASSES)
        x, y = np.concatenate(xs), np.concatenate(ys)
        keep = np.concatenate([np.flatnonzero(y == c)[: sizes[c]] for c in range(CLASSES)])
        keep = rng.permutation(keep)
        return x[keep], y[keep]


def _flip(rng: np.random.Generator, y: np.ndarray, share: float) -> tuple[np.ndarray, np.ndarray]:
    """Replace ``share`` of the labels by a random other class (symmetric label noise)."""
    flipped = rng.random(y.size) < share
    y = y.copy()
    y[flipped] = (y[flipped] + rng.integers(1, CLASSES, int(flipped.sum()))) % CLASSES
    return y, flipped


def _tabular(family: str, seed: int, scale: float, noise: float = 0.0) -> Task:
    rng = np.random.default_rng([seed, 13])
    teacher = _Teacher(rng)
    n, n_test = round(8000 * scale), round(8000 * scale)
    x_train, y_train = teacher.draw(rng, n)
    y_train, flipped = _flip(rng, y_train, noise)
    x_test, y_test = teacher.draw(rng, n_test)
    note = f"{n} train / {n_test} test, {TEACHER}"
    if noise:
        note += f"; {noise:.0%} of training labels flipped to another class"
    return Task(family, seed, x_train, y_train, x_test, y_test, "mlp", 0.1, note, flipped)


def _imbalance(family: str, seed: int, scale: float) -> Task:
    """Class sizes fall geometrically from 2,000 to 100 (in a random class order)."""
    rng = np.random.default_rng([seed, 15])
    teacher = _Teacher(rng)
    order = rng.permutation(CLASSES) / (CLASSES - 1)
    sizes = np.round(2000 * scale * 0.05**order).astype(np.int64)
    x_train, y_train = teacher.draw_sized(rng, sizes)
    x_test, y_test = teacher.draw_sized(rng, np.full(CLASSES, round(800 * scale)))
    note = (
        f"{len(y_train)} train (class sizes {sizes.max()} down to {sizes.min()}, geometric) / "
        f"{len(y_test)} test (balanced), {TEACHER}"
    )
    none = np.zeros(y_train.size, dtype=np.bool_)
    return Task(family, seed, x_train, y_train, x_test, y_test, "mlp", 0.1, note, none)


def _redundant(family: str, seed: int, scale: float) -> Task:
    """Web-like data: distinct samples plus many copies of a few of them."""
    rng = np.random.default_rng([seed, 17])
    teacher = _Teacher(rng)
    distinct, copied, copies = round(3000 * scale), round(250 * scale), 20
    x, y = teacher.draw(rng, distinct)
    dup = np.repeat(rng.choice(distinct, copied, replace=False), copies)
    idx = rng.permutation(np.concatenate([np.arange(distinct), dup]))
    x_test, y_test = teacher.draw(rng, round(8000 * scale))
    note = (
        f"{distinct} distinct samples + {copies} copies each of {copied} of them "
        f"({idx.size} in all) / {len(y_test)} test, {TEACHER}"
    )
    none = np.zeros(idx.size, dtype=np.bool_)
    return Task(family, seed, x[idx], y[idx], x_test, y_test, "mlp", 0.1, note, none)


def _images(family: str, seed: int, scale: float) -> Task:
    """1x16x16 images: a blocky template per class, shifted, faint or clear, in pixel noise."""
    rng = np.random.default_rng([seed, 19])
    coarse = rng.random((CLASSES, 4, 4)).astype(np.float32)
    templates = np.kron(coarse, np.ones((4, 4), np.float32)) - 0.5  # 4x4 blocks of 4x4 pixels

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        label = rng.integers(0, CLASSES, count)
        shift = rng.integers(-3, 4, (count, 2))
        contrast = rng.uniform(0.1, 0.7, count).astype(np.float32)
        img = np.empty((count, 1, 16, 16), np.float32)
        for i in range(count):
            img[i, 0] = np.roll(templates[label[i]], tuple(shift[i]), axis=(0, 1)) * contrast[i]
        img += rng.normal(scale=0.25, size=img.shape).astype(np.float32)
        return img, label.astype(np.int64)

    n, n_test = round(8000 * scale), round(4000 * scale)
    x_train, y_train = draw(n)
    x_test, y_test = draw(n_test)
    note = (
        f"{n} train / {n_test} test images 1x16x16: 10 blocky templates shifted by up to 3 px, "
        "contrast 0.1-0.7 in pixel noise 0.25; a 2-layer CNN"
    )
    none = np.zeros(n, dtype=np.bool_)
    return Task(family, seed, x_train, y_train, x_test, y_test, "cnn", 0.02, note, none)


def _digits(family: str, seed: int, scale: float) -> Task:
    """scikit-learn's bundled 8x8 digits (real handwriting), 20% of training labels flipped."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)
    rng = np.random.default_rng([seed, 23])
    ytr, flipped = _flip(rng, ytr.astype(np.int64), 0.2)
    note = f"sklearn digits, {len(ytr)} train / {len(yte)} test, 20% of training labels flipped"
    return Task(family, seed, xtr, ytr, xte, yte.astype(np.int64), "mlp", 0.1, note, flipped)


FAMILIES: dict[str, Callable[[str, int, float], Task]] = {
    "clean": _tabular,
    "noisy10": partial(_tabular, noise=0.1),
    "noisy30": partial(_tabular, noise=0.3),
    "imbalance": _imbalance,
    "redundant": _redundant,
    "image": _images,
    "digits": _digits,
}
# The recommended setting's rule was chosen on these families ...
TUNED_ON = ("clean", "noisy10", "imbalance")
# ... and written down (committed) before these were run with it; `digits` (real data, a kind
# the generators do not make) is the further held-out family.
NOT_TUNED = ("noisy30", "redundant", "image")
HELD_OUT = ("digits",)


def make_task(family: str, seed: int, scale: float = 1.0) -> Task:
    """Draw ``family`` with ``seed``; ``scale`` multiplies the generated set sizes."""
    return FAMILIES[family](family, seed, scale)


def make_model(task: Task) -> nn.Module:
    """Two hidden layers of 64 for tabular tasks; two conv layers (8, 16 channels) for images."""
    if task.model == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 4 * 4, CLASSES),
        )
    dim = task.x_train.shape[1]
    return nn.Sequential(
        nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES)
    )
