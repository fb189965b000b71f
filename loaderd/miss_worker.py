"""A miss worker process: read, verify and copy a batch into its ring slot, and answer.

Forked by the daemon's ``Forker`` (``miss_workers.py``), which this module's ``fork_workers``
runs as: a single-threaded process that forks one worker per request. A worker opens the
store read-only, maps the rings (and the arena file) the daemon names, and serves until its
socket to the daemon closes.
"""

from __future__ import annotations

import mmap
import os
import signal
import socket
import struct
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import numpy as np

from loaderd.client.shm import ShmRing, layout_bytes, slot_layout
from loaderd.miss_messages import decode_task, encode_reply
from loaderd.prefetch import BatchWriter
from loaderd.storage.row_reads import worth_reading
from loaderd.storage.store import SampleStore


def _fill(
    store: SampleStore,
    writer: BatchWriter,
    ring: ShmRing,
    slot: int,
    ids: np.ndarray,
    weights: np.ndarray,
    spans: tuple[np.ndarray, np.ndarray] | None,
    arena: tuple[memoryview, np.ndarray, np.ndarray] | None = None,
    from_map: bool = False,
) -> tuple[Any, ...]:
    """Read, verify and copy one batch into a slot; ("ok", sizes, offsets, lengths).

    ``spans``: where each record lies in the file (``SampleStore.sliceable_spans``), each
    slice verified against its sample's checksum; None: each is read through LMDB, and its
    offset found from where it lies in the map. ``arena``: this process's map of the arena
    file, and where the records lent from it lie (offset -1: read from the store); each is
    verified against its sample's checksum as well. The offset answered for those is -1.
    ``from_map``: records read into rows are copied from this process's map of the file.
    """
    if spans is not None and reads_rows(writer, spans[1]):
        # Large records of fixed fields: read from the file (or copied from the arena's map:
        # an arena record is the store's) into the slot's rows, and verified there.
        sizes = writer.frame_sizes(len(ids))
        frames = _slot_frames(ring, slot, sizes)
        if frames is None:
            return ("full", f"the batch needs {layout_bytes(sizes)} bytes")
        offsets, lengths = spans
        answered, elsewhere = offsets, None  # an arena record's file offset is answered -1
        if arena is not None:
            mapped, at, _ = arena
            lent = at >= 0
            elsewhere = ("the arena", mapped, lent)
            offsets, answered = np.where(lent, at, offsets), np.where(lent, -1, offsets)
        read = partial(
            store.read_rows, ids, offsets, lengths, from_map=from_map, elsewhere=elsewhere
        )
        writer.fill_read(ids, weights, frames, read)
        return ("ok", sizes, answered, lengths)
    here = np.ones(len(ids), bool) if arena is None else arena[1] < 0
    mine = ids[here]
    with (
        store.views(mine) if spans is None else store.views_at(mine, spans[0][here], spans[1][here])
    ) as from_store:
        records = from_store if arena is None else _with_arena(store, ids, here, from_store, arena)
        sizes, parts = writer.measure(records)
        frames = _slot_frames(ring, slot, sizes)
        if frames is None:
            return ("full", f"the batch needs {layout_bytes(sizes)} bytes")
        writer.fill(ids, weights, records, parts, frames)
        offsets = np.full(len(ids), -1, np.int64)
        if spans is not None:
            offsets[here] = spans[0][here]
        elif (found := store.file_offsets(from_store)) is not None:
            offsets[here] = found  # else -1: the daemon then reads them itself
        lengths = np.fromiter((r.nbytes for r in records), np.int64, len(ids))
    return ("ok", sizes, offsets, lengths)


def reads_rows(writer: BatchWriter, lengths: np.ndarray) -> bool:
    """Whether records of these lengths are read into their rows (``row_reads.py``).

    Large records of a schema without variable-length fields, each as long as the schema
    makes every record: one of another length is damaged (its leaf, or the index), and is
    sliced as before, where its checksum reports it without a buffer sized by the damage.
    """
    size = writer.layout.record_bytes
    if size is None or not worth_reading(size, len(writer.layout.fixed)):
        return False
    return bool(len(lengths) and (lengths == size).all())


def _slot_frames(ring: ShmRing, slot: int, sizes: list[int]) -> list[memoryview] | None:
    """The slot's frames for a batch of these frame sizes; None: it does not fit the slot."""
    if layout_bytes(sizes) > ring.slot_bytes:
        return None
    return [ring.view(slot, off, n) for off, n in slot_layout(sizes)]


def _with_arena(
    store: SampleStore,
    ids: np.ndarray,
    here: np.ndarray,
    from_store: list[memoryview],
    arena: tuple[memoryview, np.ndarray, np.ndarray],
) -> list[memoryview]:
    """The batch's records in order: the store's, and the arena's, verified here."""
    mapped, offsets, lengths = arena
    lent = ~here
    starts, ends = offsets[lent], offsets[lent] + lengths[lent]
    if int(ends.max()) > len(mapped):
        raise ValueError(f"an arena record ends at {int(ends.max())}, past its file")
    from_arena = [mapped[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    store.verify(from_arena, ids[lent])
    theirs, ours = iter(from_arena), iter(from_store)
    return [next(theirs) if x else next(ours) for x in lent.tolist()]


def _map_arena(key: str) -> memoryview:
    """The daemon's arena file ("device:inode:path"), mapped read-only, checked to be it."""
    dev, ino, path = key.split(":", 2)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (int(dev), int(ino)):
            raise ValueError(f"{path} is no longer the daemon's arena")
        return memoryview(mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def serve(conn: Connection, store_path: str) -> None:
    """A worker's loop: batches in, ("ok", ...) or (reason, message) out, until EOF."""
    try:
        store = SampleStore(store_path, check_damaged=False)  # takes() sends none
        writer = BatchWriter(store.schema)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    rings: dict[str, ShmRing] = {}
    arenas: dict[str, memoryview] = {}  # one: the daemon's arena is the same for its life
    while True:
        try:
            ring_name, slot, ids, weights, live, spans, lent, from_map = decode_task(
                conn.recv_bytes()
            )
        except (EOFError, OSError):
            break
        for name in [n for n in rings if n not in live]:
            rings.pop(name).close()
        try:
            ring = rings.get(ring_name)
            if ring is None:
                ring = rings[ring_name] = ShmRing.attach(ring_name)
            arena = None
            if lent is not None:
                key, offsets, lengths = lent
                if key not in arenas:
                    arenas.clear()
                    arenas[key] = _map_arena(key)
                arena = arenas[key], offsets, lengths
            reply = _fill(store, writer, ring, slot, ids, weights, spans, arena, from_map)
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send_bytes(encode_reply(reply))
    for ring in rings.values():
        ring.close()
    store.close()


def fork_workers(sock: socket.socket, store_path: str) -> NoReturn:
    """The forker's loop: one worker forked per request, until the daemon's socket closes."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)  # the daemon's handlers are not ours
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    code = 0
    try:
        while True:
            msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
            if not msg or not fds:
                break
            pid = os.fork()
            if pid == 0:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                try:
                    serve(Connection(fds[0]), store_path)
                finally:
                    os._exit(0)
            os.close(fds[0])
            sock.sendall(struct.pack("<q", pid))
    except BaseException:
        code = 1
    os._exit(code)
