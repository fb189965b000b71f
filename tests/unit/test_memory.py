"""The memory a process may fill: the machine's, and its memory cgroup's limits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loaderd.storage.memory import cgroup_limits, memory_available, memory_total
from tests.helpers import memory_limited


def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _mountinfo(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "mountinfo"
    path.write_text("".join(f"{ln}\n" for ln in lines))
    return path


def test_v2_a_parents_limit_binds_and_the_group_may_reclaim_its_page_cache(
    tmp_path: Path,
) -> None:
    # A cgroup2 tree laid out as the kernel shows it: this process in /job/daemon, whose
    # own limit is loose (memory.high is the lower of its two), its parent's tight.
    mount = tmp_path / "cg2"
    _files(
        mount,
        {
            "memory.max": "max\n",  # the root's files: no limit, never counted
            "job/memory.max": "1000000\n",
            "job/memory.high": "max\n",
            "job/memory.current": "700000\n",
            "job/memory.stat": "anon 300000\nfile 400000\nactive_file 100000\n"
            "inactive_file 250000\n",
            "job/daemon/memory.max": "5000000\n",
            "job/daemon/memory.high": "4000000\n",
            "job/daemon/memory.current": "600000\n",
            "job/daemon/memory.stat": "active_file 0\ninactive_file 100000\n",
        },
    )
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/daemon\n")
    info = _mountinfo(tmp_path, [f"30 23 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw"])
    limits = cgroup_limits(proc, info)
    assert [(c.path, c.limit, c.used) for c in limits] == [
        (mount / "job/daemon", 4_000_000, 500_000),
        (mount / "job", 1_000_000, 350_000),  # 700,000 charged, 350,000 of it page cache
    ]
    assert min(c.room for c in limits) == 650_000


def test_v1_in_a_container_its_hierarchy_is_mounted_from_its_own_group(tmp_path: Path) -> None:
    # Docker without a cgroup namespace: /proc/self/cgroup names the host's path, and the
    # mount's root field says the container's group is what is mounted.
    mount = tmp_path / "memory"
    _files(
        mount,
        {
            "memory.limit_in_bytes": "2000000\n",
            "memory.usage_in_bytes": "900000\n",
            "memory.stat": "cache 500000\ntotal_inactive_file 300000\ntotal_active_file 100000\n",
        },
    )
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    info = _mountinfo(
        tmp_path,
        [
            f"40 31 0:38 / {tmp_path}/unified rw - cgroup2 cgroup2 rw",
            f"35 31 0:32 /docker/abc {mount} ro,nosuid - cgroup cgroup rw,memory",
        ],
    )
    (limit,) = cgroup_limits(proc, info)
    assert (limit.path, limit.limit, limit.used, limit.room) == (
        mount,
        2_000_000,
        500_000,
        1_500_000,
    )


def test_no_limit_set_or_nothing_readable_leaves_the_machine_as_the_bound(
    tmp_path: Path,
) -> None:
    mount = tmp_path / "memory"
    _files(mount, {"memory.limit_in_bytes": "9223372036854771712\n"})  # v1's "no limit"
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/\n")
    info = _mountinfo(tmp_path, [f"35 31 0:32 / {mount} rw - cgroup cgroup rw,memory"])
    assert cgroup_limits(proc, info) == []
    assert cgroup_limits(tmp_path / "absent", info) == []
    proc.write_text("garbage\n")
    assert cgroup_limits(proc, info) == []


def test_a_mount_point_with_a_space_is_read_as_mountinfo_escapes_it(tmp_path: Path) -> None:
    mount = tmp_path / "cg 2"
    _files(mount, {"g/memory.max": "4096\n", "g/memory.current": "1024\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("0::/g\n")
    escaped = str(mount).replace(" ", "\\040")
    info = _mountinfo(tmp_path, [f"30 23 0:26 / {escaped} rw - cgroup2 cgroup2 rw"])
    assert [c.room for c in cgroup_limits(proc, info)] == [3072]


_REPORT = """
import json, numpy as np
from loaderd.storage.memory import cgroup_limits, memory_available, memory_total
before = memory_available()
held = np.ones(64 << 20, np.uint8)  # 64 MiB charged to the group
print(json.dumps([memory_total(), before, memory_available(), cgroup_limits()[0].limit]))
"""


def test_a_process_in_a_real_memory_cgroup_sees_its_limit_and_its_use() -> None:
    limit = 512 << 20
    with memory_limited(limit) as under:
        if under is None:
            pytest.skip("no memory cgroup can be made here")
        out = subprocess.run(
            [*under, sys.executable, "-c", _REPORT], capture_output=True, check=True, text=True
        ).stdout
    total, before, after, own = json.loads(out)
    assert total == own == limit < memory_total()
    assert before < limit and 60 << 20 <= before - after <= 80 << 20
    assert memory_available() > limit  # this process is not in that group
