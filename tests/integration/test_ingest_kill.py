"""A real ``loaderd ingest`` killed with SIGKILL mid-transaction, then run again: it keeps
what was committed, appends the rest, and the store is the uninterrupted one."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loaderd.storage.store_writer import partial_path, read_partial
from tests.unit.test_ingest_resume import dump

ROWS = 3 * 4096 + 1234  # the CLI commits 4096 samples per transaction


def loaderd(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("loaderd", path=str(Path(sys.executable).parent))
    assert exe is not None
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_sigkill_mid_ingest_then_the_same_command_continues(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "x": rng.standard_normal((ROWS, 8)).astype(np.float32).tolist(),
            "tokens": [list(range(i % 9)) for i in range(ROWS)],
            "word": pa.array([f"w{i // 500}" for i in range(ROWS)]).dictionary_encode(),
        }
    )
    for k in range(2):  # two files of several row groups
        half = table.slice(k * (ROWS // 2), ROWS // 2 + k * (ROWS % 2))
        pq.write_table(half, src / f"part-{k}.parquet", row_group_size=3000)
    argv = [str(src), "--out", str(tmp_path / "db"), "--no-progress"]

    killed = subprocess.run(
        [sys.executable, "-m", "tests.integration.ingest_killed", str(2 * 4096 + 2000), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "db").exists()
    kept = read_partial(tmp_path / "db")
    assert kept is not None
    assert 0 < kept["samples"] < 2 * 4096 + 2000  # committed batches only, not the open one

    again = loaderd("ingest", *argv)
    assert again.returncode == 0, again.stderr
    assert f"continuing an interrupted ingest at sample {kept['samples']:,}" in again.stdout
    assert f"ingested {ROWS:,} samples" in again.stdout
    assert not partial_path(tmp_path / "db").exists()

    whole = loaderd("ingest", str(src), "--out", str(tmp_path / "whole"), "--no-progress")
    assert whole.returncode == 0, whole.stderr
    resumed, uninterrupted = dump(tmp_path / "db"), dump(tmp_path / "whole")
    assert len(resumed["samples"]) == ROWS
    assert resumed == uninterrupted


def test_a_changed_source_is_refused_in_one_line(tmp_path: Path) -> None:
    src = tmp_path / "d.parquet"
    pq.write_table(pa.table({"v": np.arange(3 * 4096)}), src)
    argv = [str(src), "--out", str(tmp_path / "db"), "--no-progress"]
    killed = subprocess.run(
        [sys.executable, "-m", "tests.integration.ingest_killed", "5000", *argv],
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL
    pq.write_table(pa.table({"v": np.arange(3 * 4096 + 1)}), src)
    refused = loaderd("ingest", *argv)
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to resume" in lines[0] and "--restart" in lines[0]
    assert read_partial(tmp_path / "db") is not None  # kept for the user to decide
    restarted = loaderd("ingest", *argv, "--restart")
    assert restarted.returncode == 0, restarted.stderr
    assert "ingested 12,289 samples" in restarted.stdout
