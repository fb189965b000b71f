"""The arena's snapshot region (seed 000): two slots, so a reader never sees a mix.

The slots are written alternately, so a reader always finds the previous or the new snapshot
whole.

A slot is a 512-byte header (magic, version, job name length, arena uid, sequence, step,
payload length, xxh3 of the payload, xxh3 of the header and job name, then the job name), the
payload, and an 8-byte commit word stored and flushed after the payload.
"""

from __future__ import annotations

import logging
import mmap
import struct
import threading
from typing import Final, NamedTuple

import xxhash

from loaderd.storage import durability as dur
from loaderd.storage.errors import StorageError, StoreFullError

logger = logging.getLogger(__name__)

Payload = bytes | bytearray | memoryview

SLOT_HEAD: Final = 512
_MAGIC: Final = 0x4E53444C  # b"LDSN" read as a little-endian u32
_VERSION: Final = 1
# magic, version, reserved, job name length, arena uid, seq, step, length, payload xxh3;
# then the xxh3 of these bytes and the job name; then the job name.
_SLOT = struct.Struct("<IBBHQQqQQ")
_CHECKSUM = struct.Struct("<Q")
_JOB_AT: Final = _SLOT.size + _CHECKSUM.size
MAX_JOB_BYTES: Final = SLOT_HEAD - _JOB_AT
_COMMIT_SALT: Final = 0x5A5B5C5D01020304


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


def _commit_word(header_xxh: int) -> int:
    return (header_xxh ^ _COMMIT_SALT) | 1


class _Slot(NamedTuple):
    seq: int
    job: str
    step: int
    length: int
    payload_xxh: int


