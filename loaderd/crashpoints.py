"""Deterministic crash points: make the daemon die at a named place, on purpose, for tests.

``loaderd serve`` reads ``LOADERD_CRASH_AT=name:count`` (``__main__`` reads the environment,
never this module) and arms the point: the ``count``-th time the code passes ``hit(name)``, the
process calls ``os._exit`` at once, without flushing or closing anything, exactly as a
``kill -9`` at that instruction would leave it. Unarmed, ``hit`` is one dict lookup.

The points (see where each ``hit`` is called):

* ``open-pass``      a new pass was created, before its cursor is written
* ``assign``         a batch was assigned to a consumer, before the cursor is written
* ``commit``         cursors were written, before the replies of the loop turn went out
* ``deliver``        a BATCH was sent, before the next loop turn
* ``ack``            acknowledgements were applied in memory, before they are written
* ``journal-append`` feedback was appended to the journal, before its fsync
* ``replace``        a state file's temporary copy is written, before ``os.replace``
* ``cursor-log``     a turn's cursor changes are about to be appended to the cursor log
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

POINTS = (
    "open-pass",
    "assign",
    "commit",
    "deliver",
    "ack",
    "journal-append",
    "cursor-log",
    "replace",
)
EXIT_STATUS = 86  # what a crash point exits with, so a test can tell it from a real crash

_armed: dict[str, int] = {}


def arm(spec: str | None) -> None:
    """Arm the point named by ``name:count`` (``name`` alone means the first pass).

    Raises:
        ValueError: the name is not a known point or the count is not a positive int.
    """
    _armed.clear()
    if not spec:
        return
    name, _, count = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}, expected one of {', '.join(POINTS)}")
    try:
        n = int(count or 1)
    except ValueError:
        raise ValueError(f"crash point count must be an int, got {count!r}") from None
    if n < 1:
        raise ValueError(f"crash point count must be >= 1, got {n}")
    _armed[name] = n
    logger.warning("crash point armed: the daemon exits at pass %d of %r", n, name)


def hit(name: str) -> None:
    """Pass the point ``name``; die here if it is armed and its count is reached."""
    if not _armed:
        return
    left = _armed.get(name)
    if left is None:
        return
    if left <= 1:
        os.write(2, f"loaderd: crash point {name!r} reached: exiting\n".encode())
        os._exit(EXIT_STATUS)
    _armed[name] = left - 1
