"""Shared-memory batch rings: same-host delivery with only a descriptor on the socket.

The daemon creates a ring, a file under ``/dev/shm`` named ``loaderd-<daemon pid>-<token>``
that both sides map. It holds ``slots`` slots of ``slot_bytes`` each. The daemon lends a slot
(``acquire``), assembles a batch straight into it (``layout`` + ``view``, or ``pack``) and sends
the trainer a ``SlotDescriptor`` in the BATCH meta instead of payload frames. The trainer
attaches once per ring (``ShmRing.attach``) and turns each descriptor into memoryviews over the
slot (``frames``), in the same order the payload frames would have had, so
``protocol.decode_batch`` reads them unchanged. The daemon takes the slot back (``release``)
when the trainer acknowledges the batch, and ``reclaim`` takes back every slot of a consumer
that died.

Lifetime: views over a slot are valid until the trainer hands the slot back, that is until
its next request acknowledges the batch (the window of batches in flight). A trainer that
keeps tensors beyond that must copy them on purpose (``copy_batch``); otherwise the daemon
reuses the slot and the kept tensors silently change. ``ShmRing.is_current`` tells whether a
descriptor's slot still holds that batch.

File layout (all little-endian)::

    0      header  HEADER (magic, version, slots, slot_bytes, data_offset, owner pid,
                   owner start time) + crc32 of those bytes
    64     slots x uint64 generation, bumped each time the daemon lends the slot
    data_offset (page-aligned)  slot 0, slot 1, ... each slot_bytes (a multiple of the page)

Inside a slot, frames start at 64-byte-aligned offsets; ``slot_layout`` is the only code that
decides where, and ``ShmRing.frames`` the only code that reads a layout back.

A crashed daemon leaves its file behind; ``cleanup_stale`` removes every ring whose owner
process is gone (pid and start time, so a reused pid does not keep a dead ring alive). The
daemon calls it at start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import zlib
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from loaderd.client.errors import LoaderdError, ProtocolError
from loaderd.client.protocol import MAX_FRAMES

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
DEFAULT_PREFIX = "loaderd-"
MAGIC = b"LDRDRING"
VERSION = 1
# magic, version, (pad), slots, slot_bytes, data_offset, owner_pid, owner_start; then crc32
HEADER = struct.Struct("<8sH2xIQQQQ")
CRC = struct.Struct("<I")
GEN = struct.Struct("<Q")
GEN_TABLE_OFFSET = 64
ALIGN = 64  # frame alignment inside a slot: a cache line, and enough for any dtype / SIMD load
PAGE = mmap.PAGESIZE
MAX_SLOTS = 1 << 16
MAX_SLOT_BYTES = 1 << 40
# A ring name comes from the daemon over the wire: never let it walk out of the directory.
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
# Pre-fault page tables when mapping: a first touch of each 4 KiB page otherwise costs about as
# much as copying it, on every batch of the first pass over the ring.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class ShmError(LoaderdError):
    """A shared-memory ring cannot be created, attached or used; the message names the path."""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def slot_layout(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Where each frame of a batch goes in a slot: the one definition of the slot layout.

    Args:
        sizes: byte size of each frame, in wire order.

    Returns:
        ``(offset, nbytes)`` per frame; each offset is a multiple of ``ALIGN`` (64).

    Raises:
        ValueError: a size is negative.
    """
    out: list[tuple[int, int]] = []
    offset = 0
    for i, n in enumerate(sizes):
        if n < 0:
            raise ValueError(f"frame {i} has negative size {n}")
        out.append((offset, n))
        offset = _round_up(offset + n, ALIGN)
    return out


def layout_bytes(sizes: Sequence[int]) -> int:
    """Slot bytes needed for frames of these sizes (to size a ring for the largest batch)."""
    spans = slot_layout(sizes)
    return spans[-1][0] + spans[-1][1] if spans else 0


