"""Batches that miss DRAM, assembled in worker processes beside the daemon's interpreter.

A miss costs reads through LMDB, checksums and copies. In the daemon they share one GIL with
the server loop, the read-ahead and DRAM admission, and the threads' waits to win it back
cost more than the work: a warm miss used about 100 us of daemon CPU per 100 KB record where
the work itself takes 17 (``benchmarks/bench_miss_workers.py``: one thread 60k records/s,
two threads 46k, two processes 104k). So a batch bound for a shared-memory ring that misses
DRAM is read, verified and copied into its slot by a worker process that opens the same store
read-only and maps the same ring. The daemon lends the slot, and afterwards accounts for the
read (``TierStack.read_elsewhere``): hits and misses as the policy sees them, and DRAM
admission of the records at the file offsets the worker found them at, sliced from the
daemon's own map of the same pages (no second read, no second checksum).

The server loop drives the workers itself: it sends a batch to a worker with room and takes
the answer when its poll finds the worker's socket readable. A prefetch thread blocked on a
worker had to win the GIL back from the loop for every batch, a handover of the lock (and a
context switch) each way; the loop only does work that is ready. Each worker holds up to
``PIPELINE`` batches, so that it finds the next one waiting when it finishes one.

A batch with records in the NVRAM arena goes to a worker too: the daemon lends it those
records (``Arena.lend``: the ring does not overwrite them until the worker has answered or is
gone), and the worker copies them out of its own read-only map of the arena file, which it
first checks is the daemon's (device and inode), verifying each against its sample's
checksum. Those still queued for the arena it reads from the store: the same bytes.

Everything else is assembled in the daemon as before, with the same bytes and the same
errors: a batch for the socket, one larger than its slot, one a worker failed on (a bad
record is then reported by the daemon's own read), or a batch whose worker died (another is
started; after ``_MAX_FAILED_STARTS`` failed starts in a row the pool turns itself off).
Workers are forked by a process the daemon forks at its start (``Forker``), and exit when
their socket to the daemon closes: none outlives it. A worker's own loop is
``miss_worker.py``; what goes between it and the daemon, ``miss_messages.py``.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from loaderd.miss_messages import arena_spans, decode_reply, encode_task
from loaderd.miss_worker import fork_workers, reads_rows
from loaderd.prefetch import Allocate, Batch, BatchWriter
from loaderd.shm_delivery import BlankSlot, RingAllocator
from loaderd.storage.memory import memory_total
from loaderd.storage.tiers import ArenaLoan, TierStack

logger = logging.getLogger(__name__)

_MAX_FAILED_STARTS = 3
# Workers copy records from maps of the file (``SampleStore.read_rows``) only of a file this
# share of the daemon's memory (the machine's, or its cgroup's limit) can hold, and no larger
# than this: a page the page cache lets go is mapped again at the next read, and a worker's
# page tables for a map it has read whole take 2 MiB a GiB.
MAP_COPY_SHARE = 0.5
MAP_COPY_MAX_BYTES = 64 << 30
# Batches a worker holds at once: one it assembles, the rest waiting in its socket, so that
# it does not sleep between batches while the server loop, which shares the cores with the
# workers, has not yet had its turn to take an answer and send the next one. On 2 cores,
# holding two, a worker waited a third of a warm miss; four ran it 13 % faster and a store
# four times DRAM 11 % (``benchmarks/results/pipeline.md``).
PIPELINE = 4


@dataclass(slots=True)
class _Worker:
    pid: int
    conn: Connection

    def stop(self) -> None:
        """Close its socket: the worker sees EOF and exits (its parent reaps it)."""
        self.conn.close()


@dataclass(slots=True)
class Flight:
    """A batch a worker is assembling: its worker, its slot and its ids."""

    worker: _Worker
    blank: BlankSlot
    ids: np.ndarray
    loan: ArenaLoan | None = None  # its arena records, kept whole until the worker is done

    def fileno(self) -> int:
        """The worker's socket: readable once its answer is there (or it died)."""
        return self.worker.conn.fileno()


