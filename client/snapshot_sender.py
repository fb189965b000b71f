"""Snapshots sent from a background thread, so that saving one never stalls training.

``LoaderdDataset.save_snapshot`` serialises on the caller's thread and waits until the daemon
holds the bytes, over the dataset's own socket, which is not thread-safe. The hybrid trainer
(seed 000) merges every k iterations and wants each merged model kept without waiting, so this
sender owns a thread and a connection of its own: ``submit`` hands it a copy of the state and
returns at once, and the thread serialises and sends it. Only the newest snapshot matters, so a
submitted one that has not started sending is replaced by the next (counted in ``dropped``):
a slow or stopped daemon costs neither training time nor memory beyond one pending state.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from loaderd.client.connection import Connection
from loaderd.client.errors import DaemonUnavailableError
from loaderd.client.snapshot import send_snapshot

logger = logging.getLogger(__name__)


class SnapshotSender:
    """Sends the newest submitted snapshot of a job to the daemon, on its own thread.

    Args:
        address: the daemon's endpoint.
        job: the job whose snapshot this is.
        curve_dir: the key directory for a ``tcp://`` daemon, as for ``LoaderdDataset``.
        timeout_s: how long one send waits for the daemon to take the bytes.

    Attributes:
        sent: snapshots the daemon has accepted.
        dropped: snapshots replaced by a newer one before they were sent.
        failed: snapshots the daemon refused or did not answer (the newest error is kept
            for ``flush``).
        bytes_sent: bytes of the accepted snapshots.
        last_step: the step of the newest accepted snapshot, or None.
    """

    def __init__(
        self,
        address: str,
        job: str,
        *,
        curve_dir: str | Path | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"`timeout_s` must be positive, got {timeout_s}")
        self.address, self.job = address, job
        self._curve_dir, self._timeout_s = curve_dir, timeout_s
        self.sent = self.dropped = self.failed = self.bytes_sent = 0
        self.last_step: int | None = None
        self._error: Exception | None = None
        self._pending: tuple[Any, int] | None = None
        self._busy = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loaderd-snapshots", daemon=True)
        self._thread.start()

    @classmethod
    def for_dataset(cls, ds: Any) -> SnapshotSender:
        """A sender to the daemon and job of a ``LoaderdDataset`` (its address, keys, timeout)."""
        conn = ds._conn  # the dataset's connection settings; its socket is never shared
        return cls(ds.address, ds.job, curve_dir=conn.curve_dir, timeout_s=conn.timeout_s)

    def submit(self, state: Any, step: int) -> None:
        """Queue ``state`` (which must not change afterwards: pass a copy) and return.

        Args:
            state: anything ``torch.save`` can write, typically a ``state_dict`` copy.
            step: the training step it belongs to.

        Raises:
            RuntimeError: the sender is closed.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"`step` must be an int >= 0, got {step!r}")
        with self._cond:
            if self._stop.is_set():
                raise RuntimeError("submit() on a closed SnapshotSender")
            if self._pending is not None:
                self.dropped += 1
            self._pending = (state, step)
            self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every submitted snapshot is sent or replaced; raise the newest failure.

        Raises:
            Exception: the last failed send's error, once (e.g. ``RemoteError``: the daemon
                has no ``--nvram-dir``; ``DaemonUnavailableError``: it did not answer).
            DaemonUnavailableError: the wait itself ran past ``timeout_s``.
        """
        wait_s = self._timeout_s * 2 if timeout_s is None else timeout_s
        with self._cond:
            done = self._cond.wait_for(lambda: self._pending is None and not self._busy, wait_s)
            error, self._error = self._error, None
        if error is not None:
            raise error
        if not done:
            raise DaemonUnavailableError(
                f"snapshot of job {self.job!r} not taken by loaderd at {self.address} "
                f"within {wait_s:g} s"
            )

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is pending (waiting at most ``timeout_s``), then stop. Safe twice."""
        if self._stop.is_set():
            return
        try:
            self.flush(timeout_s)
        except Exception as e:
            logger.warning("closing the snapshot sender of job %r: %s", self.job, e)
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
        self._thread.join()

    def __enter__(self) -> SnapshotSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        conn = Connection(self.address, self._timeout_s, self._curve_dir)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pending is not None or self._stop.is_set())
                    if self._pending is None:
                        return  # stopped, nothing left
                    (state, step), self._pending = self._pending, None
                    self._busy = True
                try:
                    size = send_snapshot(conn, self.job, state, step)
                except Exception as e:  # kept for flush(): the thread must outlive any failure
                    self._failed(e)
                else:
                    with self._cond:
                        self.sent += 1
                        self.bytes_sent += size
                        self.last_step = step
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        finally:
            conn.close()

    def _failed(self, error: Exception) -> None:
        with self._cond:
            first = self.failed == 0
            self.failed += 1
            self._error = error
        # Every merge submits one: say it once loudly, then quietly.
        (logger.warning if first else logger.debug)(
            "snapshot of job %r not kept: %s", self.job, error
        )
