"""The daemon's side of the shared-memory rings: create, lend, reclaim, clean up after crashes.

A ring (``client/shm.py`` describes the file) is created by the daemon, which alone lends its
slots: ``acquire`` lends a free slot to an owner (and bumps its generation, so a trainer can
tell a reused slot), ``layout`` places a batch's frames in it, ``transfer`` hands a slot
assembled ahead of demand to the consumer that asks for it, ``release`` and ``reclaim`` take
slots back. Lending state lives in the daemon's memory only; the methods are thread-safe, so
prefetch workers acquire while the server loop releases.

A crashed daemon leaves its file behind; ``cleanup_stale`` removes every ring whose owner
process is gone (pid and start time, so a reused pid does not keep a dead ring alive). The
daemon calls it at start.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import threading
import zlib
from collections.abc import Hashable, Sequence
from pathlib import Path

from loaderd.client.pids import pid_alive, start_time
from loaderd.client.shm import (
    CRC,
    DEFAULT_PREFIX,
    GEN,
    GEN_TABLE_OFFSET,
    HEADER,
    MAGIC,
    MAP_FLAGS,
    MAX_SLOT_BYTES,
    MAX_SLOTS,
    NAME_RE,
    PAGE,
    SHM_DIR,
    VERSION,
    ShmError,
    ShmRing,
    SlotDescriptor,
    read_header,
    slot_layout,
)

logger = logging.getLogger(__name__)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class LentRing(ShmRing):
    """A ring this process created and lends slots of (the daemon side).

    A context manager; ``close`` unmaps and removes the file, and is safe to call twice.
    """

    def __init__(
        self, path: Path, mm: mmap.mmap, *, slots: int, slot_bytes: int, data_offset: int
    ) -> None:
        """Use ``create``."""
        super().__init__(path, mm, slots=slots, slot_bytes=slot_bytes, data_offset=data_offset)
        self._creator_pid = os.getpid()
        self._lock = threading.Lock()
        # LIFO: the slot released last is reused first, so its pages are still warm in cache.
        self._free: list[int] = list(range(slots - 1, -1, -1))
        self._lent: dict[int, Hashable] = {}
        self._generation = [0] * slots
        self.retired = False  # lends no more slots (``retire``)

    @classmethod
    def create(
        cls,
        slots: int,
        slot_bytes: int,
        *,
        prefix: str = DEFAULT_PREFIX,
        directory: str | os.PathLike[str] = SHM_DIR,
        mode: int = 0o600,
    ) -> LentRing:
        """Create a ring owned by this process (the daemon side).

        The memory is reserved up front (``posix_fallocate``), so a too-small ``/dev/shm``
        fails here with a clear error instead of a SIGBUS on the first batch.

        Args:
            slots: number of slots (1..65536).
            slot_bytes: usable bytes per slot; rounded up to a multiple of the page size.
            prefix: file name prefix; the name is ``<prefix><pid>-<token>``.
            directory: where the file lives (a tmpfs; ``/dev/shm`` by default).
            mode: file permissions; trainers of another user need a wider mode.

        Returns:
            The ring, mapped read-write, all slots free.

        Raises:
            ValueError: ``slots``, ``slot_bytes`` or ``prefix`` is out of range.
            ShmError: the file cannot be created or the memory cannot be reserved.
        """
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"`slots` must be in 1..{MAX_SLOTS}, got {slots}")
        if not 1 <= slot_bytes <= MAX_SLOT_BYTES:
            raise ValueError(f"`slot_bytes` must be in 1..{MAX_SLOT_BYTES}, got {slot_bytes}")
        if not NAME_RE.fullmatch(prefix + "0"):
            raise ValueError(f"`prefix` must be a plain file name prefix, got {prefix!r}")
        slot_bytes = _round_up(slot_bytes, PAGE)
        data_offset = _round_up(GEN_TABLE_OFFSET + GEN.size * slots, PAGE)
        total = data_offset + slots * slot_bytes
        path = Path(directory) / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except OSError as e:
            raise ShmError(f"cannot create shared-memory ring {path}: {e.strerror}") from e
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                raise ShmError(
                    f"cannot reserve {total / 2**20:.1f} MiB for ring {path}: {e.strerror} "
                    f"(is {directory} too small? containers default to 64 MiB: --shm-size)"
                ) from e
            mm = mmap.mmap(fd, total, flags=MAP_FLAGS)  # dups fd: ours is closed below
            pid = os.getpid()
            head = HEADER.pack(
                MAGIC, VERSION, slots, slot_bytes, data_offset, pid, start_time(pid) or 0
            )
            # The header goes in last, checksummed: a ring caught half-made never validates.
            mm[: HEADER.size + CRC.size] = head + CRC.pack(zlib.crc32(head))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        logger.info(
            "created shm ring %s: %d slots of %d bytes (%.1f MiB)",
            path,
            slots,
            slot_bytes,
            total / 2**20,
        )
        return cls(path, mm, slots=slots, slot_bytes=slot_bytes, data_offset=data_offset)

    def unlink(self) -> None:
        """Remove the file; mappings stay valid until each side closes. Safe to call twice."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
            logger.info("unlinked shm ring %s", self.path)

    def close(self) -> None:
        """Remove the file (not from a forked child) and unmap. Safe to call twice."""
        if self._creator_pid == os.getpid():
            self.unlink()  # a forked child must not remove its parent's ring
        super().close()

    # --- lending -------------------------------------------------------------------------

    def acquire(self, owner: Hashable = None) -> int | None:
        """Lend a free slot to ``owner`` (a consumer tag the daemon chooses).

        Returns:
            The slot index, or None when every slot is lent.
        """
        with self._lock:
            if not self._free or self.retired:
                return None
            slot = self._free.pop()
            self._lent[slot] = owner
            self._generation[slot] += 1
            GEN.pack_into(self._map(), GEN_TABLE_OFFSET + GEN.size * slot, self._generation[slot])
        return slot

    def release(self, slot: int, owner: Hashable = None) -> None:
        """Take a slot back so it can be lent again.

        Args:
            slot: a lent slot.
            owner: when given, the slot must be lent to this owner (a client may only hand
                back its own slots).

        Raises:
            ValueError: the slot is not lent, or is lent to another owner.
        """
        with self._lock:
            if slot not in self._lent:
                raise ValueError(f"slot {slot} of ring {self.name} is not lent")
            if owner is not None and self._lent[slot] != owner:
                raise ValueError(f"slot {slot} of ring {self.name} is not lent to {owner!r}")
            del self._lent[slot]
            self._free.append(slot)

    def retire(self) -> bool:
        """Stop lending, if no slot is lent: then the ring may be closed.

        A prefetch worker acquires a slot and then writes into it; taken under the lock that
        ``acquire`` takes, this leaves no moment where a worker holds a slot of a retired ring.

        Returns:
            True when the ring is retired (no slot is lent, and none will be); False when a
            slot is lent and nothing changed.
        """
        with self._lock:
            if self._lent:
                return False
            self.retired = True
        return True

    def transfer(self, slot: int, owner: Hashable, *, expected: Hashable) -> bool:
        """Hand a lent slot to another owner, keeping its generation (the batch stays valid).

        A batch assembled ahead of demand is lent to a placeholder owner, then handed to the
        consumer that asks for it; release and acquire would bump the generation instead.

        Returns:
            True when the slot was lent to ``expected`` and now belongs to ``owner``.
        """
        with self._lock:
            if slot not in self._lent or self._lent[slot] != expected:
                return False
            self._lent[slot] = owner
        return True

    def reclaim(self, owner: Hashable) -> list[int]:
        """Take back every slot lent to ``owner`` (a consumer that died or went away).

        Returns:
            The slots taken back, in increasing order.
        """
        with self._lock:
            slots = sorted(s for s, o in self._lent.items() if o == owner)
            for s in slots:
                del self._lent[s]
                self._free.append(s)
        if slots:
            logger.info("reclaimed %d slots of %r in ring %s", len(slots), owner, self.name)
        return slots

    def lent(self) -> dict[int, Hashable]:
        """A snapshot of the lent slots and their owners."""
        with self._lock:
            return dict(self._lent)

    @property
    def free_count(self) -> int:
        """How many slots can be lent now."""
        return len(self._free)

    def view(self, slot: int, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """A writable view of part of a lent slot, without a copy.

        Raises:
            ValueError: the range does not lie inside the slot, or the slot is not lent.
        """
        if 0 <= slot < self.slots and slot not in self._lent:
            raise ValueError(f"slot {slot} of ring {self.name} is not lent")
        return super().view(slot, offset, nbytes)

    def layout(self, slot: int, sizes: Sequence[int]) -> SlotDescriptor:
        """Lay out frames of these sizes in a lent slot (daemon side).

        Assemble each frame into ``view(slot, offset, nbytes)`` of its span, then send the
        descriptor.

        Args:
            slot: a lent slot.
            sizes: byte size of each payload frame, in wire order.

        Returns:
            The descriptor to put in the BATCH meta (``to_json()``).

        Raises:
            ValueError: the frames do not fit in a slot, or the slot is not lent.
        """
        spans = slot_layout(sizes)
        need = spans[-1][0] + spans[-1][1] if spans else 0
        if need > self.slot_bytes:
            raise ValueError(
                f"batch needs {need} bytes, slots of ring {self.name} hold {self.slot_bytes}"
            )
        with self._lock:
            if slot not in self._lent:
                raise ValueError(f"slot {slot} of ring {self.name} is not lent")
            gen = self._generation[slot]
        return SlotDescriptor(self.name, slot, gen, tuple(spans))


# --- stale rings ------------------------------------------------------------------------------


def cleanup_stale(
    prefix: str = DEFAULT_PREFIX, *, directory: str | os.PathLike[str] = SHM_DIR
) -> list[str]:
    """Remove rings whose owning process is gone (after a daemon crash).

    A file named ``<prefix><pid>-...`` is removed when its owner (from a valid header, else
    from the name: a ring caught half-made) is dead. Rings of live processes are kept, and so
    are files whose owner cannot be told. Note that pids are per pid namespace: daemons in
    containers that share one ``/dev/shm`` must use distinct prefixes.

    Args:
        prefix: file name prefix of the rings to consider.
        directory: where the rings live.

    Returns:
        The names removed.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError as e:
        logger.warning("cannot list %s for stale rings: %s", directory, e)
        return removed
    name_pid = re.compile(re.escape(prefix) + r"(\d+)-")
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_file(follow_symlinks=False):
            continue
        owner = _owner(Path(entry.path), name_pid)
        if owner is None or pid_alive(*owner):
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue  # another cleaner got there first
        except OSError as e:
            logger.warning("cannot remove stale ring %s: %s", entry.path, e)
            continue
        logger.info("removed stale shm ring %s (owner pid %d is gone)", entry.path, owner[0])
        removed.append(entry.name)
    return removed


def _owner(path: Path, name_pid: re.Pattern[str]) -> tuple[int, int | None] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        _, _, _, pid, start = read_header(fd, path)
        return pid, start or None
    except (ShmError, OSError):
        m = name_pid.match(path.name)
        return (int(m.group(1)), None) if m else None
    finally:
        os.close(fd)
