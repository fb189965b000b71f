"""DRAM admissions off the serving path: a queue bounded in bytes, drained by one thread.

A record read from the store is served from the batch it was copied into. Keeping it in DRAM
as well costs a page lock (a copy for a small record), which does not have to happen before
the batch goes out. So the read offers the record's view (into the store's map, which stays
mapped while the store is open; verified by that read) here and returns; a worker thread
hands batches of queued records to ``admit``, which locks or copies them and puts those the
policy still wants (``tiers.TierStack``).

When the queue holds its bound, an offer is refused at once (the caller forgets the admission;
a later read may admit the record again): serving never waits for admission. Bytes count from
the offer until ``admit`` returns, so the bound also caps the work under way. An empty queue
takes one record of any size, so a bound smaller than a record means one at a time.

Admissions that copy (a daemon that may not lock pages) are background work that competes
with serving for the cores: ``background()`` lowers the worker's CPU priority (``nice`` +10),
so DRAM fills from the time serving leaves. Page locks are cheap and their next epoch's hits
are what they buy: niced, they fell behind (docs/design.md), so that worker keeps the
daemon's priority.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

Admit = Callable[[list[tuple[int, memoryview]]], None]

BACKGROUND_NICE = 10  # what ``background()`` adds to the worker's nice value


class AdmissionQueue:
    """Records waiting to enter DRAM, and the thread that admits them.

    Args:
        capacity_bytes: record bytes queued or being admitted at most (> 0).
        admit: admits a batch of (sample id, view); runs on the worker thread.
    """

    def __init__(self, capacity_bytes: int, admit: Admit) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"`capacity_bytes` must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.dropped = 0  # offers refused because the queue was full
        self.failed = 0  # batches whose admission raised (their records stay uncached)
        self._admit = admit
        self._items: list[tuple[int, memoryview]] = []
        self._bytes = 0  # queued plus being admitted
        self._busy = False
        self._stop = False
        self._cond = threading.Condition()
        self._background = False
        self._thread = threading.Thread(target=self._run, name="loaderd-dram-admit", daemon=True)
        self._thread.start()
        self._tid: int = self._thread.native_id  # type: ignore[assignment]  # (started)

    def offer(self, sample_id: int, view: memoryview) -> bool:
        """Queue a verified record for admission; False (nothing queued) when full or closed."""
        return not self.offer_many([(sample_id, view)])

    def offer_many(self, items: list[tuple[int, memoryview]]) -> list[int]:
        """Queue verified records for admission, in order, while they fit; the ids refused."""
        with self._cond:
            took = 0
            for _, view in items:
                size = view.nbytes
                if self._stop or (self._bytes and self._bytes + size > self.capacity_bytes):
                    break
                self._bytes += size
                took += 1
            if took:
                self._items += items[:took]
                self._cond.notify()
            self.dropped += len(items) - took
            return [sample_id for sample_id, _ in items[took:]]

    @property
    def niceness(self) -> int:
        """The worker thread's nice value (Linux keeps one per thread)."""
        return os.getpriority(os.PRIO_PROCESS, self._tid)

    def background(self) -> None:
        """Lower the worker's CPU priority by ``BACKGROUND_NICE``, once (module doc).

        Where the system refuses (not Linux), the worker keeps the daemon's priority.
        """
        if self._background:
            return
        self._background = True
        try:
            os.setpriority(os.PRIO_PROCESS, self._tid, min(19, self.niceness + BACKGROUND_NICE))
        except OSError as e:
            logger.debug("DRAM admission keeps the daemon's priority: %s", e)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                batch, self._items = self._items, []
                self._busy = True
            try:
                self._admit(batch)
            except Exception:
                self.failed += 1
                logger.exception("DRAM admission: a batch failed; its records stay uncached")
            with self._cond:
                self._bytes -= sum(v.nbytes for _, v in batch)
                self._busy = False
                self._cond.notify_all()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued record is admitted (or dropped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._busy, timeout_s)

    def stats(self) -> dict[str, int]:
        """``admit_queue_bytes`` (queued or under way), ``admit_dropped``, ``admit_failed``."""
        with self._cond:
            return {
                "admit_queue_bytes": self._bytes,
                "admit_dropped": self.dropped,
                "admit_failed": self.failed,
            }

    def close(self) -> None:
        """Stop the worker, dropping what is queued; returns once no admission runs."""
        with self._cond:
            self._stop = True
            self.dropped += len(self._items)
            self._items = []
            self._cond.notify_all()
        self._thread.join()
