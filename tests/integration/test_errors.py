"""Every failure a user can cause ends in one clear line, and the daemon stays up."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from loaderd.client import DaemonUnavailableError, LoaderdDataset, RemoteError
from loaderd.client.connection import Connection
from loaderd.client.errors import ErrorCode
from loaderd.client.protocol import HEADER, MAGIC, MsgType, decode
from loaderd.storage.store import sample_key
from tests.helpers import Daemon, damage_value_length, point_value_at

pytestmark = pytest.mark.integration


def loaderd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loaderd", "--log-level", "ERROR", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0, proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("loaderd: error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_ingest_errors(tmp_path: Path) -> None:
    one_line_error(
        loaderd("ingest", str(tmp_path / "nope.parquet"), "--out", str(tmp_path / "db")),
        "nope.parquet",
    )
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    one_line_error(
        loaderd("ingest", str(tmp_path / "x.csv"), "--out", str(tmp_path / "db")), "x.csv"
    )
    np.savez(tmp_path / "empty.npz", image=np.zeros((0, 3), np.uint8))
    one_line_error(
        loaderd("ingest", str(tmp_path / "empty.npz"), "--out", str(tmp_path / "db")), "empty"
    )
    assert not (tmp_path / "db").exists()


def test_serve_refuses_a_directory_that_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "notastore").mkdir()
    sock = f"ipc://{tmp_path}/s.sock"
    one_line_error(
        loaderd("serve", "--db", str(tmp_path / "notastore"), "--socket", sock),
        "not a loaderd store",
    )


def test_second_daemon_on_a_live_socket_refuses(daemon: Daemon, tmp_path: Path) -> None:
    proc = loaderd(
        "serve",
        "--db",
        str(daemon.db),
        "--socket",
        daemon.address,
        "--state-dir",
        str(tmp_path / "other-state"),
    )
    one_line_error(proc, "already served by a live daemon", str(daemon.proc.pid))  # type: ignore[union-attr]
    LoaderdDataset(daemon.address, job="still-up", batch_size=8).stats()  # the first one serves on


def corrupt_copy(src: Path, db: Path, sample_id: int) -> Path:
    """A copy of the store ``src`` at ``db`` with one byte of a record's body flipped."""
    import lmdb

    shutil.copytree(src, db)
    env = lmdb.open(str(db), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"samples")) as txn:
        rec = bytearray(txn.get(sample_key(sample_id)))
        rec[-1] ^= 0xFF
        txn.put(sample_key(sample_id), bytes(rec))
    env.close()
    return db


