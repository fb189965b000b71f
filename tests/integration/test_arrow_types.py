"""Every Arrow type a training set uses, through ingest -> a real daemon -> the client.

Each sample's value is a function of its index, so a batch is checked row by row against
the source, on both delivery paths (the socket and the shared-memory ring), with lists as
values + offsets and padded, and with a transform in real DataLoader workers.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from loaderd.client import LoaderdDataset
from loaderd.storage.ingest import ingest
from tests.helpers import Daemon

pytestmark = pytest.mark.integration

N = 50
COLORS = ["red", "green", "blue"]


def tokens(i: int) -> list[int]:
    return list(range(i, i + i % 7))  # lengths 0..6, some empty


def points(i: int) -> list[list[float]]:
    return [[float(i), float(k)] for k in range(i % 3 + 1)]


def score(i: int) -> float | None:
    return None if i % 4 == 0 else i / 2


def stamp(i: int) -> dt.datetime:
    return dt.datetime(2024, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i)


def write_source(path: Path) -> None:
    # Row groups of 16: Parquet gives each its own dictionary, which the store unifies.
    table = pa.table(
        {
            "tokens": pa.array([tokens(i) for i in range(N)], pa.list_(pa.int32())),
            "points": pa.array([points(i) for i in range(N)], pa.list_(pa.list_(pa.float32(), 2))),
            "score": pa.array([score(i) for i in range(N)], pa.float64()),
            "caption": pa.array([None if i % 5 == 1 else f"c{i}" for i in range(N)]),
            "image": pa.array(
                [
                    None if i == 3 else {"bytes": bytes([i]) * 3, "path": f"{i}.jpg"}
                    for i in range(N)
                ]
            ),
            "ts": pa.array([stamp(i) for i in range(N)], pa.timestamp("ms", tz="UTC")),
            "color": pa.array([COLORS[(i * 7) % 3] for i in range(N)]).dictionary_encode(),
            "skip": pa.array([[("k", i)] for i in range(N)], pa.map_(pa.string(), pa.int64())),
        }
    )
    pq.write_table(table, path, row_group_size=16)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("types")
    write_source(root / "t.parquet")
    summary = ingest(root / "t.parquet", root / "t.db", progress=False, exclude=["skip"])
    assert summary.samples == N
    with Daemon(db=root / "t.db", state_dir=root / "state") as d:
        yield d


def check_row(batch: dict[str, Any], k: int, i: int, lists: str) -> None:
    if lists == "offsets":
        off = batch["tokens.offsets"]
        assert batch["tokens"][off[k] : off[k + 1]].tolist() == tokens(i)
        off = batch["points.offsets"]
        assert batch["points"][off[k] : off[k + 1]].tolist() == points(i)
    else:
        n = int(batch["tokens.lengths"][k])
        assert batch["tokens"][k, :n].tolist() == tokens(i)
        assert not batch["tokens"][k, n:].any(), "padding is zeros"
        n = int(batch["points.lengths"][k])
        assert batch["points"][k, :n].tolist() == points(i)
    want = score(i)
    assert bool(batch["score.valid"][k]) == (want is not None)
    assert float(batch["score"][k]) == (want or 0.0)
    assert batch["caption"][k] == ("" if i % 5 == 1 else f"c{i}")
    assert bool(batch["caption.valid"][k]) == (i % 5 != 1)
    assert batch["image.bytes"][k] == (b"" if i == 3 else bytes([i]) * 3)
    assert batch["image.path"][k] == ("" if i == 3 else f"{i}.jpg")
    assert bool(batch["image.bytes.valid"][k]) == (i != 3)
    assert int(batch["ts"][k]) == int(stamp(i).timestamp() * 1000)
    assert int(batch["color"][k]) == [0, 1, 2][(i * 7) % 3]  # codes in first-seen order


@pytest.mark.parametrize(
    ("shm", "lists"), [(False, "offsets"), (True, "offsets"), (True, "padded")]
)
def test_every_type_round_trips(daemon: Daemon, shm: bool, lists: str) -> None:
    ds = LoaderdDataset(
        daemon.address, job=f"types-{shm}-{lists}", batch_size=16, shm=shm, lists=lists
    )
    seen = []
    for batch in ds:
        assert batch["tokens"].dtype == torch.int32 and batch["points"].dtype == torch.float32
        assert batch["ts"].dtype == torch.int64 and batch["score.valid"].dtype == torch.bool
        assert "skip" not in batch
        for k, i in enumerate(batch["id"].tolist()):
            check_row(batch, k, i, lists)
            seen.append(i)
    assert sorted(seen) == list(range(N))
    delivered = ds.stats()["shm"]["delivered"]
    assert (delivered > 0) == shm, "the shm job went through the ring, the other not"
    fields = ds.fields
    assert fields["color"].kind == "dictionary"
    assert fields["color"].info["dictionary"] == COLORS
    assert fields["ts"].info["unit"] == "ms" and fields["ts"].info["tz"] == "UTC"
    assert fields["tokens"].kind == "list" and fields["points"].shape == (2,)


def lengths_and_pid(batch: dict[str, Any]) -> dict[str, Any]:
    """A per-batch transform: the worker's pid proves where it ran."""
    import os

    off = batch["tokens.offsets"]
    return {"id": batch["id"], "length": off[1:] - off[:-1], "pid": torch.tensor(os.getpid())}


def test_transform_runs_in_each_dataloader_worker(daemon: Daemon) -> None:
    import os

    ds = LoaderdDataset(daemon.address, job="transform", batch_size=8, transform=lengths_and_pid)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    pids, seen = set(), []
    for batch in loader:
        assert set(batch) == {"id", "length", "pid"}
        for k, i in enumerate(batch["id"].tolist()):
            assert int(batch["length"][k]) == len(tokens(i))
            seen.append(i)
        pids.add(int(batch["pid"]))
    assert sorted(seen) == list(range(N))
    assert os.getpid() not in pids and len(pids) == 2, "each worker ran the transform"


def ids_and_pid(batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """A transform as torchvision users write them: a tuple, not the batch dict."""
    import os

    return batch["id"], os.getpid()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_may_return_a_tuple_and_each_batch_still_arrives_once(
    daemon: Daemon, workers: int
) -> None:
    ds = LoaderdDataset(daemon.address, job=f"tuple{workers}", batch_size=8, transform=ids_and_pid)
    seen = []
    for ids, _pid in DataLoader(ds, batch_size=None, num_workers=workers):
        seen += ids.tolist()
        if len(seen) >= 16:
            break  # what the loop took counts; the rest comes in the next pass
    for ids, _pid in DataLoader(ds, batch_size=None, num_workers=workers):
        seen += ids.tolist()
    assert sorted(seen) == list(range(N))


def test_columns_selects_and_struct_names_select_children(tmp_path: Path) -> None:
    write_source(tmp_path / "t.parquet")
    ingest(tmp_path / "t.parquet", tmp_path / "t.db", progress=False, columns=["image", "ts"])
    with Daemon(db=tmp_path / "t.db", state_dir=tmp_path / "state") as d:
        ds = LoaderdDataset(d.address, job="cols", batch_size=N)
        (batch,) = list(ds)
        assert set(batch) == {
            "id",
            "weight",
            "image.bytes",
            "image.bytes.valid",
            "image.path",
            "image.path.valid",
            "ts",
        }
        np.testing.assert_array_equal(
            batch["ts"].numpy(), [int(stamp(i).timestamp() * 1000) for i in batch["id"].tolist()]
        )
