"""Durable job state: an append-only, checksummed feedback journal and atomic file writes.

Feedback arrives far more often than the engine's state is worth rewriting, so each FEEDBACK
is appended here (a few dozen bytes of header plus the arrays) and the engine's arrays are
snapshotted now and then; a restart loads the snapshot and replays the journal written since.
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

logger = logging.getLogger(__name__)

_MAGIC = b"LDFJ"
# magic, epoch, kind (0 train, 1 rescore), count, xxh3 of the payload that follows
_ENTRY = struct.Struct("<4siBxxxIQ")
_KINDS = ("train", "rescore")


@dataclass(frozen=True, slots=True)
class FeedbackEntry:
    """One FEEDBACK as journalled."""

    epoch: int
    kind: str
    ids: np.ndarray
    losses: np.ndarray


class FeedbackJournal:
    """Append-only file of feedback entries. Not thread-safe: the server loop owns it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "ab")  # noqa: SIM115  # held open for the daemon's lifetime
        self._dirty = False

    def append(self, epoch: int, kind: str, ids: np.ndarray, losses: np.ndarray) -> None:
        """Append one entry (buffered; ``sync`` makes it durable)."""
        payload = (
            np.ascontiguousarray(ids, np.int64).tobytes()
            + np.ascontiguousarray(losses, np.float32).tobytes()
        )
        head = _ENTRY.pack(
            _MAGIC, epoch, _KINDS.index(kind), len(ids), xxhash.xxh3_64_intdigest(payload)
        )
        self._file.write(head + payload)
        self._dirty = True

    def sync(self) -> None:
        """Flush and fsync what was appended since the last sync."""
        if self._dirty:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._dirty = False

    def reset(self) -> None:
        """Empty the journal (after the state it holds was snapshotted)."""
        self._file.truncate(0)
        self._file.seek(0)
        self.sync()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._file.closed

    def close(self) -> None:
        """Sync and close (safe to call twice)."""
        if not self._file.closed:
            self.sync()
            self._file.close()

    @staticmethod
    def replay(path: Path) -> Iterator[FeedbackEntry]:
        """Yield whole entries in order; cut the file at the first torn or corrupt one."""
        if not path.exists():
            return
        data = path.read_bytes()
        pos = 0
        while pos + _ENTRY.size <= len(data):
            magic, epoch, kind, n, digest = _ENTRY.unpack_from(data, pos)
            end = pos + _ENTRY.size + 12 * n
            payload = data[pos + _ENTRY.size : end]
            if magic != _MAGIC or kind >= len(_KINDS) or end > len(data):
                break
            if xxhash.xxh3_64_intdigest(payload) != digest:
                break
            ids = np.frombuffer(payload, np.int64, n)
            losses = np.frombuffer(payload, np.float32, n, 8 * n)
            yield FeedbackEntry(epoch, _KINDS[kind], ids, losses)
            pos = end
        if pos < len(data):
            logger.warning(
                "%s: cut %d bytes of torn feedback at offset %d", path, len(data) - pos, pos
            )
            with open(path, "r+b") as f:
                f.truncate(pos)


def write_atomic(path: Path, data: bytes, sync: bool = True) -> None:
    """Replace ``path`` with ``data`` so a crash leaves the old or the new file, never a mix.

    ``sync=False`` skips the fsyncs: the replacement then survives a crash of this process
    (the page cache keeps it) but not a crash of the machine.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    crashpoints.hit("replace")
    os.replace(tmp, path)
    if not sync:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json_atomic(path: Path, obj: Any, sync: bool = True) -> None:
    """``write_atomic`` for a JSON object."""
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode(), sync)


def read_json(path: Path) -> Any:
    """A JSON file's object, or None when the file does not exist."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
