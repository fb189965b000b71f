"""Private directories, files at predictable names and atomic replacement, on real files."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from loaderd.storage.safe_files import (
    DaemonLockedError,
    PathLock,
    UnsafePathError,
    create_exclusive,
    private_dir,
    remove_stale_socket,
    write_atomic,
)

OTHER_UID = 65534  # nobody


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_private_dir_is_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        d = private_dir(tmp_path / "a" / "state", "state directory")
    finally:
        os.umask(old)
    assert mode(d) == 0o700


def test_private_dir_tightens_ours_and_refuses_writable(tmp_path: Path) -> None:
    readable = tmp_path / "readable"
    readable.mkdir()
    readable.chmod(0o755)
    private_dir(readable, "state directory")
    assert mode(readable) == 0o700
    for bits in (0o770, 0o777, 0o1777):
        shared = tmp_path / f"shared{bits:o}"
        shared.mkdir()
        shared.chmod(bits)
        with pytest.raises(UnsafePathError, match=r"lets other users plant files.*chmod 700"):
            private_dir(shared, "state directory")
        assert mode(shared) == bits, "never changed behind the user's back"
    not_dir = tmp_path / "file"
    not_dir.write_bytes(b"")
    with pytest.raises(UnsafePathError, match="not a directory"):
        private_dir(not_dir, "state directory")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_private_dir_refuses_another_users_dir_and_link(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePathError, match=f"owned by uid {OTHER_UID}, not by us"):
        private_dir(theirs, "socket directory")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePathError, match="symbolic link made by uid"):
        private_dir(link, "socket directory")


def test_path_lock_never_follows_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "d.sock.lock").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        PathLock(tmp_path / "d.sock.lock", "socket")
    assert victim.read_bytes() == b"precious"


def test_path_lock_excludes_a_second_process_and_is_0600(tmp_path: Path) -> None:
    lock = PathLock(tmp_path / "daemon.lock", "state directory")
    try:
        assert mode(tmp_path / "daemon.lock") == 0o600
        # A real second process trying the same lock.
        code = (
            "import sys; from pathlib import Path; from loaderd.storage.safe_files import *\n"
            "try: PathLock(Path(sys.argv[1]), 'state directory')\n"
            "except DaemonLockedError as e: print(e); sys.exit(3)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "daemon.lock")],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 3 and f"pid {os.getpid()}" in out.stdout
    finally:
        lock.release()
        lock.release()
    PathLock(tmp_path / "daemon.lock", "again").release()
    with pytest.raises(DaemonLockedError):
        held = PathLock(tmp_path / "daemon.lock", "x")
        try:
            PathLock(tmp_path / "daemon.lock", "x")
        finally:
            held.release()


def test_create_exclusive_refuses_any_existing_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "secret").symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_exclusive(tmp_path / "secret", b"key")
    assert victim.read_bytes() == b"precious"
    old = os.umask(0)
    try:
        create_exclusive(tmp_path / "new", b"key")
    finally:
        os.umask(old)
    assert mode(tmp_path / "new") == 0o600 and (tmp_path / "new").read_bytes() == b"key"


def test_write_atomic_ignores_planted_temporaries_and_replaces_links(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    # The names the old code used: a planted link there must not catch the bytes.
    (tmp_path / ".model.pt.tmp").symlink_to(victim)
    target = tmp_path / "model.pt"
    target.symlink_to(victim)
    write_atomic(target, b"weights")
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink() and target.read_bytes() == b"weights"
    assert mode(target) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.pt.tmp", "model.pt", "victim"]


_FULL_WRITE = """
import os, resource, signal, sys
from pathlib import Path
from loaderd.storage.safe_files import write_atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    write_atomic(Path(sys.argv[1]), b"x" * 100_000)
except OSError as e:
    print(e.errno)
    sys.exit(3)
"""


def test_write_atomic_that_fails_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "job.json"
    target.write_bytes(b'{"old": 1}')
    out = subprocess.run(
        [sys.executable, "-c", _FULL_WRITE, str(target)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 3, out.stderr
    assert target.read_bytes() == b'{"old": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["job.json"]


def test_remove_stale_socket_removes_only_sockets(tmp_path: Path) -> None:
    import socket

    regular = tmp_path / "notes.txt"
    regular.write_bytes(b"mine")
    with pytest.raises(UnsafePathError, match="not a socket"):
        remove_stale_socket(regular)
    assert regular.read_bytes() == b"mine"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "d.sock"))
    s.close()
    remove_stale_socket(tmp_path / "d.sock")
    assert not (tmp_path / "d.sock").exists()
    remove_stale_socket(tmp_path / "d.sock")  # nothing there: fine
