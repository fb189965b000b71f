"""``s3://`` ingest against a real S3 HTTP endpoint: moto's server on 127.0.0.1.

Credentials and the endpoint come from the environment, as for any AWS tool: pyarrow's
S3 file system (the AWS C++ SDK) reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the
endpoint from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from loaderd.storage.errors import SourceError
from loaderd.storage.ingest import ingest
from loaderd.storage.store_writer import StoreWriter
from tests.unit.test_ingest import read_store
from tests.unit.test_ingest_resume import Interrupt, dump

moto_server = pytest.importorskip("moto.server")

N = 1000
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "loaderd-test",
    "AWS_SECRET_ACCESS_KEY": "loaderd-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """A moto S3 server holding s3://data/train/ (two Parquet files) and s3://data/one.parquet."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    s3 = pafs.S3FileSystem(
        access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region="us-east-1",
        endpoint_override=url,
        allow_bucket_creation=True,
    )
    s3.create_dir("data")
    table = table_of(N)
    pq.write_table(
        table.slice(0, 600), "data/train/part-0.parquet", filesystem=s3, row_group_size=200
    )
    pq.write_table(table.slice(600), "data/train/part-1.parquet", filesystem=s3, row_group_size=200)
    pq.write_table(table, "data/one.parquet", filesystem=s3)
    try:
        yield url
    finally:
        server.stop()


def table_of(n: int) -> pa.Table:
    return pa.table(
        {
            "x": pa.array(list(np.arange(n * 4, dtype=np.float32).reshape(n, 4))),
            "label": pa.array(np.arange(n) % 10),
            "text": pa.array([f"row {i}" for i in range(n)]),
            "tokens": pa.array([list(range(i % 6)) for i in range(n)], pa.list_(pa.int32())),
        }
    )


def check(out: Path, n: int = N) -> None:
    store, rows = read_store(out)
    assert store.num_samples == n
    want = table_of(n).to_pydict()
    assert [r["x"].tolist() for r in rows] == [list(map(float, x)) for x in want["x"]]
    assert [int(r["label"]) for r in rows] == want["label"]
    assert [r["text"] for r in rows] == want["text"]
    assert [r["tokens"].tolist() for r in rows] == want["tokens"]


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_s3_folder_round_trip_with_the_usual_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, endpoint: str, variable: str
) -> None:
    for k, v in {**CREDENTIALS, variable: endpoint}.items():
        monkeypatch.setenv(k, v)
    summary = ingest("s3://data/train/", tmp_path / "db", progress=False)
    assert (summary.samples, summary.kind) == (N, "parquet-folder")
    check(tmp_path / "db")


def test_the_cli_ingests_one_s3_object(tmp_path: Path, endpoint: str) -> None:
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    exe = Path(sys.executable).parent / "loaderd"
    argv = [str(exe), "ingest", "s3://data/one.parquet", "--out", str(tmp_path / "db")]
    done = subprocess.run(
        [*argv, "--no-progress"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"ingested {N:,} samples") and "from parquet s3://" in done.stdout
    check(tmp_path / "db")


def test_an_interrupted_s3_ingest_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    for k, v in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(k, v)
    ingest("s3://data/train/", tmp_path / "whole", progress=False, batch_rows=128)
    with monkeypatch.context() as m:
        # Row groups of 200 read in batches of 128 + 72: 7 batches end inside the second file.
        Interrupt(m, after=7, exc=KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            ingest("s3://data/train/", tmp_path / "db", progress=False, batch_rows=128)
    appended: list[int] = []
    append = StoreWriter.append

    def count(w: StoreWriter, records: list[bytes], extra: object = None) -> None:
        appended.append(len(records))
        append(w, records, extra)  # type: ignore[arg-type]

    monkeypatch.setattr(StoreWriter, "append", count)
    resumed = ingest("s3://data/train/", tmp_path / "db", progress=False, batch_rows=128)
    assert resumed.resumed_at == 728 and sum(appended) == N - resumed.resumed_at
    assert dump(tmp_path / "db") == dump(tmp_path / "whole")


def test_a_missing_bucket_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    for k, v in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SourceError, match=r"^s3://nope/train: ") as err:
        ingest("s3://nope/train", tmp_path / "db", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "db").exists()
