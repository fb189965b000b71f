"""Datasets as their own libraries write them: Hugging Face ``save_to_disk``, ``webdataset``
shards; and the ``loaderd ingest`` command's options and output."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from loaderd.cli import main
from loaderd.storage.errors import SourceError
from loaderd.storage.ingest import ingest
from tests.unit.test_ingest import read_store


def test_huggingface_save_to_disk_folder(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "label": datasets.ClassLabel(names=["neg", "pos"]),
            "text": datasets.Value("string"),
            "image": datasets.Image(),
        }
    )
    n = 30
    data = {
        "input_ids": [list(range(i % 5 + 1)) for i in range(n)],
        "label": [i % 2 for i in range(n)],
        "text": [f"t{i}" for i in range(n)],
        "image": [{"bytes": b"\xff\xd8" + bytes([i]), "path": None} for i in range(n)],
    }
    ds = datasets.Dataset.from_dict(data, features=features)
    ds.save_to_disk(str(tmp_path / "hf"), num_shards=2)  # two Arrow stream files, in order
    summary = ingest(tmp_path / "hf", tmp_path / "db", progress=False, batch_rows=8)
    assert (summary.samples, summary.kind) == (n, "huggingface")
    store, rows = read_store(tmp_path / "db")
    assert [r["input_ids"].tolist() for r in rows] == data["input_ids"]
    assert [int(r["label"]) for r in rows] == data["label"]
    assert [r["text"] for r in rows] == data["text"]
    assert [r["image.bytes"] for r in rows] == [d["bytes"] for d in data["image"]]
    assert [bool(r["image.path.valid"]) for r in rows] == [False] * n  # path None: masked
    label = next(f for f in store.schema.fields if f.name == "label")
    assert label.attrs == {"names": ["neg", "pos"]}
    assert store.info["classes"] == {"label": ["neg", "pos"]}

    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SourceError, match=r"DatasetDict of splits \['test', 'train'\]"):
        ingest(tmp_path / "dd", tmp_path / "db2", progress=False)
    ingest(tmp_path / "dd" / "train", tmp_path / "db2", progress=False)


# webdataset's own reader leaves its tar files for the garbage collector to close
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_webdataset_shards_written_by_the_library(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    (tmp_path / "shards").mkdir()
    pattern = str(tmp_path / "shards" / "part-%03d.tar")
    with wds.ShardWriter(pattern, maxcount=7, verbose=0) as sink:
        for i in range(20):
            sink.write(
                {
                    "__key__": f"sample{i:04d}",
                    "jpg": bytes([i]) * 4,
                    "cls": i % 3,
                    "txt": f"caption {i}",
                    "seg.png": b"png%d" % i,
                }
            )
    summary = ingest(tmp_path / "shards", tmp_path / "db", progress=False, batch_rows=6)
    assert summary.samples == 20 and summary.kind == "webdataset"
    _, rows = read_store(tmp_path / "db")
    # what webdataset.WebDataset(...).decode() would yield, field for field
    reference = list(
        wds.WebDataset(
            sorted(str(p) for p in (tmp_path / "shards").iterdir()), shardshuffle=False
        ).decode()
    )
    gc.collect()  # its leaked files are closed here, inside this test
    assert len(reference) == 20
    for row, ref in zip(rows, reference, strict=True):
        assert row["__key__"] == ref["__key__"]
        assert int(row["cls"]) == ref["cls"]
        assert row["txt"] == ref["txt"]
        assert row["jpg"] == ref["jpg"] and row["seg.png"] == ref["seg.png"]


def test_cli_prints_one_summary_in_binary_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "d.npz", image=np.zeros((300, 64, 64), np.uint8), label=np.arange(300))
    argv = ["ingest", str(tmp_path / "d.npz"), "--out", str(tmp_path / "db"), "--no-progress"]
    assert main([*argv, "--exclude", "label"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("ingested 300 samples (1.2 MiB) from npz")
    assert lines[1] == "fields: image:uint8[64, 64]", "--exclude label dropped the field"
    assert "ingested" not in err and "MB" not in out
    assert main([*argv, "--columns", "nope"]) == 1
    assert "no column 'nope'" in capsys.readouterr().err


def test_an_object_store_that_never_answers_is_an_error_not_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    import loaderd.storage.ingest as ingest_module

    monkeypatch.setattr(ingest_module, "URI_OPEN_TIMEOUT_S", 1.0)
    with socket.socket() as silent:  # accepts connections (the backlog), answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        uri = f"s3://bucket/x.parquet?endpoint_override=127.0.0.1:{port}&scheme=http"
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        with pytest.raises(SourceError, match=r"did not answer within 1 s"):
            ingest(uri, tmp_path / "db", progress=False)
    assert not (tmp_path / "db").exists()
