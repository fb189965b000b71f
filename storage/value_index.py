"""Where each sample's record lies in ``data.mdb``, found without reading the records.

Read-ahead needs the byte range of every record of a pass before anyone reads it, so that
the kernel can be asked to fetch many ranges at once (``posix_fadvise(WILLNEED)``). LMDB
cannot say where a value lies without touching it: py-lmdb's ``get`` pre-faults the whole
value (to fault without the GIL held), and positioning a cursor touches the value's first
page. On a cold store that is one synchronous random read per sample, the very cost
read-ahead exists to hide. So this module walks the B-tree of the ``samples`` database itself,
from the meta page through the branch pages to the leaves, reading only those pages (about
one page per 150 samples), and takes each value's offset from its leaf node.

The format read is LMDB 0.9's (the one py-lmdb bundles), 64-bit, native byte order. The
index is a hint only: records are still read and verified through LMDB, so a wrong offset
could cost speed, never bytes. Anything unexpected (another engine version, a page that does
not parse, ids that are not 0..N-1) gives no index, and the caller reads ahead without one.

One thing the index knows that LMDB does not check: a value whose leaf node gives a length
(or an overflow page) running past the end of the file. LMDB returns it as it is, py-lmdb
touches every page of it, and the first page past the file is a SIGBUS that kills the
process. Such samples are listed as ``damaged``, and the store refuses them as corrupt
before LMDB is asked (``SampleStore.views``).

The walk also keeps the pages every lookup through LMDB reads and no record's advice covers:
the meta pages, the branch pages of ``samples``, and its leaf pages that hold only pointers to
values stored in pages of their own (a leaf holding values is read with them). A reader that
finds one of those cold reads it on its own, behind whatever the read-ahead has queued. The
two kinds are kept apart: the inner pages are a handful, the leaves of pointers grow with the
store, so the read-ahead asks for those only when they fit its budget.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

_MAGIC = 0xBEEFC0DE
_HDR = 16  # PAGEHDRSZ of LMDB 0.9
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_U16, _U32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")
_MAX_DEPTH = 32
# Pages of a level read at once: that many reads in flight, and that much memory. A level is
# read a part at a time because its leaves hold the records of a store of small ones (values
# in their leaf pages): read whole, a 400 MB store of 1 KB records held 400 MB of pages.
_PAGES_AT_ONCE = 256


class _Unreadable(Exception):
    """The file does not have the shape this reader understands."""


@dataclass(frozen=True, slots=True)
class ValueIndex:
    """File offset and length of every sample's record in ``data.mdb``.

    ``offsets[i]``, ``lengths[i]``: the record of sample i occupies bytes
    ``[offsets[i], offsets[i] + lengths[i])`` of the file (12 bytes of memory per sample).
    ``damaged``: samples whose leaf node says their record runs past the end of the file
    (sorted ids). LMDB would hand out such a value unchecked, and the first byte read past
    the file is a SIGBUS; each is indexed as an empty record in its leaf page.
    """

    offsets: np.ndarray  # int64 [N]
    lengths: np.ndarray  # uint32 [N]
    # The pages a lookup reads that hold no record, page numbers sorted: the meta and branch
    # pages (a few), and the leaves holding only pointers to values (one per ~160 records).
    inner_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    leaf_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    page_bytes: int = 4096
    damaged: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.offsets)

    def first_damaged(self, ids: np.ndarray) -> int | None:
        """The first of these samples (in their order) whose record runs past the file."""
        if not len(self.damaged):
            return None
        bad = np.isin(ids, self.damaged)
        return int(ids[np.argmax(bad)]) if bad.any() else None

    def nbytes(self, ids: np.ndarray) -> int:
        """Record bytes of these samples."""
        return int(self.lengths[ids].sum(dtype=np.int64))

    def ranges(self, ids: np.ndarray, gap: int = 0, page: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The records' byte ranges in file order, whole pages, neighbours joined.

        Each record's range is widened to whole ``page``s (what the page cache holds of it);
        ranges that overlap (a repeated id), touch, or lie at most ``gap`` bytes apart become
        one, so that a run of records stored one after the other (LMDB puts a leaf page
        between runs now and then) is asked for in one system call. The pages between joined
        records are part of the range: a caller that bounds the bytes it asks for counts them.

        Returns:
            ``(starts, lengths)``: int64, sorted by start, disjoint, ``page``-aligned.
        """
        offsets = self.offsets[ids]
        if not len(offsets):
            return offsets.astype(np.int64), offsets.astype(np.int64)
        order = np.argsort(offsets, kind="stable")
        starts = offsets[order] // page * page
        ends = -(-(offsets[order] + self.lengths[ids][order].astype(np.int64)) // page) * page
        ends = np.maximum.accumulate(ends)  # a range's end is the furthest end so far
        first = np.empty(len(starts), bool)
        first[0] = True
        first[1:] = starts[1:] > ends[:-1] + gap  # a new range where the gap is too wide
        heads = np.flatnonzero(first)
        lasts = np.append(heads[1:], len(starts)) - 1
        return starts[heads], ends[lasts] - starts[heads]

    def blocks(self, ids: np.ndarray, unit: int) -> np.ndarray:
        """The ``unit``-sized, ``unit``-aligned blocks of the file holding the records.

        Returns:
            Block numbers (block ``b`` is bytes ``[b * unit, (b + 1) * unit)``), int64,
            sorted, unique.
        """
        offsets = self.offsets[ids]
        first = offsets // unit
        last = (offsets + self.lengths[ids].astype(np.int64) - 1) // unit
        if bool((first == last).all()):  # no record crosses a block's end: small records
            return np.unique(first)
        span = last - first + 1  # a record larger than a block lies in several
        steps = np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span)
        return np.unique(np.repeat(first, span) + steps)


