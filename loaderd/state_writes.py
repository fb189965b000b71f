"""State writes that meet a full or failing disk: a logged, reported error, never a dead daemon.

The server loop writes job state every turn (cursors), every tick (job.json, the journal's
fsync) and at shutdown. When the state directory's disk is full, those writes fail; the
daemon must keep serving what needs no disk, refuse what does (with an ERROR naming the
cause), and retry on its own once space is back. One place decides how such a failure is
caught, logged (at most every few seconds, not every tick) and turned into a reply.

The same holds at start: one job's damaged file (an empty ``job.json`` or
``importance.npz`` after a power loss) must not keep every other job from being served.
That job's directory is moved aside, whole, into ``quarantine/`` (never deleted).

Whether state writes fail now is shown in stats (``state_disk``): failing from the first
failed write until writes succeed again with space left on the disk.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from loaderd.client.errors import ErrorCode
from loaderd.client.protocol import Message, error_message
from loaderd.jobs import JobError
from loaderd.storage.errors import StorageError
from loaderd.storage.safe_files import fsync_dir, private_dir

logger = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0
_last_logged: dict[str, float] = {}
# After a full disk, writes that succeed mean little while this little is free: a write
# with nothing to write succeeds on a full disk too.
_FREE_OK_BYTES = 1 << 20


class StateDisk:
    """Whether the daemon's state writes fail now, since when, and why."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.since: float | None = None  # wall-clock time the current state began
        self.failures = 0
        self.state_dir: Path | None = None
        self._full_dir: str | Path | None = None  # where a full disk was met

    def watch(self, state_dir: Path) -> None:
        """The daemon's state directory: where a write that names no file went."""
        self.state_dir = state_dir

    def failed(self, error: BaseException, message: str) -> None:
        """A state write failed with ``error``."""
        if self.error is None:
            self.since = time.time()
        self.error, self.failures = message, self.failures + 1
        cause = error if isinstance(error, OSError) else error.__cause__
        full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
        name = cause.filename if isinstance(cause, OSError) else None
        where = os.path.dirname(os.fsdecode(name)) if name else self.state_dir
        self._full_dir = where if full else None

    def succeeded(self) -> None:
        """A batch of state writes succeeded: the disk is fine again if it has room."""
        if self.error is None:
            return
        if self._full_dir is not None and free_bytes(self._full_dir) < _FREE_OK_BYTES:
            return
        self.error, self.since, self._full_dir = None, time.time(), None

    def stats(self) -> dict[str, object]:
        """``ok``, ``error`` (None when ok), ``since``, ``failures``, ``free_bytes``."""
        return {
            "ok": self.error is None,
            "error": self.error,
            "since": self.since,
            "failures": self.failures,
            "free_bytes": None if self.state_dir is None else free_bytes(self.state_dir),
        }


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s disk (0 if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


STATE_DISK = StateDisk()  # the daemon's state directory (one per process)


def note_failed_write(error: BaseException) -> None:
    """A request's own state write failed (a journal append): shown in stats."""
    STATE_DISK.failed(error, f"cannot write daemon state: {error}")


@dataclass(frozen=True, slots=True)
class StateWriteFailure:
    """The first failed state write of a batch of writes."""

    message: str

    def reply_to(self, reply: Message) -> Message:
        """The ERROR that replaces ``reply`` (its request was not made durable)."""
        return error_message(reply.request_id, ErrorCode.STORAGE, self.message)


def durability_failure(writes: Iterable[Callable[[], None]]) -> StateWriteFailure | None:
    """Run every write; return the first failure (a full disk, an I/O error), or None.

    Every write is attempted even after one fails: one job's failure must not keep the
    others' state from being written.
    """
    failure: StateWriteFailure | None = None
    for write in writes:
        try:
            write()
        except (OSError, StorageError) as e:
            message = f"cannot write daemon state: {e}"
            STATE_DISK.failed(e, message)
            failure = failure or StateWriteFailure(message)
            now = time.monotonic()
            if now - _last_logged.get(message, -_LOG_EVERY_S) >= _LOG_EVERY_S:
                _last_logged[message] = now
                logger.error("%s (serving on; retried until it succeeds)", message)
    if failure is None:
        STATE_DISK.succeeded()
    return failure


# What loading a damaged job directory raises: bad JSON (ValueError), missing or mistyped
# fields, a cut-off or garbage npz (EOFError, BadZipFile), an unreadable file, a bad spec.
DAMAGED_STATE_ERRORS = (
    JobError,
    KeyError,
    TypeError,
    ValueError,
    EOFError,
    OSError,
    zipfile.BadZipFile,
)


def quarantine(job_dir: Path, state_dir: Path, error: BaseException) -> Path:
    """Move a job directory that cannot be loaded into ``state_dir/quarantine/``.

    Returns:
        Where it now is.
    """
    target_dir = private_dir(state_dir / "quarantine", "quarantine directory")
    target = target_dir / f"{job_dir.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    os.rename(job_dir, target)
    fsync_dir(job_dir.parent)
    fsync_dir(target_dir)
    logger.warning(
        "job in %s cannot be loaded (%s: %s): moved to %s; the other jobs are served",
        job_dir,
        type(error).__name__,
        error,
        target,
    )
    return target
