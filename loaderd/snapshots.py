"""Async parameter snapshots (seed 000): SNAPSHOT_PUT and SNAPSHOT_GET, written in the background.

A trainer sends its state (``torch.save`` bytes) and gets OK as soon as the daemon holds it; a
thread writes it into the arena's snapshot region (two alternating slots, so a reader always
finds the previous or the new snapshot whole). Only the newest queued snapshot of a job is
written: an older one still waiting is superseded. The region's two slots are shared by every
job: a job whose next write would overwrite another job's snapshot has its snapshots written
to a per-job file in the state directory instead (``snapshot_files``), so no job's snapshot is
ever evicted by another's. Without an arena (no ``--nvram-dir``) the
daemon refuses snapshots with an error that says so, rather than keep them in a file the user
did not ask for.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from loaderd.client.errors import ErrorCode
from loaderd.client.protocol import Message, MsgType, snapshot_payload
from loaderd.jobs import JobError
from loaderd.snapshot_files import SnapshotFiles
from loaderd.storage.arena import Arena

logger = logging.getLogger(__name__)


class Snapshots:
    """The snapshot requests of one daemon, and the thread that writes them.

    Args:
        arena: the NVRAM arena, or None (snapshots are then refused).
        spill_dir: where a job's snapshots go when the arena's slots hold other jobs'.
    """

    def __init__(self, arena: Arena | None, spill_dir: Path) -> None:
        self.arena = arena
        self.files = SnapshotFiles(spill_dir)
        self.spilled = 0
        self._queue: dict[str, tuple[int, memoryview]] = {}  # job -> newest (step, payload)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._busy = False
        self.written = 0
        self.superseded = 0
        self.failed = 0
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None
        if arena is not None and arena.snapshots.max_payload > 0:
            self._thread = threading.Thread(target=self._run, name="loaderd-snapshots", daemon=True)
            self._thread.start()

    def _region(self) -> Arena:
        if self.arena is None:
            raise JobError(
                "snapshots need an NVRAM arena: start `loaderd serve` with --nvram-dir",
                ErrorCode.STORAGE,
            )
        if self.arena.snapshots.max_payload <= 0:
            raise JobError(
                "the arena has no snapshot region (--snapshot-bytes 0)", ErrorCode.STORAGE
            )
        return self.arena

    def put(self, identity: bytes, msg: Message) -> Message:
        """SNAPSHOT_PUT: check the size, queue the write, answer OK at once."""
        arena = self._region()
        job, step = msg.meta["job"], msg.meta["step"]
        payload = snapshot_payload(msg)
        limit = arena.snapshots.max_payload
        if payload.nbytes > limit:
            raise JobError(
                f"snapshot of job {job!r} is {payload.nbytes} bytes, the arena's snapshot slots "
                f"hold {limit} (raise --snapshot-bytes / --nvram-bytes)",
                ErrorCode.STORAGE,
            )
        with self._cond:
            if job in self._queue:
                self.superseded += 1
            self._queue[job] = (step, payload)
            self._cond.notify()
        return Message(MsgType.OK, msg.request_id, {"queued": True, "bytes": payload.nbytes})

    def get(self, identity: bytes, msg: Message) -> Message:
        """SNAPSHOT_GET: the job's newest whole snapshot, as one frame."""
        job = msg.meta["job"]
        arena = self._region()
        if self.files.has(job):
            got = self.files.read(job)
        else:
            in_arena = arena.read_snapshot(job)
            got = None if in_arena is None else in_arena[1:]
        if got is None:
            raise JobError(f"no snapshot of job {job!r}", ErrorCode.NOT_FOUND)
        step, payload = got
        return Message(
            MsgType.SNAPSHOT,
            msg.request_id,
            {"job": job, "step": step, "bytes": len(payload)},
            [memoryview(payload)],
        )

    def _run(self) -> None:
        assert self.arena is not None
        while True:
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait(timeout=1.0)
                if not self._queue:
                    self._busy = False
                    self._cond.notify_all()
                    return
                job = next(iter(self._queue))
                step, payload = self._queue.pop(job)
                self._busy = True
            try:
                self._write(job, step, payload)
                self.written += 1
                logger.info(
                    "snapshot of job %s step %d written (%d bytes)", job, step, len(payload)
                )
            except Exception as e:
                self.failed += 1
                self.last_error = f"{type(e).__name__}: {e}"
                logger.exception("snapshot of job %s step %d failed", job, step)

    def _write(self, job: str, step: int, payload: memoryview) -> None:
        assert self.arena is not None
        if not self.files.has(job):
            other = self.arena.snapshots.evicts(job)
            if other is None:
                self.arena.write_snapshot(job, step, payload)
                return
            logger.info(
                "snapshots of job %s go to %s: the arena's slots hold job %s's",
                job,
                self.files.directory,
                other,
            )
        self.files.write(job, step, payload)
        self.spilled += 1

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued snapshot is written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def stats(self) -> dict[str, Any]:
        """The newest snapshot (job, step, bytes, max_bytes) and durability, and counters."""
        out: dict[str, Any] = {"enabled": self._thread is not None}
        if self.arena is not None:
            newest = self.arena.stats()["snapshot"]
            out["newest"] = newest
            out["durability"] = self.arena.durability
        with self._cond:
            out["queued"] = len(self._queue) + int(self._busy)
        out.update(
            written=self.written,
            superseded=self.superseded,
            failed=self.failed,
            to_files=self.spilled,
        )
        if self.last_error is not None:
            out["last_error"] = self.last_error
        return out

    def close(self) -> None:
        """Write what is queued, then stop the thread (safe to call twice)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
