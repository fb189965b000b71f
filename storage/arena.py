"""The NVRAM tier: a fixed-size mmap'ed file holding a checksummed ring log of sample records.

File layout (little-endian; offsets in bytes)::

    [0, 4096)                      header page: magic, version, arena uid, store fingerprint,
                                   layout sizes, xxh3 of the header
    [4096, 4096 + log_bytes)       the log: records at 64-byte aligned offsets, used as a ring
    [snap_offset, file end)        two snapshot slots, written alternately (arena_snapshot.py)

A record is a 64-byte header (magic, version, arena uid, sequence, sample id, payload length,
xxh3 of the payload, xxh3 of the header), the payload, then an 8-byte commit word derived from
the header checksum. The commit word is stored and flushed only after the payload is durable,
so a torn write is never taken as whole.

Recovery reads every valid header and replays the ring backwards in sequence order: writes
are sequential, so everything written after a record lies between its end and the head. A
record is alive when that sweep has not come round to it; alive records must also carry their
commit word and payload checksum. What lies beyond the newest whole record is zeroed. Another
store's fingerprint, another layout or format version, or a garbage header rebuilds the arena
(with a warning): the file is truncated and a fresh random arena uid makes any stale record
unrecognisable. The contract is "never serve wrong bytes; recover what is whole".
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Final, NamedTuple

import numpy as np
import xxhash

from loaderd.storage import durability as dur
from loaderd.storage.arena_snapshot import SnapshotRegion
from loaderd.storage.errors import CorruptRecordError, StorageError, StoreFullError

logger = logging.getLogger(__name__)

Payload = bytes | bytearray | memoryview

FORMAT_VERSION: Final = 1
HEADER_PAGE: Final = 4096
ALIGN: Final = 64  # record alignment: one cache line, and a cheap vectorised header search

_ARENA_MAGIC: Final = b"LDARENA\x00"
# magic, version, flags, arena uid, fingerprint, file bytes, log offset, log bytes,
# snapshot offset, snapshot slot bytes; the xxh3 of these bytes follows.
_HEADER = struct.Struct("<8sIIQ16sQQQQQ")
_CHECKSUM = struct.Struct("<Q")

_REC_MAGIC: Final = 0x4344524C  # b"LRDC" read as a little-endian u32
_REC_KIND_SAMPLE: Final = 1
# magic, version, kind, reserved, arena uid, seq, sample id, length, payload xxh3; then the
# header's own xxh3; the payload starts at the next cache line.
_REC = struct.Struct("<IBBHQQQQQ")
_REC_HEAD: Final = 64
_COMMIT_SALT: Final = 0xC0EC0111DEADBEEF
_MAX_SAMPLE_ID: Final = (1 << 63) - 1  # ids() is int64
_ZERO_CHUNK: Final = 1 << 20
_SCAN_CHUNK: Final = 64 << 20


def _xxh(data: Payload) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _commit_word(header_xxh: int) -> int:
    # Never zero: a zeroed commit word is how a record is revoked (discard, corrupt).
    return (header_xxh ^ _COMMIT_SALT) | 1


def record_extent(length: int) -> int:
    """Bytes a record with a ``length``-byte payload takes in the log (header, commit, pad)."""
    return _align(_REC_HEAD + _align(length, 8) + 8, ALIGN)


class _Rec(NamedTuple):
    off: int  # absolute file offset
    extent: int
    seq: int
    sample_id: int
    length: int
    payload_xxh: int
    header_xxh: int


class Arena:
    """A crash-safe cache of sample payloads in one fixed-size mmap'ed file.

    Thread-safe (one lock for the log, another for the snapshot region), and a context
    manager. One process at a time: the file is locked with ``flock``.

    Attributes:
        path: The arena file.
        durability: ``"pmem-sync"``, ``"file-msync"`` or ``"volatile"`` (see ``durability.py``).
        recovered_items: Records the recovery scan kept when the arena was opened.
        recovery_dropped: Records the scan dropped for a wrong commit word or payload
            checksum (a torn write or corruption; uncommitted records are not counted).
        rebuilt: Whether the file was (re)created at open rather than recovered.
    """

    def __init__(
        self, path: Path, capacity_bytes: int, fingerprint: bytes, *, snapshot_bytes: int = 0
    ) -> None:
        """Open the arena at ``path``, recovering its records, or create it.

        Args:
            path: The arena file; its directory must exist.
            capacity_bytes: Size of the whole file (rounded down to 4 KiB), snapshot region
                included.
            fingerprint: 16 bytes that identify the sample store the records come from.
            snapshot_bytes: Bytes reserved for the two snapshot slots (0: no snapshots).

        Raises:
            ValueError: A size or the fingerprint is out of range.
            StoreFullError: The file system has no room for the file.
            StorageError: Another process holds the arena, or the file cannot be opened.
        """
        if len(fingerprint) != 16:
            raise ValueError(f"`fingerprint` must be 16 bytes, got {len(fingerprint)}")
        if snapshot_bytes < 0:
            raise ValueError(f"`snapshot_bytes` must be >= 0, got {snapshot_bytes}")
        file_bytes = capacity_bytes // HEADER_PAGE * HEADER_PAGE
        slot_bytes = snapshot_bytes // 2 // HEADER_PAGE * HEADER_PAGE
        if snapshot_bytes and slot_bytes < 2 * HEADER_PAGE:
            raise ValueError(f"`snapshot_bytes` must be 0 or >= 16384, got {snapshot_bytes}")
        log_bytes = file_bytes - HEADER_PAGE - 2 * slot_bytes
        if log_bytes < HEADER_PAGE:
            raise ValueError(
                f"`capacity_bytes`={capacity_bytes} leaves no room for the log "
                f"(header {HEADER_PAGE} + snapshots {2 * slot_bytes} bytes)"
            )
        self.path = Path(path)
        self._fingerprint = bytes(fingerprint)
        self._file_bytes = file_bytes
        self._log_off = HEADER_PAGE
        self._log_bytes = log_bytes
        self._log_end = HEADER_PAGE + log_bytes
        self._slot_bytes = slot_bytes
        self._lock = threading.Lock()
        self._closed = False
        self._index: dict[int, tuple[int, int]] = {}  # sample id -> (offset, seq)
        # Records in ring order from the head: the front is the next one to be overwritten.
        self._ring: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self._head = self._log_off
        self._seq = 1
        self._batch_seq = 1  # first sequence of the batch being written, not yet committed
        self._used = 0
        self._pending: set[int] = set()  # pages with revoked commit words not yet flushed
        self.corrupt_dropped = 0
        self.evictions = 0
        self.hits = 0
        self.misses = 0
        self.recovered_items = 0
        self.recovery_dropped = 0
        self.rebuilt = False

        t0 = time.perf_counter()
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StorageError(f"cannot open arena {self.path}: {e}") from e
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                raise StorageError(f"arena {self.path} is in use by another process") from e
            self.durability = dur.probe_durability(self.path)
            self._uid = self._open_or_rebuild()
            self._mm = dur.map_file(self._fd, file_bytes, self.durability)
            self.snapshots = SnapshotRegion(
                self._mm,
                offset=self._log_end,
                slot_bytes=slot_bytes,
                uid=self._uid,
                durability=self.durability,
                where=str(self.path),
            )
            self._recover()
        except BaseException:
            self._release()
            raise
        logger.info(
            "arena %s (%s): %d records recovered, %d dropped, in %.2f s",
            self.path,
            self.durability,
            self.recovered_items,
            self.recovery_dropped,
            time.perf_counter() - t0,
        )

    # ---- opening ---------------------------------------------------------------------------

    def _header_bytes(self, uid: int) -> bytes:
        fields = _HEADER.pack(
            _ARENA_MAGIC,
            FORMAT_VERSION,
            0,
            uid,
            self._fingerprint,
            self._file_bytes,
            self._log_off,
            self._log_bytes,
            self._log_end,
            self._slot_bytes,
        )
        return fields + _CHECKSUM.pack(_xxh(fields))

    def _why_not_valid(self) -> str | None:
        size = os.fstat(self._fd).st_size
        if size != self._file_bytes:
            return f"its size is {size} bytes, expected {self._file_bytes}"
        raw = os.pread(self._fd, _HEADER.size + _CHECKSUM.size, 0)
        fields = raw[: _HEADER.size]
        (magic, version, _flags, _uid, fingerprint, *layout) = _HEADER.unpack(fields)
        if magic != _ARENA_MAGIC:
            return "its header is not an arena header"
        if _CHECKSUM.unpack_from(raw, _HEADER.size)[0] != _xxh(fields):
            return "its header checksum does not match"
        if version != FORMAT_VERSION:
            return f"it has format version {version}, expected {FORMAT_VERSION}"
        if fingerprint != self._fingerprint:
            return f"it belongs to another store (fingerprint {fingerprint.hex()})"
        expected = [self._file_bytes, self._log_off, self._log_bytes, self._log_end]
        if layout != [*expected, self._slot_bytes]:
            return "its layout (log or snapshot sizes) differs"
        return None

    def _open_or_rebuild(self) -> int:
        fresh = os.fstat(self._fd).st_size == 0
        why = None if fresh else self._why_not_valid()
        if not fresh and why is None:
            self._reserve_space()  # fill holes, so a full disk cannot SIGBUS a later store
            raw = os.pread(self._fd, _HEADER.size, 0)
            uid: int = _HEADER.unpack(raw)[3]
            return uid
        if why is not None:
            logger.warning("rebuilding arena %s: %s", self.path, why)
        self.rebuilt = True
        # Truncating drops every old byte at once; a fresh uid makes stale records unreadable
        # even where a file system keeps the blocks.
        uid = int.from_bytes(os.urandom(8), "little")
        os.ftruncate(self._fd, 0)
        os.ftruncate(self._fd, self._file_bytes)
        self._reserve_space()
        os.pwrite(self._fd, self._header_bytes(uid), 0)
        os.fsync(self._fd)
        return uid

    def _reserve_space(self) -> None:
        try:
            os.posix_fallocate(self._fd, 0, self._file_bytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFullError(
                    f"no room for the {self._file_bytes}-byte arena {self.path}: {e.strerror}"
                ) from e
            logger.debug("cannot preallocate arena %s: %s", self.path, e)

    # ---- recovery --------------------------------------------------------------------------

    def _parse(self, off: int) -> _Rec | None:
        """The record header at ``off`` if it is one of ours and intact, else None."""
        magic, version, kind, _, uid, seq, sample_id, length, pxh = _REC.unpack_from(self._mm, off)
        if magic != _REC_MAGIC or version != FORMAT_VERSION or kind != _REC_KIND_SAMPLE:
            return None
        if uid != self._uid:
            return None
        hxh = _CHECKSUM.unpack_from(self._mm, off + _REC.size)[0]
        if hxh != _xxh(self._mm[off : off + _REC.size]):
            return None
        extent = record_extent(length)
        if off + extent > self._log_end:
            return None
        return _Rec(off, extent, seq, sample_id, length, pxh, hxh)

    def _whole(self, rec: _Rec) -> bool | None:
        """True: commit word and payload checksum match; None: never committed, or revoked."""
        commit_at = rec.off + _REC_HEAD + _align(rec.length, 8)
        commit = _CHECKSUM.unpack_from(self._mm, commit_at)[0]
        if commit != _commit_word(rec.header_xxh):
            return None if commit == 0 else False
        start = rec.off + _REC_HEAD
        return _xxh(self._mm[start : start + rec.length]) == rec.payload_xxh

    def _candidates(self) -> list[int]:
        """Offsets in the log where a record magic sits on a record boundary."""
        found: list[int] = []
        for lo in range(self._log_off, self._log_end, _SCAN_CHUNK):
            n = min(_SCAN_CHUNK, self._log_end - lo)
            words = np.frombuffer(self._mm, dtype="<u4", count=n // 4, offset=lo)
            hits = np.flatnonzero(words[:: ALIGN // 4] == _REC_MAGIC)
            del words  # release the export, or the mmap cannot be closed
            found.extend((hits * ALIGN + lo).tolist())
        return found

    def _recover(self) -> None:
        recs = [r for off in self._candidates() if (r := self._parse(off)) is not None]
        recs.sort(key=lambda r: r.seq, reverse=True)
        size = self._log_bytes
        alive: list[_Rec] = []
        swept = 0  # bytes of ring written after the record under consideration
        sweep_start = 0  # relative offset where that sweep begins
        for i, rec in enumerate(recs):
            rel = rec.off - self._log_off
            if i > 0:
                gap = (sweep_start - (rel + rec.extent)) % size
                if gap + rec.extent + swept > size:
                    continue  # overwritten by a later lap of the ring
                swept += gap
            swept += rec.extent
            sweep_start = rel
            whole = self._whole(rec)
            if whole:
                alive.append(rec)
            elif whole is not None:
                self.recovery_dropped += 1
            if swept >= size:
                break
        self._seq = recs[0].seq + 1 if recs else 1
        self._head = alive[0].off + alive[0].extent if alive else self._log_off
        head_rel = self._head - self._log_off
        alive.sort(key=lambda r: (r.off - self._log_off - head_rel) % size)
        for rec in alive:
            self._ring.append((rec.off, rec.extent, rec.sample_id, rec.seq))
            self._used += rec.extent
            known = self._index.get(rec.sample_id)
            if known is None or known[1] < rec.seq:
                self._index[rec.sample_id] = (rec.off, rec.seq)
        self.recovered_items = len(self._index)
        # Beyond the newest whole record lie only torn writes and overwritten laps.
        stop = self._ring[0][0] if self._ring and self._ring[0][0] >= self._head else None
        self._zero(self._head, self._log_end if stop is None else stop)

    def _zero(self, start: int, end: int) -> None:
        for lo in range(start, end, _ZERO_CHUNK):
            n = min(_ZERO_CHUNK, end - lo)
            view = np.frombuffer(self._mm, dtype=np.uint8, count=n, offset=lo)
            dirty = bool(view.any())  # skip pages that are zero already: no writes, no flush
            del view
            if dirty:
                self._mm[lo : lo + n] = bytes(n)
                dur.flush_range(self._mm, lo, lo + n, self.durability)

    # ---- the log ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"arena {self.path} is closed")

    def _evict_front(self, evict: bool, evicted: list[int]) -> None:
        off, extent, sample_id, seq = self._ring[0]
        assert seq < self._batch_seq, "a batch must never overwrite itself"
        if self._index.get(sample_id) == (off, seq):
            if not evict:
                raise StoreFullError(
                    f"arena {self.path} is full: {len(self._index)} records in "
                    f"{self._log_bytes} bytes, and eviction is off"
                )
            del self._index[sample_id]
            self.evictions += 1
            evicted.append(sample_id)
        self._ring.popleft()
        self._used -= extent

    def _place(self, extent: int, evict: bool, evicted: list[int]) -> int:
        """Find room for ``extent`` bytes at the head, evicting what is in the way."""
        while True:
            ahead = bool(self._ring) and self._ring[0][0] >= self._head
            limit = self._ring[0][0] if ahead else self._log_end
            if self._head + extent <= limit:
                return self._head
            if ahead:
                self._evict_front(evict, evicted)
            else:
                self._head = self._log_off  # nothing left before the end: wrap

    def put(self, sample_id: int, payload: Payload, *, evict: bool = True) -> list[int]:
        """Store one sample durably (see :meth:`put_many`).

        Args:
            sample_id: The sample's id (0 <= id < 2**63).
            payload: The sample's bytes.
            evict: Whether older records may be evicted to make room.

        Returns:
            The ids evicted to make room.

        Raises:
            StoreFullError: The payload is larger than the log, or the log is full of live
                records and ``evict`` is False.
        """
        return self.put_many([(sample_id, payload)], evict=evict)

    def put_many(self, items: Iterable[tuple[int, Payload]], *, evict: bool = True) -> list[int]:
        """Append samples to the log with one pair of flushes for the whole batch.

        Payloads are written and flushed, then their commit words are written and flushed;
        the records become visible to :meth:`get` only after that. If an item fails (a bad
        id, no room), the items before it are still committed before the error is raised.
        A later put of an id replaces the earlier record.

        Args:
            items: ``(sample_id, payload)`` pairs.
            evict: Whether older records may be evicted to make room.

        Returns:
            The ids evicted to make room (they are no longer in the arena).

        Raises:
            ValueError: A sample id is out of range.
            StoreFullError: A payload is larger than the log, or the log is full of live
                records and ``evict`` is False.
        """
        evicted: list[int] = []
        with self._lock:
            self._check_open()
            written: list[_Rec] = []
            batch_bytes = 0
            self._batch_seq = self._seq
            try:
                for sample_id, payload in items:
                    extent = record_extent(memoryview(payload).nbytes)
                    if batch_bytes + extent > self._log_bytes // 2:
                        # Commit early: an uncommitted batch spanning (with the space a wrap
                        # wastes) at most the whole ring can never overwrite itself.
                        self._commit(written)
                        written, batch_bytes = [], 0
                        self._batch_seq = self._seq
                    written.append(self._write(sample_id, payload, evict, evicted))
                    batch_bytes += extent
            finally:
                self._commit(written)
                self._batch_seq = self._seq
        return evicted

    def _write(self, sample_id: int, payload: Payload, evict: bool, evicted: list[int]) -> _Rec:
        if not 0 <= sample_id <= _MAX_SAMPLE_ID:
            raise ValueError(f"`sample_id` must be in [0, 2**63), got {sample_id}")
        length = memoryview(payload).nbytes
        extent = record_extent(length)
        if extent > self._log_bytes:
            raise StoreFullError(
                f"sample {sample_id} of {length} bytes does not fit in arena {self.path} "
                f"(log of {self._log_bytes} bytes)"
            )
        off = self._place(extent, evict, evicted)
        seq = self._seq
        self._seq += 1
        fields = _REC.pack(
            _REC_MAGIC,
            FORMAT_VERSION,
            _REC_KIND_SAMPLE,
            0,
            self._uid,
            seq,
            sample_id,
            length,
            _xxh(payload),
        )
        hxh = _xxh(fields)
        mm = self._mm
        mm[off : off + _REC.size] = fields
        _CHECKSUM.pack_into(mm, off + _REC.size, hxh)
        mm[off + _REC_HEAD : off + _REC_HEAD + length] = payload
        self._head = off + extent
        self._ring.append((off, extent, sample_id, seq))
        self._used += extent
        return _Rec(off, extent, seq, sample_id, length, 0, hxh)

    def _flush_records(self, recs: list[_Rec]) -> None:
        runs: list[list[int]] = []
        for rec in sorted(recs):
            if runs and runs[-1][1] == rec.off:
                runs[-1][1] = rec.off + rec.extent
            else:
                runs.append([rec.off, rec.off + rec.extent])
        for lo, hi in runs:
            dur.flush_range(self._mm, lo, hi, self.durability)

    def _commit(self, recs: list[_Rec]) -> None:
        if not recs:
            return
        self._flush_records(recs)  # payloads first: a commit word must never precede them
        for rec in recs:
            commit_at = rec.off + _REC_HEAD + _align(rec.length, 8)
            _CHECKSUM.pack_into(self._mm, commit_at, _commit_word(rec.header_xxh))
            old = self._index.get(rec.sample_id)
            self._index[rec.sample_id] = (rec.off, rec.seq)
            if old is not None and (prev := self._parse(old[0])) is not None:
                # Revoke the replaced copy: a later discard must not bring it back on reopen.
                self._revoke(old[0], prev.length)
        self._flush_records(recs)
        self._flush_pending()

    def _revoke(self, off: int, length: int) -> None:
        """Zero a record's commit word so that recovery will not bring it back."""
        commit_at = off + _REC_HEAD + _align(length, 8)
        _CHECKSUM.pack_into(self._mm, commit_at, 0)
        self._pending.add(commit_at)

    def _flush_pending(self) -> None:
        for at in self._pending:
            dur.flush_range(self._mm, at, at + 8, self.durability)
        self._pending.clear()

    def get(self, sample_id: int) -> bytes | None:
        """Return a sample's bytes, verified against its checksum.

        A record that fails its checks is dropped, counted in ``corrupt_dropped`` and logged;
        the caller then reads the sample from the store.

        Args:
            sample_id: The sample's id.

        Returns:
            The payload, or None when the arena does not hold a whole copy of the sample.
        """
        with self._lock:
            self._check_open()
            loc = self._index.get(sample_id)
            if loc is None:
                self.misses += 1
                return None
            off, seq = loc
            rec = self._parse(off)
            if rec is not None and rec.seq == seq and rec.sample_id == sample_id:
                start = off + _REC_HEAD
                data = self._mm[start : start + rec.length]
                commit_at = start + _align(rec.length, 8)
                commit = _CHECKSUM.unpack_from(self._mm, commit_at)[0]
                if commit == _commit_word(rec.header_xxh) and _xxh(data) == rec.payload_xxh:
                    self.hits += 1
                    return data
            del self._index[sample_id]
            self.corrupt_dropped += 1
            self.misses += 1
            if rec is not None:
                self._revoke(off, rec.length)
            err = CorruptRecordError(sample_id, f"arena {self.path} at offset {off}")
            logger.warning("dropped a bad record: %s", err)
            return None

    def discard(self, sample_id: int) -> None:
        """Drop a sample from the arena (a no-op when it is absent).

        Its space is reclaimed when the ring comes round; the record is revoked on disk with
        the next flush (a put or close), so a restart does not bring it back after that.

        Args:
            sample_id: The sample's id.
        """
        with self._lock:
            self._check_open()
            loc = self._index.pop(sample_id, None)
            if loc is not None and (rec := self._parse(loc[0])) is not None:
                self._revoke(loc[0], rec.length)

    def __contains__(self, sample_id: object) -> bool:
        with self._lock:
            return sample_id in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def ids(self) -> np.ndarray:
        """Return the ids of the samples held, as an int64 array in no particular order."""
        with self._lock:
            return np.fromiter(self._index, dtype=np.int64, count=len(self._index))

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the log, the space records (with their headers) can use."""
        return self._log_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the log taken by whole records, including replaced and dropped ones."""
        return self._used

    def stats(self) -> dict[str, object]:
        """Return counters and sizes for the STATS request.

        Returns:
            ``capacity_bytes``, ``used_bytes``, ``items``, ``hits``, ``misses``,
            ``evictions``, ``corrupt_dropped``, ``path``, ``durability``,
            ``recovered_items``, ``recovery_dropped``, ``rebuilt``, ``file_bytes`` and
            ``snapshot`` (None, or the newest snapshot's ``job``, ``step``, ``bytes`` and
            ``max_bytes``).
        """
        with self._lock:
            out: dict[str, object] = {
                "capacity_bytes": self._log_bytes,
                "used_bytes": self._used,
                "items": len(self._index),
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "corrupt_dropped": self.corrupt_dropped,
                "path": str(self.path),
                "durability": self.durability,
                "recovered_items": self.recovered_items,
                "recovery_dropped": self.recovery_dropped,
                "rebuilt": self.rebuilt,
                "file_bytes": self._file_bytes,
            }
        out["snapshot"] = None if self._closed else self.snapshots.newest()
        return out

    # ---- snapshots -------------------------------------------------------------------------

    def write_snapshot(self, job: str, step: int, payload: Payload) -> None:
        """Write a job's snapshot atomically (see :meth:`SnapshotRegion.write`).

        Args:
            job: The job's name.
            step: The training step the snapshot belongs to.
            payload: The serialised state.

        Raises:
            StoreFullError: The payload is larger than a snapshot slot.
            ValueError: The job name is too long.
        """
        self._check_open()
        self.snapshots.write(job, step, payload)

    def read_snapshot(self, job: str | None = None) -> tuple[str, int, bytes] | None:
        """Return the newest whole snapshot, of ``job`` or of any job.

        Args:
            job: The job's name, or None for whichever job wrote last.

        Returns:
            ``(job, step, payload)``, or None when there is no whole snapshot.
        """
        self._check_open()
        return self.snapshots.read(job)

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Flush what is pending and release the file. Safe to call twice."""
        with self._lock, self.snapshots.lock:
            if self._closed:
                return
            self._closed = True
            self._flush_pending()
            self._release()

    def _release(self) -> None:
        mm = getattr(self, "_mm", None)
        if mm is not None:
            mm.close()
        os.close(self._fd)  # closing the descriptor drops the flock

    def __enter__(self) -> Arena:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Arena({str(self.path)!r}, {self.durability}, items={len(self._index)})"
