"""A fair share per connection: a flooding client cannot take the server loop from a trainer.

Raw frames from a socket that sends GET_BATCH after GET_BATCH and acknowledges nothing,
beside a trainer of another job that reads its epoch through a plain connection.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.protocol import PROTOCOL_VERSION, Message, MsgType, decode, encode
from loaderd.config import LimitsConfig
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, wait_until

pytestmark = pytest.mark.integration

BATCH = 16  # the trainer's: N_SAMPLES / BATCH batches


def hello_meta(job: str, batch_size: int) -> dict[str, Any]:
    return {
        "job": job,
        "rank": 0,
        "world_size": 1,
        "seed": 0,
        "batch_size": batch_size,
        "options": {},
        "version": PROTOCOL_VERSION,
        "shm": False,
    }


class Flooder:
    """A raw DEALER socket that floods GET_BATCH of its own job and reads every reply."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 4 * LimitsConfig().max_backlog_per_client)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sent = 0
        self.replies: list[Message] = []
        self.base: dict[str, Any] = {"job": "flood", "rank": 0, "worker": 0, "phase": "train"}

    def request(self, type_: MsgType, meta: dict[str, Any]) -> Message:
        self.sent += 1
        self.sock.send_multipart(encode(Message(type_, self.sent, meta)))
        while True:  # the socket is ours alone until the flood starts
            assert self.sock.poll(30_000), "the daemon answers"
            reply = decode(self.sock.recv_multipart())
            if reply.request_id == self.sent:
                return reply

    def open(self) -> None:
        self.request(MsgType.HELLO, hello_meta("flood", 1))  # a batch per sample
        epoch = self.request(MsgType.OPEN_PASS, self.base).meta["epoch"]
        self.ask = {**self.base, "epoch": epoch, "acks": []}

    def send(self, n: int) -> None:
        for _ in range(n):
            self.sent += 1
            self.sock.send_multipart(encode(Message(MsgType.GET_BATCH, self.sent, self.ask)))

    def flood(self, stop: threading.Event) -> None:
        """Send as fast as the socket takes them until ``stop``."""
        while not stop.is_set():
            try:
                msg = Message(MsgType.GET_BATCH, self.sent + 1, self.ask)
                self.sock.send_multipart(encode(msg), zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:  # its queue is full: the daemon has not read it yet
                stop.wait(0.001)

    def drain(self) -> None:
        while self.sock.poll(0):
            self.replies.append(decode(self.sock.recv_multipart()))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def fair_share_stats(address: str) -> dict[str, Any]:
    with Connection(address, timeout_s=60.0) as conn:
        return dict(conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta["fair_share"])


def test_a_flooding_connection_is_refused_past_its_backlog_while_a_trainer_reads_on(
    dataset: tuple[Path, dict[str, np.ndarray]], daemon: Daemon
) -> None:
    images = dataset[1]["image"].reshape(N_SAMPLES, -1)
    limit = LimitsConfig().max_backlog_per_client
    assert fair_share_stats(daemon.address)["max_backlog_per_client"] == limit
    flooder = Flooder(daemon.address)
    stop = threading.Event()
    flooding = threading.Thread(target=flooder.flood, args=(stop,))
    try:
        flooder.open()
        with Connection(daemon.address, timeout_s=120.0) as trainer:
            trainer.request(MsgType.HELLO, hello_meta("trainer", BATCH), expect=MsgType.WELCOME)
            base = {"job": "trainer", "rank": 0, "worker": 0, "phase": "train"}
            epoch = trainer.request(MsgType.OPEN_PASS, base, expect=MsgType.PASS).meta["epoch"]
            ask = {**base, "epoch": epoch, "acks": []}
            # The daemon stopped, both queue: the flooder far past its backlog, the trainer the
            # four requests the client library keeps in flight.
            assert daemon.proc is not None
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                flooder.send(3 * limit)
                pending = [trainer.send(MsgType.GET_BATCH, ask) for _ in range(4)]
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            flooding.start()  # and the flood goes on for the trainer's whole epoch
            # A STATS of a third connection is answered amid the flood; the backlog fills.
            wait_until(
                lambda: fair_share_stats(daemon.address)["refused"] > 0,
                timeout_s=120,
                what="the flooder's backlog to fill",
            )
            got: list[int] = []
            while pending:
                reply = trainer.wait(pending.pop(0))
                assert reply.type == MsgType.BATCH, reply.meta
                index, ids = int(reply.meta["index"]), np.frombuffer(reply.frames[0], np.int64)
                assert index == len(got), "request k of the trainer gets the pass's batch k"
                image = np.frombuffer(reply.frames[2], np.uint8).reshape(len(ids), -1)
                np.testing.assert_array_equal(image, images[ids])
                got.append(index)
                if len(got) + len(pending) < N_SAMPLES // BATCH:
                    pending.append(trainer.send(MsgType.GET_BATCH, {**ask, "acks": [index]}))
            assert got == list(range(N_SAMPLES // BATCH))
            stop.set()
            flooding.join()
            s = fair_share_stats(daemon.address)
    finally:
        stop.set()
        if flooding.is_alive():
            flooding.join()
        flooder.drain()
        flooder.close()
    # The flooder's backlog filled and stayed at its bound; what was past it was refused.
    assert s["peak_backlog"] == limit and s["refused"] > 0
    refusals = [m.meta["message"] for m in flooder.replies if m.type != MsgType.BATCH]
    assert len(refusals) < len(flooder.replies) <= flooder.sent
    kinds = {"max_backlog_per_client", "max_outstanding_batches"}
    assert all(sum(k in r for k in kinds) == 1 and "\n" not in r for r in refusals)
    assert any("max_backlog_per_client" in r for r in refusals)
    # The daemon serves on, for a client of the library too.
    ds = LoaderdDataset(daemon.address, job="after", batch_size=32, timeout_s=30.0)
    assert sum(len(b["id"]) for b in ds) == N_SAMPLES
    ds.close()
