"""Records read from data.mdb straight into a batch's rows, and verified there.

A miss worker that slices a record out of its map of the store has every page of it mapped
into its process (a fault, or a fault-around, per few pages), then reads the record twice:
once for its checksum, once to copy it into the batch. ``preadv`` maps nothing: the kernel
copies from the page cache and scatters the record as it goes (its header to a scratch
buffer, each fixed field into its row of the batch's frame, the padding between them to the
scratch), and the checksum is then computed over the pieces where they landed, in record
order, while they are still in the CPU's cache. One call per record, and a cold record's
pages are read in one request rather than one fault after another.

It pays for large records only (``benchmarks/bench_row_reads.py``, CPU per record on this
project's 2-core VMs). From Python: 100 KB records took 14-27 % less than through the map,
300 KB 3-13 % less; 50 KB records 3-15 % more and 3 KB records 60 % more (the Python around
each call outweighs the faults it saves). With the loop compiled (below), 100 KB records
took 22 us against 30-34 through the map and 26 from Python, 20 KB records 8.6-9.8 against
9.3-11.3, while 8 KB records still lost (7.0-7.4 against 6.7-6.8). So records under
16 KiB compiled, 64 KiB from Python (``worth_reading``), are sliced as before.

The loop over a batch's records runs in C (``storage/read_rows.c``, built as an optional
extension, loaded with ``ctypes.PyDLL``): the ``preadv`` of each record and its hash over the
pieces, with xxHash's own streaming functions from the library python-xxhash is built with.
In Python that loop cost ~10 us a record (the pieces' list, the call, the hasher and its
updates), a quarter of a worker's CPU on a warm 100 KB miss. The checks stay here: the
headers and digests come back as arrays and are compared in one numpy expression. A record
whose header says it was sealed as encoded (seed 0, not its id) is read again by the Python
loop, as is every record where the library was not built.

Given a map of the whole file, the same loop copies each piece from it with ``memcpy``
instead (``SampleStore.read_rows(from_map=True)``), the hash again over the pieces where they
landed. The first read of a record then maps its pages, which costs more than ``preadv``;
every later one costs a copy and no system call. Measured in the daemon's workers (20,000
records of 100 KB, a store four times DRAM, warm page cache, 2 cores): 8-9 us a record of
worker CPU from the third pass on, against 12.5-13 with ``preadv``; 15 against 13 in the
first pass. The daemon chooses (``MissWorkers._copies_from_map``). The source is chosen
record by record: records of the NVRAM arena, in the store's format at offsets of the
arena's, are copied from a worker's map of the arena file in the same call (``maps``).

Only a caller that knows each record's place in the file (the value index) reads this way,
and only records whose checksums name their samples, or whose place LMDB confirmed: a wrong
offset must fail the checksum (``map_slices.py``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import numpy as np
import xxhash
import xxhash._xxhash

from loaderd.storage.errors import CorruptRecordError
from loaderd.storage.records import HEADER_DTYPE, RECORD_HEADER, RECORD_VERSION, STORED_VERSION
from loaderd.storage.syscalls import address_of

logger = logging.getLogger(__name__)

Rows = Sequence[tuple[memoryview, int, int]]  # (out, offset in the record, width), as gather_rows
# Files mapped whole, by name, and per record the one it is copied from (-1: read from the fd).
Maps = tuple[Sequence[tuple[str, memoryview]], np.ndarray]


class _Hasher(ctypes.Structure):
    """xxHash's streaming XXH3-64, as ``read_rows.c``'s ``hasher_t``: five function addresses."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("create", "free", "reset", "update", "digest")]


def _built() -> str | None:
    """The compiled record reader's file; None where it was not built."""
    spec = importlib.util.find_spec("loaderd.storage._read_rows")
    return None if spec is None else spec.origin


def _load() -> tuple[ctypes.PyDLL, _Hasher] | None:
    origin = _built()
    if origin is None:
        logger.info("the compiled record reader is not built: records are read from Python")
        return None
    try:
        xxh = ctypes.PyDLL(xxhash._xxhash.__file__)
        names = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset_withSeed")
        fns = [ctypes.cast(getattr(xxh, name), ctypes.c_void_p).value for name in names]
        update = getattr(xxh, "XXH3_64bits_update_dispatch", None) or xxh.XXH3_64bits_update
        fns += [ctypes.cast(f, ctypes.c_void_p).value for f in (update, xxh.XXH3_64bits_digest)]
    except (OSError, AttributeError):
        logger.info("xxHash's streaming XXH3 is not exported: records are read from Python")
        return None
    lib = ctypes.PyDLL(origin)
    if not hasattr(lib, "loaderd_read_or_copy_rows"):
        logger.info("the compiled record reader is out of date: records are read from Python")
        return None
    p, n, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    lib.loaderd_read_or_copy_rows.argtypes = [i, p, n, p, p, p, p, n, p, n, p, p, p]
    lib.loaderd_read_or_copy_rows.restype = ctypes.c_long
    return lib, _Hasher(*fns)


