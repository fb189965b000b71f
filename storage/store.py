"""The LMDB sample store: read-only for serving, written once by a single ingest writer.

A store is a directory holding an LMDB environment with two named databases:

* ``samples``: key = sample id as 8 big-endian bytes (so key order is id order and a
  sequential scan is a sequential read), value = a checksummed record (``records.py``).
* ``meta``: ``schema`` (Arrow schema IPC bytes) and ``info`` (JSON: samples, bytes,
  format version, fingerprint).

A store is written once (``store_writer.py``) and read here, by ``SampleStore``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pyarrow as pa

from loaderd.storage.errors import CorruptRecordError, NotAStoreError
from loaderd.storage.map_slices import MapSlices, map_view
from loaderd.storage.memory import memory_available
from loaderd.storage.pinning import PageLocks, still_locked
from loaderd.storage.prefault import Prefault
from loaderd.storage.records import STORED_VERSION, Schema, verify_all
from loaderd.storage.residency import ResidencyProbe
from loaderd.storage.row_reads import Rows, read_rows
from loaderd.storage.syscalls import address_of, mapped_at, mlock_onfault, populate_read
from loaderd.storage.value_index import ValueIndex, block_ranges, build_value_index

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_KEY = struct.Struct(">Q")
SAMPLES_DB = b"samples"  # the LMDB databases of a store (see the module docstring)
_PAGE = mmap.PAGESIZE  # what the page cache reads and holds of a record: whole pages
# Smaller records are copied into DRAM rather than held as views of the store's map. Each
# lock of a record's pages is a system call (``mlock``, ~8 us), dearer than copying less than
# this. In a map locked whole (``lock_map``) a view costs no system call, and its copy, a
# first touch of fresh memory, cost the loop ~0.45 us a KiB, for a record then held twice in
# RAM. So every record of fixed fields is held as a view there: hits gather those from their
# addresses (``DramCache.located``). With variable fields, a record under a page is copied:
# hits gather views one object at a time, and a view cost 0.4 us more a record a hit. Where
# the memory available holds the store once but not twice, those too are held as views
# (``views_only``).
PIN_MIN_BYTES = 16 << 10
VIEW_MIN_BYTES = _PAGE
_OVERFLOW_HEADER = 16  # an overflow value starts this far into its first page (LMDB 0.9)
META_DB = b"meta"
# Records at most this far apart in data.mdb are read ahead in one call, the pages between
# them included: LMDB puts a leaf page between runs of records every ~150 records, and a
# system call per record cost 12-23 % of the daemon's time serving 3 KB records from the page
# cache. A shuffled pass seldom has two records this close (bridged bytes are counted).
ADVISE_GAP = 16 << 10
# A pass over small records is read ahead in blocks of this size (``SampleStore.read_unit``):
# the kernel's own read-around for a faulted page.
READ_UNIT = 128 << 10
SMALL_RECORD = READ_UNIT // 8  # records smaller than this on average are read in blocks


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
        check_damaged: before a record is first read through LMDB, build the value index
            (once) and refuse the samples it finds running past the file (``unreachable``):
            LMDB would hand them out unchecked, and reading one is a SIGBUS. A miss worker
            passes False: the daemon sends it no such sample, and one index is enough.

    Raises:
        NotAStoreError: the path is missing or is not a loaderd store.
    """

    def __init__(self, path: str | os.PathLike[str], *, check_damaged: bool = True) -> None:
        self.path = Path(path)
        self._check_damaged = check_damaged
        if not (self.path / "data.mdb").is_file():
            raise NotAStoreError(f"{self.path}: not a loaderd store (no data.mdb)")
        try:
            # lock=False: a finished store is immutable, so readers need no lock table (and a
            # crashed reader leaves no stale slot behind). readahead=False: access is random.
            self._env = lmdb.open(
                str(self.path), readonly=True, lock=False, max_dbs=2, readahead=False
            )
            check_not_truncated(self.path / "data.mdb", self._env)
            self._samples = self._env.open_db(SAMPLES_DB, create=False)
            meta = self._env.open_db(META_DB, create=False)
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
        self.corrupt = 0  # reads refused: a record failed its checksum, or LMDB could not reach it
        self._fd = -1  # data.mdb, for posix_fadvise and preadv (opened on first use)
        self._fd_lock = threading.Lock()  # the read-ahead and assembly threads both advise
        self._psize = int(self._env.stat()["psize"])
        self._locks = PageLocks()
        # [start, end) of the map held whole in RAM: locked (``lock_map``) or owned (``own_map``)
        self._map_held: tuple[int, int] | None = None
        self._map_owned = False
        self._map_resident = False  # every page of the held map is mapped (``map_loaded``)
        self._views_only = False  # records under a page held as views too (``views_only``)

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
        slices = self._slices
        sliced = None if slices is None else slices.slices(np.asarray(ids, np.int64))
        if sliced is not None:  # no call into LMDB (``map_slices.py``)
            yield self._checked(sliced, ids, verified)
            return
        if self._check_damaged:
            self._refuse_unreachable(np.asarray(ids, np.int64))
        with self._env.begin(db=self._samples, buffers=True) as txn:
            get = txn.get
            out: list[memoryview] = []
            for sid in ids:
                try:
                    rec = get(int(sid).to_bytes(8, "big")) if sid >= 0 else None
                except lmdb.Error as e:  # a damaged page on the way to the record
                    self.corrupt += 1
                    where = f"store {self.path}"
                    raise CorruptRecordError(int(sid), where, f"LMDB cannot read it ({e})") from e
                if rec is None:
                    raise KeyError(f"sample {int(sid)} is not in store {self.path}")
                if slices is not None:
                    slices.confirm(int(sid), rec)
                out.append(rec)
            yield self._checked(out, ids, verified)

    def unreachable(self, ids: np.ndarray) -> int | None:
        """The first of these samples whose record runs past the end of data.mdb, if any.

        Known from the value index (built here the first time); None also where there is no
        index. Such a record is damaged in LMDB's leaf page: reading it would fault.
        """
        index = self.value_index
        return None if index is None else index.first_damaged(ids)

    def _refuse_unreachable(self, ids: np.ndarray) -> None:
        sid = self.unreachable(ids)
        if sid is not None:
            self.corrupt += 1
            raise CorruptRecordError(
                sid, f"store {self.path}", "its leaf node says it runs past the end of data.mdb"
            )

    @contextmanager
    def views_at(
        self, ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
    ) -> Iterator[list[memoryview]]:
        """``views``, of records at file offsets the daemon's value index gave.

        A miss worker's map of data.mdb is its own: the daemon passes the offsets of records
        it may slice (``sliceable_spans``), and the worker slices them from its map as the
        daemon would, without a call into LMDB (2.5 us a 3 KB record, against 0.3 for a
        slice). Each record's checksum is verified: a failure is the daemon's to read again
        through LMDB (``map_slices.py``). Where this process's map is not found, or a range
        lies past the file, the records are read through LMDB.
        """
        whole = self._whole_map
        ends = offsets + lengths
        if whole is None or not len(ids) or offsets.min() < 0 or ends.max() > len(whole):
            with self.views(ids) as records:
                yield records
            return
        records = [whole[a:b] for a, b in zip(offsets.tolist(), ends.tolist(), strict=True)]
        yield self._checked(records, ids, True)

    def _checked(
        self, records: list[memoryview], ids: Sequence[int] | np.ndarray, verified: bool
    ) -> list[memoryview]:
        """The records, their checksums verified (if ``verified``) and counted."""
        if verified:
            self.verify(records, ids)
        self._count(records)
        return records

    def verify(
        self, records: Sequence[memoryview | bytes], ids: Sequence[int] | np.ndarray
    ) -> None:
        """Check the records' checksums; a failure is counted (``corrupt``) and raised.

        Raises:
            CorruptRecordError: the first damaged record, naming its sample and this store.
        """
        try:
            verify_all(records, ids, f"store {self.path}")
        except CorruptRecordError:
            self.corrupt += 1
            raise

    def known_bytes(self, ids: np.ndarray) -> int | None:
        """Total record length of these samples, where it is known without a read; else None.

        Known from the value index once it is built (never built here), or from where LMDB
        returned each record before.
        """
        index: ValueIndex | None = self.__dict__.get("value_index")
        if index is not None:
            return index.nbytes(ids)
        spans = self.sliceable_spans(ids)
        return None if spans is None else int(spans[1].sum())

    def read_rows(
        self,
        ids: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        rows: Rows,
        *,
        from_map: bool = False,
        elsewhere: tuple[str, memoryview, np.ndarray] | None = None,
    ) -> None:
        """Records at file offsets the daemon gave (``sliceable_spans``), read into ``rows``.

        ``preadv`` straight into the batch's rows, each record verified where it landed,
        nothing mapped (``row_reads.py``): for records ``row_reads.worth_reading``.
        ``from_map``: copied instead from a map of data.mdb of this store's own, not
        LMDB's (whose ``MADV_RANDOM`` would read a cold record a page at a time): once
        mapped, a record costs a copy and no system call. ``elsewhere``: (name, map, which):
        the records ``which`` selects are copied from that map of another file, in the
        store's record format, at their ``offsets`` there (the NVRAM arena's).

        Raises:
            CorruptRecordError: the first record that fails, naming its sample and this store.
        """
        maps = None
        if from_map or elsewhere is not None:
            views: list[tuple[str, memoryview]] = []
            source = np.full(len(ids), -1, np.int8)
            if from_map:
                views.append(("data.mdb", memoryview(self._file_map)))
                source[:] = 0
            if elsewhere is not None:
                name, view, which = elsewhere
                source[which] = len(views)
                views.append((name, view))
            maps = views, source
        try:
            read_rows(self._data_fd(), ids, offsets, lengths, rows, f"store {self.path}", maps)
        except CorruptRecordError:
            self.corrupt += 1
            raise
        self.reads += len(ids)
        self.bytes_read += int(lengths.sum())

    def sliceable_spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(file offsets, lengths) of records a miss worker may slice (``views_at``), or None.

        Records LMDB has returned once, or, where every checksum names its sample (record
        version 2), any record the value index found whole (``map_slices.py``).
        """
        slices = self._slices
        return None if slices is None else slices.spans(np.asarray(ids, np.int64))

    @cached_property
    def _whole_map(self) -> memoryview | None:
        """This process's map of data.mdb up to the file's end (the store is not written)."""
        base = self._map_start
        return None if base is None else map_view(base, self.file_bytes)

    def view_at(self, address: int, length: int) -> memoryview:
        """The ``length`` bytes at ``address`` of this process's map of data.mdb.

        Gives back a record the DRAM tier keeps only as where it lies (``address_of`` of a
        view of the map); valid while the store is open.
        """
        whole, base = self._whole_map, self._map_start
        if whole is None or base is None or not 0 <= address - base <= len(whole) - length:
            raise ValueError(f"store {self.path}: no record of its map at {address:#x}")
        return whole[address - base : address - base + length]

    def file_offsets(self, views: Sequence[bytes | memoryview]) -> np.ndarray | None:
        """Where in data.mdb each view (from ``views``) starts; None where that is unknown.

        What a miss worker tells the daemon, so that the daemon may slice those records
        from its own map (``confirm_offsets``).
        """
        base = self._map_start
        if base is None:
            return None
        return np.fromiter((address_of(v) - base for v in views), np.int64, len(views))

    def file_extents(self, records: Sequence[bytes | memoryview]) -> tuple[int, np.ndarray] | None:
        """data.mdb's descriptor and where in it each record lies; None: none lies in it.

        A record that is a view of this process's map of data.mdb has its file offset there;
        any other has -1. For a copy that should not map the records' pages here (the arena's
        writer: ``Arena.put_many(read_from=...)``).
        """
        offsets = self.file_offsets(records) if records else None
        if offsets is None:
            return None
        lengths = np.fromiter(map(len, records), np.int64, len(records))
        inside = (offsets >= 0) & (offsets + lengths <= self.file_bytes)
        if not inside.any():
            return None
        return self._data_fd(), np.where(inside, offsets, -1)

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
        trusted = self.info.get("record_version") == STORED_VERSION
        return MapSlices(pages.base, pages.size, index, trusted)

    # --- read-ahead -------------------------------------------------------------------------

    @cached_property
    def value_index(self) -> ValueIndex | None:
        """Where each record lies in data.mdb (None: unknown, see ``value_index.py``)."""
        return build_value_index(self.path / "data.mdb", SAMPLES_DB, self.num_samples)

    def advise(
        self,
        ids: np.ndarray,
        blocks: np.ndarray | None = None,
        ranges: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[int, int]:
        """Ask the kernel to read these records ahead, without waiting for it.

        With a value index the byte ranges go to ``posix_fadvise(WILLNEED)``, in file order,
        records stored close together in one call (``advise_bytes``): the device gets every
        range at once, and this returns at once. Without one, each record is touched through
        LMDB (py-lmdb faults a value's pages in with the GIL released), which waits for each
        read: call it off the serving path.

        Args:
            ids: the records to read ahead.
            blocks: ask for these ``read_unit`` blocks instead of the records' own pages
                (``read_blocks``, less those asked for already); adjacent blocks are one call.
            ranges: the records' ``advise_ranges``, where the caller has them already.

        Returns:
            The record bytes asked for, and the system calls that asked (0 without an index).
        """
        index = self.value_index
        if index is None:
            with self._env.begin(db=self._samples, buffers=True) as txn:
                return sum(len(txn.get(int(s).to_bytes(8, "big")) or b"") for s in ids), 0
        ids = np.asarray(ids, np.int64)
        if blocks is not None:
            starts, lengths = block_ranges(blocks, self.read_unit)
        else:
            starts, lengths = ranges if ranges is not None else index.ranges(ids, ADVISE_GAP, _PAGE)
        probe = self._residency
        late = self._read_first[ids]
        if late.any():  # a reader got here first: pages it just read say nothing of the rest
            self._read_first[ids] = False
            probe = None
        if not len(starts):
            calls = 0  # their blocks were asked for already (and would mislead the probe)
        elif probe is not None and probe.resident(starts, lengths):
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
        if index is None or len(index.damaged) == self.num_samples:
            return None
        # The lowest id not damaged (``damaged`` is sorted): the first place it differs.
        first = next(i for i, d in enumerate([*index.damaged.tolist(), -1]) if i != d)
        with self._env.begin(db=self._samples, buffers=True) as txn:
            rec = txn.get(_KEY.pack(first))
            base = None if rec is None else address_of(rec) - int(index.offsets[first])
        if base is None or base % _PAGE:  # a map starts on a page: the index is off
            logger.info(
                "store %s: record %d is not where the index says; no prefault", self.path, first
            )
            return None
        return Prefault(base, int(self._env.info()["map_size"]))

    def advise_ranges(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The file ranges ``advise(ids)`` asks for: ``(starts, lengths)`` (None: no index).

        Whole pages, and the pages between records it joins into one range (at most
        ``ADVISE_GAP`` apart): the kernel reads those too. So a read-ahead that counts their
        bytes holds no more than it counts; the advice of any subset of ``ids`` holds no more
        either. Computed once a batch: the read-ahead counts them, then passes them to
        ``advise``.
        """
        index = self.value_index
        return None if index is None else index.ranges(ids, ADVISE_GAP, _PAGE)

    def advise_bytes(self, ids: np.ndarray) -> int | None:
        """The bytes ``advise(ids)`` has the page cache read and hold (None: no index)."""
        ranges = self.advise_ranges(ids)
        return None if ranges is None else int(ranges[1].sum())

    @cached_property
    def read_unit(self) -> int:
        """The block a pass's small records are read ahead in; 0: each record's own pages.

        A record of a few KiB costs the device a request for a page or two: a cold shuffled
        pass over 3 KB records, each advised on its own, ran at 60 % of 32 threads'
        random ``pread`` and half the rate of a DataLoader whose page faults read 128 KiB
        around them. Asked for in aligned ``READ_UNIT`` blocks, each block once per pass,
        it ran at the rate of a pass whose pages were cached already (~31k to ~40k samples/s;
        the miss path's CPU is the limit then); records of 100 KB gained nothing. Only where it
        pays: small records, in a file that fits in half the memory available now, so
        that a block's other records are still cached when their turn in the pass comes.
        """
        if not self.num_samples or self.total_bytes // self.num_samples >= SMALL_RECORD:
            return 0
        return READ_UNIT if self.file_bytes <= memory_available() // 2 else 0

    def read_blocks(self, ids: np.ndarray) -> np.ndarray | None:
        """The ``read_unit`` blocks holding these records (None: no block reads, no index)."""
        index = self.value_index
        unit = self.read_unit
        return None if index is None or not unit else index.blocks(ids, unit)

    @property
    def file_blocks(self) -> int:
        """How many ``read_unit`` blocks data.mdb spans (0 without block reads)."""
        unit = self.read_unit
        return -(-self.file_bytes // unit) if unit else 0

    def advise_known(self, ids: Sequence[int]) -> None:
        """``advise`` these records when their byte ranges are known already; never waits.

        For a read about to happen: a cold record faulted in through the map costs one
        synchronous page read after another (measured ~2.5 ms per 100 KB record here); asked
        for as ranges first, the batch's reads reach the device together (~0.7 us a record
        when its pages are cached already). Without an index built (the read-ahead builds
        it) this does nothing rather than build one on the serving path. Records that
        ``advise`` asked for already (the read-ahead) are not asked for again: this read
        consumes that advice, one system call a record fewer on the serving path. Once the
        whole map is mapped (``map_loaded``) nothing is asked for: walking a batch's cached
        ranges took a third of the serving loop's time in a warm-miss epoch.
        """
        index = self.__dict__.get("value_index")
        if index is None or len(ids) < 2 or self._map_resident:
            return
        want = np.asarray(ids, np.int64)
        if want.min() < 0 or want.max() >= self.num_samples:
            return  # the read that follows says which id is not in the store
        advised = self._advised
        fresh = want[~advised[want]]
        advised[want] = False  # a later read (the next pass) is advised afresh
        self._read_first[fresh] = True  # the read-ahead is behind (``advise``)
        if len(fresh) > 1:
            self._advise_ranges(index, fresh)

    @cached_property
    def _advised(self) -> np.ndarray:
        """Per sample: advised and not read since.

        Updated without a lock: a lost update costs one system call more or less, never bytes.
        """
        return np.zeros(self.num_samples, bool)

    @cached_property
    def _read_first(self) -> np.ndarray:
        """Per sample: read before the read-ahead advised it (``advise_known`` saw it fresh).

        ``advise`` takes no residency evidence from a batch with such a record. At a pass's
        start the workers read its first batches while the read-ahead begins; their pages,
        found cached, had the probe trust the store as cached and skip the next 15 batches
        of a cold one, which the workers then read at fault speed (a stall of ~1 s in half
        of the cold epochs of 20,000 records of 100 KB). Updated without a lock, as
        ``_advised``.
        """
        return np.zeros(self.num_samples, bool)

    def pin(self, record: memoryview) -> Callable[[], None] | None:
        """Lock a record's pages in RAM when it has pages of its own; returns the unlock.

        LMDB keeps a value larger than half a page in overflow pages of its own, starting
        right after their 16-byte page header; a smaller value shares a leaf page, which is
        not locked (None: the caller copies it). Below ``PIN_MIN_BYTES`` a copy is cheaper
        than the system call (measured: ``mlock`` ~8 us, a copy into fresh memory ~0.6 us per
        KiB), so those are copied too. Once the whole map is locked (``lock_map``), see
        ``pin_many``.
        """
        return self.pin_many([record])[0]

    def pin_many(
        self, records: Sequence[bytes | memoryview], addresses: np.ndarray | None = None
    ) -> list[Callable[[], None] | None]:
        """``pin`` of each record: its unlock, or None where it is to be copied.

        ``addresses``: where each record lies (``address_of``), where the caller has them.

        Once the whole map is held (``lock_map``, ``own_map``), a record of ``copy_below``
        or more is held as it is: its pages are locked as they are mapped (or are the
        process's own once the loader has copied them), and they are mapped here,
        for all the records at once (``populate_read``), since a miss worker read them
        through a map of its own; once every page of the map is mapped (``map_loaded``),
        that call is left out: asked for pages already mapped, the kernel still walks and
        counts each one, ~5 us a 100 KB record in single pages, the cost of mapping them.
        A record of no view of the map (``bytes``) is to be copied.
        """
        if self._map_held is None:
            return [self._pin_one(r) if self._locks.enabled else None for r in records]
        lo, hi = self._map_held
        n = len(records)
        sizes = np.fromiter(map(len, records), np.int64, n)
        large = sizes >= self.copy_below
        if addresses is None:
            addresses = np.zeros(n, np.int64)  # 0: copied (small, or not of the locked map)
            addresses[large] = [
                address_of(r) for r, big in zip(records, large.tolist(), strict=True) if big
            ]
        held = large & (addresses >= lo) & (addresses < hi)
        starts = addresses[held]
        first = starts - starts % self._psize
        if len(first) and not self.holds_free:
            populate_read(first, starts + sizes[held] - first)  # else on first touch
        return [still_locked if h else None for h in held.tolist()]

    def _pin_one(self, record: bytes | memoryview) -> Callable[[], None] | None:
        """``mlock`` of an overflow record's own pages (the map is not locked whole)."""
        if len(record) < PIN_MIN_BYTES:
            return None
        address = address_of(record)
        if address % self._psize != _OVERFLOW_HEADER:
            return None
        start = address - _OVERFLOW_HEADER
        length = -(-(len(record) + _OVERFLOW_HEADER) // self._psize) * self._psize
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
        self._map_held = (base, base + size)
        return True

    def own_map(self) -> bool:
        """Hold data.mdb's map in RAM as memory of this process's own, where it may not lock.

        What ``lock_map`` does for a DRAM tier that can hold the whole store, for a process
        ``RLIMIT_MEMLOCK`` refuses: a ``MapLoader`` with ``copy_from`` then copies the file
        into anonymous memory a chunk at a time and moves each chunk over the map's pages,
        at the same addresses. The store is immutable while served, so LMDB and every view
        read the same bytes there, from memory the kernel does not take back as page cache
        (it may swap it, as it may any copy). ``pin_many`` holds records as with a locked
        map; one the loader has not passed yet is held by the page cache until it does.
        False where the map is not found.
        """
        base = self._map_start
        if base is None:
            return False
        self._map_held = (base, base + -(-self.file_bytes // self._psize) * self._psize)
        self._map_owned = True
        return True

    @property
    def map_locked(self) -> bool:
        """Whether ``lock_map`` locked the whole map."""
        return self._map_held is not None and not self._map_owned

    @property
    def map_owned(self) -> bool:
        """Whether the map is held as memory of this process's own (``own_map``)."""
        return self._map_owned

    def map_loaded(self) -> None:
        """Note that every page of the held map is mapped now (``map_loader.py``).

        A record of it is held from here on with no system call at all (``pin_many``).
        """
        if self._map_held is not None:
            self._map_resident = True

    @property
    def copy_below(self) -> int:
        """The size under which ``pin_many`` leaves a record to be copied."""
        if self._map_held is None:
            return PIN_MIN_BYTES
        return 0 if self.gathers_by_address or self._views_only else VIEW_MIN_BYTES

    def views_only(self) -> None:
        """Hold every record of the held map as a view, none as a copy (``copy_below`` 0).

        For a map held whole where the memory available holds the store once but not twice:
        records of variable fields under a page are otherwise copied, each then in RAM twice
        (the copy, and the held map's page), for hits 3-17 % faster at 3 KB.
        """
        self._views_only = True

    def bytes_copied_when_held(self) -> int:
        """Bytes of the records a held map leaves to be copied (at most the records' total).

        Counted from the value index's lengths where it is built already (building it walks
        the whole tree, which is not for the daemon's start), else all the records' bytes.
        """
        if self.gathers_by_address or self._views_only:
            return 0
        index = self.__dict__.get("value_index")
        if index is None:
            return self.total_bytes
        lengths = index.lengths
        return int(lengths[lengths < VIEW_MIN_BYTES].sum(dtype=np.int64))

    @property
    def gathers_by_address(self) -> bool:
        """Whether a batch of these records can be copied from their addresses alone.

        Records of fixed fields only: the rows of each lie at the same offsets. The DRAM
        tier keeps where its views of them lie (``DramCache.located``), so in a map locked
        whole any of them is held as a view (``copy_below``).
        """
        return not self.schema.layout.variable

    @property
    def map_resident(self) -> bool:
        """Whether every page of the held map is mapped (``map_loaded``)."""
        return self._map_resident

    @property
    def holds_free(self) -> bool:
        """Whether ``pin_many`` holds a record of the held map with no system call.

        Once every page of a locked map is mapped (``map_loaded``), and in an owned map from
        the start: mapping the file's pages there would hold nothing, the copy does.
        """
        return self._map_resident or self._map_owned

    @property
    def held_range(self) -> tuple[int, int] | None:
        """``[start, end)`` of the map held whole (locked or owned), in this process; None: not."""
        return self._map_held

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

    def advise_tree(self, leaf_bytes: int) -> int:
        """Ask the kernel to read the pages every lookup goes through, without waiting.

        A lookup through LMDB (a miss worker's, or this process's before a record is sliced
        from the map) reads the meta pages and a branch and leaf page of the samples tree.
        Not asked for, a cold one is read on its own when a reader faults on it, queued behind
        the read-ahead's records: measured on a cold store of 20,000 records of 100 KB, the
        first batch came after 250-400 ms with the tree cold, 60-80 ms with it asked for.

        Args:
            leaf_bytes: the leaves of pointers are asked for only when they take at most
                this much (a store of 10 M large records has ~250 MB of them); the meta and
                branch pages always are.

        Returns:
            The pages asked for (0 without a value index).
        """
        index = self.value_index
        if index is None:
            return 0
        pages = index.inner_pages
        if len(index.leaf_pages) * index.page_bytes <= leaf_bytes:
            pages = np.union1d(pages, index.leaf_pages)
        if len(pages):
            self._fadvise(*block_ranges(pages, index.page_bytes))
        return len(pages)

    def _fadvise(self, starts: np.ndarray, lengths: np.ndarray) -> int:
        fd = self._data_fd()
        for off, n in zip(starts.tolist(), lengths.tolist(), strict=True):
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
        return len(starts)

    def _data_fd(self) -> int:
        with self._fd_lock:
            if self._fd < 0:
                self._fd = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
                # A ``preadv`` through it reads the record's pages and no more: access is
                # random, and the read-ahead advises what the plan will need.
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            return self._fd

    @cached_property
    def _file_map(self) -> mmap.mmap:
        """data.mdb mapped read-only, whole, with the kernel's default read-ahead."""
        fd = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the environment (safe to call twice)."""
        file_map = self.__dict__.pop("_file_map", None)
        if file_map is not None:
            with suppress(BufferError):  # a view outlived the store: unmapped when it goes
                file_map.close()
        self._env.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SampleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
