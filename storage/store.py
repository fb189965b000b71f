"""The LMDB sample store: read-only for serving, written once by a single ingest writer.

A store is a directory holding an LMDB environment with two named databases:

* ``samples``: key = sample id as 8 big-endian bytes (so key order is id order and a
  sequential scan is a sequential read), value = a checksummed record (``records.py``).
* ``meta``: ``schema`` (Arrow schema IPC bytes) and ``info`` (JSON: samples, bytes,
  format version, fingerprint).

The writer builds the store in a temporary sibling directory and renames it into place only
after every record and the metadata are synced, so an interrupted ingest never leaves a
directory that looks like a complete store.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import mmap
import os
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from types import TracebackType
from typing import Any

import lmdb
import numpy as np
import pyarrow as pa
import xxhash

from loaderd.storage.errors import NotAStoreError, ResumeError, StoreFullError
from loaderd.storage.map_slices import MapSlices
from loaderd.storage.pinning import PageLocks
from loaderd.storage.prefault import MADV_POPULATE_READ, Prefault
from loaderd.storage.records import Schema, verify
from loaderd.storage.residency import ResidencyProbe
from loaderd.storage.safe_files import fsync_dir
from loaderd.storage.syscalls import address_of, madvise, mapped_at, mlock_onfault
from loaderd.storage.value_index import ValueIndex, build_value_index

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_KEY = struct.Struct(">Q")
_SAMPLES = b"samples"
PIN_MIN_BYTES = 16 << 10
_OVERFLOW_HEADER = 16  # an overflow value starts this far into its first page (LMDB 0.9)
_META = b"meta"
_PAGE = mmap.PAGESIZE  # what the page cache reads and holds of a record: whole pages
# Records at most this far apart in data.mdb are read ahead in one call, the pages between
# them included: LMDB puts a leaf page between runs of records every ~150 records, and a
# system call per record cost 12-23 % of the daemon's time serving 3 KB records from the page
# cache. A shuffled pass seldom has two records this close (bridged bytes are counted).
ADVISE_GAP = 16 << 10


def sample_key(sample_id: int) -> bytes:
    """The LMDB key of a sample."""
    return _KEY.pack(sample_id)


def check_not_truncated(data: Path, env: lmdb.Environment) -> None:
    """Refuse a data file shorter than its own last page (a copy cut short, a full disk).

    LMDB maps the file and trusts its meta page: a page past the end of a truncated file
    is a SIGBUS on the first read that reaches it, not an error. The meta page (read with
    ``read``, not through the map) says which page is the last in use.

    Raises:
        NotAStoreError: the file is shorter than its last page.
    """
    needed = (int(env.info()["last_pgno"]) + 1) * int(env.stat()["psize"])
    size = data.stat().st_size
    if size < needed:
        env.close()
        raise NotAStoreError(
            f"{data} is truncated: {size} bytes, but its last page ends at {needed} "
            "(an interrupted copy or a full disk?); re-copy or re-ingest the store"
        )


class SampleStore:
    """A read-only view of a store directory. Thread-safe; never use it across a fork.

    Args:
        path: the store directory (as written by ``StoreWriter``).

    Raises:
        NotAStoreError: the path is missing or is not a loaderd store.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not (self.path / "data.mdb").is_file():
            raise NotAStoreError(f"{self.path}: not a loaderd store (no data.mdb)")
        try:
            # lock=False: a finished store is immutable, so readers need no lock table (and a
            # crashed reader leaves no stale slot behind). readahead=False: access is random.
            self._env = lmdb.open(
                str(self.path), readonly=True, lock=False, max_dbs=2, readahead=False
            )
            check_not_truncated(self.path / "data.mdb", self._env)
            self._samples = self._env.open_db(_SAMPLES, create=False)
            meta = self._env.open_db(_META, create=False)
            with self._env.begin(db=meta) as txn:
                info_raw, schema_raw = txn.get(b"info"), txn.get(b"schema")
        except lmdb.Error as e:
            raise NotAStoreError(f"{self.path}: not a loaderd store ({e})") from e
        if info_raw is None or schema_raw is None:
            raise NotAStoreError(f"{self.path}: not a loaderd store (no metadata)")
        info = json.loads(info_raw)
        if info.get("format_version") != FORMAT_VERSION:
            raise NotAStoreError(
                f"{self.path}: store format {info.get('format_version')}, "
                f"this loaderd reads {FORMAT_VERSION}"
            )
        self.schema = Schema.from_arrow(pa.ipc.read_schema(pa.py_buffer(schema_raw)))
        self.num_samples: int = int(info["samples"])
        self.total_bytes: int = int(info["bytes"])
        self.fingerprint: bytes = bytes.fromhex(info["fingerprint"])
        self.info: dict[str, Any] = info
        self.reads = 0
        self.bytes_read = 0
        self._fd = -1  # data.mdb, for posix_fadvise (opened on first use)
        self._fd_lock = threading.Lock()  # the read-ahead and assembly threads both advise
        self._psize = int(self._env.stat()["psize"])
        self._locks = PageLocks()
        self._map_locked: tuple[int, int] | None = None  # [start, end) locked (``lock_map``)

    def get(self, sample_id: int) -> bytes:
        """One verified record.

        Raises:
            KeyError: no such sample.
            CorruptRecordError: the record failed its checksum.
        """
        return self.get_many([sample_id])[0]

    def get_many(self, ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """Verified records for ids, in order, as bytes (copies; see ``views`` for none)."""
        with self.views(ids) as views:
            return [bytes(v) for v in views]

    @contextmanager
    def views(
        self, ids: Sequence[int] | np.ndarray, *, verified: bool = True
    ) -> Iterator[list[memoryview]]:
        """Records for ids, in order, as views into LMDB's map: no copy.

        Once the value index is built and LMDB has returned each record of a batch once,
        the batch is sliced from the map without a call into LMDB (``map_slices.py``).

        The views are valid inside the ``with`` block only (one read transaction); copy what
        must outlive it. Each record's checksum is verified here, unless ``verified`` is
        False: then the caller verifies each record once (``records.verify``), where it has
        the bytes in cache anyway.

        Raises:
            KeyError: no such sample.
            CorruptRecordError: the record failed its checksum.
        """
        where = f"store {self.path}"
        slices = self._slices
        sliced = None if slices is None else slices.slices(np.asarray(ids, np.int64))
        if sliced is not None:  # no call into LMDB (``map_slices.py``)
            if verified:
                for sid, view in zip(ids, sliced, strict=True):
                    verify(view, int(sid), where)
            self._count(sliced)
            yield sliced
            return
        with self._env.begin(db=self._samples, buffers=True) as txn:
            get = txn.get
            out: list[memoryview] = []
            for sid in ids:
                rec = get(int(sid).to_bytes(8, "big")) if sid >= 0 else None
                if rec is None:
                    raise KeyError(f"sample {int(sid)} is not in store {self.path}")
                if verified:
                    verify(rec, int(sid), where)
                if slices is not None:
                    slices.confirm(int(sid), rec)
                out.append(rec)
            self._count(out)
            yield out

    def file_offsets(self, views: Sequence[memoryview]) -> np.ndarray | None:
        """Where in data.mdb each view (from ``views``) starts; None where that is unknown.

        What a miss worker tells the daemon, so that the daemon may slice those records
        from its own map (``confirm_offsets``).
        """
        base = self._map_start
        if base is None:
            return None
        return np.fromiter((address_of(v) - base for v in views), np.int64, len(views))

    @cached_property
    def _map_start(self) -> int | None:
        """The address of data.mdb's first byte in this process (LMDB maps the whole file)."""
        return mapped_at(self.path / "data.mdb")

    def confirm_offsets(self, ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """Records LMDB returned to another process at these file offsets and lengths.

        Where the value index agrees, they are sliced from this map from now on.
        """
        slices = self._slices
        if slices is not None:
            slices.confirm_many(ids, offsets, lengths)

    @property
    def sliceable(self) -> bool:
        """Whether records can be sliced from the map once confirmed (``map_slices.py``)."""
        slices = self._slices
        return slices is not None and slices.enabled

    def _count(self, records: list[memoryview]) -> None:
        # Statistics, not invariants: a lost increment under a race is harmless.
        self.reads += len(records)
        self.bytes_read += sum(v.nbytes for v in records)

    @property
    def _slices(self) -> MapSlices | None:
        """Records as slices of the map, once the value index is built (never built here)."""
        if "value_index" not in self.__dict__:
            return None
        return self._map_slices

    @cached_property
    def _map_slices(self) -> MapSlices | None:
        pages = self._prefault
        index = self.value_index
        if pages is None or index is None:
            return None
        return MapSlices(pages.base, pages.size, index)

    # --- read-ahead -------------------------------------------------------------------------

    @cached_property
    def value_index(self) -> ValueIndex | None:
        """Where each record lies in data.mdb (None: unknown, see ``value_index.py``)."""
        return build_value_index(self.path / "data.mdb", _SAMPLES, self.num_samples)

    def advise(self, ids: np.ndarray) -> tuple[int, int]:
        """Ask the kernel to read these records ahead, without waiting for it.

        With a value index the byte ranges go to ``posix_fadvise(WILLNEED)``, in file order,
        records stored close together in one call (``advise_bytes``): the device gets every
        range at once, and this returns at once. Without one, each record is touched through
        LMDB (py-lmdb faults a value's pages in with the GIL released), which waits for each
        read: call it off the serving path.

        Returns:
            The record bytes asked for, and the system calls that asked (0 without an index).
        """
        index = self.value_index
        if index is None:
            with self._env.begin(db=self._samples, buffers=True) as txn:
                return sum(len(txn.get(int(s).to_bytes(8, "big")) or b"") for s in ids), 0
        ids = np.asarray(ids, np.int64)
        starts, lengths = index.ranges(ids, ADVISE_GAP, _PAGE)
        probe = self._residency
        if probe is not None and probe.resident(starts, lengths):
            calls = 0  # the page cache holds them: nothing to read (``residency.py``)
        else:
            calls = self._fadvise(starts, lengths)
        self._advised[ids] = True  # their read need not ask again (``advise_known``)
        return index.nbytes(ids), calls

    @cached_property
    def _residency(self) -> ResidencyProbe | None:
        """Skips advice while the page cache holds the store (needs the map located)."""
        pages = self._prefault
        return None if pages is None else ResidencyProbe(pages.base)

    @property
    def advice_skipped(self) -> int:
        """Batches ``advise`` did not advise: the page cache held them (``residency.py``)."""
        probe = self.__dict__.get("_residency")
        return 0 if probe is None else probe.skipped

    def prefault(self, ids: np.ndarray) -> tuple[int, int]:
        """Map the pages ``advise(ids)`` read into this process, waiting for their reads.

        The same ranges as ``advise`` (so it holds no page more), mapped with
        ``MADV_POPULATE_READ`` (``prefault.py``): the reader then finds them mapped instead of
        faulting each page in. Records mapped once are not asked for again: their pages stay
        mapped (unless reclaimed: then their reader faults them in), and a call for pages
        mapped already costs as much as faulting in a small record. Call it off the serving
        path, after ``advise``: it waits for pages not yet read. Does nothing without a value
        index or where the kernel refuses.

        Returns:
            The records asked for, and the system calls made.
        """
        index: ValueIndex | None = self.__dict__.get("value_index")
        if index is None or not len(ids):
            return 0, 0
        pages = self._prefault
        if pages is None or not pages.enabled:
            return 0, 0
        want = np.asarray(ids, np.int64)
        want = want[~self._mapped[want]]
        self._mapped[want] = True  # without a lock: a lost update costs a call, never bytes
        if not len(want):
            return 0, 0
        return len(want), pages.populate(*index.ranges(want, ADVISE_GAP, _PAGE))

    @cached_property
    def _mapped(self) -> np.ndarray:
        """Per sample: ``prefault`` mapped it."""
        return np.zeros(self.num_samples, bool)

    @property
    def prefaulting(self) -> bool:
        """Whether ``prefault`` maps pages (locates the map the first time: off serving)."""
        pages = self._prefault
        return pages is not None and pages.enabled

    @cached_property
    def _prefault(self) -> Prefault | None:
        """The map's pages, located from one record: its address less its file offset."""
        index = self.value_index
        if index is None or not self.num_samples:
            return None
        with self._env.begin(db=self._samples, buffers=True) as txn:
            rec = txn.get(_KEY.pack(0))
            base = None if rec is None else address_of(rec) - int(index.offsets[0])
        if base is None or base % _PAGE:  # a map starts on a page: the index is off
            logger.info("store %s: record 0 is not where the index says; no prefault", self.path)
            return None
        return Prefault(base, int(self._env.info()["map_size"]))

    def advise_bytes(self, ids: np.ndarray) -> int | None:
        """The bytes ``advise(ids)`` has the page cache read and hold (None: no index).

        Whole pages, and the pages between records it joins into one range (at most
        ``ADVISE_GAP`` apart): the kernel reads those too. So a read-ahead that counts this
        holds no more than it counts; the advice of any subset of ``ids`` holds no more either.
        """
        index = self.value_index
        return None if index is None else int(index.ranges(ids, ADVISE_GAP, _PAGE)[1].sum())

    def advise_known(self, ids: Sequence[int]) -> None:
        """``advise`` these records when their byte ranges are known already; never waits.

        For a read about to happen: a cold record faulted in through the map costs one
        synchronous page read after another (measured ~2.5 ms per 100 KB record here); asked
        for as ranges first, the batch's reads reach the device together (~0.7 us a record
        when its pages are cached already). Without an index built (the read-ahead builds
        it) this does nothing rather than build one on the serving path. Records that
        ``advise`` asked for already (the read-ahead) are not asked for again: this read
        consumes that advice, one system call a record fewer on the serving path.
        """
        index = self.__dict__.get("value_index")
        if index is None or len(ids) < 2:
            return
        want = np.asarray(ids, np.int64)
        advised = self._advised
        fresh = want[~advised[want]]
        advised[want] = False  # a later read (the next pass) is advised afresh
        if len(fresh) > 1:
            self._advise_ranges(index, fresh)

    @cached_property
    def _advised(self) -> np.ndarray:
        """Per sample: advised and not read since.

        Updated without a lock: a lost update costs one system call more or less, never bytes.
        """
        return np.zeros(self.num_samples, bool)

    def pin(self, record: memoryview) -> Callable[[], None] | None:
        """Lock a record's pages in RAM when it has pages of its own; returns the unlock.

        LMDB keeps a value larger than half a page in overflow pages of its own, starting
        right after their 16-byte page header; a smaller value shares a leaf page, which is
        not locked (None: the caller copies it). Below ``PIN_MIN_BYTES`` a copy is cheaper
        than the system call (measured: ``mlock`` ~8 us, a copy into fresh memory ~0.6 us per
        KiB), so those are copied too (and copies packed together serve hits faster than
        views spread over leaf pages). Once the whole map is locked (``lock_map``), a larger
        record is held as it is, its pages mapped here in one call (they are locked as they
        are mapped, and a miss worker read them through a map of its own).
        """
        if record.nbytes < PIN_MIN_BYTES:
            return None
        address = address_of(record)
        whole = self._map_locked
        if whole is not None:
            if not whole[0] <= address < whole[1]:
                return None
            first = address - address % self._psize
            madvise(first, address + record.nbytes - first, MADV_POPULATE_READ)  # else on touch
            return _still_locked
        if not self._locks.enabled:
            return None
        if address % self._psize != _OVERFLOW_HEADER:
            return None
        start = address - _OVERFLOW_HEADER
        length = -(-(record.nbytes + _OVERFLOW_HEADER) // self._psize) * self._psize
        if not self._locks.lock(start, length):
            return None
        return partial(self._locks.unlock, start, length)

    def lock_map(self) -> bool:
        """Lock every page of data.mdb this process maps, now and as it maps more.

        For a DRAM tier that can hold the whole store: ``pin`` then holds any record of the
        map without a system call (``mlock`` per record, and the split of the map it
        costs, was the largest part of a first epoch's admissions).
        ``mlock2(MLOCK_ONFAULT)`` reads nothing: pages are locked as a read or a
        prefault maps them, so at most the file is locked. False where the kernel refuses
        (``RLIMIT_MEMLOCK``, no ``mlock2``): records are locked one by one instead.
        """
        base = self._map_start
        size = -(-self.file_bytes // self._psize) * self._psize
        if base is None or mlock_onfault(base, size) != 0:
            err = ctypes.get_errno() if base is not None else 0
            logger.info(
                "store %s: cannot lock its map in RAM (%s): records are locked one by one",
                self.path,
                os.strerror(err) if err else "map not found",
            )
            return False
        self._map_locked = (base, base + size)
        return True

    @property
    def map_locked(self) -> bool:
        """Whether ``lock_map`` locked the whole map."""
        return self._map_locked is not None

    @property
    def file_bytes(self) -> int:
        """The size of data.mdb."""
        return os.stat(self.path / "data.mdb").st_size

    @property
    def locked_bytes(self) -> int:
        """Bytes of the map locked in RAM for the DRAM tier."""
        return self._locks.locked_bytes

    def record_bytes(self, ids: np.ndarray) -> np.ndarray | None:
        """Each record's size (int64), when the value index knows it."""
        index = self.value_index
        return None if index is None else index.lengths[ids].astype(np.int64)

    def _advise_ranges(self, index: ValueIndex, ids: np.ndarray) -> int:
        """``posix_fadvise(WILLNEED)`` on the records' pages, joined; returns the calls made."""
        return self._fadvise(*index.ranges(ids, ADVISE_GAP, _PAGE))

    def _fadvise(self, starts: np.ndarray, lengths: np.ndarray) -> int:
        fd = self._advise_fd()
        for off, n in zip(starts.tolist(), lengths.tolist(), strict=True):
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
        return len(starts)

    def _advise_fd(self) -> int:
        with self._fd_lock:
            if self._fd < 0:
                self._fd = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
            return self._fd

    def close(self) -> None:
        """Close the environment (safe to call twice)."""
        self._env.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SampleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoreWriter:
    """Builds a new store at ``path``, appending records with ids 0, 1, 2, ...

    Use as a context manager: a clean exit commits (syncs, writes metadata, renames into
    place); an exception removes the partial store.

    A resumable writer (``resumable`` given) builds the store in the fixed sibling
    ``.NAME.partial`` instead of a throw-away one, holds an ``flock`` on it while it writes,
    and writes its progress (records so far, their bytes, the fingerprint's state) in the
    transaction that commits those records: whatever a crash leaves is a consistent prefix. A
    later writer of the same identity continues after it (``resumed_at``). Interrupted by
    ^C or a full disk, the partial store is kept for that; any other error drops it.

    Args:
        path: the store directory to create.
        schema: the records' schema.
        overwrite: replace a store at ``path`` (only once the new one is complete).
        resumable: what is being written (the source and options, JSON-able), or None for
            a writer that starts over every time.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        ResumeError: another live ingest writes the partial store, or it holds records of
            another identity or schema.
    """

    COMMIT_SECONDS = 1.0  # a resumable writer commits (and syncs) about this often
    COMMIT_BYTES = 256 << 20  # or once it holds this much

    def __init__(
        self,
        path: str | os.PathLike[str],
        schema: Schema,
        *,
        overwrite: bool = False,
        resumable: dict[str, Any] | None = None,
    ):
        self.path = Path(path)
        if self.path.exists() or self.path.is_symlink():
            if not overwrite:
                raise FileExistsError(
                    f"{self.path} already exists (pass --overwrite to replace it)"
                )
            _check_replaceable(self.path)
        self.schema = schema
        self.overwrite = overwrite
        self.resumable = resumable is not None
        self._lock_fd = -1
        self.count = 0
        self.bytes = 0
        self._fingerprint = _Fingerprint()
        self._done = False
        self._pending: list[bytes] = []  # a resumable writer's batches not committed yet
        self._pending_extra: dict[bytes, bytes] = {}
        self._pending_bytes = 0
        self._committed_at = time.monotonic()
        if resumable is None:
            self.tmp = self.path.with_name(
                f".{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            )
            self.tmp.mkdir(parents=True)
        else:
            self.tmp = partial_path(self.path)
            self._lock_fd = _lock_partial(self.tmp, create=True)
        self._map_size = max(64 << 20, 2 * _file_size(self.tmp / "data.mdb"))
        # A resumable store syncs its data pages at every commit (its meta page rides on the
        # next one's sync: LMDB's NOMETASYNC keeps the file consistent, a power cut loses at
        # most the last commit's worth); a throw-away one needs no sync before the final one.
        self._env = lmdb.open(
            str(self.tmp),
            map_size=self._map_size,
            max_dbs=2,
            sync=self.resumable,
            metasync=False,
        )
        self._samples = self._env.open_db(_SAMPLES)
        self._meta = self._env.open_db(_META)
        if resumable is not None:
            self._start_or_resume(resumable)
        self.resumed_at = self.count

    def _start_or_resume(self, identity: dict[str, Any]) -> None:
        schema = self.schema.to_arrow().serialize().to_pybytes()
        with self._env.begin(db=self._meta) as txn:
            old, progress = txn.get(_IDENTITY), txn.get(_PROGRESS)
            old_schema, pending = txn.get(b"schema"), txn.get(_PENDING)
        if old is None or progress is None:
            # New; or killed before its first batch, or after its last commit but before the
            # rename: either way nothing in it says what it holds, so it starts empty.
            with self._env.begin(write=True) as txn:
                txn.drop(self._samples, delete=False)
                txn.drop(self._meta, delete=False)
            self._put_meta({_IDENTITY: json.dumps(identity).encode(), b"schema": schema})
            return
        if json.loads(old) != identity or old_schema != schema:
            self.close_partial()
            raise ResumeError(
                f"{self.tmp}: holds an interrupted ingest of another source or schema; "
                "start over with --restart"
            )
        state = json.loads(progress)
        self.count, self.bytes = int(state["samples"]), int(state["bytes"])
        self._fingerprint = _Fingerprint(bytes.fromhex(state["chain"]), bytes(pending or b""))
        with self._env.begin(db=self._samples) as txn:
            held = int(txn.stat(self._samples)["entries"])
        if held != self.count:  # the progress key and the records commit together
            self.close_partial()
            raise ResumeError(f"{self.tmp}: {held} records but progress says {self.count}")
        logger.info("resuming %s at record %d", self.tmp, self.count)

    def _put_meta(self, items: dict[bytes, bytes]) -> None:
        while True:
            try:
                with self._env.begin(write=True, db=self._meta) as txn:
                    for k, v in items.items():
                        txn.put(k, v)
                return
            except lmdb.MapFullError:
                self._grow(sum(len(v) for v in items.values()))

    def partial_items(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The ``extra`` metadata earlier ``append`` calls wrote under ``prefix``, in key order.

        What a resumed ingest needs back, e.g. a dictionary's values.
        """
        key = _PARTIAL + prefix
        out = []
        with self._env.begin(db=self._meta) as txn:
            cur = txn.cursor()
            if cur.set_range(key):
                for k, v in cur:
                    if not k.startswith(key):
                        break
                    out.append((k[len(_PARTIAL) :], bytes(v)))
        return out

    def append(self, records: Iterable[bytes], extra: dict[bytes, bytes] | None = None) -> None:
        """Append a batch of records, growing the map as needed.

        A plain writer commits each batch in its own transaction. A resumable one gathers
        batches for up to ``COMMIT_SECONDS`` (or ``COMMIT_BYTES``) and commits them, with
        their progress, in one synced transaction: an fsync per batch of small records
        would double an ingest's time.

        Args:
            records: the records, ids following the last ones.
            extra: metadata a resumed writer needs back (``partial_items``), written in the
                same transaction as the records and dropped at ``commit``.
        """
        batch = list(records)
        if not self.resumable:
            self._write(batch, {})
            return
        self._pending += batch
        self._pending_extra.update(extra or {})
        self._pending_bytes += sum(len(r) for r in batch)
        due = time.monotonic() - self._committed_at >= self.COMMIT_SECONDS
        if due or self._pending_bytes >= self.COMMIT_BYTES:
            self.flush()

    def flush(self) -> None:
        """Commit the batches a resumable writer has gathered (a no-op without any)."""
        if self._pending:
            self._write(self._pending, self._pending_extra)
        self._pending, self._pending_extra, self._pending_bytes = [], {}, 0
        self._committed_at = time.monotonic()

    def _write(self, batch: list[bytes], extra: dict[bytes, bytes]) -> None:
        fingerprint = self._fingerprint.after(b"".join(rec[:8] for rec in batch))
        count = self.count + len(batch)
        size = self.bytes + sum(len(r) for r in batch)
        while True:
            try:
                with self._env.begin(write=True, db=self._samples) as txn:
                    for i, rec in enumerate(batch):
                        txn.put(_KEY.pack(self.count + i), rec, append=True)
                    if self.resumable:
                        for k, v in extra.items():
                            txn.put(_PARTIAL + k, v, db=self._meta)
                        state = {"samples": count, "bytes": size, "chain": fingerprint.chain.hex()}
                        txn.put(_PROGRESS, json.dumps(state).encode(), db=self._meta)
                        txn.put(_PENDING, fingerprint.pending, db=self._meta)
                break
            except lmdb.MapFullError:
                self._grow(sum(len(r) for r in batch))
            except lmdb.Error as e:
                raise StoreFullError(f"{self.tmp}: cannot write records ({e})") from e
        self._fingerprint, self.count, self.bytes = fingerprint, count, size

    def _grow(self, need: int) -> None:
        self._map_size = max(self._map_size * 2, self._map_size + 4 * need)
        self._env.set_mapsize(self._map_size)

    def commit(
        self, extra_info: dict[str, Any] | None = None, schema: Schema | None = None
    ) -> Path:
        """Write the metadata, sync, and rename the store into place (once).

        Args:
            extra_info: more keys for the store's info (the source, class names, ...).
            schema: the schema to store, if it changed while writing: the same fields and
                layout, with info learned from the data (a dictionary's values).
        """
        if self._done:
            return self.path
        self.flush()
        self._done = True
        if schema is not None:
            if schema.layout != self.schema.layout:
                raise ValueError("commit: the schema's record layout changed while writing")
            self.schema = schema
        info = {
            "format_version": FORMAT_VERSION,
            "samples": self.count,
            "bytes": self.bytes,
            "fingerprint": self._fingerprint.hexdigest(),
            "created": time.time(),
            **(extra_info or {}),
        }
        while True:
            try:
                with self._env.begin(write=True, db=self._meta) as txn:
                    # What only a resumed writer needs goes in the transaction that completes
                    # the store, so the finished store holds the same keys however it was made.
                    cur = txn.cursor()
                    while cur.set_range(_PARTIAL) and cur.key().startswith(_PARTIAL):
                        cur.delete()
                    txn.put(b"info", json.dumps(info).encode())
                    txn.put(b"schema", self.schema.to_arrow().serialize().to_pybytes())
                break
            except lmdb.MapFullError:
                self._grow(1 << 20)
        try:
            self._env.sync(True)
        except lmdb.Error as e:
            raise StoreFullError(f"{self.tmp}: cannot sync the store ({e})") from e
        self._env.close()
        old = None
        if self.overwrite and self.path.exists():
            _check_replaceable(self.path)  # again: it may have changed while we wrote
            # Two renames, never a window without a store at `path`: the old store moves
            # aside first, and is deleted only once the new one is in place.
            old = self.path.with_name(f".{self.path.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        self.close_partial()
        if old is not None:
            shutil.rmtree(old)
        logger.debug("wrote store %s: %d samples, %d bytes", self.path, self.count, self.bytes)
        return self.path

    def abort(self, *, keep: bool = False) -> None:
        """Drop the partial store (a no-op after commit).

        Args:
            keep: keep a resumable writer's partial store for a later run to continue.
        """
        if self._done:
            return
        if keep and self.resumable:
            try:  # what was read before a ^C is whole: keep it too
                self.flush()
            except StoreFullError:
                logger.debug("the last %d records did not fit", len(self._pending))
        self._done = True
        self._env.close()
        if keep and self.resumable:
            logger.warning(
                "kept the partial store %s (%d records): the same command continues it, "
                "--restart drops it",
                self.tmp,
                self.count,
            )
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.close_partial()

    def close_partial(self) -> None:
        """Release the partial store's lock (safe to call twice)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort(keep=issubclass(exc_type, (KeyboardInterrupt, StoreFullError)))


_PARTIAL = b"partial:"  # meta keys of a partial store, dropped at commit
_IDENTITY = _PARTIAL + b"identity"
_PROGRESS = _PARTIAL + b"progress"
_PENDING = _PARTIAL + b"pending"
_FINGERPRINT_BLOCK = 8 * 1024  # record checksums folded into the chain at a time


@dataclass(frozen=True, slots=True)
class _Fingerprint:
    """xxh3-128 over every record's checksum, as a chain that can be saved and resumed.

    ``chain`` folds each full block of checksums (``xxh3_128(chain + block)``), ``pending``
    holds the checksums since; both fit in a batch's transaction, which a running hash
    object's state does not. The blocks do not depend on how records were batched.
    """

    chain: bytes = bytes(16)
    pending: bytes = b""

    def after(self, checksums: bytes) -> _Fingerprint:
        data = self.pending + checksums
        chain, full = self.chain, len(data) - len(data) % _FINGERPRINT_BLOCK
        for at in range(0, full, _FINGERPRINT_BLOCK):
            chain = xxhash.xxh3_128_digest(chain + data[at : at + _FINGERPRINT_BLOCK])
        return _Fingerprint(chain, data[full:])

    def hexdigest(self) -> str:
        return xxhash.xxh3_128_hexdigest(self.chain + self.pending)[:32]


def partial_path(path: Path) -> Path:
    """Where a resumable ingest into ``path`` builds the store."""
    return path.with_name(f".{path.name}.partial")


def read_partial(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The identity and progress of an interrupted ingest into ``path``, or None.

    Returns:
        ``{"identity": ..., "samples": n}`` as the last committed batch left them.

    Raises:
        ResumeError: a live ingest is writing it.
    """
    tmp = partial_path(Path(path))
    if not tmp.is_dir() or tmp.is_symlink():
        return None
    os.close(_lock_partial(tmp, create=False))
    try:
        env = lmdb.open(str(tmp), readonly=True, lock=False, max_dbs=2)
    except lmdb.Error:
        return None  # killed before LMDB wrote its first page: nothing to continue
    try:
        with env.begin() as txn:
            meta = env.open_db(_META, txn=txn, create=False)
            identity, progress = txn.get(_IDENTITY, db=meta), txn.get(_PROGRESS, db=meta)
    except lmdb.Error:
        identity = progress = None
    finally:
        env.close()
    if identity is None or progress is None:
        return None
    return {"identity": json.loads(identity), "samples": json.loads(progress)["samples"]}


def discard_partial(path: str | os.PathLike[str]) -> bool:
    """Remove an interrupted ingest's partial store (loaderd's own files only).

    Returns:
        Whether there was one.

    Raises:
        ResumeError: a live ingest is writing it.
        FileExistsError: something else than a partial store has its name.
    """
    tmp = partial_path(Path(path))
    if not tmp.exists() and not tmp.is_symlink():
        return False
    fd = _lock_partial(tmp, create=False)
    try:
        shutil.rmtree(tmp)
    finally:
        os.close(fd)
    return True


def _lock_partial(tmp: Path, *, create: bool) -> int:
    """An flock on the partial store's directory, held while a writer appends to it."""
    if create:
        with contextlib.suppress(FileExistsError):
            tmp.mkdir(parents=True)
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise FileExistsError(f"{tmp} is not a partial loaderd store; not touching it") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ResumeError(f"{tmp}: another ingest is writing this store right now") from None
    names = {p.name for p in tmp.iterdir()}
    if os.fstat(fd).st_uid != os.geteuid() or names - {"data.mdb", "lock.mdb"}:
        os.close(fd)
        raise FileExistsError(f"{tmp} is not a partial loaderd store; not touching it")
    return fd


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _check_replaceable(path: Path) -> None:
    """Refuse to overwrite anything but a loaderd store: the user's files are never deleted.

    Raises:
        FileExistsError: ``path`` is a file, a link, or a directory that holds anything but
            a store's ``data.mdb`` and ``lock.mdb``.
    """
    if path.is_symlink() or not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a loaderd store; not replacing it")
    names = {p.name for p in path.iterdir()}
    if "data.mdb" not in names or names - {"data.mdb", "lock.mdb"}:
        raise FileExistsError(
            f"{path} exists and is not a loaderd store (it holds {sorted(names)[:5]}); "
            "not replacing it"
        )


def _still_locked() -> None:
    """``pin``'s unlock for a record of a map locked whole: nothing to undo."""
