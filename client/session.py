"""One process's session with its daemon: HELLO, and the requests whose replies come later.

A ``LoaderdDataset`` is copied into every DataLoader worker (forked or pickled), and a copy
must neither use its parent's socket nor wait for its parent's replies: each process says
HELLO once on its own socket (``Connection`` makes a fresh one after fork), and drops what its
parent had in flight. The daemon may restart under a session: a request that finds it gone
reconnects for up to ``reconnect_s`` and sends again what was not confirmed (feedback and the
loop's acknowledgements are recorded at least once).

Losses and acknowledgements are sent without waiting (``client/unconfirmed.py``); ``flush``
waits until the daemon recorded all of them, and a refusal raises there at the latest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from loaderd.client.connection import Connection
from loaderd.client.errors import DaemonUnavailableError, RemoteError
from loaderd.client.fastpath import ShmReceiver
from loaderd.client.losses import LossBatcher
from loaderd.client.protocol import PROTOCOL_VERSION, FieldSpec, MsgType, feedback_frames
from loaderd.client.resume import Deadline, DeliveryStats, recoverable
from loaderd.client.unconfirmed import Unconfirmed

logger = logging.getLogger(__name__)
_MAX_FEEDBACK_IN_FLIGHT = 64
_MAX_LOOP_ACKS_IN_FLIGHT = 64  # the main process's acknowledgements for DataLoader workers


class Session:
    """The daemon at ``address`` as this process sees it, for one job and rank.

    The base of ``LoaderdDataset``, which adds the passes; the arguments are its own.
    """

    num_samples: int  # in the store, known once the daemon was reached

    def __init__(
        self,
        address: str,
        job: str,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        drop_last: bool,
        options: dict[str, Any],
        timeout_s: float,
        reconnect_s: float,
        curve_dir: str | Path | None,
        shm: bool,
    ) -> None:
        self.address = address
        self.job = job
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.drop_last = drop_last
        self.options = options
        self.reconnect_s = reconnect_s
        self._conn = Connection(address, timeout_s, curve_dir)
        # Fast path (client/fastpath.py): shared memory for same-host daemons.
        self._shm = ShmReceiver(shm and address.startswith("ipc://"))
        self._hello_pid = -1
        self._instance: str | None = None  # the daemon's run that last WELCOMEd this process
        self._instances: set[str] = set()  # every run that did, or that this process met
        self._schema: list[FieldSpec] = []
        self._welcomed = False  # reached the daemon once (here or in a parent process)
        # Losses may come from a thread other than the one iterating (a prefetch thread);
        # requests awaiting their OK lock themselves (client/unconfirmed.py).
        self._losses_lock = threading.RLock()
        self._losses = LossBatcher()  # feedback not sent yet (client/losses.py)
        self._feedback = Unconfirmed(_MAX_FEEDBACK_IN_FLIGHT)  # sent, OK not yet read
        self._loop_acks = Unconfirmed(_MAX_LOOP_ACKS_IN_FLIGHT)  # the same, when workers fetch
        self.delivery = DeliveryStats()

    @property
    def fields(self) -> dict[str, FieldSpec]:
        """The store's fields by name, known once the daemon was reached (``connect()``).

        Each has its kind, dtype and shape; ``info`` holds e.g. a dictionary's values.
        """
        return {f.name: f for f in self._schema}

    def connect(self) -> None:
        """Say HELLO now, to check the job's parameters early.

        It also lets DataLoader workers forked afterwards wait for a daemon that restarts
        while they start (a dataset that never reached its daemon fails after ``timeout_s``).

        Raises:
            DaemonUnavailableError: no daemon answered within ``timeout_s``.
            RemoteError: the daemon refused the job (e.g. JOB_CONFLICT).
        """
        self._hello()

    def stats(self) -> dict[str, Any]:
        """The daemon's statistics (the same object as ``loaderd stats --json``)."""
        return dict(self._conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta)

    def save_snapshot(self, obj: Any, step: int) -> None:
        """Send a snapshot (e.g. a ``state_dict``) to the daemon's NVRAM arena.

        Returns once the daemon holds the bytes; it writes them in the background, atomically
        (``load_snapshot`` finds the previous or the new one, never a mix).

        Args:
            obj: anything ``torch.save`` can write.
            step: the training step it belongs to.

        Raises:
            RemoteError: the daemon refused it (no ``--nvram-dir``, or too large).
        """
        from loaderd.client.snapshot import send_snapshot

        send_snapshot(self._conn, self.job, obj, step)

    @staticmethod
    def load_snapshot(
        address: str, job: str, *, timeout_s: float = 30.0, weights_only: bool = True
    ) -> Any | None:
        """The job's newest whole snapshot from the daemon at ``address``, or None."""
        from loaderd.client.snapshot import load_snapshot

        return load_snapshot(address, job, timeout_s=timeout_s, weights_only=weights_only)

    def flush(self) -> None:
        """Wait until the daemon has recorded every feedback (and acknowledgement) sent so far.

        Raises:
            RemoteError: the daemon refused some feedback (e.g. an id out of range) or an
                acknowledgement.
        """
        self._send_losses()
        self._confirm_loop_acks()
        while self._feedback:
            self._wait_feedback()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into spawned DataLoader workers: a lock does not travel, the child makes one.
        state = self.__dict__.copy()
        del state["_losses_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._losses_lock = threading.RLock()

    # --- HELLO --------------------------------------------------------------------------------

    def _handover_pid(self) -> int | None:
        """The process this one hands its shared-memory slots to with its batches, if any."""
        return None

    def _hello(self) -> None:
        if self._hello_pid == os.getpid():
            return
        if self._hello_pid != -1:  # requests of the parent process are not ours to wait for
            # New, not emptied: a thread of the parent's may have held their locks.
            self._losses_lock = threading.RLock()
            self._losses.drop()
            self._feedback = Unconfirmed(_MAX_FEEDBACK_IN_FLIGHT)
            self._loop_acks = Unconfirmed(_MAX_LOOP_ACKS_IN_FLIGHT)
        meta = {
            "job": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "options": self.options,
            "version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "pidns": _pid_namespace(),  # the daemon checks the pid only inside its own
            "shm": self._shm.wanted,
        }
        handover = self._handover_pid()
        if handover is not None:
            meta["handover"] = handover  # the process the slots go to with the batches
        reply = self._conn.request(MsgType.HELLO, meta, expect=MsgType.WELCOME)
        if not self._shm.accept(reply.meta):  # cannot map the ring: ask for the socket path
            meta["shm"] = False
            reply = self._conn.request(MsgType.HELLO, meta, expect=MsgType.WELCOME)
        self._schema = [FieldSpec.from_json(f) for f in reply.meta["schema"]]
        self._instance = reply.meta.get("instance")
        if self._instance is not None:
            self._instances.add(self._instance)
        self._welcomed = True
        self.num_samples = int(reply.meta["num_samples"])
        self._hello_pid = os.getpid()

    def _hello_retrying(self, again: bool = False) -> None:
        """HELLO, reconnecting for up to ``reconnect_s`` while the daemon is away."""
        if not again:
            try:
                self._hello()
                return
            except DaemonUnavailableError:
                if self.reconnect_s <= 0 or not self._welcomed:
                    raise
        deadline = Deadline(self.reconnect_s)
        while True:
            try:
                self._rehello()
                break
            except DaemonUnavailableError:
                if deadline.passed():
                    raise
        self.delivery.reconnects += 1

    def _hello_again(self) -> None:
        """HELLO to a daemon that restarted while requests of this pass kept reaching it.

        ZeroMQ reconnects by itself and delivers the requests still queued, so a restarted
        daemon (its state journaled) can go on serving a pass without this process having
        said HELLO to it: it would know neither the process (to give back its batches if it
        dies) nor that it takes shared memory, and every later batch would come over the
        socket. The reply in hand stays valid; the next ones follow the new WELCOME.
        """
        logger.info("loaderd at %s restarted; saying HELLO to it", self.address)
        self._hello_pid = -1
        self._hello()

    def _rehello(self) -> None:
        """A fresh socket and HELLO, then every unconfirmed feedback sent again."""
        self._conn.reset()  # replies to the old socket are lost: their requests go again
        self._hello_pid = -1
        self._hello()
        self._feedback.resend(self._conn)
        self._loop_acks.resend(self._conn)

    # --- requests confirmed later -------------------------------------------------------------

    def _send_losses(self) -> None:
        """Send the losses kept (``client/losses.py``) as one FEEDBACK, if any."""
        with self._losses_lock:
            if not len(self._losses):
                return
            kind, ids, losses = self._losses.take()
            meta = {"job": self.job, "kind": kind}
            self._feedback.send(self._conn, MsgType.FEEDBACK, meta, feedback_frames(ids, losses))
        while self._feedback.over_limit():
            self._wait_feedback()  # bounded memory, and errors surface

    def _wait_feedback(self) -> None:
        """Wait for the oldest feedback; if the daemon went away, send it all again.

        Feedback is at-least-once: what a crashed daemon had journalled but not confirmed is
        recorded twice, which only adds one more loss sample to the importance history.
        """
        try:
            self._feedback.confirm_oldest(self._conn)  # refused: raised, not sent again
        except DaemonUnavailableError:
            if self.reconnect_s <= 0:
                raise
            self._hello_retrying(again=True)

    def _confirm_loop_acks(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` of the main process's acknowledgements are unconfirmed.

        While the daemon restarts (up to ``reconnect_s``) they go again: all of them on a
        fresh socket when it went away, one by one while the workers reopen their pass at a
        daemon that does not know it yet. Only this process knows what the loop received.

        Raises:
            RemoteError: the daemon refused an acknowledgement.
            DaemonUnavailableError: the daemon did not come back within ``reconnect_s``.
        """
        deadline: Deadline | None = None

        def again(e: RemoteError) -> bool:
            nonlocal deadline
            if not recoverable(e) or self.reconnect_s <= 0:
                return False
            deadline = deadline or Deadline(self.reconnect_s)
            if deadline.passed():
                return False
            time.sleep(0.05)  # the workers are reopening the pass
            return True

        while len(self._loop_acks) > keep:
            try:
                self._loop_acks.confirm_oldest(self._conn, again)
            except DaemonUnavailableError:
                if self.reconnect_s <= 0 or not self._welcomed:
                    raise
                deadline = deadline or Deadline(self.reconnect_s)
                if deadline.passed():
                    raise
                self._hello_retrying(again=True)  # sends every unconfirmed request again


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
