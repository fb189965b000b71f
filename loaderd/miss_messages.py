"""What goes between the daemon and a miss worker (``miss_workers.py``): a batch and its answer.

Packed by hand: pickling a batch's numpy arrays took about 11 us a message each way, on the
server loop and in the worker, where this takes about one.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from loaderd.storage.tiers import ArenaLoan

# slot, samples, bytes of the ring names, 1 with spans, bytes of the arena key, 1 from the map
_TASK = struct.Struct("<qqqqqq")
_OK = struct.Struct("<qq")  # frames, samples; ``_OK_TAG`` before it, a pickle otherwise
_OK_TAG = b"k"

# A batch's arena records: "device:inode:path" of the arena file, payload offsets (-1: read
# from the store) and lengths.
ArenaSpans = tuple[str, np.ndarray, np.ndarray]


def encode_task(
    ring: str,
    slot: int,
    ids: np.ndarray,
    weights: np.ndarray,
    live: Iterable[str],
    spans: tuple[np.ndarray, np.ndarray] | None,
    arena: ArenaSpans | None = None,
    from_map: bool = False,
) -> bytes:
    """A batch for a worker: the slot of ``ring`` to fill, and the rings in use.

    ``spans``: where each record lies in the file (``SampleStore.sliceable_spans``), if known;
    ``arena``: the records it copies from the arena file instead (``arena_spans``);
    ``from_map``: records read into rows are copied from its map of the file
    (``miss_worker._fill``).
    """
    names = "\n".join([ring, *live]).encode()  # the daemon names its rings: no newline
    key = b"" if arena is None else arena[0].encode()
    parts = [
        _TASK.pack(slot, len(ids), len(names), spans is not None, len(key), from_map),
        names,
        np.asarray(ids, np.int64).tobytes(),
        np.asarray(weights, np.float32).tobytes(),
    ]
    if spans is not None:
        parts += [np.asarray(a, np.int64).tobytes() for a in spans]
    if arena is not None:
        parts += [key, *(np.asarray(a, np.int64).tobytes() for a in arena[1:])]
    return b"".join(parts)


def arena_spans(loan: ArenaLoan | None) -> ArenaSpans | None:
    """What a worker needs of a loan: the file (to check it maps the daemon's) and spans."""
    if loan is None:
        return None
    dev, ino = loan.file_id
    return f"{dev}:{ino}:{loan.path}", loan.offsets, loan.lengths


def decode_task(
    raw: bytes,
) -> tuple[
    str,
    int,
    np.ndarray,
    np.ndarray,
    list[str],
    tuple[np.ndarray, np.ndarray] | None,
    ArenaSpans | None,
    bool,
]:
    """(ring, slot, ids, weights, live rings, spans, arena spans, from map) of ``encode_task``."""
    slot, n, k, has_spans, a, from_map = _TASK.unpack_from(raw)
    pos = _TASK.size
    ring, *live = raw[pos : pos + k].decode().split("\n")
    pos += k
    ids = np.frombuffer(raw, np.int64, n, pos)
    weights = np.frombuffer(raw, np.float32, n, pos + 8 * n)
    pos += 12 * n
    spans = None
    if has_spans:
        spans = np.frombuffer(raw, np.int64, n, pos), np.frombuffer(raw, np.int64, n, pos + 8 * n)
        pos += 16 * n
    arena = None
    if a:
        key = raw[pos : pos + a].decode()
        pos += a
        arena = (
            key,
            np.frombuffer(raw, np.int64, n, pos),
            np.frombuffer(raw, np.int64, n, pos + 8 * n),
        )
    return ring, slot, ids, weights, live, spans, arena, bool(from_map)


def encode_reply(reply: tuple[Any, ...]) -> bytes:
    """("ok", sizes, offsets, lengths) packed; a failure (reason, message) pickled."""
    if reply[0] != "ok":
        return pickle.dumps(reply)
    _, sizes, offsets, lengths = reply
    return b"".join(
        [
            _OK_TAG,
            _OK.pack(len(sizes), len(offsets)),
            np.asarray(sizes, np.int64).tobytes(),
            np.asarray(offsets, np.int64).tobytes(),
            np.asarray(lengths, np.int64).tobytes(),
        ]
    )


def decode_reply(raw: bytes) -> tuple[Any, ...]:
    """The tuple ``encode_reply`` was given (sizes as a list of ints)."""
    if raw[:1] != _OK_TAG:
        reply: tuple[Any, ...] = pickle.loads(raw)
        return reply
    k, n = _OK.unpack_from(raw, 1)
    pos = 1 + _OK.size
    sizes = np.frombuffer(raw, np.int64, k, pos).tolist()
    pos += 8 * k
    offsets = np.frombuffer(raw, np.int64, n, pos)
    return ("ok", sizes, offsets, np.frombuffer(raw, np.int64, n, pos + 8 * n))