class SnapshotRegion:
    """Two alternating snapshot slots inside an arena's mapping.

    The writer targets the slot that does not hold the newest whole snapshot of the same job,
    so that job's previous snapshot stays readable until the new one is committed. The region
    holds two snapshots in all: ``evicts`` says whose snapshot the next write of a job would
    overwrite, and the daemon writes that job's snapshots elsewhere rather than let it happen.

    Attributes:
        lock: Serialises writers and readers of the region.
    """

    def __init__(
        self,
        mm: mmap.mmap,
        *,
        offset: int,
        slot_bytes: int,
        uid: int,
        durability: str,
        where: str,
    ) -> None:
        """Attach to the region and read its slot headers.

        Args:
            mm: The arena's mapping.
            offset: Where the first slot starts.
            slot_bytes: Size of each slot (0: the arena has no snapshot region).
            uid: The arena's uid; slots written under another uid are ignored.
            durability: The mapping's durability class.
            where: The arena's path, for messages.
        """
        self.lock = threading.Lock()
        self._mm = mm
        self._offset = offset
        self._slot_bytes = slot_bytes
        self._uid = uid
        self._durability = durability
        self._where = where
        self._slots: list[_Slot | None] = []
        self._seq = 1
        self._closed = False
        if slot_bytes:
            for i in range(2):
                seq, slot = self._parse(i)
                self._slots.append(slot)
                self._seq = max(self._seq, seq + 1)

    @property
    def max_payload(self) -> int:
        """The largest payload a slot takes, in bytes (0 without a snapshot region)."""
        return max(0, (self._slot_bytes - SLOT_HEAD - 8) // 8 * 8)

    def _base(self, i: int) -> int:
        return self._offset + i * self._slot_bytes

    def _parse(self, i: int) -> tuple[int, _Slot | None]:
        """The slot's sequence (0 if its header is not intact) and, if committed, its entry."""
        mm, base = self._mm, self._base(i)
        magic, version, _, job_len, uid, seq, step, length, pxh = _SLOT.unpack_from(mm, base)
        if magic != _MAGIC or version != _VERSION or uid != self._uid:
            return 0, None
        if job_len > MAX_JOB_BYTES or SLOT_HEAD + _align8(length) + 8 > self._slot_bytes:
            return 0, None
        hxh = _CHECKSUM.unpack_from(mm, base + _SLOT.size)[0]
        job_b = mm[base + _JOB_AT : base + _JOB_AT + job_len]
        if hxh != xxhash.xxh3_64_intdigest(mm[base : base + _SLOT.size] + job_b):
            return 0, None
        commit = _CHECKSUM.unpack_from(mm, base + SLOT_HEAD + _align8(length))[0]
        if commit != _commit_word(hxh):
            return seq, None  # torn: its sequence is still spent
        try:
            job = job_b.decode()
        except UnicodeDecodeError:
            return seq, None
        return seq, _Slot(seq, job, step, length, pxh)

    def close(self) -> None:
        """Refuse further reads and writes; the caller holds ``lock`` and unmaps afterwards."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"arena {self._where} is closed")

    def _live(self) -> list[tuple[int, int, _Slot]]:
        """``(seq, slot index, slot)`` of the committed slots, newest first."""
        live = [(s.seq, i, s) for i, s in enumerate(self._slots) if s is not None]
        return sorted(live, reverse=True)

    def _target(self, job: str) -> int:
        live = self._live()
        mine = [i for _, i, s in live if s.job == job]
        if mine:
            return 1 - mine[0]
        if len(live) < 2:
            return next(i for i, s in enumerate(self._slots) if s is None)
        return live[-1][1]

    def evicts(self, job: str) -> str | None:
        """The other job whose whole snapshot the next write of ``job`` would overwrite."""
        with self.lock:
            if not self._slot_bytes:
                return None
            slot = self._slots[self._target(job)]
            return slot.job if slot is not None and slot.job != job else None

    def write(self, job: str, step: int, payload: Payload) -> None:
        """Write a snapshot so that a crash at any moment leaves the previous one readable.

        Args:
            job: The job's name (at most 440 bytes of UTF-8).
            step: The training step the snapshot belongs to.
            payload: The serialised state.

        Raises:
            StoreFullError: The payload is larger than a slot.
            ValueError: The job name is too long.
        """
        job_b = job.encode()
        if len(job_b) > MAX_JOB_BYTES:
            raise ValueError(f"`job` must be at most {MAX_JOB_BYTES} bytes, got {len(job_b)}")
        length = memoryview(payload).nbytes
        if length > self.max_payload:
            raise StoreFullError(
                f"snapshot of {length} bytes for job {job!r} does not fit the snapshot slot "
                f"of arena {self._where} (at most {self.max_payload} bytes; raise "
                "snapshot_bytes)"
            )
        with self.lock:
            self._check_open()
            i = self._target(job)
            old = self._slots[i]
            if old is not None and old.job != job:
                logger.info("snapshot of job %r replaces job %r's", job, old.job)
            self._slots[i] = None
            seq = self._seq
            self._seq += 1
            fields = _SLOT.pack(
                _MAGIC,
                _VERSION,
                0,
                len(job_b),
                self._uid,
                seq,
                step,
                length,
                xxhash.xxh3_64_intdigest(payload),
            )
            hxh = xxhash.xxh3_64_intdigest(fields + job_b)
            mm, base = self._mm, self._base(i)
            mm[base : base + _SLOT.size] = fields
            _CHECKSUM.pack_into(mm, base + _SLOT.size, hxh)
            mm[base + _JOB_AT : base + _JOB_AT + len(job_b)] = job_b
            mm[base + SLOT_HEAD : base + SLOT_HEAD + length] = payload
            commit_at = base + SLOT_HEAD + _align8(length)
            dur.flush_range(mm, base, commit_at, self._durability)
            _CHECKSUM.pack_into(mm, commit_at, _commit_word(hxh))
            dur.flush_range(mm, commit_at, commit_at + 8, self._durability)
            # Parse what is in the slot now rather than trust what was meant to be written.
            self._slots[i] = self._parse(i)[1]
        logger.debug("snapshot of job %r step %d: %d bytes in slot %d", job, step, length, i)

    def read(self, job: str | None = None) -> tuple[str, int, bytes] | None:
        """Return the newest whole snapshot, of ``job`` or of any job.

        Args:
            job: The job's name, or None for whichever job wrote last.

        Returns:
            ``(job, step, payload)``, or None when no whole snapshot exists.
        """
        with self.lock:
            self._check_open()
            for _, i, slot in self._live():
                if job is not None and slot.job != job:
                    continue
                start = self._base(i) + SLOT_HEAD
                data = self._mm[start : start + slot.length]
                if xxhash.xxh3_64_intdigest(data) == slot.payload_xxh:
                    return slot.job, slot.step, data
                logger.warning(
                    "snapshot of job %r step %d in arena %s fails its checksum; dropped",
                    slot.job,
                    slot.step,
                    self._where,
                )
                self._slots[i] = None
            return None

    def newest(self) -> dict[str, object] | None:
        """Describe the newest committed snapshot: ``job``, ``step``, ``bytes``, ``max_bytes``."""
        with self.lock:
            live = self._live()
            if not live:
                return None
            s = live[0][2]
            return {"job": s.job, "step": s.step, "bytes": s.length, "max_bytes": self.max_payload}
