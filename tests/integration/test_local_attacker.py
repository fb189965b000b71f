"""A hostile local user against a real ``loaderd serve``: planted names, shared directories.

The attacker is a real second process running as another user (``setpriv`` to ``nobody``)
where the machine allows it; it works in a sticky, world-writable directory like ``/tmp``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import Daemon

pytestmark = pytest.mark.integration

NOBODY = 65534
can_switch_user = os.geteuid() == 0 and shutil.which("setpriv") is not None
needs_second_user = pytest.mark.skipif(not can_switch_user, reason="needs root and setpriv")


def loaderd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loaderd", *args], capture_output=True, text=True, timeout=60
    )


def as_nobody(*cmd: str) -> None:
    """Run ``cmd`` as another user (a real second process with another uid)."""
    subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd],
        check=True,
        timeout=30,
    )


def serve(db: Path, state: Path, socket: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return loaderd("serve", "--db", str(db), "--state-dir", str(state), "--socket", socket, *extra)


def refused(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("loaderd: error: "), out.stderr
    return last


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory like /tmp: root's, sticky, writable by all."""
    d = Path(tempfile.mkdtemp(prefix="ld-sh-", dir="/tmp"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@needs_second_user
def test_preplanted_socket_directory_is_refused(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, shared: Path
) -> None:
    as_nobody("mkdir", "-m", "0777", str(shared / "loaderd-0"))
    out = serve(dataset[0], tmp_path / "state", f"ipc://{shared}/loaderd-0/loaderd.sock")
    assert f"owned by uid {NOBODY}" in refused(out)
    assert os.listdir(shared / "loaderd-0") == [], "nothing of ours was created in it"


@needs_second_user
def test_planted_lock_link_and_foreign_socket_are_refused(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, shared: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o666)
    as_nobody("ln", "-s", str(victim), str(shared / "a.sock.lock"))
    state = tmp_path / "state"
    assert "symbolic link" in refused(serve(dataset[0], state, f"ipc://{shared}/a.sock"))
    assert victim.read_bytes() == b"precious", "the link's target was not truncated"
    # A socket another user bound at our name: never unlinked and replaced.
    code = f"import socket; s = socket.socket(socket.AF_UNIX); s.bind('{shared}/b.sock')"
    as_nobody(sys.executable, "-c", code)
    assert f"owned by uid {NOBODY}" in refused(serve(dataset[0], state, f"ipc://{shared}/b.sock"))


def test_socket_path_holding_a_regular_file_is_left_alone(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    sock_dir = Path(tempfile.mkdtemp(prefix="ld-", dir="/tmp"))
    try:
        notes = sock_dir / "notes.txt"
        notes.write_bytes(b"mine")
        out = serve(dataset[0], tmp_path / "state", f"ipc://{notes}")
        assert "not a socket" in refused(out)
        assert notes.read_bytes() == b"mine"
    finally:
        shutil.rmtree(sock_dir)


@needs_second_user
def test_planted_arena_file_is_refused(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, shared: Path
) -> None:
    as_nobody("sh", "-c", f"umask 0; : > {shared}/loaderd.arena")
    sock = Path(tempfile.mkdtemp(prefix="ld-", dir="/tmp"))
    try:
        nvram = ("--nvram-dir", str(shared), "--nvram-bytes", "64MiB")
        out = serve(dataset[0], tmp_path / "state", f"ipc://{sock}/d.sock", *nvram)
        last = refused(out)
        assert "arena" in last and f"owned by uid {NOBODY}" in last
        assert os.stat(shared / "loaderd.arena").st_size == 0, "nothing written into it"
    finally:
        shutil.rmtree(sock)


def test_state_directory_is_private(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)  # as an older daemon left it
    with Daemon(db=dataset[0], state_dir=state) as d:
        from loaderd.client import LoaderdDataset

        ds = LoaderdDataset(d.address, job="j", batch_size=64, timeout_s=10.0)
        assert sum(len(b["id"]) for b in ds) > 0
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_IMODE((state / "daemon.lock").stat().st_mode) == 0o600
    writable = tmp_path / "open"
    writable.mkdir()
    writable.chmod(0o777)
    sock = Path(tempfile.mkdtemp(prefix="ld-", dir="/tmp"))
    try:
        out = serve(dataset[0], writable, f"ipc://{sock}/d.sock")
        assert "state directory" in refused(out)
    finally:
        shutil.rmtree(sock)


def test_keys_generate_makes_the_directory_private_and_never_follows_links(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    keys.chmod(0o755)
    out = loaderd("keys", "generate", str(keys))
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
    # A planted link where a secret goes: refused, its target untouched.
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (other / "client.key_secret").symlink_to(victim)
    out = loaderd("keys", "generate", str(other))
    assert out.returncode == 1 and "client.key_secret already exists" in out.stderr
    assert victim.read_bytes() == b"precious"
    assert sorted(p.name for p in other.iterdir()) == ["authorized", "client.key_secret"]
