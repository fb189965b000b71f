"""The NVRAM tier: a fixed-size mmap'ed file holding a checksummed ring log of sample records.

The format is in ``arena_format.py``, the snapshot slots in ``arena_snapshot.py``, and the
durability probe in ``durability.py``. Records are appended at the head of a ring; the payload
is flushed before its commit word is stored and flushed, so a torn write is never taken as
whole. Opening scans every intact header and keeps the records no later lap has overwritten
whose commit word and payload checksum match; what lies beyond the newest whole record is
zeroed. Another store's fingerprint, another layout or format version, or a garbage header
rebuilds the arena with a warning: the file is truncated, and a fresh random arena uid makes
any stale record unrecognisable. The contract: never serve wrong bytes; recover what is whole.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Final

import numpy as np

from loaderd.storage import durability as dur
from loaderd.storage.arena_format import (
    CHECKSUM,
    HEADER_BYTES,
    HEADER_PAGE,
    REC_HEAD,
    Layout,
    Payload,
    Rec,
    commit_offset,
    commit_word,
    find_headers,
    pack_record_header,
    parse_record,
    record_extent,
    record_state,
    unswept,
    xxh,
)
from loaderd.storage.arena_snapshot import SnapshotRegion
from loaderd.storage.errors import CorruptRecordError, StorageError, StoreFullError
from loaderd.storage.row_reads import read_whole
from loaderd.storage.safe_files import UnsafePathError, open_private
from loaderd.storage.syscalls import address_of

__all__ = ["HEADER_PAGE", "Arena", "record_extent"]

logger = logging.getLogger(__name__)

_MAX_SAMPLE_ID: Final = (1 << 63) - 1  # ids() is int64
_ZERO_CHUNK: Final = 1 << 20


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
        self.path = Path(path)
        self._layout = layout = Layout.plan(capacity_bytes, snapshot_bytes, fingerprint)
        self._log_off = layout.log_off
        self._log_bytes = layout.log_bytes
        self._log_end = layout.log_end
        # ``_lock`` guards the index and the ring, held to find room and to commit, never while
        # payloads are copied or flushed: readers (``get``, ``lend``) do not wait on the disk.
        # ``_write_lock`` keeps one writer at a time; the room it reserved is its own.
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._returned = threading.Condition(self._lock)  # a lent record came back
        # record offset -> loans (a plain dict: a Counter's missing key and del run Python)
        self._lent: dict[int, int] = {}
        self._closing = False  # a writer waiting on a loan gives up
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
            # A shared --nvram-dir (/dev/shm) lets anyone plant the name: adopt only our file.
            self._fd = open_private(self.path, "arena")
        except UnsafePathError as e:
            raise StorageError(str(e)) from e
        except OSError as e:
            raise StorageError(f"cannot open arena {self.path}: {e}") from e
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                raise StorageError(f"arena {self.path} is in use by another process") from e
            st = os.fstat(self._fd)  # a rebuild truncates this file: the same inode
            self._file_id = (st.st_dev, st.st_ino)
            self.durability = dur.probe_durability(self.path)
            self._uid = self._open_or_rebuild()
            self._mm = dur.map_file(self._fd, layout.file_bytes, self.durability)
            self.snapshots = SnapshotRegion(
                self._mm,
                offset=self._log_end,
                slot_bytes=layout.slot_bytes,
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

    def _open_or_rebuild(self) -> int:
        size = os.fstat(self._fd).st_size
        uid, why = self._layout.check(os.pread(self._fd, HEADER_BYTES, 0), size)
        if size and why is None:
            self._reserve_space()  # fill holes, so a full disk cannot SIGBUS a later store
            return uid
        if size:
            logger.warning("rebuilding arena %s: %s", self.path, why)
        self.rebuilt = True
        # Truncating drops every old byte at once; a fresh uid makes stale records unreadable
        # even where a file system keeps the blocks.
        uid = int.from_bytes(os.urandom(8), "little")
        os.ftruncate(self._fd, 0)
        os.ftruncate(self._fd, self._layout.file_bytes)
        self._reserve_space()
        os.pwrite(self._fd, self._layout.header(uid), 0)
        os.fsync(self._fd)
        return uid

    def _reserve_space(self) -> None:
        try:
            os.posix_fallocate(self._fd, 0, self._layout.file_bytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFullError(
                    f"no room for the {self._layout.file_bytes}-byte arena {self.path}: "
                    f"{e.strerror}"
                ) from e
            logger.debug("cannot preallocate arena %s: %s", self.path, e)

    # ---- recovery --------------------------------------------------------------------------

    def _parse(self, off: int) -> Rec | None:
        return parse_record(self._mm, off, self._uid, self._log_end)

    def _recover(self) -> None:
        recs = find_headers(self._mm, self._log_off, self._log_end, self._uid)
        alive: list[Rec] = []
        for rec in unswept(recs, self._log_off, self._log_bytes):
            state = record_state(self._mm, rec)
            if state:
                alive.append(rec)
            elif state is not None:
                self.recovery_dropped += 1
        self._seq = recs[0].seq + 1 if recs else 1
        self._head = alive[0].off + alive[0].extent if alive else self._log_off
        head_rel = self._head - self._log_off
        alive.sort(key=lambda r: (r.off - self._log_off - head_rel) % self._log_bytes)
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
        off = self._ring[0][0]
        while off in self._lent:  # another process reads it: not overwritten under its feet
            if self._closing:
                raise StorageError(f"arena {self.path} is closing")
            self._returned.wait(1.0)
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

    def put_many(
        self,
        items: Iterable[tuple[int, Payload]],
        *,
        evict: bool = True,
        read_from: tuple[int, np.ndarray] | None = None,
    ) -> list[int]:
        """Append samples to the log with one pair of flushes for the whole batch.

        Payloads are written and flushed, then their commit words are written and flushed;
        the records become visible to :meth:`get` only after that. If an item fails (a bad
        id, no room), the items before it are still committed before the error is raised.
        A later put of an id replaces the earlier record.

        Args:
            items: ``(sample_id, payload)`` pairs.
            evict: Whether older records may be evicted to make room.
            read_from: ``(fd, offsets)``: the payload of item i lies at ``offsets[i]`` of
                ``fd`` as well (-1: it does not), and is read from there by the kernel, for
                the whole batch in one call that lets go of the GIL
                (``row_reads.read_whole``). The payload is then not touched here: a view of
                a map whose pages this process has not mapped costs more to copy than to read.

        Returns:
            The ids evicted to make room (they are no longer in the arena).

        Raises:
            ValueError: A sample id is out of range.
            StoreFullError: A payload is larger than the log, or the log is full of live
                records and ``evict`` is False.
        """
        evicted: list[int] = []
        with self._write_lock:
            with self._lock:
                self._check_open()
            written: list[Rec] = []
            reads: list[tuple[Rec, int, Payload]] = []  # placed, to be read from the file
            batch_bytes = 0
            self._batch_seq = self._seq
            try:
                for k, (sample_id, payload) in enumerate(items):
                    length = memoryview(payload).nbytes
                    extent = record_extent(length)
                    if batch_bytes + extent > self._log_bytes // 2:
                        # Commit early: an uncommitted batch spanning (with the space a wrap
                        # wastes) at most the whole ring can never overwrite itself.
                        written += self._read_in(read_from, reads)
                        self._commit(written)
                        written, reads, batch_bytes = [], [], 0
                        self._batch_seq = self._seq
                    at = -1 if read_from is None else int(read_from[1][k])
                    rec = self._reserve(sample_id, length, evict, evicted)
                    if at >= 0:
                        reads.append((rec, at, payload))
                    else:
                        written.append(self._fill(rec, payload, xxh(payload)))
                    batch_bytes += extent
            finally:
                written += self._read_in(read_from, reads)
                self._commit(written)
                self._batch_seq = self._seq
        return evicted

    def _reserve(self, sample_id: int, length: int, evict: bool, evicted: list[int]) -> Rec:
        """Room at the head for a record (its header not yet written, its checksums unknown)."""
        if not 0 <= sample_id <= _MAX_SAMPLE_ID:
            raise ValueError(f"`sample_id` must be in [0, 2**63), got {sample_id}")
        extent = record_extent(length)
        if extent > self._log_bytes:
            raise StoreFullError(
                f"sample {sample_id} of {length} bytes does not fit in arena {self.path} "
                f"(log of {self._log_bytes} bytes)"
            )
        with self._lock:  # room at the head: what lay there leaves the index first
            off = self._place(extent, evict, evicted)
            seq = self._seq
            self._seq += 1
            self._head = off + extent
            self._ring.append((off, extent, sample_id, seq))
            self._used += extent
        return Rec(off, extent, seq, sample_id, length, 0, 0)

    def _fill(self, rec: Rec, payload: Payload | None, payload_xxh: int) -> Rec:
        """Write a reserved record's header, and its payload unless it is in place already.

        Not indexed until its commit: no reader looks here while it is written.
        """
        header, hxh = pack_record_header(self._uid, rec.seq, rec.sample_id, rec.length, payload_xxh)
        self._mm[rec.off : rec.off + len(header)] = header
        if payload is not None:
            self._mm[rec.off + REC_HEAD : rec.off + REC_HEAD + rec.length] = payload
        return rec._replace(payload_xxh=payload_xxh, header_xxh=hxh)

    def _read_in(
        self, read_from: tuple[int, np.ndarray] | None, reads: list[tuple[Rec, int, Payload]]
    ) -> list[Rec]:
        """Fill reserved records from the file, hashed where they landed; copied where not.

        A read that fails (the file shorter than it was, a closed descriptor) leaves the
        batch to be copied from its payloads as any other.
        """
        if not reads:
            return []
        assert read_from is not None
        recs = [rec for rec, _, _ in reads]
        base = address_of(memoryview(self._mm)) + REC_HEAD
        try:
            digests = read_whole(
                read_from[0],
                np.array([at for _, at, _ in reads], np.int64),
                np.array([rec.length for rec in recs], np.int64),
                np.array([base + rec.off for rec in recs], np.uint64),
            )
        except OSError as e:
            logger.debug("arena %s: reading a batch from its file failed (%s)", self.path, e)
            digests = None
        if digests is None:
            return [self._fill(rec, payload, xxh(payload)) for rec, _, payload in reads]
        return [self._fill(rec, None, d) for rec, d in zip(recs, digests.tolist(), strict=True)]

    def _flush_records(self, recs: list[Rec]) -> None:
        runs: list[list[int]] = []
        for rec in sorted(recs):
            if runs and runs[-1][1] == rec.off:
                runs[-1][1] = rec.off + rec.extent
            else:
                runs.append([rec.off, rec.off + rec.extent])
        for lo, hi in runs:
            dur.flush_range(self._mm, lo, hi, self.durability)

    def _commit(self, recs: list[Rec]) -> None:
        if not recs or self._closed:  # closed while waiting for a loan: nothing is mapped
            return
        self._flush_records(recs)  # payloads first: a commit word must never precede them
        with self._lock:
            for rec in recs:
                commit_at = commit_offset(rec.off, rec.length)
                CHECKSUM.pack_into(self._mm, commit_at, commit_word(rec.header_xxh))
                old = self._index.get(rec.sample_id)
                self._index[rec.sample_id] = (rec.off, rec.seq)
                if old is not None and (prev := self._parse(old[0])) is not None:
                    # Revoke the replaced copy: a later discard must not bring it back on reopen.
                    self._revoke(old[0], prev.length)
            pending, self._pending = self._pending, set()
        self._flush_records(recs)
        for at in pending:
            dur.flush_range(self._mm, at, at + 8, self.durability)

    def _revoke(self, off: int, length: int) -> None:
        """Zero a record's commit word so that recovery will not bring it back."""
        commit_at = commit_offset(off, length)
        CHECKSUM.pack_into(self._mm, commit_at, 0)
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
                start = off + REC_HEAD
                data = self._mm[start : start + rec.length]
                commit = CHECKSUM.unpack_from(self._mm, commit_offset(off, rec.length))[0]
                if commit == commit_word(rec.header_xxh) and xxh(data) == rec.payload_xxh:
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

    def lend(self, sample_ids: Iterable[int]) -> np.ndarray:
        """Where these samples' payloads start in the file, kept whole until ``give_back``.

        For another process that maps the file and copies the payloads itself (a miss
        worker), knowing their lengths (a payload is its sample's record): until the offsets
        are given back, the ring waits before it overwrites any of these records, and the
        reader verifies each payload against its sample's checksum. -1 where a sample is not
        here (the reader reads it another way); nothing of it is lent.
        """
        offs: list[int] = []
        absent = (-1 - REC_HEAD, 0)
        with self._lock:
            self._check_open()
            index, lent = self._index, self._lent
            for sid in sample_ids:
                off = index.get(sid, absent)[0]
                offs.append(off)
                if off >= 0:
                    lent[off] = lent.get(off, 0) + 1
        return np.array(offs, np.int64) + REC_HEAD

    def give_back(self, payload_offsets: np.ndarray) -> None:
        """End a loan (``lend``): the ring may overwrite those records again."""
        with self._lock:
            lent = self._lent
            for off in (payload_offsets[payload_offsets >= 0] - REC_HEAD).tolist():
                left = lent.pop(off, 0) - 1
                if left > 0:
                    lent[off] = left
            self._returned.notify_all()

    @property
    def file_id(self) -> tuple[int, int]:
        """The file's (device, inode): a reader that opens ``path`` checks it is this file."""
        return self._file_id

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

    def sizes(self) -> dict[int, int]:
        """Return each held sample's payload length (read from the record headers)."""
        with self._lock:
            self._check_open()
            out: dict[int, int] = {}
            for sample_id, (off, _) in self._index.items():
                rec = self._parse(off)
                if rec is not None:
                    out[sample_id] = rec.length
            return out

    def ahead(self, nbytes: int) -> list[int]:
        """Return the ids of live records that appending ``nbytes`` would overwrite.

        The ring evicts in write order, whatever a placement policy wants; a caller that
        wants to keep such records appends them again first (compaction by relocation).

        Args:
            nbytes: Bytes about to be appended (record extents, headers included).
        """
        with self._lock:
            self._check_open()
            out: list[int] = []
            # The caller adds a margin for the room a wrap wastes at the end of the log.
            for off, _extent, sample_id, seq in self._ring:
                if (off - self._head) % self._log_bytes >= nbytes:
                    break
                if self._index.get(sample_id) == (off, seq):
                    out.append(sample_id)
            return out

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
            ``recovered_items``, ``recovery_dropped``, ``rebuilt``, ``file_bytes``, ``lent``
            (records lent to readers in other processes now) and ``snapshot`` (None, or the
            newest snapshot's ``job``, ``step``, ``bytes`` and ``max_bytes``).
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
                "file_bytes": self._layout.file_bytes,
                "lent": sum(self._lent.values()),
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
        self.snapshots.write(job, step, payload)

    def read_snapshot(self, job: str | None = None) -> tuple[str, int, bytes] | None:
        """Return the newest whole snapshot, of ``job`` or of any job.

        Args:
            job: The job's name, or None for whichever job wrote last.

        Returns:
            ``(job, step, payload)``, or None when there is no whole snapshot.
        """
        return self.snapshots.read(job)

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Flush what is pending and release the file. Safe to call twice."""
        with self._lock:
            self._closing = True
            self._returned.notify_all()  # a writer waiting on a loan gives up
        with self._write_lock, self._lock, self.snapshots.lock:
            if self._closed:
                return
            self._closed = True
            self.snapshots.close()
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
