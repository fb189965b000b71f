"""A trainer's view: batches over a real socket match the store, epoch after epoch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loaderd.client import LoaderdDataset
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon

pytestmark = pytest.mark.integration


def epoch_ids(ds: LoaderdDataset, arrays: dict[str, np.ndarray]) -> list[int]:
    ids: list[int] = []
    for batch in ds:
        i = batch["id"].numpy()
        assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (len(i), 3, 8, 8)
        assert batch["label"].dtype == torch.int64
        np.testing.assert_array_equal(batch["image"].numpy(), arrays["image"][i])
        np.testing.assert_array_equal(batch["label"].numpy(), arrays["label"][i])
        assert torch.equal(batch["weight"], torch.ones(len(i)))
        ids += i.tolist()
    return ids


def test_every_sample_once_per_epoch_with_exact_bytes(
    daemon: Daemon, dataset: tuple[Path, dict[str, np.ndarray]]
) -> None:
    ds = LoaderdDataset(daemon.address, job="rt", batch_size=64)
    first = epoch_ids(ds, dataset[1])
    second = epoch_ids(ds, dataset[1])
    assert sorted(first) == sorted(second) == list(range(N_SAMPLES))
    assert first != second, "each epoch is shuffled anew"
    assert ds.epoch == 1


def test_plan_is_deterministic_across_jobs_with_one_seed(daemon: Daemon) -> None:
    def order(job: str, seed: int) -> list[int]:
        ds = LoaderdDataset(daemon.address, job=job, batch_size=50, seed=seed)
        return [i for b in ds for i in b["id"].tolist()]

    assert order("a", seed=7) == order("b", seed=7)
    assert order("c", seed=8) != order("a", seed=7)


def test_variable_length_fields_round_trip(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from loaderd.storage.ingest import ingest

    texts = [f"sample-{i}-" + "x" * (i % 7) for i in range(40)]
    blobs = [bytes(range(i % 50)) for i in range(40)]
    pq.write_table(
        pa.table({"text": texts, "blob": blobs, "y": np.arange(40.0)}), tmp_path / "t.parquet"
    )
    ingest(tmp_path / "t.parquet", tmp_path / "t.db", progress=False)
    with Daemon(db=tmp_path / "t.db", state_dir=tmp_path / "state") as d:
        ds = LoaderdDataset(d.address, job="var", batch_size=16)
        got = {}
        for batch in ds:
            for k, i in enumerate(batch["id"].tolist()):
                got[i] = (batch["text"][k], batch["blob"][k], float(batch["y"][k]))
        assert got == {i: (texts[i], blobs[i], float(i)) for i in range(40)}


def test_breaking_out_of_an_epoch_resumes_it(daemon: Daemon) -> None:
    ds = LoaderdDataset(daemon.address, job="resume", batch_size=32)
    taken: list[int] = []
    for batch in ds:
        taken += batch["id"].tolist()
        if len(taken) >= 96:
            break
    rest = [i for b in ds for i in b["id"].tolist()]
    assert ds.epoch == 0, "the interrupted epoch continues"
    assert sorted(taken + rest) == list(range(N_SAMPLES))
