"""Addresses: one default everywhere, and a one-line refusal of what ZeroMQ would misread."""

from __future__ import annotations

from pathlib import Path

import pytest

from loaderd.cli import build_parser, main
from loaderd.client.address import check_address, default_address
from loaderd.client.connection import Connection
from loaderd.client.errors import DaemonUnavailableError
from loaderd.client.protocol import MsgType


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("/tmp/x.sock", "did you mean 'ipc:///tmp/x.sock'"),
        ("ipc:/tmp/x.sock", "did you mean 'ipc:///tmp/x.sock'"),
        ("unix:///tmp/x.sock", "spelled 'ipc:///tmp/x.sock'"),
        ("ipc://x.sock", "must be absolute"),
        ("tcp://127.0.0.1", "needs a port"),
        ("", "non-empty"),
    ],
)
def test_bad_addresses_are_refused_in_one_line(address: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as e:
        check_address(address)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=says):
        Connection(address)


@pytest.mark.parametrize(
    "address", ["ipc:///tmp/x.sock", "ipc://@abstract", "tcp://10.0.0.1:5555", "inproc://x"]
)
def test_good_addresses_pass(address: str) -> None:
    assert check_address(address) == address


def test_one_default_for_serve_stats_and_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    from loaderd.client.dataset import LoaderdDataset

    monkeypatch.setenv("LOADERD_SOCKET", "ipc:///tmp/ld-env/d.sock")
    assert default_address() == "ipc:///tmp/ld-env/d.sock"
    parser = build_parser()
    assert parser.parse_args(["serve", "--db", "x"]).socket == default_address()
    assert parser.parse_args(["stats"]).socket == default_address()
    assert LoaderdDataset(None, job="j", batch_size=4).address == default_address()
    monkeypatch.delenv("LOADERD_SOCKET")
    assert default_address().startswith("ipc:///tmp/loaderd-")


def test_cli_names_a_bad_address(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--socket", "/tmp/x.sock"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("loaderd: error: address '/tmp/x.sock'")


def test_tcp_without_keys_says_keys_are_needed() -> None:
    # Nothing listens on this port; the hint must be about keys, not about a daemon being down.
    with (
        Connection("tcp://127.0.0.1:9", timeout_s=0.2) as conn,
        pytest.raises(DaemonUnavailableError, match="CURVE keys: pass curve_dir"),
    ):
        conn.wait(conn.send(MsgType.PING, {}))


def test_a_send_that_cannot_go_fails_within_the_timeout_not_forever(tmp_path: Path) -> None:
    # Nobody reads: once zmq's send queue is full, a send would block (as it does when a failed
    # CURVE handshake leaves the socket no pipe at all). It must fail like a missing reply.
    address = f"ipc://{tmp_path}/nobody.sock"
    with (
        Connection(address, timeout_s=0.2) as conn,
        pytest.raises(DaemonUnavailableError, match=address),
    ):
        for _ in range(100_000):
            conn.send(MsgType.PING, {})
    with Connection(address, timeout_s=0.2) as conn:  # a fresh socket is usable again
        assert conn.send(MsgType.PING, {}) == 1
    with Connection(address, timeout_s=1e9) as conn:  # past zmq's int of milliseconds
        assert conn.send(MsgType.PING, {}) == 1
