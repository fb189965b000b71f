"""Durable job state: an append-only, checksummed feedback journal and atomic file writes.

Feedback arrives far more often than the engine's state is worth rewriting, so each FEEDBACK
is appended here (a few dozen bytes of header plus the arrays) and the engine's arrays are
snapshotted now and then; a restart loads the snapshot and replays the journal written since.
An epoch's selection moves the engine too (its groups, its counters): it is journalled as
what was decided (``SelectionEntry``), in its place among the feedback, so that the epoch's
start writes a few dozen bytes instead of a snapshot.
A torn tail (the daemon killed mid-append) fails its checksum and is cut off at open.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from loaderd import crashpoints
from loaderd.storage.errors import StorageError
from loaderd.storage.safe_files import open_private
from loaderd.storage.safe_files import write_atomic as safe_write_atomic

logger = logging.getLogger(__name__)

_MAGIC = b"LDFJ"
# magic, epoch, kind (0 train, 1 rescore, 2 selection), count, xxh3 of the payload that
# follows: ids and losses (12 bytes a sample), or a selection's count and cut (16 bytes).
_ENTRY = struct.Struct("<4siBxxxIQ")
_KINDS = ("train", "rescore")
_SELECTION = len(_KINDS)
_SELECTED = struct.Struct("<qd")


@dataclass(frozen=True, slots=True)
class FeedbackEntry:
    """One FEEDBACK as journalled."""

    epoch: int
    kind: str
    ids: np.ndarray
    losses: np.ndarray


@dataclass(frozen=True, slots=True)
class SelectionEntry:
    """An epoch's selection as journalled: how many samples it kept, and at what loss."""

    epoch: int
    selected: int
    cut: float


class JournalWriteError(StorageError):
    """An entry (feedback, a selection) could not be made durable (a full disk, an I/O error)."""


class FeedbackJournal:
    """Append-only file of feedback and selection entries. Not thread-safe: the loop owns it.

    Each entry is written straight to the file (no user-space buffer), so a full disk is
    reported by the append that meets it, and the file is cut back to the end of the last
    whole entry: a torn entry never stays in the middle, where it would hide every later
    (acknowledged) entry from the replay.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = open_private(path, "feedback journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self._end = self._synced = os.fstat(self._fd).st_size

    def append(self, epoch: int, kind: str, ids: np.ndarray, losses: np.ndarray) -> None:
        """Append one entry (``sync`` makes it durable).

        Raises:
            JournalWriteError: the write failed; the journal is as it was before.
        """
        payload = (
            np.ascontiguousarray(ids, np.int64).tobytes()
            + np.ascontiguousarray(losses, np.float32).tobytes()
        )
        self._write(epoch, _KINDS.index(kind), len(ids), payload)

    def append_selection(self, epoch: int, selected: int, cut: float) -> None:
        """Append an epoch's selection (``ImportanceEngine.last_selection``); see ``append``."""
        self._write(epoch, _SELECTION, 0, _SELECTED.pack(selected, cut))

    def _write(self, epoch: int, kind: int, count: int, payload: bytes) -> None:
        head = _ENTRY.pack(_MAGIC, epoch, kind, count, xxhash.xxh3_64_intdigest(payload))
        entry = memoryview(head + payload)
        try:
            while entry:
                entry = entry[os.write(self._fd, entry) :]
        except OSError as e:
            self._cut(self._end)
            raise JournalWriteError(f"cannot journal feedback in {self.path}: {e}") from e
        self._end += len(head) + len(payload)

    def sync(self) -> None:
        """Make what was appended since the last sync durable.

        Raises:
            JournalWriteError: the fsync failed; the entries since the last sync are cut
                off (none of them was acknowledged).
        """
        if self._end == self._synced:
            return
        try:
            os.fsync(self._fd)
        except OSError as e:
            self._cut(self._synced)
            raise JournalWriteError(f"cannot sync feedback journal {self.path}: {e}") from e
        self._synced = self._end

    def _cut(self, end: int) -> None:
        try:
            os.ftruncate(self._fd, end)
        except OSError:
            logger.exception("%s: cannot cut back to %d bytes", self.path, end)
            raise
        self._end = end

    def reset(self) -> None:
        """Empty the journal (after the state it holds was snapshotted)."""
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)
        self._end = self._synced = 0

    @property
    def size_bytes(self) -> int:
        """Bytes appended since the last reset."""
        return self._end

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._fd < 0

    def close(self) -> None:
        """Sync and close (safe to call twice)."""
        if self._fd >= 0:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = -1

    @staticmethod
    def replay(path: Path) -> Iterator[FeedbackEntry | SelectionEntry]:
        """Yield whole entries in order; cut the file at the first torn or corrupt one."""
        if not path.exists():
            return
        data = path.read_bytes()
        pos = 0
        while pos + _ENTRY.size <= len(data):
            magic, epoch, kind, n, digest = _ENTRY.unpack_from(data, pos)
            end = pos + _ENTRY.size + (_SELECTED.size if kind == _SELECTION else 12 * n)
            payload = data[pos + _ENTRY.size : end]
            if magic != _MAGIC or kind > _SELECTION or end > len(data):
                break
            if xxhash.xxh3_64_intdigest(payload) != digest:
                break
            if kind == _SELECTION:
                yield SelectionEntry(epoch, *_SELECTED.unpack(payload))
            else:
                ids = np.frombuffer(payload, np.int64, n)
                losses = np.frombuffer(payload, np.float32, n, 8 * n)
                yield FeedbackEntry(epoch, _KINDS[kind], ids, losses)
            pos = end
        if pos < len(data):
            logger.warning(
                "%s: cut %d bytes of torn feedback at offset %d", path, len(data) - pos, pos
            )
            if data.find(_MAGIC, pos + 1) >= 0:
                # Damage in the middle, not a torn tail: keep what follows for the user.
                aside = path.with_name(f"{path.name}.damaged-at-{pos}")
                safe_write_atomic(aside, data[pos:])
                logger.warning("%s: the entries after offset %d were kept in %s", path, pos, aside)
            with open(path, "r+b") as f:
                f.truncate(pos)


def write_atomic(path: Path, data: bytes, sync: bool = True) -> None:
    """Replace ``path`` with ``data`` so a crash leaves the old or the new file, never a mix.

    ``safe_files.write_atomic`` with the ``replace`` crash point between write and rename.
    """
    safe_write_atomic(path, data, sync, before_replace=lambda: crashpoints.hit("replace"))


def write_json_atomic(path: Path, obj: Any, sync: bool = True) -> None:
    """``write_atomic`` for a JSON object."""
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode(), sync)


def read_json(path: Path) -> Any:
    """A JSON file's object, or None when the file does not exist."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
