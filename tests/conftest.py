"""Fixtures: a small ingested store, and a real daemon serving it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import Daemon, make_npz

N_SAMPLES = 480  # divisible by 2 ranks, 3 workers, and not by the batch sizes used


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """(store path, the arrays it was ingested from)."""
    from loaderd.storage.ingest import ingest

    root = tmp_path_factory.mktemp("data")
    arrays = make_npz(root / "train.npz", N_SAMPLES)
    ingest(root / "train.npz", root / "train.db", progress=False)
    return root / "train.db", arrays


@pytest.fixture
def daemon(dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> Iterator[Daemon]:
    with Daemon(db=dataset[0], state_dir=tmp_path / "state") as d:
        yield d