@dataclass(frozen=True, slots=True)
class SlotDescriptor:
    """Where a batch lies in shared memory: what the BATCH meta carries instead of frames.

    JSON form (``to_json``)::

        {"ring": "loaderd-4242-9f3a1c0e", "slot": 3, "gen": 17,
         "frames": [[0, 2048], [2048, 1024], [3072, 6291456]]}

    ``frames`` lists ``[offset, nbytes]`` per payload frame, in the order the socket path
    would send the frames.
    """

    ring: str
    slot: int
    generation: int
    frames: tuple[tuple[int, int], ...]

    def to_json(self) -> dict[str, Any]:
        """The descriptor as a JSON-ready object."""
        return {
            "ring": self.ring,
            "slot": self.slot,
            "gen": self.generation,
            "frames": [[o, n] for o, n in self.frames],
        }

    @classmethod
    def from_json(cls, obj: Any) -> SlotDescriptor:
        """Parse a descriptor sent by the daemon, checking every part's type.

        Raises:
            ProtocolError: a key is missing or has the wrong type.
        """
        if not isinstance(obj, dict):
            raise ProtocolError(f"slot descriptor must be an object, got {obj!r}")
        ring, slot, gen, frames = (obj.get(k) for k in ("ring", "slot", "gen", "frames"))
        if not isinstance(ring, str) or not _NAME_RE.fullmatch(ring):
            raise ProtocolError(f"slot descriptor: bad ring name {ring!r}")
        if not _is_uint(slot) or not _is_uint(gen):
            raise ProtocolError(f"slot descriptor: 'slot' and 'gen' must be ints, got {obj!r}")
        if (
            not isinstance(frames, list)
            or len(frames) > MAX_FRAMES
            or not all(
                isinstance(f, list) and len(f) == 2 and _is_uint(f[0]) and _is_uint(f[1])
                for f in frames
            )
        ):
            raise ProtocolError("slot descriptor: 'frames' must be a list of [offset, nbytes]")
        return cls(ring, slot, gen, tuple((f[0], f[1]) for f in frames))