def test_corrupt_record_names_the_sample_and_daemon_stays_up(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    db = corrupt_copy(dataset[0], tmp_path / "corrupt.db", 7)
    with Daemon(db=db, state_dir=tmp_path / "state") as d:
        ds = LoaderdDataset(d.address, job="c", batch_size=480)  # one batch holds sample 7
        with pytest.raises(RemoteError, match="sample 7") as e:
            list(ds)
        assert e.value.code == ErrorCode.CORRUPT_RECORD
        assert ds.stats()["dataset"]["samples"] == 480
        assert ds.stats()["backing"]["corrupt"] >= 1  # counted where an operator looks


def test_a_corrupt_record_reaches_a_trainer_with_workers_as_a_remote_error(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    from torch.utils.data import DataLoader

    db = corrupt_copy(dataset[0], tmp_path / "corrupt.db", 7)
    with Daemon(db=db, state_dir=tmp_path / "state") as d:
        ds = LoaderdDataset(d.address, job="w", batch_size=16)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        with pytest.raises(RemoteError, match="sample 7") as e:
            list(loader)  # caught as the trainer would catch it without workers
        assert e.value.code == ErrorCode.CORRUPT_RECORD
        assert e.value.message.startswith("sample 7: checksum mismatch")


def test_malformed_messages_get_error_replies_on_a_kept_connection(daemon: Daemon) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(daemon.address)
    try:
        good_header = HEADER.pack(MAGIC, 1, int(MsgType.PING), 0, 9)
        hello = {"job": "j", "rank": 0, "world_size": 1, "seed": 0, "batch_size": 8}
        bad, old = ErrorCode.BAD_MESSAGE, ErrorCode.BAD_VERSION
        for frames, code in (
            ([b"junk"], bad),
            ([b"x" * HEADER.size, b"{}"], bad),
            ([HEADER.pack(MAGIC, 99, 1, 0, 1), b"{}"], old),
            ([HEADER.pack(MAGIC, 1, 200, 0, 2), b"{}"], bad),
            ([good_header, b"not json"], bad),
            ([HEADER.pack(MAGIC, 1, int(MsgType.GET_BATCH), 0, 3), b'{"job": 5}'], bad),
            ([HEADER.pack(MAGIC, 1, int(MsgType.PONG), 0, 4), b"{}"], bad),
            (
                [
                    HEADER.pack(MAGIC, 1, int(MsgType.OPEN_PASS), 0, 5),
                    b'{"job": "j", "rank": 0, "worker": 0, "phase": "eval"}',
                ],
                bad,
            ),
            (
                [
                    HEADER.pack(MAGIC, 1, int(MsgType.HELLO), 0, 6),
                    json.dumps({**hello, "options": {}, "version": 7}).encode(),
                ],
                old,
            ),
        ):
            sock.send_multipart(frames)
            reply = decode(sock.recv_multipart())
            assert reply.type == MsgType.ERROR, frames
            assert reply.meta["code"] == code, (frames, reply.meta)
        sock.send_multipart([good_header, b"{}"])
        assert decode(sock.recv_multipart()).type == MsgType.PONG
    finally:
        sock.close()
        ctx.term()


def test_unknown_job_and_bad_rank(daemon: Daemon) -> None:
    with Connection(daemon.address) as conn:
        meta = {"job": "ghost", "rank": 0, "worker": 0, "phase": "train"}
        with pytest.raises(RemoteError, match="unknown job 'ghost'") as e:
            conn.request(MsgType.OPEN_PASS, meta)
        assert e.value.code == ErrorCode.UNKNOWN_JOB
    LoaderdDataset(daemon.address, job="r", batch_size=8, rank=0, world_size=4).stats()
    next(iter(LoaderdDataset(daemon.address, job="r", batch_size=8, rank=0, world_size=4)))
    with Connection(daemon.address) as conn:
        meta = {"job": "r", "rank": 7, "worker": 0, "phase": "train"}
        with pytest.raises(RemoteError, match="rank 7 out of range") as e:
            conn.request(MsgType.OPEN_PASS, meta)
        assert e.value.code == ErrorCode.BAD_RANK
    with pytest.raises(ValueError, match="rank"):
        LoaderdDataset(daemon.address, job="r", batch_size=8, rank=3, world_size=2)
    with pytest.raises(RemoteError, match="JOB_CONFLICT"):
        next(iter(LoaderdDataset(daemon.address, job="r", batch_size=16, rank=0, world_size=4)))


def test_client_of_a_gone_daemon_times_out_naming_the_address(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/nobody.sock"
    ds = LoaderdDataset(address, job="j", batch_size=8, timeout_s=0.5)
    with pytest.raises(DaemonUnavailableError, match=address):
        next(iter(ds))
    stats = loaderd("stats", "--socket", address, "--timeout", "0.5")
    one_line_error(stats, address)


def test_a_damaged_tree_page_names_the_sample_and_the_store(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    from loaderd.storage.value_index import build_value_index

    db = tmp_path / "branch.db"
    shutil.copytree(dataset[0], db)
    index = build_value_index(db / "data.mdb", b"samples", 480)
    assert index is not None
    page = int(index.inner_pages[-1])  # the last branch page on the way to some records
    with open(db / "data.mdb", "r+b") as f:
        f.seek(page * index.page_bytes)
        f.write(bytes(index.page_bytes))
    with Daemon(db=db, state_dir=tmp_path / "state") as d:
        ds = LoaderdDataset(d.address, job="b", batch_size=480)
        with pytest.raises(RemoteError, match=rf"sample \d+: LMDB cannot read it .* store {db}"):
            list(ds)
        assert ds.stats()["dataset"]["samples"] == 480  # the daemon serves on
        assert ds.stats()["backing"]["corrupt"] >= 1
        with pytest.raises(RemoteError, match="LMDB cannot read it"):
            list(ds)  # each try fails the same way, and the read-ahead's log stays short
        log = d.log.read_text()
        assert log.count("read-ahead of pass") <= 1, "one traceback per kind of failure"


def big_store(tmp_path: Path, record_bytes: int = 20_000) -> Path:
    """A store of 64 records of 20 KB (or ``record_bytes``): each in overflow pages of its own."""
    src = tmp_path / "big.npz"
    rng = np.random.default_rng(0)
    np.savez(src, blob=rng.integers(0, 256, (64, record_bytes), np.uint8), label=np.arange(64))
    db = tmp_path / "big.db"
    assert loaderd("ingest", str(src), "--out", str(db)).returncode == 0
    return db


@pytest.mark.parametrize(
    ("miss_procs", "record_bytes"), [("0", 20_000), ("2", 20_000), ("2", 70_000)]
)
def test_a_leaf_pointing_at_another_samples_record_is_refused_and_the_daemon_stays_up(
    tmp_path: Path, miss_procs: str, record_bytes: int
) -> None:
    # LMDB and the value index both say sample 7 lies where sample 9 does: only the checksum,
    # seeded with the id, tells. A miss worker slices it at the index's offset the first
    # time (a record of 64 KiB or more: reads it into its slot), fails it, and the daemon's
    # own read through LMDB reports it.
    db = big_store(tmp_path, record_bytes)
    point_value_at(db, 7, 9)
    with Daemon(db=db, state_dir=tmp_path / "state", extra=["--miss-procs", miss_procs]) as d:
        for _ in range(2):  # each pass fails the same way
            ds = LoaderdDataset(d.address, job="p", batch_size=16)
            delivered: list[int] = []
            with pytest.raises(RemoteError, match="sample 7: checksum mismatch") as e:
                for batch in ds:
                    delivered += batch["id"].tolist()
            assert e.value.code == ErrorCode.CORRUPT_RECORD
            assert 7 not in delivered
            ds.close()
        ds = LoaderdDataset(d.address, job="p", batch_size=16)
        assert ds.stats()["backing"]["corrupt"] >= 2 and d.proc.poll() is None  # serves on
        ds.close()


@pytest.mark.parametrize("miss_procs", ["0", "2"])
def test_a_record_running_past_the_file_is_refused_and_the_daemon_stays_up(
    tmp_path: Path, miss_procs: str
) -> None:
    # A damaged leaf node whose value runs past data.mdb: LMDB hands it out unchecked and the
    # first read of it is a SIGBUS, in the daemon or in a miss worker.
    db = big_store(tmp_path)
    damage_value_length(db, 7)
    with Daemon(db=db, state_dir=tmp_path / "state", extra=["--miss-procs", miss_procs]) as d:
        for _ in range(2):  # each pass fails the same way: nothing was left half-read
            ds = LoaderdDataset(d.address, job="p", batch_size=16)
            with pytest.raises(RemoteError, match="sample 7: its leaf node says it runs past"):
                list(ds)
            ds.close()
        ds = LoaderdDataset(d.address, job="p", batch_size=16)
        stats = ds.stats()
        assert stats["dataset"]["samples"] == 64  # the daemon serves on
        assert stats["dataset"]["record_version"] == 2  # its checksums name their samples
        assert stats["backing"]["corrupt"] >= 2
        ds.close()
        assert d.proc.poll() is None
    assert "run past the end of the file" in d.log.read_text()
