"""One trainer process, several threads: batches through a prefetch thread of the trainer's
own, losses sent (and waited for) from its training loop, one connection for all."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.errors import DaemonUnavailableError
from loaderd.client.protocol import MsgType
from loaderd.client.unconfirmed import Unconfirmed
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon

pytestmark = pytest.mark.integration


def run_together(*targets: Callable[[], None]) -> list[BaseException]:
    """Run each target on a thread of its own until all end; what they raised."""
    errors: list[BaseException] = []

    def run(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread still waits"
    return errors


def test_threads_waiting_on_one_connection_each_get_their_own_replies(daemon: Daemon) -> None:
    # Before turns, a thread polling the socket read the others' replies and kept them while
    # they polled on: each waited out its timeout.
    with Connection(daemon.address, timeout_s=10.0) as conn:

        def ping() -> None:
            for _ in range(300):
                assert conn.request(MsgType.PING, {}).type == MsgType.PONG

        assert run_together(ping, ping, ping) == []


@pytest.mark.parametrize(("workers", "start"), [(0, None), (2, "fork"), (2, "spawn")])
def test_a_prefetch_thread_iterates_while_the_loop_sends_and_flushes_losses(
    dataset: tuple[Path, dict[str, np.ndarray]], daemon: Daemon, workers: int, start: str | None
) -> None:
    # With DataLoader workers the prefetch thread also sends the loop's acknowledgements,
    # whose replies the training loop's flush collects. Spawned workers get the dataset
    # pickled, its locks left behind.
    images = torch.from_numpy(dataset[1]["image"])
    ds = LoaderdDataset(daemon.address, job="threads", batch_size=16)
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context=start,
    )
    epochs = 3

    def prefetch(out: queue.Queue[object]) -> None:
        try:
            for batch in loader:
                out.put(batch)
        except BaseException as e:
            out.put(e)
        out.put(None)

    for _ in range(epochs):
        batches: queue.Queue[object] = queue.Queue(maxsize=4)
        thread = threading.Thread(target=prefetch, args=(batches,))
        thread.start()
        seen: list[int] = []
        while (batch := batches.get(timeout=60)) is not None:
            assert not isinstance(batch, BaseException), batch
            assert isinstance(batch, dict)
            assert torch.equal(batch["image"], images[batch["id"]])
            ds.feedback(batch["id"], batch["id"].float() / N_SAMPLES)
            if len(seen) % 48 == 0:
                ds.flush()  # waits for its replies while the thread waits for batches
            seen += batch["id"].tolist()
        thread.join(60)
        assert sorted(seen) == list(range(N_SAMPLES)), "each sample once an epoch"
    ds.flush()
    assert ds.stats()["jobs"]["threads"]["feedback_samples"] == epochs * N_SAMPLES
    ds.close()


def test_a_thread_whose_request_a_reset_dropped_leaves_the_new_socket_alone(
    daemon: Daemon,
) -> None:
    assert daemon.proc is not None
    with Connection(daemon.address, timeout_s=30.0) as conn:
        conn.request(MsgType.PING, {})
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # nothing is answered until SIGCONT
        try:
            first = conn.send(MsgType.PING, {})
            failed: list[BaseException] = []

            def wait_first() -> None:
                try:
                    conn.wait(first)
                except BaseException as e:
                    failed.append(e)

            waiting = threading.Thread(target=wait_first)
            waiting.start()
            time.sleep(0.2)  # it polls
            conn.reset()  # as a thread that gave the daemon up does
            second = conn.send(MsgType.PING, {})
            waiting.join(10)
            assert not waiting.is_alive(), "a dropped request's wait ends at once"
            assert len(failed) == 1 and isinstance(failed[0], DaemonUnavailableError)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert conn.wait(second).type == MsgType.PONG, "the new socket still carries it"


def test_two_threads_collect_the_replies_of_one_set_of_unconfirmed_requests(
    daemon: Daemon,
) -> None:
    # The loop's acknowledgements: sent by the thread that iterates, collected there and by
    # the training loop's flush. Both took the same oldest and waited for it twice.
    done = threading.Event()
    with Connection(daemon.address, timeout_s=10.0) as conn:
        unconfirmed = Unconfirmed(limit=2)

        def send() -> None:
            try:
                for _ in range(300):
                    unconfirmed.send(conn, MsgType.PING, {})
                    if unconfirmed.over_limit():
                        unconfirmed.confirm_oldest(conn)
            finally:
                done.set()

        def collect() -> None:
            while not done.is_set() or len(unconfirmed):
                unconfirmed.confirm_all(conn)
                time.sleep(0.0005)

        assert run_together(send, collect) == []
    assert len(unconfirmed) == 0
