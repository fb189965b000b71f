"""A greedy or careless client is refused at HELLO, by field, and the daemon serves on."""

from __future__ import annotations

import numpy as np
import pytest

from loaderd.client import LoaderdDataset, RemoteError
from loaderd.client.errors import ErrorCode
from loaderd.config import LimitsConfig
from loaderd.jobs import JobSpec
from loaderd.limits import LimitError, check_hello
from tests.helpers import Daemon

pytestmark = pytest.mark.integration


def hello(d: Daemon, job: str, **kw: object) -> None:
    next(iter(LoaderdDataset(d.address, job=job, batch_size=64, timeout_s=10.0, **kw)))


@pytest.mark.parametrize(
    ("job", "kw", "field"),
    [
        ("a\0b", {}, "control characters"),
        ("é" * 128, {}, "255 bytes"),
        ("neg", {"seed": -1}, "`seed`"),
        ("warm", {"warmup_epochs": 125_000}, "`warmup_epochs`"),
    ],
)
def test_hello_refused_at_the_door(
    daemon: Daemon, job: str, kw: dict[str, object], field: str
) -> None:
    with pytest.raises(RemoteError, match=field) as e:
        hello(daemon, job, **kw)
    assert e.value.code == ErrorCode.BAD_ARGUMENT
    assert not (daemon.state_dir / "jobs" / job).exists(), "nothing persisted"
    hello(daemon, "well-behaved")  # the daemon serves on


def test_job_count_is_bounded() -> None:
    limits = LimitsConfig(max_jobs=2)
    check_hello(JobSpec("c", 1, 0, 8), {"a"}, limits)
    with pytest.raises(LimitError, match="holds 2 jobs"):
        check_hello(JobSpec("c", 1, 0, 8), {"a", "b"}, limits)
    check_hello(JobSpec("a", 1, 0, 8), {"a", "b"}, limits)  # an existing job reopens
    with pytest.raises(ValueError, match="max_jobs"):
        LimitsConfig(max_jobs=0)


def test_oversized_requests_are_refused_by_name(daemon: Daemon) -> None:
    from loaderd.client.connection import Connection
    from loaderd.client.protocol import MsgType, feedback_frames

    hello(daemon, "fb")
    n = (1 << 22) + 1  # one past max_feedback_samples: 50 MB on the wire, not 3.5x that
    big = feedback_frames(np.zeros(n, np.int64), np.zeros(n, np.float32))
    many = [b"x"] * 9  # one past max_request_frames
    with Connection(daemon.address, timeout_s=30.0) as conn:
        for frames, limit in ((big, "max_feedback_samples"), (many, "max_request_frames")):
            with pytest.raises(RemoteError, match=limit) as e:
                conn.request(MsgType.FEEDBACK, {"job": "fb", "kind": "train"}, frames)
            assert e.value.code == ErrorCode.BAD_MESSAGE
        ok = feedback_frames(np.arange(4), np.ones(4, np.float32))
        conn.request(MsgType.FEEDBACK, {"job": "fb", "kind": "train"}, ok, expect=MsgType.OK)


def test_rewind_past_the_jobs_progress_is_refused(daemon: Daemon) -> None:
    from loaderd.client.connection import Connection
    from loaderd.client.protocol import MsgType

    ds = LoaderdDataset(daemon.address, job="rw", batch_size=64, timeout_s=10.0)
    sum(1 for _ in ds)  # epoch 0 served
    meta = {"job": "rw", "rank": 0, "worker": 0, "phase": "train"}
    far = {"epoch": 1000, "rewind": True, "delivered": []}
    with Connection(daemon.address, timeout_s=10.0) as conn:
        with pytest.raises(RemoteError, match=r"resume\.epoch 1000 is ahead of job 'rw'") as e:
            conn.request(MsgType.OPEN_PASS, {**meta, "resume": far})
        assert e.value.code == ErrorCode.BAD_ARGUMENT
        back = {"epoch": 0, "rewind": True, "delivered": []}
        conn.request(MsgType.OPEN_PASS, {**meta, "resume": back}, expect=MsgType.PASS)
    assert ds.stats()["jobs"]["rw"]["epoch"] == 0, "the job was not moved"