_LIB = _load()
AVAILABLE = _LIB is not None


def _load_whole() -> Callable[..., int] | None:
    """``loaderd_read_whole`` through ``ctypes.CDLL``, which lets go of the GIL for the call."""
    origin = _built()
    if _LIB is None or origin is None:
        return None
    fn: Any = getattr(ctypes.CDLL(origin), "loaderd_read_whole", None)
    if fn is None:
        logger.info("the compiled record reader is out of date: arena records are copied")
        return None
    p, n = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, n, p, p, p, p, p]
    fn.restype = ctypes.c_long
    return cast(Callable[..., int], fn)


_READ_WHOLE = _load_whole()


def read_whole(
    fd: int, offsets: np.ndarray, lengths: np.ndarray, dests: np.ndarray
) -> np.ndarray | None:
    """Read record i (``lengths[i]`` bytes at ``offsets[i]`` of ``fd``) to address ``dests[i]``.

    The kernel copies from the page cache and nothing of the file is mapped here; each record
    is then hashed where it landed. One call for the batch, the GIL let go throughout: the
    caller (the arena's writer thread) keeps whatever ``dests`` lie in mapped meanwhile.

    Returns:
        Each record's xxh3-64 (seed 0); None where the compiled reader is not built.

    Raises:
        OSError: a read failed, or a record runs past the end of the file.
    """
    if _READ_WHOLE is None or _LIB is None:
        return None
    offsets = np.ascontiguousarray(offsets, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    dests = np.ascontiguousarray(dests, np.uint64)
    digests = np.empty(len(offsets), np.uint64)
    done = _READ_WHOLE(
        fd, len(offsets), offsets.ctypes.data, lengths.ctypes.data, dests.ctypes.data,
        ctypes.byref(_LIB[1]), digests.ctypes.data,
    )  # fmt: skip
    if done < 0:
        raise OSError(-done, f"reading whole records: {os.strerror(-done)}")
    if done < len(offsets):
        raise OSError(f"record {done} of the batch runs past the end of the file")
    return digests


# Pieces one ``preadv`` takes (Linux's IOV_MAX; ``read_rows.c`` has the same bound): a record
# is its header, each field's row and the gaps between them.
MAX_PIECES = 1024


def worth_reading(record_bytes: int, fields: int) -> bool:
    """Whether records this long, of this many fixed fields, are read into rows, not sliced."""
    if 2 * fields + 2 > MAX_PIECES:
        return False  # more pieces than one call takes
    return record_bytes >= (16 << 10 if _LIB is not None else 64 << 10)


def read_rows(
    fd: int,
    ids: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    rows: Rows,
    where: str,
    maps: Maps | None = None,
) -> None:
    """Read record i (``lengths[i]`` bytes at ``offsets[i]`` of ``fd``) into row i of each out.

    Args:
        fd: the store's data.mdb, open for reading.
        ids: the batch's sample ids, in row order.
        offsets: where each record starts in the file.
        lengths: each record's length, header included.
        rows: (``out``, ``offset``, ``width``): bytes ``[offset, offset + width)`` of each
            record go to row i of ``out``, a buffer of ``len(ids)`` rows; disjoint ranges past
            the header. Bytes of a record no range covers are read and hashed, not kept.
        where: names the store in errors.
        maps: (``(name, view)`` of files mapped whole, ``source``): record i is copied from
            the map ``source[i]`` at ``offsets[i]`` instead of read from ``fd`` (-1). Pages a
            read of this process mapped already cost no system call.

    Raises:
        CorruptRecordError: the first record (in row order) that is short, too short for its
            rows, or fails its header or checksum; rows already read hold their records.
    """
    order = sorted(rows, key=lambda r: r[1])
    need = max((off + width for _, off, width in order), default=RECORD_HEADER.size)
    offsets = np.asarray(offsets, np.int64)
    lengths = np.asarray(lengths, np.int64)
    bad = lengths < need
    if maps is not None:
        views, source = maps
        ends = np.array([view.nbytes for _, view in views] + [np.iinfo(np.int64).max])
        # Each must lie within its map (-1, the file: a short read says so).
        bad |= (offsets + lengths > ends[source]) | ((source >= 0) & (offsets < 0))
    first = np.flatnonzero(bad)
    upto = int(first[0]) if len(first) else len(ids)  # records before the first checked bad
    part = None if maps is None else (maps[0], maps[1][:upto])
    read = _read_python if _LIB is None else partial(_read_compiled, _LIB)
    read(fd, part, ids[:upto], offsets[:upto], lengths[:upto], order, need, where)
    if upto < len(ids):
        sid, length = int(ids[upto]), int(lengths[upto])
        if length < need:
            raise CorruptRecordError(
                sid, where, f"record of {length} bytes, its fields need {need}"
            )
        assert maps is not None
        name = maps[0][int(maps[1][upto])][0]
        raise CorruptRecordError(sid, where, f"record runs past the end of {name}")


def _read_compiled(
    lib: tuple[ctypes.PyDLL, _Hasher],
    fd: int,
    maps: Maps | None,
    ids: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    order: Rows,
    need: int,
    where: str,
) -> None:
    """``read_rows`` of records at least ``need`` long, the loop in C, the checks here."""
    n = len(ids)
    if n == 0:
        return
    fn, hasher = lib
    head = RECORD_HEADER.size
    offsets = np.ascontiguousarray(offsets, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    seeds = np.ascontiguousarray(ids, np.int64).view(np.uint64)
    table = np.empty((len(order), 3), np.uint64)
    for k, (out, off, width) in enumerate(order):
        if out.readonly or not out.contiguous or out.nbytes < n * width:
            raise ValueError("rows are read into writable, contiguous frames of every row")
        table[k] = (address_of(out), off, width)
    headers = np.empty(n, HEADER_DTYPE)
    digests = np.empty(n, np.uint64)
    scratch = np.empty(max(int(lengths.max()), need), np.uint8)
    start = None
    if maps is not None:  # where each record lies in its map (0: read from the fd)
        views, source = maps
        start = np.zeros(n, np.uint64)
        for k, (_, view) in enumerate(views):
            mine = source == k
            start[mine] = address_of(view) + offsets[mine].astype(np.uint64)
    done = fn.loaderd_read_or_copy_rows(
        fd, None if start is None else start.ctypes.data, n, offsets.ctypes.data,
        lengths.ctypes.data, seeds.ctypes.data, headers.ctypes.data, head, table.ctypes.data,
        len(order), scratch.ctypes.data, ctypes.byref(hasher), digests.ctypes.data,
    )  # fmt: skip
    if done < 0:
        raise OSError(-done, f"reading records of {where}: {os.strerror(-done)}")
    read = slice(0, done)
    version = headers["version"][read]
    damaged = (headers["length"][read] != lengths[read] - head) | (
        (version != STORED_VERSION) & (version != RECORD_VERSION)
    )
    failed = damaged | ((version == STORED_VERSION) & (headers["digest"][read] != digests[read]))
    # Sealed as encoded (seed 0): read again and checked record by record, a rare store.
    unseeded = np.flatnonzero(~damaged & (version == RECORD_VERSION))
    first = int(np.argmax(failed)) if failed.any() else done
    for i in unseeded[unseeded < first].tolist():
        one = slice(i, i + 1)
        one_map = None if maps is None else (maps[0], maps[1][one])
        _read_python(fd, one_map, ids[one], offsets[one], lengths[one], _row(order, i), need, where)
    if first < done:
        if damaged[first]:
            raise CorruptRecordError(int(ids[first]), where, "record header is damaged")
        raise CorruptRecordError(int(ids[first]), where)
    if done < n:
        raise CorruptRecordError(int(ids[done]), where, "record runs past the end of data.mdb")


def _row(order: Rows, i: int) -> list[tuple[memoryview, int, int]]:
    """Row ``i`` of each out, as the outs of a batch of one."""
    return [(out[i * width : (i + 1) * width], off, width) for out, off, width in order]


def _read_python(
    fd: int,
    maps: Maps | None,
    ids: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    order: Rows,
    need: int,
    where: str,
) -> None:
    """``read_rows`` of records at least ``need`` long, one at a time from Python."""
    head = RECORD_HEADER.size
    scratch = memoryview(bytearray(max(int(lengths.max(initial=0)), need)))
    for i, (sid, start, length) in enumerate(
        zip(ids.tolist(), offsets.tolist(), lengths.tolist(), strict=True)
    ):
        pieces = [scratch[:head]]
        pos = head
        for out, off, width in order:
            if off > pos:
                pieces.append(scratch[pos:off])
            pieces.append(out[i * width : (i + 1) * width])
            pos = off + width
        if length > pos:
            pieces.append(scratch[pos:length])
        if maps is None or (k := int(maps[1][i])) < 0:
            got = os.preadv(fd, pieces, start)
        else:
            got = _copy(maps[0][k][1], pieces, start, length)
        if got != length:
            raise CorruptRecordError(sid, where, "record runs past the end of data.mdb")
        digest, body_bytes, version = RECORD_HEADER.unpack_from(scratch)
        if version not in (RECORD_VERSION, STORED_VERSION) or body_bytes != length - head:
            raise CorruptRecordError(sid, where, "record header is damaged")
        hasher = xxhash.xxh3_64(seed=sid if version == STORED_VERSION else 0)
        for piece in pieces[1:]:
            hasher.update(piece)
        if hasher.intdigest() != digest:
            raise CorruptRecordError(sid, where)


def _copy(mapped: memoryview, pieces: list[memoryview], start: int, length: int) -> int:
    """``preadv`` of ``pieces`` from a map of a file, the record checked to lie in it."""
    for piece in pieces:
        piece[:] = mapped[start : start + piece.nbytes]
        start += piece.nbytes
    return length
