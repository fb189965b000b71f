"""ClusterConfig validation, and `loaderd serve --cluster/--nodes/--node-rank` with LOADERD_*."""

from __future__ import annotations

import argparse

import pytest

from loaderd.cli import build_parser, cluster_config, main
from loaderd.config import ClusterConfig, DaemonConfig


def test_default_is_a_cluster_of_one() -> None:
    config = ClusterConfig()
    assert not config.enabled
    assert (config.nodes, config.node_rank) == (1, 0)


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [
        ("tcp://10.0.0.1:29500", "10.0.0.1", 29500),
        ("tcp://node-0.cluster.local:1", "node-0.cluster.local", 1),
        ("tcp://[::1]:65535", "::1", 65535),
    ],
)
def test_address(address: str, host: str, port: int) -> None:
    config = ClusterConfig(address=address, nodes=4, node_rank=3)
    assert config.enabled and (config.host, config.port) == (host, port)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": 2}, "2 nodes need a rendezvous `cluster` address"),
        ({"address": "10.0.0.1:29500"}, "`cluster` must be tcp://HOST:PORT"),
        ({"address": "tcp://10.0.0.1"}, "`cluster` must be tcp://HOST:PORT"),
        ({"address": "tcp://10.0.0.1:0"}, "`cluster` must be tcp://HOST:PORT"),
        ({"address": "tcp://10.0.0.1:70000"}, "`cluster` must be tcp://HOST:PORT"),
        ({"address": "ipc:///tmp/x"}, "`cluster` must be tcp://HOST:PORT"),
        ({"nodes": 0}, r"`nodes` must be in \[1, 4096\], got 0"),
        ({"address": "tcp://h:1", "nodes": 3, "node_rank": 3}, r"`node_rank` must be in \[0, 2\]"),
        ({"address": "tcp://h:1", "nodes": 3, "node_rank": -1}, "`node_rank` must be in"),
        ({"timeout_s": 0}, "`cluster_timeout` must be positive"),
        ({"round_interval_s": 0}, "`round_interval_s` must be in"),
    ],
)
def test_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**kwargs)


def test_daemon_config_carries_it() -> None:
    cluster = ClusterConfig(address="tcp://h:1", nodes=2, node_rank=1)
    config = DaemonConfig(db="db", socket="ipc:///tmp/x.sock", state_dir="s", cluster=cluster)
    assert config.cluster is cluster
    assert not DaemonConfig(db="db", socket="ipc:///tmp/x.sock", state_dir="s").cluster.enabled


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--db", "train.db", *flags])


ENV = {
    "LOADERD_CLUSTER": "tcp://10.0.0.1:29500",
    "LOADERD_NODES": "4",
    "LOADERD_NODE_RANK": "2",
    "LOADERD_CLUSTER_TIMEOUT": "60",
}


def test_environment_stands_in_for_the_flags() -> None:
    config = cluster_config(serve_args(), ENV)
    assert config == ClusterConfig(
        address="tcp://10.0.0.1:29500", nodes=4, node_rank=2, timeout_s=60.0
    )


def test_flags_win_over_the_environment() -> None:
    args = serve_args("--cluster", "tcp://h:7", "--nodes", "3", "--node-rank", "0")
    config = cluster_config(args, ENV)
    assert (config.address, config.nodes, config.node_rank, config.timeout_s) == (
        "tcp://h:7",
        3,
        0,
        60.0,
    )


def test_no_flags_no_environment_is_a_cluster_of_one() -> None:
    assert cluster_config(serve_args(), {}) == ClusterConfig()
    assert cluster_config(serve_args(), {"LOADERD_CLUSTER": " "}) == ClusterConfig()


def test_bad_environment_value_is_named() -> None:
    with pytest.raises(ValueError, match="LOADERD_NODE_RANK must be a number, got 'two'"):
        cluster_config(serve_args(), {**ENV, "LOADERD_NODE_RANK": "two"})


def test_serve_refuses_a_bad_cluster_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--db", "missing.db", "--nodes", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["loaderd: error: 2 nodes need a rendezvous `cluster` address (tcp://HOST:PORT)"]
