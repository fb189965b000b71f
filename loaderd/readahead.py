"""Plan-aware read-ahead: the storage device busy far ahead of the trainers, within a budget.

The daemon knows every pass's order before it starts, so it need not wait for a trainer to
ask before a record is read. For each open pass (a *stream*: one rank's pass) this thread
walks the plan from the first batch not yet handed out and asks the kernel to read the
records of the next batches (``SampleStore.advise``: ``posix_fadvise(WILLNEED)`` on their byte
ranges in data.mdb), skipping what a cache tier holds: a batch held whole is passed over at
once and takes no room in the window, so a pass served from the cache costs this thread
nothing per batch, and the server loop wakes it only when room comes free. The kernel queues
all those reads at once, so the device sees many in flight while the assemblers copy what has
arrived; measured here, one thread advising 64 MiB ahead reads a cold store at 96 % of 32
threads issuing ``pread``, against 28 % for 32 threads faulting pages in through LMDB
(``docs/design.md``). A new pass first asks for the pages every lookup reads (``SampleStore.
advise_tree``): a cold leaf page faulted in by a reader is read on its own, behind the window.

The window is counted in bytes, not batches: the pages advised for batches not yet handed
out (whole pages; records stored close together are one range, the pages between them
counted: ``SampleStore.advise_bytes``) never exceed ``budget_bytes`` over all streams
(bounded memory with a store larger than RAM). Small records in a store that fits in memory
are asked for in aligned blocks (``SampleStore.read_unit``), each block once per pass and
counted whole in the window of the batch that first needs it: a few large reads instead of a
request per record, the block's other records cached before their turn (a batch whose blocks
would take over a quarter of the budget is asked for by its records' own pages). A stream
advances only when its pass does, so a trainer that stops mid-epoch leaves a full window and
nothing running; a stream that has not moved for ``idle_s`` gives its share back, and a
finished or forgotten pass ends its stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from loaderd.planner import RankPlan
from loaderd.storage.store import SampleStore

logger = logging.getLogger(__name__)

StreamKey = tuple[Any, ...]  # (job, rank, epoch, phase) from the server
Ranges = tuple[np.ndarray, np.ndarray]  # file (starts, lengths): ``SampleStore.advise_ranges``
# A batch is read in blocks only where its new blocks take at most this share of the budget;
# else its records' own pages are (a small budget still holds several batches ahead). The
# store's leaves of pointers are asked for at a pass's start only within the same share.
_BLOCK_SHARE = 4
# How often a paused read-ahead looks whether it may go on (only a load that stopped short
# ends a pause). Rarely: each time a thread of the daemon wakes it takes the GIL from the
# server loop, which on two busy cores waits about a millisecond to have it back. At 50 a
# second, 3 KB warm misses ran 2-9 % slower; at 500, half as fast.
_PAUSED_POLL_S = 1.0


@dataclass(slots=True)
class _Stream:
    plan: RankPlan
    head: int  # the first batch not yet handed out
    issued: int  # batches [head, issued) are advised (or cached)
    window: deque[tuple[int, int]] = field(default_factory=deque)  # (batch index, bytes)
    unmapped: deque[tuple[int, np.ndarray]] = field(default_factory=deque)  # advised, not mapped
    bytes: int = 0
    moved: float = field(default_factory=time.monotonic)
    mapped: bool = True  # its advised pages are mapped into this process too
    blocks: np.ndarray | None = None  # per ``read_unit`` block: asked for in this pass


# A batch to advise: its stream, its index, the ids to read, their bytes, blocks or ranges.
_Job = tuple[StreamKey, _Stream, int, np.ndarray, int, np.ndarray | None, Ranges | None]


class ReadAhead:
    """One thread that advises the store's records ahead of every open pass.

    Args:
        store: the store to read ahead in.
        cached: which of some ids a cache tier holds (those are not read ahead).
        budget_bytes: the most record bytes advised for batches not yet handed out; 0 turns
            read-ahead off.
        idle_s: a stream whose pass has not moved for this long gives its window back.
        reads_here: whether this process reads a stream's records (they are then mapped
            ahead, ``SampleStore.prefault``); not: a miss worker reads them through a map
            of its own, and mapping them here too would cost as much again. None: all.
        paused: while it says True, nothing is advised: the whole store is streaming into
            RAM in file order, or is there, locked (``TierStack.in_ram_whole``). Random reads
            of the same file would only slow that stream down for records it brings within
            the load, and once it is in there is nothing left to read.
    """

    def __init__(
        self,
        store: SampleStore,
        cached: Callable[[np.ndarray], np.ndarray],
        budget_bytes: int,
        idle_s: float = 60.0,
        reads_here: Callable[[StreamKey], bool] | None = None,
        paused: Callable[[], bool] | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"`budget_bytes` must be >= 0, got {budget_bytes}")
        self.store = store
        self.cached = cached
        self.budget_bytes = budget_bytes
        self.idle_s = idle_s
        self._reads_here = reads_here
        self._paused = paused
        self._streams: dict[StreamKey, _Stream] = {}
        self._ranks: dict[str, set[int]] = {}  # job -> every rank whose pass was followed
        self._bytes = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._mean = max(1, store.total_bytes // max(store.num_samples, 1))
        self.advised_bytes = 0
        self.advised_records = 0
        self.advise_calls = 0  # posix_fadvise calls: records stored close together share one
        self.cached_batches = 0  # batches passed over: a cache tier held all their records
        self.prefaulted_records = 0
        self.prefault_calls = 0
        self.tree_pages = 0  # pages of the store's tree asked for (``SampleStore.advise_tree``)
        self._tree_due = False  # a new pass: ask for the tree before its records
        self.peak_bytes = 0
        self.busy = False
        self._warned = False
        self._failed_kinds: set[tuple[str, str]] = set()  # logged with a traceback once
        self.indexed = False  # byte ranges known (posix_fadvise), else records are touched
        self.prefaulting = False  # advised pages are mapped ahead (MADV_POPULATE_READ)
        self._thread: threading.Thread | None = None
        if budget_bytes > 0:
            self._thread = threading.Thread(target=self._run, name="loaderd-readahead", daemon=True)
            self._thread.start()

    # --- the server loop's side ---------------------------------------------------------------

    def follow(self, key: StreamKey, plan: RankPlan, head: int) -> None:
        """Pass ``key`` will hand out its batches from ``head`` on, in plan order."""
        if self._thread is None:
            return
        with self._cond:
            if isinstance(key, tuple) and len(key) >= 2:  # the server's (job, rank, ...)
                self._ranks.setdefault(key[0], set()).add(key[1])
            s = self._streams.get(key)
            wake = True
            if s is None or s.plan is not plan:
                if s is not None:
                    self._bytes -= s.bytes
                mapped = self._reads_here is None or self._reads_here(key)
                s = self._streams[key] = _Stream(plan, head, head, mapped=mapped)
                self._tree_due = True
                if self.store.read_unit:
                    s.blocks = np.zeros(self.store.file_blocks, bool)
            elif head != s.head:
                s.head, s.moved = head, time.monotonic()
                freed = 0
                while s.window and s.window[0][0] < head:
                    freed += s.window.popleft()[1]
                s.bytes -= freed
                self._bytes -= freed
                while s.unmapped and s.unmapped[0][0] < head:
                    s.unmapped.popleft()  # handed out: its reader mapped it already
                # The thread has something new to do only when room came free (or it was
                # behind the head); a pass served from the cache wakes it for nothing.
                wake = freed > 0 or s.issued < head
                s.issued = max(s.issued, head)
            else:
                wake = False
            if head >= plan.num_batches:
                self._end(key)
            if wake:
                self._cond.notify()

    def set_budget(self, budget_bytes: int) -> None:
        """Change the window's bound while serving (``serve --autotune``).

        A lower bound takes effect as the passes move: what was advised stays in the page
        cache, and nothing more is advised until the window is below the new bound.
        """
        if budget_bytes < 0:
            raise ValueError(f"`budget_bytes` must be >= 0, got {budget_bytes}")
        with self._cond:
            self.budget_bytes = budget_bytes
            self._warned = False
            self._cond.notify()

    def drop(self, predicate: Callable[[StreamKey], bool]) -> None:
        """End every stream whose key matches (its pass is over or forgotten)."""
        with self._cond:
            for key in [k for k in self._streams if predicate(k)]:
                self._end(key)

    def _end(self, key: StreamKey) -> None:
        s = self._streams.pop(key)
        self._bytes -= s.bytes

    # --- the thread ---------------------------------------------------------------------------

    def _next(self) -> _Job | None:
        """The batch to advise next: of the stream least far ahead, if it fits the budget.

        Returns its records that no cache tier holds, their bytes, and the blocks to ask for
        where small records are read in blocks (``SampleStore.read_unit``: those not asked for
        earlier in the pass, so a block's bytes count once), else their byte ranges; a batch
        the cache holds whole takes no room in the window (its stream is claimed past it by
        the caller).
        """
        now = time.monotonic()
        for key in [k for k, s in self._streams.items() if now - s.moved > self.idle_s]:
            logger.info("read-ahead: pass %s has not moved for %.0f s, parked", key, self.idle_s)
            self._end(key)
        open_ = [(s.bytes, k) for k, s in self._streams.items() if s.issued < s.plan.num_batches]
        if not open_:
            return None
        _, key = min(open_, key=lambda t: t[0])
        s = self._streams[key]
        index = s.issued
        ids = s.plan.batch(index)[0]
        ids = ids[~self.cached(ids)]
        if not len(ids):
            return key, s, index, ids, 0, None, None
        blocks = None if s.blocks is None else self.store.read_blocks(ids)
        ranges = None
        if blocks is not None:
            assert s.blocks is not None
            blocks = blocks[~s.blocks[blocks]]
            need = len(blocks) * self.store.read_unit
            if need > self.budget_bytes // _BLOCK_SHARE:  # the window would hold too few batches
                blocks = None
        if blocks is None:  # whole pages, and the pages a joined range spans
            ranges = self.store.advise_ranges(ids)
            need = (0 if ranges is None else int(ranges[1].sum())) or self._mean * len(ids)
        if self._bytes + need > self.budget_bytes:
            if not self._bytes and not self._warned:
                self._warned = True
                logger.warning(
                    "read-ahead budget of %d bytes holds less than one batch (%d bytes): "
                    "nothing is read ahead (raise --readahead-bytes)",
                    self.budget_bytes,
                    need,
                )
            return None
        return key, s, index, ids, need, blocks, ranges

    def _next_unmapped(self) -> tuple[StreamKey, np.ndarray] | None:
        """The advised batch to map next: the one nearest its pass's head, of all streams."""
        best: tuple[int, StreamKey] | None = None
        for key, s in self._streams.items():
            if s.unmapped and (best is None or s.unmapped[0][0] - s.head < best[0]):
                best = (s.unmapped[0][0] - s.head, key)
        return None if best is None else (best[1], self._streams[best[1]].unmapped.popleft()[1])

    def _run(self) -> None:
        indexed = self.store.value_index is not None  # built here, off the serving path
        self.prefaulting = indexed and self.store.prefaulting
        self.indexed = indexed
        while not self._stop.is_set():
            if self._paused is not None and self._paused():
                self._stop.wait(_PAUSED_POLL_S)
                continue
            with self._cond:
                tree, self._tree_due = self._tree_due, False
            if tree:
                self._advise_tree()
            with self._cond:
                job = self._next()
                # Mapping waits for the reads, so it comes after the whole window is advised.
                mapping = None if job is not None else self._next_unmapped()
                self.busy = job is not None or mapping is not None
                if not self.busy:
                    self._cond.wait(timeout=1.0)
                    continue
                if job is not None:
                    key, s, index, todo, need, blocks, ranges = job
                    s.issued = index + 1  # claimed: the server thread may move the head meanwhile
                    if not len(todo):
                        self.cached_batches += 1
                        continue
                    if blocks is not None and s.blocks is not None:
                        s.blocks[blocks] = True
            if mapping is not None:
                self._map(*mapping)
                continue
            done, calls = self._attempt(
                "read-ahead", key, partial(self.store.advise, blocks=blocks, ranges=ranges), todo
            )
            with self._cond:
                if self._streams.get(key) is s and index >= s.head:
                    s.window.append((index, need))
                    s.bytes += need
                    self._bytes += need
                    self.peak_bytes = max(self.peak_bytes, self._bytes)
                    if done and self.prefaulting and s.mapped:
                        s.unmapped.append((index, todo))
                self.advised_bytes += done
                self.advised_records += len(todo)
                self.advise_calls += calls

    def _advise_tree(self) -> None:
        """Ask for the pages every lookup reads, ahead of a new pass's records."""
        try:
            pages = self.store.advise_tree(self.budget_bytes // _BLOCK_SHARE)
        except Exception:
            logger.exception("read-ahead of the store's tree pages failed; going on without it")
            return
        with self._cond:
            self.tree_pages += pages

    def _map(self, key: StreamKey, ids: np.ndarray) -> None:
        """Map an advised batch's pages into the daemon (``SampleStore.prefault``)."""
        records, calls = self._attempt("prefault", key, self.store.prefault, ids)
        with self._cond:
            self.prefaulted_records += records
            self.prefault_calls += calls

    def _attempt(
        self,
        what: str,
        key: StreamKey,
        call: Callable[[np.ndarray], tuple[int, int]],
        ids: np.ndarray,
    ) -> tuple[int, int]:
        """``call(ids)``; a failure counts as nothing done: serving goes on.

        Each kind of failure is logged once with its traceback, later ones at debug level: a
        damaged store fails every batch alike, hundreds of times a second, and serving
        reports each batch's error itself.
        """
        try:
            return call(ids)
        except Exception as e:
            kind = (what, type(e).__name__)
            if kind in self._failed_kinds:
                logger.debug("%s of pass %s failed again: %s", what, key, e)
            else:
                self._failed_kinds.add(kind)
                logger.exception("%s of pass %s failed; going on without it", what, key)
            return 0, 0

    # --- the rest -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The ``readahead`` section of STATS.

        ``ranks``: per job, every rank whose passes this daemon has read ahead since it started
        (on a node of a cluster, only the ranks that node serves).
        """
        with self._cond:
            return {
                "budget_bytes": self.budget_bytes,
                "window_bytes": self._bytes,
                "peak_window_bytes": self.peak_bytes,
                "advised_bytes": self.advised_bytes,
                "advised_records": self.advised_records,
                "advise_calls": self.advise_calls,
                "advice_skipped": self.store.advice_skipped,
                "cached_batches": self.cached_batches,
                "prefaulted_records": self.prefaulted_records,
                "prefault_calls": self.prefault_calls,
                "tree_pages": self.tree_pages,
                "streams": len(self._streams),
                "busy": self.busy,
                "indexed": self.indexed,
                "prefaulting": self.prefaulting and self.store.prefaulting,
                "read_unit_bytes": self.store.read_unit if self.indexed else 0,
                "ranks": {job: sorted(r) for job, r in self._ranks.items()},
            }

    def close(self) -> None:
        """Stop the thread (safe to call twice)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