def _is_uint(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class ShmRing:
    """A ring of fixed-size batch slots in a shared-memory file.

    The daemon makes one with ``create`` and is the only side that lends and takes back slots;
    trainers ``attach`` and only read (or write their own lent slot: tensors are writable, an
    in-place transform must not fault). Lending state lives in the daemon's memory only. The
    lending methods are thread-safe, so prefetch workers may acquire while the server loop
    releases. A ring is a context manager; ``close`` is safe to call twice.
    """

    def __init__(
        self,
        path: Path,
        mm: mmap.mmap,
        *,
        slots: int,
        slot_bytes: int,
        data_offset: int,
        creator: bool,
    ) -> None:
        """Use ``create`` or ``attach``; this only wraps an open, validated mapping."""
        self.path = path
        self.name = path.name
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._mm: mmap.mmap | None = mm
        self._data_offset = data_offset
        self._creator_pid = os.getpid() if creator else None
        self._lock = threading.Lock()
        # LIFO: the slot released last is reused first, so its pages are still warm in cache.
        self._free: list[int] = list(range(slots - 1, -1, -1))
        self._lent: dict[int, Hashable] = {}
        self._generation = [0] * slots

    # --- lifecycle -------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        slots: int,
        slot_bytes: int,
        *,
        prefix: str = DEFAULT_PREFIX,
        directory: str | os.PathLike[str] = SHM_DIR,
        mode: int = 0o600,
    ) -> ShmRing:
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
        if not _NAME_RE.fullmatch(prefix + "0"):
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
            mm = mmap.mmap(fd, total, flags=_MAP_FLAGS)  # dups fd: ours is closed below
            pid = os.getpid()
            head = HEADER.pack(
                MAGIC, VERSION, slots, slot_bytes, data_offset, pid, _start_time(pid) or 0
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
        return cls(
            path,
            mm,
            slots=slots,
            slot_bytes=slot_bytes,
            data_offset=data_offset,
            creator=True,
        )

    @classmethod
    def attach(cls, name: str, *, directory: str | os.PathLike[str] = SHM_DIR) -> ShmRing:
        """Attach to a ring the daemon created (the trainer side).

        Args:
            name: the ring's file name, as in a ``SlotDescriptor``.
            directory: where the file lives.

        Returns:
            The ring, mapped read-write (tensors over it must be writable).

        Raises:
            ShmError: the file is missing or is not a valid ring; the message names the path.
        """
        path = Path(directory) / name
        if not _NAME_RE.fullmatch(name):
            raise ShmError(f"bad shared-memory ring name {name!r}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ShmError(
                f"no shared-memory ring at {path} (the daemon that made it is gone?)"
            ) from None
        except OSError as e:
            raise ShmError(f"cannot open shared-memory ring {path}: {e.strerror}") from e
        try:
            slots, slot_bytes, data_offset, _, _ = _read_header(fd, path)
            size = os.fstat(fd).st_size
            want = data_offset + slots * slot_bytes
            if size != want:
                raise ShmError(f"ring {path} is {size} bytes, its header says {want}")
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        logger.debug("attached shm ring %s: %d slots of %d bytes", path, slots, slot_bytes)
        return cls(
            path,
            mm,
            slots=slots,
            slot_bytes=slot_bytes,
            data_offset=data_offset,
            creator=False,
        )

    def unlink(self) -> None:
        """Remove the file; mappings stay valid until each side closes. Safe to call twice."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
            logger.info("unlinked shm ring %s", self.path)

    def close(self) -> None:
        """Unmap and close; the creator also unlinks. Safe to call twice.

        Views still held elsewhere (tensors of a batch) keep the mapping alive: it is then
        unmapped when the last of them is freed, never under their feet.
        """
        if self._creator_pid == os.getpid():
            self.unlink()  # a forked child must not remove its parent's ring
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                logger.debug("shm ring %s still has views; unmapped when they go", self.path)

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShmRing({self.name!r}, slots={self.slots}, slot_bytes={self.slot_bytes})"

    # --- lending (daemon side) -------------------------------------------------------------

    def acquire(self, owner: Hashable = None) -> int | None:
        """Lend a free slot to ``owner`` (a consumer tag the daemon chooses).

        Returns:
            The slot index, or None when every slot is lent.
        """
        self._check_creator("acquire")
        with self._lock:
            if not self._free:
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
        self._check_creator("release")
        with self._lock:
            if slot not in self._lent:
                raise ValueError(f"slot {slot} of ring {self.name} is not lent")
            if owner is not None and self._lent[slot] != owner:
                raise ValueError(f"slot {slot} of ring {self.name} is not lent to {owner!r}")
            del self._lent[slot]
            self._free.append(slot)

    def transfer(self, slot: int, owner: Hashable, *, expected: Hashable) -> bool:
        """Hand a lent slot to another owner, keeping its generation (the batch stays valid).

        A batch assembled ahead of demand is lent to a placeholder owner, then handed to the
        consumer that asks for it; release and acquire would bump the generation instead.

        Returns:
            True when the slot was lent to ``expected`` and now belongs to ``owner``.
        """
        self._check_creator("transfer")
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
        self._check_creator("reclaim")
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

    # --- bytes ------------------------------------------------------------------------------

    def view(self, slot: int, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """A writable view of part of a slot, without a copy.

        Args:
            slot: the slot index; on the daemon side it must be lent.
            offset: start within the slot.
            nbytes: length; the rest of the slot when None.

        Raises:
            ValueError: the range does not lie inside the slot, or the daemon views a free slot.
        """
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range 0..{self.slots - 1} in ring {self.name}")
        if self._creator_pid is not None and slot not in self._lent:
            raise ValueError(f"slot {slot} of ring {self.name} is not lent")
        if nbytes is None:
            nbytes = self.slot_bytes - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.slot_bytes:
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) outside slot of {self.slot_bytes} bytes "
                f"in ring {self.name}"
            )
        start = self._data_offset + slot * self.slot_bytes + offset
        return memoryview(self._map())[start : start + nbytes]

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
        self._check_creator("layout")
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

    def pack(self, slot: int, frames: Iterable[Any]) -> SlotDescriptor:
        """Copy ready frames (bytes-like objects) into a lent slot; one copy each.

        Prefer ``layout`` and assembling in place where the bytes are not yet in one buffer.

        Args:
            slot: a lent slot.
            frames: the payload frames, in wire order.

        Returns:
            The descriptor of the packed batch.

        Raises:
            ValueError: the frames do not fit in a slot, or the slot is not lent.
        """
        bufs = [memoryview(f).cast("B") for f in frames]
        desc = self.layout(slot, [b.nbytes for b in bufs])
        for b, (off, n) in zip(bufs, desc.frames, strict=True):
            self.view(slot, off, n)[:] = b
        return desc

    def frames(self, desc: SlotDescriptor) -> list[memoryview]:
        """The frames a descriptor names, as views of the slot (the inverse of ``layout``).

        Args:
            desc: a descriptor from a BATCH meta (``SlotDescriptor.from_json``).

        Returns:
            One writable memoryview per frame, valid until the slot is handed back.

        Raises:
            ProtocolError: the descriptor names another ring, a slot or a range outside this
                ring, or a slot the daemon has already lent again.
        """
        if desc.ring != self.name:
            raise ProtocolError(f"descriptor names ring {desc.ring!r}, attached to {self.name!r}")
        if desc.slot >= self.slots:
            raise ProtocolError(
                f"descriptor names slot {desc.slot}, ring {self.name} has {self.slots}"
            )
        if len(desc.frames) > 0 and desc.frames != tuple(slot_layout([n for _, n in desc.frames])):
            raise ProtocolError(f"descriptor frames {desc.frames} do not follow the slot layout")
        end = desc.frames[-1][0] + desc.frames[-1][1] if desc.frames else 0
        if end > self.slot_bytes:
            raise ProtocolError(
                f"descriptor reaches byte {end} of a {self.slot_bytes}-byte slot in {self.name}"
            )
        if not self.is_current(desc):
            raise ProtocolError(f"slot {desc.slot} of {self.name} was lent again")
        base = self._data_offset + desc.slot * self.slot_bytes
        mv = memoryview(self._map())
        return [mv[base + off : base + off + n] for off, n in desc.frames]

    def is_current(self, desc: SlotDescriptor) -> bool:
        """Whether the descriptor's slot still holds its batch (not yet lent again).

        A trainer that kept views past handing the slot back can check them with this.
        """
        return self.generation(desc.slot) == desc.generation

    def generation(self, slot: int) -> int:
        """How many times the slot has been lent (read from the shared table)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range 0..{self.slots - 1} in ring {self.name}")
        return int(GEN.unpack_from(self._map(), GEN_TABLE_OFFSET + GEN.size * slot)[0])

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise ShmError(f"shared-memory ring {self.path} is closed")
        return self._mm

    def _check_creator(self, what: str) -> None:
        if self._creator_pid is None:
            raise ShmError(f"{what}() belongs to the daemon; ring {self.name} is attached")


# --- stale rings ------------------------------------------------------------------------------


def _read_header(fd: int, path: Path) -> tuple[int, int, int, int, int]:
    """Validate a ring's header; returns (slots, slot_bytes, data_offset, pid, start_time)."""
    raw = os.pread(fd, HEADER.size + CRC.size, 0)
    if len(raw) < HEADER.size + CRC.size:
        raise ShmError(f"{path} is not a loaderd ring: {len(raw)}-byte file, no header")
    head = raw[: HEADER.size]
    magic, version, slots, slot_bytes, data_offset, pid, start = HEADER.unpack(head)
    if magic != MAGIC:
        raise ShmError(f"{path} is not a loaderd ring: magic {magic!r}, expected {MAGIC!r}")
    if CRC.unpack_from(raw, HEADER.size)[0] != zlib.crc32(head):
        raise ShmError(f"ring {path} has a corrupt header (checksum mismatch)")
    if version != VERSION:
        raise ShmError(f"ring {path} has layout version {version}, this client reads {VERSION}")
    if not (
        1 <= slots <= MAX_SLOTS
        and 0 < slot_bytes <= MAX_SLOT_BYTES
        and slot_bytes % PAGE == 0
        and data_offset % PAGE == 0
        and data_offset >= GEN_TABLE_OFFSET + GEN.size * slots
    ):
        raise ShmError(
            f"ring {path} has an impossible geometry: {slots} slots of {slot_bytes} bytes "
            f"from offset {data_offset}"
        )
    return slots, slot_bytes, data_offset, pid, start


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: count fields after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether the process ``pid`` runs, and is the one that started at ``start_time``.

    Args:
        pid: process id.
        start_time: the start time recorded with the pid (clock ticks since boot, as in
            ``/proc/<pid>/stat``); when given and readable, a reused pid reads as dead.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    if start_time:
        now = _start_time(pid)
        if now is not None and now != start_time:
            return False
    # A zombie has exited and will never touch the ring again.
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
        return state not in (b"Z", b"X")
    except OSError:
        return True


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
        if owner is None or process_alive(*owner):
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
        _, _, _, pid, start = _read_header(fd, path)
        return pid, start or None
    except (ShmError, OSError):
        m = name_pid.match(path.name)
        return (int(m.group(1)), None) if m else None
    finally:
        os.close(fd)


# --- keeping a batch past its slot -------------------------------------------------------------


def copy_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Copy a batch out of shared memory, for a trainer that keeps it past the next request.

    Tensors are cloned, numpy arrays and memoryviews copied, and lists, tuples, dicts and
    dataclasses (such as ``protocol.BatchArrays``) copied member by member; anything else
    (ints, strings) is kept as is.
    """
    return {k: _copy(v) for k, v in batch.items()}


def _copy(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.copy()
    if isinstance(v, memoryview):
        return bytes(v)
    if isinstance(v, list | tuple):
        return type(v)(_copy(x) for x in v)
    if isinstance(v, Mapping):
        return {k: _copy(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        # e.g. protocol.VarColumn / BatchArrays, whose arrays and views point into the slot
        return type(v)(**{f.name: _copy(getattr(v, f.name)) for f in dataclasses.fields(v)})
    clone = getattr(v, "clone", None)  # torch.Tensor, without importing torch here
    return clone() if callable(clone) else v
