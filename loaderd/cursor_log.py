"""The cursor log: every cursor change since ``job.json`` was last written, one line per turn.

Every batch handed out must be on disk before it is sent, so that a restarted daemon never
hands it out again. Rewriting ``job.json`` for that on every loop turn cost half the server
thread's time (its size grows with the pass); appending the turn's few changes costs one
``write``. ``job.json`` is still written whole when a pass starts, on the fsynced tick, and when
the log grows long; it then carries a new generation number and the log starts afresh, so lines
of an older generation (left by a crash between the two steps) are ignored when replayed.

Lines are JSON: ``[generation, [event, ...]]`` with events ``["a", rank, epoch, phase, index,
worker]`` (assigned), ``["k", rank, epoch, phase, [index, ...]]`` (acknowledged) and
``["q", rank, epoch, phase, worker]`` (a worker's batches went back to the queue) and ``["l",
rank, epoch, phase, [index, ...]]`` (batches the loop never got went back to the queue). A torn
last line (the daemon killed mid-write) does not parse and ends the replay.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from loaderd import crashpoints

logger = logging.getLogger(__name__)

Cursor = dict[str, Any]  # {"epoch", "phase", "batches", "acked": set, "inflight": dict}


class CursorLog:
    """Append-only log of cursor events. Not thread-safe: the server loop owns it.

    Args:
        path: the log file (created).
        generation: the generation of the ``job.json`` the log continues.
    """

    def __init__(self, path: Path, generation: int) -> None:
        self.path = path
        self.generation = generation
        self.lines = 0
        self._events: list[list[Any]] = []
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def assign(self, rank: int, epoch: int, phase: str, index: int, worker: int) -> None:
        """A batch was handed to a worker."""
        self._events.append(["a", rank, epoch, phase, index, worker])

    def ack(self, rank: int, epoch: int, phase: str, indices: list[int]) -> None:
        """Batches were acknowledged."""
        self._events.append(["k", rank, epoch, phase, indices])

    def requeue(self, rank: int, epoch: int, phase: str, worker: int) -> None:
        """A worker's unacknowledged batches went back to the queue."""
        self._events.append(["q", rank, epoch, phase, worker])

    def lost(self, rank: int, epoch: int, phase: str, indices: list[int]) -> None:
        """Batches handed out that the training loop never got went back to the queue."""
        self._events.append(["l", rank, epoch, phase, indices])

    def flush(self) -> None:
        """Append the events since the last flush as one line (no fsync: see the module doc)."""
        if self._events:
            line = json.dumps([self.generation, self._events], separators=(",", ":")) + "\n"
            crashpoints.hit("cursor-log")
            os.write(self._fd, line.encode())
            self._events = []
            self.lines += 1

    def reset(self, generation: int) -> None:
        """Start afresh: a ``job.json`` of ``generation`` now holds every change so far."""
        os.ftruncate(self._fd, 0)
        self.generation = generation
        self._events = []
        self.lines = 0

    def close(self) -> None:
        """Close the file (safe to call twice)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @staticmethod
    def replay(path: Path, generation: int, cursors: list[Cursor | None]) -> int:
        """Apply the log's events of ``generation`` to the cursors saved in ``job.json``.

        Returns:
            The number of events applied.
        """
        try:
            text = path.read_text()
        except FileNotFoundError:
            return 0
        applied = 0
        for line in text.splitlines():
            try:
                gen, events = json.loads(line)
            except (ValueError, TypeError):
                logger.warning("%s: cut a torn line", path)
                break
            if gen != generation:
                continue
            for kind, rank, epoch, phase, *rest in events:
                cur = cursors[rank] if 0 <= rank < len(cursors) else None
                if cur is None or (cur["epoch"], cur["phase"]) != (epoch, phase):
                    continue  # a pass start always writes job.json: this cannot happen
                if kind == "a" and rest[0] not in cur["acked"]:
                    cur["inflight"][rest[0]] = rest[1]
                elif kind == "k":
                    for index in rest[0]:
                        cur["inflight"].pop(index, None)
                        cur["acked"].add(index)
                elif kind == "q":
                    cur["inflight"] = {i: w for i, w in cur["inflight"].items() if w != rest[0]}
                elif kind == "l":
                    for index in rest[0]:
                        cur["inflight"].pop(index, None)
                applied += 1
        return applied