class Forker:
    """A process forked before the daemon starts a thread, that forks miss workers for it.

    A worker started as a new Python process imports numpy and pyarrow again: about half a
    second of CPU. Forked from this one, which has them imported already, it starts in a
    few milliseconds. The daemon itself cannot fork once its threads run (a lock one of
    them holds would stay held in the child), so this process is forked first, from the
    single thread the daemon has at the start, and stays single-threaded. It reaps its
    children, and exits (they too) when its socket to the daemon closes.
    """

    def __init__(self, store_path: str) -> None:
        ours, theirs = socket.socketpair()
        self._lock = threading.Lock()
        self.pid = os.fork()
        if self.pid == 0:  # the forker
            ours.close()
            fork_workers(theirs, store_path)  # never returns
        theirs.close()
        self._sock = ours

    @classmethod
    def start(cls, store_path: str) -> Forker | None:
        """The forker, or None where forking is not safe (this process runs threads)."""
        if threading.active_count() > 1:
            logger.warning(
                "no miss workers: this process runs %d threads, so it cannot fork safely",
                threading.active_count(),
            )
            return None
        return cls(store_path)

    def fork(self) -> _Worker | None:
        """A new worker (it opens the store itself); None if the forker is gone."""
        ours, theirs = socket.socketpair()
        try:
            with self._lock:
                socket.send_fds(self._sock, [b"w"], [theirs.fileno()])
                raw = self._sock.recv(8)
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        if len(raw) != 8:
            ours.close()
            return None
        return _Worker(struct.unpack("<q", raw)[0], Connection(ours.detach()))

    def close(self) -> None:
        """Close the socket: the forker exits, and is reaped here (within a second)."""
        self._sock.close()
        for _ in range(100):
            try:
                if os.waitpid(self.pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:
                return
            time.sleep(0.01)


class MissWorkers:
    """Up to ``procs`` worker processes that assemble misses into ring slots (``Elsewhere``).

    Workers start in the background when a shared-memory consumer first says HELLO, or
    when a batch finds fewer than ``procs`` (the daemon assembles until one is ready). The
    server loop hands batches out (``send``) and takes the answers (``finish``) as its poll
    finds them (``Prefetcher.landed``); no thread waits on a worker.

    Args:
        tiers: the daemon's tier stack (what may go to a worker, and the accounting after).
        writer: the batch layout (the daemon's ``Assembler``).
        forker: forks the workers (``Forker.start``, early); None: there are none.
        rings: the names of the rings in use (a worker unmaps the others).
    """

    def __init__(
        self,
        tiers: TierStack,
        writer: BatchWriter,
        procs: int,
        forker: Forker | None,
        rings: Callable[[], Sequence[str]],
    ) -> None:
        self._forker = forker
        self._tiers = tiers
        self._writer = writer
        self.procs = procs
        self._rings = rings
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        self._free: list[_Worker] = []  # one entry per batch a worker can take now
        self._starting = 0
        self._failed_starts = 0
        self._closed = False
        size = tiers.store.file_bytes
        self._map_fits = size <= min(memory_total() * MAP_COPY_SHARE, MAP_COPY_MAX_BYTES)
        self.batches = 0  # assembled by a worker
        self.sliced = 0  # of them, sent with their records' offsets (no LMDB lookup there)
        self.read = 0  # of those, read from the file into their slot (``row_reads.py``)
        self.copied = 0  # of those, copied from the worker's map of the file
        self.from_arena = 0  # of them, sent with arena records lent to the worker
        self.fallbacks = 0  # given to a worker, assembled by the daemon after all
        self.started = 0  # worker processes started
        self.lost = 0  # worker processes that died or broke their socket

    @property
    def enabled(self) -> bool:
        """Whether batches go to workers (off: none allowed, or they failed to start)."""
        return (
            self.procs > 0
            and self._forker is not None
            and self._failed_starts < _MAX_FAILED_STARTS
            and not self._closed
        )

    def takes(self, ids: np.ndarray, allocate: Allocate | None) -> bool:
        """Whether this batch may go to a worker: bound for a ring slot, and not all in DRAM.

        A batch DRAM holds whole is the daemon's to copy from DRAM: a worker would read the
        store's pages again, from the disk where they are not cached. A batch with a record
        damaged past the end of the file is the daemon's to refuse (reading it would fault).
        """
        return (
            isinstance(allocate, RingAllocator)
            and self.enabled
            and len(ids) > 0
            and not self._tiers.in_dram(ids)
            and self._tiers.store.unreachable(ids) is None
        )

    @property
    def idle(self) -> int:
        """Batches the workers can take now (each holds up to ``PIPELINE``)."""
        return len(self._free) if self.enabled else 0

    @property
    def running(self) -> int:
        """Workers started and not lost."""
        return len(self._all) if self.enabled else 0

    def send(
        self, ids: np.ndarray, weights: np.ndarray, allocate: Allocate | None
    ) -> Flight | None:
        """Hand this batch to a worker and return at once (``finish`` takes its answer).

        Not taken, the daemon assembles it: a batch not bound for a ring, one the store
        cannot hand to another process (``TierStack.readable_elsewhere``), a full ring, no
        worker free, or one whose socket broke.

        Args:
            ids: the batch's sample ids.
            weights: their weights.
            allocate: where the batch goes (a ring's ``RingAllocator``).

        Returns:
            The batch under way; None: not taken, nothing held.
        """
        if not isinstance(allocate, RingAllocator) or not self.enabled:
            return None
        readable = self._tiers.readable_elsewhere(ids)
        if readable is None:
            return None
        missing, loan = readable
        if not len(missing) and loan is None:
            return None  # (since ``takes``) all in DRAM
        worker = self._take()
        if worker is None:
            return self._unlend(loan)
        # A batch known to be larger than the job's slots gets a larger ring's, or none:
        # a worker would read and verify it only to answer that it does not fit.
        store = self._tiers.store
        spans = store.sliceable_spans(ids)  # the worker slices these without LMDB's help
        known = int(spans[1].sum()) if spans is not None else store.known_bytes(ids)
        least = 0 if known is None else self._writer.frame_bytes(len(ids), known)
        blank = allocate.lend(least)
        if blank is None:
            self._give(worker)
            return self._unlend(loan)
        # A cold batch's reads go out together (those of records a tier holds need none).
        store.advise_known(missing.tolist())
        rows = spans is not None and reads_rows(self._writer, spans[1])
        from_map = rows and self._copies_from_map()
        try:
            worker.conn.send_bytes(
                encode_task(
                    blank.ring.name,
                    blank.slot,
                    ids,
                    weights,
                    self._rings(),
                    spans,
                    arena_spans(loan),
                    from_map,
                )
            )
        except (EOFError, OSError):
            blank.release()
            self._lose(worker)
            self.fallbacks += 1
            return self._unlend(loan)
        except BaseException:
            blank.release()
            self._give(worker)
            self._unlend(loan)
            raise
        self.sliced += spans is not None
        self.read += rows
        self.copied += from_map
        self.from_arena += loan is not None
        return Flight(worker, blank, ids, loan)

    def _copies_from_map(self) -> bool:
        """Whether a worker copies records from its map of the file rather than read them.

        A map pays from the second read of a record on: the first maps its pages, the next
        costs a copy and no system call, where ``preadv`` costs the kernel's copy each time
        (at 100 KB, a worker's 12-13 us a record against 8-9 once mapped; 15 the first time).
        So not where DRAM holds the whole store (``TierStack.in_ram_whole``): workers read
        each record of it once. And only a file the page cache can keep (``_map_fits``).
        """
        return self._map_fits and not self._tiers.in_ram_whole

    @staticmethod
    def _unlend(loan: ArenaLoan | None) -> None:
        if loan is not None:
            loan.release()

    def finish(self, flight: Flight) -> Batch | None:
        """The batch a worker assembled; None: assemble it here.

        Called once its socket is readable (or its worker is gone): the answer is there and
        this does not wait. A worker answers its batches in the order they were sent. The
        slot is given back when the worker failed on the batch or died; the records are
        accounted for (``TierStack.read_elsewhere``) when it did not.
        """
        worker, blank = flight.worker, flight.blank
        try:
            reply = decode_reply(worker.conn.recv_bytes())
        except (EOFError, OSError):
            self._lose(worker)
            reply = ("lost", "the worker is gone")
        except BaseException:
            blank.release()
            self._give(worker)
            raise
        else:
            self._give(worker)
        finally:
            self._unlend(flight.loan)  # answered or gone: it reads no more of them
        if reply[0] != "ok":
            logger.debug("a miss worker did not assemble a batch: %s", reply[1])
            blank.release()
            self.fallbacks += 1
            return None
        try:
            _, sizes, offsets, lengths = reply
            placed = blank.place(sizes)
            self._tiers.read_elsewhere(flight.ids, offsets, lengths)
        except BaseException:
            blank.release()
            raise
        self.batches += 1
        return self._writer.wrap(placed.frames, placed.lease)

    def gone(self, flight: Flight) -> bool:
        """Whether the batch's worker is gone (it answers none of its other batches)."""
        return flight.worker.conn.closed

    def abandon(self, flight: Flight) -> None:
        """Give up on a batch under way (the daemon is closing): its slot and its worker."""
        flight.blank.release()
        self._lose(flight.worker, quiet=True)
        self._unlend(flight.loan)

    # --- the processes ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers not running, in the background (a shm consumer said HELLO)."""
        with self._lock:
            while self.enabled and len(self._all) + self._starting < self.procs:
                self._start_one()

    def _start_one(self) -> None:
        """Start one more worker on a thread of its own (the lock is held)."""
        self._starting += 1
        threading.Thread(target=self._add, name="loaderd-miss-start", daemon=True).start()

    def _take(self) -> _Worker | None:
        """A worker with room for one more batch; None: none has.

        Fewer than ``procs`` running (one died), one more is started in the background
        (a process start takes a good part of a second): the batches meanwhile are the
        daemon's.
        """
        with self._lock:
            if not self.enabled:
                return None
            if len(self._all) + self._starting < self.procs:
                self._start_one()
            return self._free.pop() if self._free else None

    def _add(self) -> None:
        worker = None
        try:
            worker = self._start()
        finally:
            with self._lock:
                self._starting -= 1
                if worker is None:
                    self._failed_starts += 1
                elif self._closed:
                    worker.stop()
                else:
                    self._failed_starts = 0
                    self._all.append(worker)
                    self._free += [worker] * PIPELINE

    def _start(self) -> _Worker | None:
        forker = self._forker
        worker = forker.fork() if forker is not None else None
        if worker is None:
            logger.warning("cannot start a miss worker: the process that forks them is gone")
            return None
        try:
            hello = worker.conn.recv()
        except (EOFError, OSError):
            hello = ("error", "it exited")
        if hello[0] != "ready":
            logger.warning("a miss worker failed to start: %s", hello[1])
            worker.stop()
            return None
        self.started += 1
        logger.info("miss worker %d started", worker.pid)
        return worker

    def _give(self, worker: _Worker) -> None:
        """Its room for one more batch is free again (unless it is lost meanwhile)."""
        with self._lock:
            if self._closed:
                worker.stop()
            elif worker in self._all:
                self._free.append(worker)

    def _lose(self, worker: _Worker, quiet: bool = False) -> None:
        """It died or its socket broke (or the daemon gives up on it): stopped, not counted."""
        with self._lock:
            if worker not in self._all:
                return  # lost already (a second batch it held found out too)
            self._all.remove(worker)
            self._free = [w for w in self._free if w is not worker]
        if not quiet:
            logger.warning("miss worker %d is gone", worker.pid)
            self.lost += 1
        worker.stop()

    def pids(self) -> list[int]:
        """The worker processes' pids (for stats and tests)."""
        with self._lock:
            return [w.pid for w in self._all]

    def stats(self) -> dict[str, Any]:
        """The ``miss_workers`` entry of the prefetch stats."""
        pids = self.pids()
        return {
            "procs": self.procs,
            "enabled": self.enabled,
            "running": len(pids),
            "pids": pids,
            "forker": self._forker.pid if self._forker is not None else None,
            "started": self.started,
            "lost": self.lost,
            "batches": self.batches,
            "sliced": self.sliced,
            "read": self.read,
            "copied": self.copied,
            "from_arena": self.from_arena,
            "fallbacks": self.fallbacks,
        }

    def close(self) -> None:
        """Stop the workers (busy ones when their batch is done); safe to call twice."""
        with self._lock:
            self._closed = True
            idle = list({id(w): w for w in self._free}.values())
            self._free = []
        for worker in idle:
            worker.stop()
        if self._forker is not None:
            self._forker.close()
