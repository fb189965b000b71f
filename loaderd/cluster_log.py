"""The cluster's durable files: the rounds a node has seen, and its feedback not yet in one.

A node must be able to rebuild the replicated history after a crash and hand a rejoining peer
what it missed, so every completed round is appended (and fsynced) to the round log before
anyone acts on it. A node's own FEEDBACK is acknowledged to its trainer once it is in the
outbox (fsynced by the loop's group commit), and leaves the outbox when a round carried it.

Both files are sequences of frames ``magic, length, xxh3, payload`` padded to 8 bytes (so
arrays read back are aligned). A torn or corrupt tail, from a crash mid-append, is cut at
open. The round log is split in segment files, ``rounds-<first round>.log``; compaction drops
whole segments, so nothing is ever rewritten in place.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from loaderd.cluster_wire import KINDS, Entries, Pending
from loaderd.storage.safe_files import fsync_dir

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("<4sIQQ")  # magic, kind, payload length, xxh3 of the payload
_ROUND_FRAME = b"LDRL"
_OUTBOX_FRAME = b"LDOB"
_FEEDBACK = struct.Struct("<QiBxH")  # seq, epoch, kind, job name length; then ids, losses
_FLOOR = 255  # an outbox record saying "every seq <= this one is in a round"


def _frame(magic: bytes, kind: int, payload: bytes | memoryview) -> bytes:
    head = _FRAME.pack(magic, kind, len(payload), xxhash.xxh3_64_intdigest(payload))
    return head + bytes(payload) + bytes(-len(payload) % 8)


def _write_frame(f: BinaryIO, magic: bytes, kind: int, parts: Sequence[bytes | memoryview]) -> int:
    """Write one frame whose payload is ``parts`` joined, without joining them; its length."""
    digest = xxhash.xxh3_64()
    length = 0
    for part in parts:
        digest.update(part)
        length += len(part)
    f.write(_FRAME.pack(magic, kind, length, digest.intdigest()))
    for part in parts:
        f.write(part)
    f.write(bytes(-length % 8))
    return length


def _frames(path: Path, magic: bytes) -> Iterator[tuple[int, int, memoryview]]:
    """(offset, kind, payload) of each whole frame; the file is cut at the first bad one."""
    data = path.read_bytes()
    view = memoryview(data)
    pos = 0
    while pos + _FRAME.size <= len(data):
        got, kind, length, digest = _FRAME.unpack_from(data, pos)
        end = pos + _FRAME.size + length
        if got != magic or end > len(data):
            break
        payload = view[pos + _FRAME.size : end]
        if xxhash.xxh3_64_intdigest(payload) != digest:
            break
        yield pos, kind, payload
        pos = end + (-length % 8)
    if pos < len(data):
        logger.warning("%s: cut %d bytes of torn records at offset %d", path, len(data) - pos, pos)
        with open(path, "r+b") as f:
            f.truncate(pos)


class RoundLog:
    """Completed rounds by number, durable, in segment files under ``directory``.

    Not thread-safe: the cluster thread owns it.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._index: dict[int, tuple[Path, int, int]] = {}  # round -> (segment, offset, length)
        self._segments: list[tuple[int, Path]] = []  # (first round, path), oldest first
        self._last = 0
        for path in sorted(directory.glob("rounds-*.log")):
            self._load(path)
        self._file: BinaryIO | None = None
        self._roll = True  # the next append starts a new segment

    def _load(self, path: Path) -> None:
        first = None
        for offset, number, payload in _frames(path, _ROUND_FRAME):
            if self._index and number != self._last + 1:
                logger.warning("%s: round %d after %d; ignored from here", path, number, self._last)
                break
            self._index[number] = (path, offset + _FRAME.size, len(payload))
            self._last = number
            first = number if first is None else first
        if first is not None:
            self._segments.append((first, path))
        elif path.stat().st_size == 0:
            path.unlink()  # a crash right after the segment was created

    @property
    def first(self) -> int:
        """The oldest round kept (``last + 1`` when the log is empty)."""
        return next(iter(self._index)) if self._index else self._last + 1

    @property
    def last(self) -> int:
        """The newest round (0 when the log never held one)."""
        return self._last

    def __contains__(self, number: int) -> bool:
        return number in self._index

    def append(self, number: int, record: bytes | Sequence[bytes | memoryview]) -> None:
        """Append round ``number`` (the next one; its record, or the record's parts), fsynced.

        Raises:
            ValueError: ``number`` does not follow the last round.
        """
        if self._index and number != self._last + 1:
            raise ValueError(f"round {number} does not follow round {self._last}")
        if self._roll or self._file is None:
            self._start_segment(number)
        assert self._file is not None
        offset = self._file.tell()
        parts = [record] if isinstance(record, bytes) else record
        length = _write_frame(self._file, _ROUND_FRAME, number, parts)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._index[number] = (self._segments[-1][1], offset + _FRAME.size, length)
        self._last = number

    def _start_segment(self, number: int) -> None:
        if self._file is not None:
            self._file.close()
        path = self.dir / f"rounds-{number:012d}.log"
        self._file = open(path, "ab")  # noqa: SIM115  # held open until the next roll
        fsync_dir(self.dir)
        self._segments.append((number, path))
        self._roll = False

    def read(self, number: int) -> bytes:
        """The record of round ``number``.

        Raises:
            KeyError: the round is not kept.
        """
        path, offset, length = self._index[number]
        if self._file is not None:
            self._file.flush()
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise KeyError(f"round {number}: {path} is shorter than its index says")
        return data

    def compact(self, through: int) -> int:
        """Drop the segments whose rounds are all ``<= through``; returns rounds dropped.

        The segment being written is closed, so the next round starts a new one (a later
        compaction can then drop what this one could not).
        """
        dropped = 0
        keep: list[tuple[int, Path]] = []
        for i, (first, path) in enumerate(self._segments):
            nxt = self._segments[i + 1][0] if i + 1 < len(self._segments) else self._last + 1
            if nxt - 1 <= through:
                if self._file is not None and self._segments[-1][1] == path:
                    self._file.close()
                    self._file = None
                path.unlink()
                for number in range(first, nxt):
                    del self._index[number]
                dropped += nxt - first
            else:
                keep.append((first, path))
        self._segments = keep
        self._roll = True
        return dropped

    def skip_to(self, number: int) -> None:
        """Drop every round and go on after ``number`` (the caller holds them all)."""
        self.compact(self._last)
        self._last = number

    def close(self) -> None:
        """Close the open segment (safe to call twice)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RoundLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _encode_pending(p: Pending) -> bytes:
    e = p.entries
    name = e.job.encode()
    return (
        _FEEDBACK.pack(p.seq, e.epoch, KINDS.index(e.kind), len(name))
        + name
        + np.ascontiguousarray(e.ids, np.int64).tobytes()
        + np.ascontiguousarray(e.losses, np.float32).tobytes()
    )


def _decode_pending(payload: memoryview) -> Pending:
    seq, epoch, kind, name_len = _FEEDBACK.unpack_from(payload, 0)
    pos = _FEEDBACK.size
    job = bytes(payload[pos : pos + name_len]).decode()
    pos += name_len
    n = (len(payload) - pos) // 12
    ids = np.frombuffer(payload, np.int64, n, pos).copy()
    losses = np.frombuffer(payload, np.float32, n, pos + 8 * n).copy()
    return Pending(seq, Entries(job, epoch, KINDS[kind], ids, losses))


class Outbox:
    """A node's own feedback until a completed round carries it. Callers hold a lock.

    Args:
        path: the file (created).

    Attributes:
        floor: every sequence number up to this one is known to be in a round.
        pending: the entries above ``floor``, oldest first, as found at open.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.floor = 0
        self.pending: list[Pending] = []
        if path.exists():
            for _, kind, payload in _frames(path, _OUTBOX_FRAME):
                if kind == _FLOOR:
                    self.floor = max(self.floor, struct.unpack_from("<Q", payload)[0])
                else:
                    self.pending.append(_decode_pending(payload))
            self.pending = [p for p in self.pending if p.seq > self.floor]
        self._file = open(path, "ab")  # noqa: SIM115  # held open for the node's lifetime
        self._dirty = False

    def append(self, p: Pending) -> None:
        """Append one entry (buffered: ``sync`` makes it durable)."""
        self._file.write(_frame(_OUTBOX_FRAME, 0, _encode_pending(p)))
        self._dirty = True

    def sync(self) -> None:
        """Flush and fsync what was appended since the last sync."""
        if self._dirty and not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._dirty = False

    def reset(self, floor: int, keep: list[Pending], sync: bool = False) -> None:
        """Replace the file by ``floor`` plus ``keep`` (the entries no round holds yet).

        The new file is written beside the old and renamed over it, so a crash leaves one or
        the other. ``sync`` makes the new one durable: needed when ``keep`` holds entries that
        were acknowledged, or before rounds are compacted away. Without it a machine crash may
        bring back the old file, whose extra entries the (fsynced) round log says are sent.
        """
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_frame(_OUTBOX_FRAME, _FLOOR, struct.pack("<Q", floor)))
            for p in keep:
                f.write(_frame(_OUTBOX_FRAME, 0, _encode_pending(p)))
            if sync:
                f.flush()
                os.fsync(f.fileno())
        self._file.close()
        os.replace(tmp, self.path)
        if sync:
            fsync_dir(self.path.parent)
        self._file = open(self.path, "ab")  # noqa: SIM115
        self.floor = floor
        self._dirty = False

    def close(self) -> None:
        """Sync and close (safe to call twice)."""
        if not self._file.closed:
            self.sync()
            self._file.close()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
