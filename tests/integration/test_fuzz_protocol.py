"""Random and mutated frames at a live daemon: it stays up, stays correct and stays small.

The frames come from a raw DEALER socket: random bytes, well-formed headers with any message
type, and meta objects built from the real field names with values of every JSON type and size.
A well-behaved client reads epochs in parallel and must keep getting every sample exactly
once; the daemon's log must show no INTERNAL error (a handler exception that escaped its
validation) and no traceback; its memory must stay bounded.
"""

from __future__ import annotations

import json
import threading

import psutil
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaderd.client import LoaderdDataset
from loaderd.client.protocol import HEADER, MAGIC, PROTOCOL_VERSION, REQUEST_FIELDS
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon

pytestmark = pytest.mark.integration

FIELDS = sorted({k for f in REQUEST_FIELDS.values() for k in f} | {"resume", "pid", "pidns"})
JOBS = ["fz", "fz2", "", "a/b", ".x", "x" * 200]

scalars = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-3, 40),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from([*JOBS, "train", "rescore", "bogus"]),
    st.booleans(),
    st.none(),
)
values = st.one_of(
    scalars,
    st.lists(st.integers(-3, 2**40), max_size=40),
    st.lists(scalars, max_size=5),
    st.dictionaries(st.sampled_from(["epoch", "delivered", "rewind", "x"]), scalars, max_size=4),
)
metas = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), values, max_size=9)


ints = st.one_of(st.integers(0, 5), st.integers(-(2**63), 2**63), st.integers(0, 2**40))
typed_values = {
    int: ints,
    str: st.sampled_from([*JOBS, "train", "rescore", "bogus"]),
    list: st.lists(ints, max_size=30),
    dict: st.dictionaries(
        st.sampled_from(["sampler", "keep_fraction", "warmup_epochs", "window", "x"]),
        st.one_of(ints, st.floats(), st.text(max_size=8)),
        max_size=3,
    ),
}


@st.composite
def shaped_meta(draw: st.DrawFn, msg_type: int) -> dict[str, object]:
    """A meta with every field its request type needs, of the right JSON type (mostly)."""
    fields = REQUEST_FIELDS.get(msg_type, {})  # type: ignore[call-overload]
    meta = {k: draw(typed_values[types[0]]) for k, types in fields.items()}
    if meta and draw(st.booleans()) and draw(st.booleans()):
        meta.pop(draw(st.sampled_from(sorted(meta))))
    if msg_type == 5 and draw(st.booleans()):  # OPEN_PASS with a resume
        meta["resume"] = draw(values)
    return meta


@st.composite
def messages(draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.sampled_from(["raw", "typed", "shaped", "shaped", "shaped", "mutated"]))
    if kind == "raw":
        return draw(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
    if kind == "shaped":
        msg_type = draw(st.sampled_from(sorted(int(t) for t in REQUEST_FIELDS)))
        meta_obj = draw(shaped_meta(msg_type))
    else:
        msg_type = draw(st.integers(0, 20))
        meta_obj = draw(metas)
    rid = draw(st.integers(0, 2**64 - 1))
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, draw(st.integers(0, 65535)), rid)
    meta = json.dumps(meta_obj).encode()
    payload = draw(st.lists(st.binary(max_size=48), max_size=3))
    frames = [header, meta, *payload]
    if kind == "mutated":
        i = draw(st.integers(0, len(frames) - 1))
        b = bytearray(frames[i])
        if b:
            j = draw(st.integers(0, len(b) - 1))
            b[j] ^= draw(st.integers(1, 255))
        frames[i] = bytes(b)
    return frames


class GoodClient(threading.Thread):
    """Reads epochs of its own job until told to stop; records any mistake."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.stop = threading.Event()
        self.epochs = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            ds = LoaderdDataset(
                self.address,
                job="good",
                batch_size=40,
                timeout_s=10.0,
                shm=False,
                sampler="uniform",
            )
            while not self.stop.is_set():
                ids = [i for b in ds for i in b["id"].tolist()]
                assert sorted(ids) == list(range(N_SAMPLES)), "the good client lost samples"
                self.epochs += 1
            ds.close()
        except BaseException as e:
            self.error = e


def test_fuzzed_frames_are_harmless(daemon: Daemon) -> None:
    assert daemon.proc is not None
    proc = psutil.Process(daemon.proc.pid)
    good = GoodClient(daemon.address)
    good.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.address)
    replies = 0
    rss: list[int] = [proc.memory_info().rss]

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(frames=messages())
    def throw(frames: list[bytes]) -> None:
        nonlocal replies
        if not frames:
            return
        sock.send_multipart(frames)
        if sock.poll(30):
            while sock.poll(0):
                sock.recv_multipart()
                replies += 1
        assert daemon.proc is not None and daemon.proc.poll() is None, "the daemon died"

    try:
        throw()
        rss.append(proc.memory_info().rss)
    finally:
        good.stop.set()
        good.join(30)
        sock.close()
        ctx.term()
    assert good.error is None, f"the good client failed: {good.error!r}"
    assert good.epochs >= 1
    assert replies > 0
    log = daemon.log.read_text()
    assert "INTERNAL" not in log and "Traceback" not in log, log[-3000:]
    assert rss[-1] - rss[0] < 200 << 20, f"daemon RSS grew {(rss[-1] - rss[0]) >> 20} MiB"
    assert daemon.proc.poll() is None