def block_ranges(blocks: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges ``(starts, lengths)`` of sorted block numbers, adjacent blocks joined."""
    if not len(blocks):
        return blocks.astype(np.int64), blocks.astype(np.int64)
    heads = np.flatnonzero(np.diff(blocks, prepend=blocks[0] - 2) != 1)
    counts = np.diff(np.append(heads, len(blocks)))
    return blocks[heads].astype(np.int64) * unit, counts.astype(np.int64) * unit


def build_value_index(path: Path, db_name: bytes, num_samples: int) -> ValueIndex | None:
    """Walk the B-tree of ``db_name`` in ``path`` (a data.mdb) and index its values.

    Args:
        path: the LMDB data file.
        db_name: the named database holding samples under 8-byte big-endian ids.
        num_samples: how many samples the store says it has (ids ``0..N-1``).

    Returns:
        The index, or None when the file is not in the shape this reader understands.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        logger.warning("no read-ahead index for %s: %s", path, e.strerror)
        return None
    try:
        # Exactly the tree's pages: the kernel's readahead of a buffered read would pull in
        # the records around each page too (8 MiB windows on some disks).
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return _Walker(fd, os.fstat(fd).st_size, path).index(db_name, num_samples)
    except (_Unreadable, struct.error, ValueError, OSError) as e:
        logger.warning("no read-ahead index for %s (%s): reading ahead without one", path, e)
        return None
    finally:
        os.close(fd)


class _Walker:
    def __init__(self, fd: int, size: int, path: Path) -> None:
        self.fd = fd
        self.size = size
        self.path = path
        head = os.pread(fd, _HDR + 160, 0)
        if len(head) < _HDR + 136 or _U32.unpack_from(head, _HDR)[0] != _MAGIC:
            raise _Unreadable("not an LMDB 0.9 data file")
        self.psize = _U32.unpack_from(head, _HDR + 24)[0]  # mm_psize aliases free-DB md_pad
        if self.psize < 512 or self.psize & (self.psize - 1) or self.psize > 1 << 16:
            raise _Unreadable(f"implausible page size {self.psize}")

    def index(self, db_name: bytes, num_samples: int) -> ValueIndex:
        main_root = self._committed_main_root()
        root = self._named_root(main_root, db_name)
        offsets = np.full(num_samples, -1, np.int64)
        lengths = np.zeros(num_samples, np.uint32)
        node_at = np.zeros(num_samples, np.int64)  # each value's node, in its leaf page
        if num_samples == 0:
            return ValueIndex(offsets, lengths)
        level = [root]
        inner = [0, 1]  # the meta pages: a read transaction starts from them
        pointer_leaves: list[int] = []
        for _ in range(_MAX_DEPTH):
            children: list[int] = []
            for lo in range(0, len(level), _PAGES_AT_ONCE):
                part = level[lo : lo + _PAGES_AT_ONCE]
                for pgno, page in zip(part, self._read_pages(part), strict=True):
                    flags = _U16.unpack_from(page, _HDR - 6)[0]
                    if flags & _P_BRANCH:
                        children += self._branch_children(page)
                        inner.append(pgno)
                    elif flags & _P_LEAF and not flags & _P_LEAF2:
                        if self._leaf_values(pgno, page, offsets, lengths, node_at):
                            pointer_leaves.append(pgno)  # no record's advice reads it
                    else:
                        raise _Unreadable(f"page {pgno} is neither branch nor leaf (0x{flags:x})")
            if not children:
                break
            level = children
        else:
            raise _Unreadable("tree deeper than LMDB allows")
        if (offsets < 0).any():
            raise _Unreadable(f"{int((offsets < 0).sum())} of {num_samples} ids not found")
        damaged = np.flatnonzero(offsets + lengths > self.size)
        if len(damaged):
            logger.warning(
                "%d records of %s run past the end of the file (damaged leaf nodes; "
                "samples %s): they are refused as corrupt, never read",
                len(damaged),
                self.path,
                ", ".join(map(str, damaged[:5].tolist())) + (", ..." if len(damaged) > 5 else ""),
            )
            offsets[damaged] = node_at[damaged]  # an empty record in its leaf page
            lengths[damaged] = 0
        return ValueIndex(
            offsets,
            lengths,
            np.unique(np.array(inner, np.int64)),
            np.unique(np.array(pointer_leaves, np.int64)),
            self.psize,
            damaged,
        )

    def _committed_main_root(self) -> int:
        best: tuple[int, int] | None = None
        for pgno in (0, 1):
            m = os.pread(self.fd, _HDR + 160, pgno * self.psize) + b""
            if len(m) < _HDR + 136 or _U32.unpack_from(m, _HDR)[0] != _MAGIC:
                continue
            main_root = _U64.unpack_from(m, _HDR + 24 + 48 + 40)[0]
            txnid = _U64.unpack_from(m, _HDR + 24 + 96 + 8)[0]
            if best is None or txnid > best[0]:
                best = (txnid, main_root)
        if best is None:
            raise _Unreadable("no valid meta page")
        return best[1]

    def _named_root(self, root: int, name: bytes) -> int:
        pgno = root
        for _ in range(_MAX_DEPTH):
            page = self._read_pages([pgno])[0]
            flags = _U16.unpack_from(page, _HDR - 6)[0]
            nodes = list(self._nodes(page))
            if flags & _P_BRANCH:  # main DB keys are names: pick the last separator <= name
                child = None
                for i, (o, lo, hi, nflags, ksize) in enumerate(nodes):
                    key = page[o + 8 : o + 8 + ksize]
                    if i == 0 or key <= name:
                        child = lo | hi << 16 | nflags << 32
                if child is None:
                    raise _Unreadable("empty branch page in the main database")
                pgno = child
                continue
            for o, lo, hi, nflags, ksize in nodes:
                if page[o + 8 : o + 8 + ksize] == name and nflags & _F_SUBDATA:
                    dsize = lo | hi << 16
                    if dsize != 48:
                        raise _Unreadable(f"database record of {dsize} bytes")
                    return int(_U64.unpack_from(page, o + 8 + ksize + 40)[0])
            raise _Unreadable(f"no database named {name!r}")
        raise _Unreadable("main database deeper than LMDB allows")

    def _read_pages(self, pgnos: list[int]) -> list[bytes]:
        ps = self.psize
        for pgno in pgnos:  # many reads in flight: the walk is one round trip per level
            if (pgno + 1) * ps > self.size or pgno < 2:
                raise _Unreadable(f"page {pgno} is outside the file")
            os.posix_fadvise(self.fd, pgno * ps, ps, os.POSIX_FADV_WILLNEED)
        out = []
        for pgno in pgnos:
            page = os.pread(self.fd, ps, pgno * ps)
            if len(page) != ps or _U64.unpack_from(page, 0)[0] != pgno:
                raise _Unreadable(f"page {pgno} does not carry its own number")
            out.append(page)
        return out

    def _nodes(self, page: bytes) -> list[tuple[int, int, int, int, int]]:
        lower = _U16.unpack_from(page, _HDR - 4)[0]
        n = (lower - _HDR) >> 1
        if n < 0 or _HDR + 2 * n > self.psize:
            raise _Unreadable("page header out of bounds")
        out = []
        for ptr in struct.unpack_from(f"<{n}H", page, _HDR):
            if ptr + 8 > self.psize:
                raise _Unreadable("node out of bounds")
            lo, hi, nflags, ksize = struct.unpack_from("<4H", page, ptr)
            if ptr + 8 + ksize > self.psize:
                raise _Unreadable("key out of bounds")
            out.append((ptr, lo, hi, nflags, ksize))
        return out

    def _branch_children(self, page: bytes) -> list[int]:
        return [lo | hi << 16 | nflags << 32 for _, lo, hi, nflags, _ in self._nodes(page)]

    def _leaf_values(
        self, pgno: int, page: bytes, offsets: np.ndarray, lengths: np.ndarray, node_at: np.ndarray
    ) -> bool:
        """Index the leaf's values; whether every one lies in overflow pages of its own."""
        ps, n = self.psize, len(offsets)
        pointers_only = True
        for o, lo, hi, nflags, ksize in self._nodes(page):
            if ksize != 8:
                raise _Unreadable(f"key of {ksize} bytes, expected 8")
            sid = int.from_bytes(page[o + 8 : o + 16], "big")
            if sid >= n:
                raise _Unreadable(f"id {sid} beyond the store's {n} samples")
            if nflags & _F_BIGDATA:
                offsets[sid] = _U64.unpack_from(page, o + 16)[0] * ps + _HDR
            else:
                offsets[sid] = pgno * ps + o + 16
                pointers_only = False
            lengths[sid] = lo | hi << 16
            node_at[sid] = pgno * ps + o + 16
        return pointers_only
