"""loaderd/config.py: byte sizes and validation messages that name the field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loaderd.config import (
    CacheConfig,
    DaemonConfig,
    PrefetchConfig,
    default_miss_procs,
    parse_size,
)
from loaderd.importance import ImportanceConfig


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1 << 20),
        ("0", 0),
        ("64k", 64 << 10),
        ("64K", 64 << 10),
        ("64KB", 64 << 10),
        ("64KiB", 64 << 10),
        ("64kib", 64 << 10),
        ("512MB", 512 << 20),
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("2G", 2 << 30),
        ("1TiB", 1 << 40),
        ("1.5KiB", 1536),
        ("0.5G", 1 << 29),
        ("  3 MiB  ", 3 << 20),
        ("100B", 100),
        ("100b", 100),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", " ", "abc", "-1", "-1KiB", "1.5.5", "10XB", "KiB", "1 2", "1PiB", "1e3", "0x10"]
)
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a size: .*expected e\.g\. 512MiB"):
        parse_size(text)


@pytest.mark.parametrize("text", ["5i", "1iB"])
def test_parse_size_refuses_i_without_a_unit(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_cache_config() -> None:
    assert CacheConfig().dram_bytes == 2 << 30
    assert CacheConfig(dram_bytes=0).dram_bytes == 0
    with pytest.raises(ValueError, match="`dram_bytes` must be >= 0, got -1"):
        CacheConfig(dram_bytes=-1)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [({"depth": -1}, "`depth` must be >= 0, got -1"), ({"workers": 0}, "`workers` must be >= 1")],
)
def test_prefetch_config_names_the_field(kwargs: dict[str, int], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        PrefetchConfig(**kwargs)


def test_prefetch_config_accepts_bounds() -> None:
    assert PrefetchConfig(depth=0, workers=1) == PrefetchConfig(depth=0, workers=1)


@pytest.mark.parametrize(("cores", "procs"), [(1, 2), (2, 2), (3, 3), (4, 4), (16, 4), (64, 4)])
def test_miss_workers_scale_with_the_cores_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch, cores: int, procs: int
) -> None:
    # This machine's own count is below; larger ones are what a node of a cluster has.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert default_miss_procs() == procs
    assert PrefetchConfig().miss_procs == procs
    assert PrefetchConfig(miss_procs=1).miss_procs == 1  # asked for, not scaled


def daemon(socket: str) -> DaemonConfig:
    return DaemonConfig(db=Path("/db"), socket=socket, state_dir=Path("/state"))


@pytest.mark.parametrize(
    "socket",
    ["ipc:///tmp/x.sock", "tcp://127.0.0.1:5555", "inproc://loaderd", "ipc://" + "a" * 100],
)
def test_daemon_config_accepts_sockets(socket: str) -> None:
    cfg = daemon(socket)
    assert cfg.socket == socket
    assert cfg.cache == CacheConfig() and cfg.prefetch == PrefetchConfig()
    assert cfg.importance == ImportanceConfig()


@pytest.mark.parametrize("socket", ["/tmp/x.sock", "udp://x", "", "IPC:///tmp/x"])
def test_daemon_config_refuses_other_schemes(socket: str) -> None:
    with pytest.raises(ValueError, match="`socket` must be an ipc://, tcp:// or inproc://"):
        daemon(socket)


def test_daemon_config_refuses_long_ipc_paths() -> None:
    with pytest.raises(ValueError, match="`socket` path is longer than 100 characters"):
        daemon("ipc://" + "a" * 101)


def test_configs_are_frozen_and_keyword_only() -> None:
    cfg = CacheConfig()
    with pytest.raises(AttributeError):
        cfg.dram_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        CacheConfig(5)  # type: ignore[misc]
