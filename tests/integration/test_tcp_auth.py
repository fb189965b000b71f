"""TCP only with CURVE and a ZAP authenticator: strangers get nothing, listed clients get data."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from loaderd.client import LoaderdDataset
from loaderd.client.connection import Connection
from loaderd.client.errors import DaemonUnavailableError, ErrorCode, RemoteError
from loaderd.client.protocol import MsgType
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, wait_until

pytestmark = pytest.mark.integration


def loaderd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loaderd", *args], capture_output=True, text=True, timeout=30
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    out = loaderd("keys", "generate", str(tmp_path / "keys"))
    assert out.returncode == 0, out.stderr
    return tmp_path / "keys"


@pytest.fixture
def tcp_daemon(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, keys: Path
) -> Iterator[tuple[Daemon, str]]:
    tcp = f"tcp://127.0.0.1:{free_port()}"
    d = Daemon(
        db=dataset[0], state_dir=tmp_path / "state", extra=["--tcp", tcp, "--curve-dir", str(keys)]
    ).start()
    try:
        yield d, tcp
    finally:
        d.close()


def no_reply(address: str, curve_dir: Path | None = None) -> bool:
    with Connection(address, timeout_s=1.0, curve_dir=curve_dir) as conn:
        try:
            conn.request(MsgType.PING, {}, expect=MsgType.PONG)
        except DaemonUnavailableError:
            return True
    return False


def test_listed_client_gets_data_and_ipc_still_works(
    tcp_daemon: tuple[Daemon, str], keys: Path
) -> None:
    d, tcp = tcp_daemon
    ds = LoaderdDataset(tcp, job="remote", batch_size=64, curve_dir=keys, timeout_s=5.0)
    assert sorted(i for b in ds for i in b["id"].tolist()) == list(range(N_SAMPLES))
    local = LoaderdDataset(d.address, job="local", batch_size=64, timeout_s=5.0)
    assert sum(len(b["id"]) for b in local) == N_SAMPLES


def test_strangers_get_nothing(tcp_daemon: tuple[Daemon, str], keys: Path, tmp_path: Path) -> None:
    _, tcp = tcp_daemon
    assert no_reply(tcp), "a client without CURVE"
    # An unknown client key, with the right server key.
    other = tmp_path / "other"
    assert loaderd("keys", "generate", str(other)).returncode == 0
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    shutil.copy(other / "client.key_secret", unknown / "client.key_secret")
    shutil.copy(keys / "server.key", unknown / "server.key")
    assert no_reply(tcp, unknown), "a client whose key is not authorized"
    # A listed client key, with the wrong server key.
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    shutil.copy(keys / "client.key_secret", wrong / "client.key_secret")
    shutil.copy(other / "server.key", wrong / "server.key")
    assert no_reply(tcp, wrong), "a client that trusts another server"
    assert not no_reply(tcp, keys), "while the listed client is served"


def test_tcp_refused_without_keys_or_authorized_clients(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, keys: Path
) -> None:
    base = ["serve", "--db", str(dataset[0]), "--state-dir", str(tmp_path / "s")]
    sock = ["--socket", f"ipc://{tmp_path}/x.sock"]
    tcp = f"tcp://127.0.0.1:{free_port()}"
    cases = {
        "without keys": [*base, *sock, "--tcp", tcp],
        "bare tcp": [*base, "--socket", tcp],
    }
    shutil.rmtree(keys / "authorized")
    cases["nobody authorized"] = [*base, *sock, "--tcp", tcp, "--curve-dir", str(keys)]
    for what, args in cases.items():
        out = loaderd(*args)
        assert out.returncode == 1, what
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("loaderd: error: "), (what, out.stderr)
        assert "tcp" in last.lower() or "authorized" in last, (what, last)


def test_removed_key_is_locked_out_and_an_added_one_let_in(
    tcp_daemon: tuple[Daemon, str], keys: Path, tmp_path: Path
) -> None:
    _, tcp = tcp_daemon
    authorized = keys / "authorized" / "client.key"
    saved = authorized.read_bytes()
    with Connection(tcp, timeout_s=5.0, curve_dir=keys) as live:
        live.request(MsgType.PING, {}, expect=MsgType.PONG)
        authorized.unlink()

        # The live connection: refused by name within the re-check interval, without restart.
        def refused() -> bool:
            try:
                live.request(MsgType.PING, {}, expect=MsgType.PONG)
            except RemoteError as e:
                assert e.code == ErrorCode.UNAUTHORIZED and "authorized" in str(e)
                return True
            return False

        wait_until(refused, what="the live connection to be refused")
    assert no_reply(tcp, keys), "a new connection with the removed key"
    (keys / "authorized" / "again.key").write_bytes(saved)
    assert not no_reply(tcp, keys), "the key added back is admitted without a restart"
