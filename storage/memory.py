"""How much memory this process may fill: the machine's, and its memory cgroup's.

In a container the kernel's ``/proc/meminfo`` is the host's, while the memory cgroup kills a
process of the group once the group goes past its limit: a daemon of an ordinary user, told
it had the host's 17 GiB available, copied a 2 GB store into memory of its own at start in a
1.5 GB container and was killed 2 s later. So each "does it fit" here takes the least of
what the machine has and what each cgroup above this process still allows.

Both versions of cgroups are read: v2 (``memory.max``, ``memory.high``, ``memory.current``)
and v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``), at every level from this
process's group up to the root of the mounted hierarchy, since a parent's limit binds the
groups below it. A group's use counts its page cache, which the group reclaims before it
kills: the file pages on its reclaim lists are taken off the use, as MemAvailable counts them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loaderd.storage.durability import unescape_mount_field

PROC_CGROUP = Path("/proc/self/cgroup")
MOUNTINFO = Path("/proc/self/mountinfo")
_UNLIMITED = 1 << 62  # v1 writes "no limit" as the largest page multiple of a signed 64 bit


@dataclass(frozen=True)
class CgroupLimit:
    """One memory cgroup's limit on this process, and what its processes use of it now."""

    path: Path
    limit: int
    used: int  # charged, less the page cache the group may reclaim

    @property
    def room(self) -> int:
        """Bytes the group's processes may still fill."""
        return max(0, self.limit - self.used)


def memory_available() -> int:
    """Bytes this process may still fill now: MemAvailable, or a cgroup's room where less."""
    return memory_room()[0]


def memory_room() -> tuple[int, CgroupLimit | None]:
    """``memory_available``, and the cgroup that bounds it (None: the machine's memory)."""
    machine = _meminfo("MemAvailable:")
    tightest = min(cgroup_limits(), key=lambda c: c.room, default=None)
    return (tightest.room, tightest) if tightest and tightest.room < machine else (machine, None)


def memory_total() -> int:
    """Bytes of memory this process may ever use: the machine's, or a cgroup's limit."""
    return min([_meminfo("MemTotal:"), *(c.limit for c in cgroup_limits())])


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = "SC_AVPHYS_PAGES" if key == "MemAvailable:" else "SC_PHYS_PAGES"
    return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")


def cgroup_limits(
    proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO
) -> list[CgroupLimit]:
    """The memory limits set on this process's cgroup and the groups above it.

    ``proc_cgroup`` and ``mountinfo``: this process's ``/proc/self/cgroup`` and
    ``/proc/self/mountinfo``. Empty where no limit is set, or no memory cgroup is mounted
    (nothing readable is not an error: the machine's memory is then the only bound).
    """
    found = memory_cgroup(proc_cgroup, mountinfo)
    if found is None:
        return []
    version, folder, mount = found
    read = _v1_limit if version == 1 else _v2_limit
    return [c for d in _up(folder, mount) if (c := read(d)) is not None]


def memory_cgroup(
    proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO
) -> tuple[int, Path, Path] | None:
    """(version, folder, mount point) of this process's memory cgroup; None: none is mounted.

    Version 1 where its memory hierarchy is mounted (a machine may mount both, and v2's then
    has no memory controller), else version 2.
    """
    try:
        groups = proc_cgroup.read_text().splitlines()
        mounts = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for version in (1, 2):
        found = _group_dir(groups, mounts, version)
        if found is not None:
            return (version, *found)
    return None


def _group_dir(groups: list[str], mounts: list[str], version: int) -> tuple[Path, Path] | None:
    """(this process's group folder, the hierarchy's mount point) of a memory cgroup version."""
    lines = (g.split(":", 2) for g in groups)
    path = next(
        (p for h, c, p in (ln for ln in lines if len(ln) == 3) if _names_memory(version, h, c)),
        None,
    )
    if path is None:
        return None
    for line in mounts:
        fields, sep, fs = line.partition(" - ")
        parts, fs_parts = fields.split(), fs.split()
        if not sep or len(parts) < 5 or len(fs_parts) < 3:
            continue
        fstype, options = fs_parts[0], fs_parts[2].split(",")
        if (version == 2 and fstype == "cgroup2") or (
            version == 1 and fstype == "cgroup" and "memory" in options
        ):
            root, mount = unescape_mount_field(parts[3]), Path(unescape_mount_field(parts[4]))
            # A container's hierarchy is mounted from its own group: the path is relative to it.
            inside = path == root or path.startswith(root.rstrip("/") + "/")
            return mount / (os.path.relpath(path, root) if inside else "."), mount
    return None


def _names_memory(version: int, hierarchy: str, controllers: str) -> bool:
    """Whether a line of /proc/self/cgroup names this process's group of memory's hierarchy."""
    if version == 2:
        return hierarchy == "0" and controllers == ""
    return "memory" in controllers.split(",")


def _up(folder: Path, mount: Path) -> Iterator[Path]:
    """``folder`` and each folder above it, up to ``mount`` (a folder outside it: ``mount``)."""
    if folder != mount and mount not in folder.parents:
        folder = mount
    while True:
        yield folder
        if folder == mount:
            return
        folder = folder.parent


def _v2_limit(folder: Path) -> CgroupLimit | None:
    limits = [v for name in ("memory.max", "memory.high") if (v := _number(folder / name))]
    used = _number(folder / "memory.current")
    if not limits or used is None:
        return None
    stat = _stat(folder / "memory.stat")
    cache = stat.get("inactive_file", 0) + stat.get("active_file", 0)
    return CgroupLimit(folder, min(limits), max(0, used - cache))


def _v1_limit(folder: Path) -> CgroupLimit | None:
    limit = _number(folder / "memory.limit_in_bytes")
    used = _number(folder / "memory.usage_in_bytes")
    if not limit or used is None:
        return None
    stat = _stat(folder / "memory.stat")
    cache = stat.get("total_inactive_file", 0) + stat.get("total_active_file", 0)
    return CgroupLimit(folder, limit, max(0, used - cache))


def _number(file: Path) -> int | None:
    """A cgroup file's number; None where it is absent, unreadable or says there is no limit."""
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max": no limit
    value = int(text)
    return None if value >= _UNLIMITED else value


def _stat(file: Path) -> dict[str, int]:
    try:
        lines = file.read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, _, v in (ln.partition(" ") for ln in lines) if v.isdigit()}
