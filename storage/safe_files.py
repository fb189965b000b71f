"""Files and directories another local user cannot plant, read or swap under us.

The daemon's state, sockets, arena and key files live at predictable names, often in shared
directories (``/tmp``, ``/dev/shm``). A hostile user who creates such a name first would own
what we then write into, so every such path goes through this module:

* a directory we keep our files in must be ours (or root's) and writable by nobody else;
  one we just made is 0700, one of ours that is merely readable by others is tightened;
* a file at a predictable name is opened with ``O_NOFOLLOW`` and must be a regular file we
  own; a new one is created 0600 from its first byte (never chmodded afterwards);
* a replacement goes through a temporary file of an unguessable name (``O_EXCL``), is
  fsynced, renamed over the target and the directory fsynced: a crash or a full disk leaves
  the old file or the new one, never a mix, and never a stray temporary.

It lives in ``storage/`` because the arena needs it and the storage layer must not import
the daemon; the daemon uses it as ``loaderd.storage.safe_files``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class UnsafePathError(PermissionError):
    """A path another user owns or can write, where we keep private files."""


class DaemonLockedError(RuntimeError):
    """Another live daemon holds the socket path or the state directory."""


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _check_kind_and_owner(
    st: os.stat_result, is_kind: Callable[[int], bool], kind: str, path: Path, what: str
) -> os.stat_result:
    if not is_kind(st.st_mode):
        raise UnsafePathError(f"refusing {what} {path}: not {kind}")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(
            f"refusing {what} {path}: owned by uid {st.st_uid}, not by us (uid {os.geteuid()})"
        )
    return st


def private_dir(path: Path, what: str) -> Path:
    """Create ``path`` 0700 if missing, and make sure nobody else can plant files in it.

    A directory of ours that others can only read (an older 0755 state directory) is
    tightened to 0700 with a warning; one owned by another user, or writable by group or
    others, is refused. A symbolic link is followed only if we (or root) made it.

    Args:
        path: the directory.
        what: what it is, for the error message ("state directory").

    Returns:
        ``path``.

    Raises:
        UnsafePathError: owned by another user, writable by others, or not a directory.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, PRIVATE_DIR_MODE)  # the umask may only narrow 0700
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and not _trusted_owner(link.st_uid):
        raise UnsafePathError(
            f"refusing {what} {path}: it is a symbolic link made by uid {link.st_uid}"
        )
    st = _check_kind_and_owner(os.stat(path), stat.S_ISDIR, "a directory", path, what)
    if st.st_mode & 0o022:
        raise UnsafePathError(
            f"refusing {what} {path}: mode {stat.S_IMODE(st.st_mode):o} lets other users "
            f"plant files in it (chmod 700 {path})"
        )
    if st.st_mode & 0o077:
        logger.warning(
            "%s %s was readable by other users (mode %o): made it 0700",
            what,
            path,
            stat.S_IMODE(st.st_mode),
        )
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def socket_dir(path: Path) -> Path:
    """The directory of an ipc socket: private as ``private_dir``, or a sticky root one.

    A sticky directory owned by root (``/tmp``) is accepted as it is: nobody else can
    remove or rename our socket and lock file in it, and the names we create there are
    checked one by one (``PathLock``, ``remove_stale_socket``).

    Raises:
        UnsafePathError: as ``private_dir``.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return private_dir(path, "socket directory")
    if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and st.st_mode & stat.S_ISVTX:
        return path
    return private_dir(path, "socket directory")


def check_own_file(fd: int, path: Path, what: str) -> os.stat_result:
    """Refuse an open file that is not a regular file we own; make it 0600 if it is ours.

    Raises:
        UnsafePathError: not a regular file, or owned by another user.
    """
    st = _check_kind_and_owner(os.fstat(fd), stat.S_ISREG, "a regular file", path, what)
    if st.st_mode & 0o077:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    return st


def open_private(path: Path, what: str, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """Open (or create 0600) a file at a predictable name without following a link.

    Returns:
        The file descriptor (close-on-exec).

    Raises:
        UnsafePathError: a symbolic link, not a regular file, or another user's file.
    """
    # The lstat names the problem (the kernel's protected_symlinks may answer EACCES
    # first); O_NOFOLLOW closes the race of a link planted after it.
    if os.path.islink(path):
        raise UnsafePathError(f"refusing {what} {path}: it is a symbolic link")
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(f"refusing {what} {path}: it is a symbolic link") from None
        raise
    try:
        check_own_file(fd, path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_exclusive(path: Path, data: bytes) -> None:
    """Write a new file 0600 from its first byte; never an existing file or link.

    Raises:
        FileExistsError: something (a file, a link) is already at ``path``.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def mkdir_durable(path: Path) -> None:
    """Create ``path`` (0700) and its missing parents, so that they survive a power loss.

    A new directory's name lives in its parent, so each parent that gained one is fsynced.
    """
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, PRIVATE_DIR_MODE)
        fsync_dir(d.parent)


def fsync_dir(path: Path) -> None:
    """Sync a directory, so the names created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: Path, data: bytes, sync: bool = True, *, before_replace: Callable[[], None] | None = None
) -> None:
    """Replace ``path`` with ``data`` so a crash leaves the old or the new file, never a mix.

    The temporary file has an unguessable name and is created ``O_EXCL`` 0600, so nothing
    planted in the directory can catch the bytes; a failed write (a full disk) removes it
    and leaves ``path`` as it was. ``rename`` replaces a link at ``path``, never its target.
    ``sync=False`` skips the fsyncs: the replacement then survives a crash of this process
    (the page cache keeps it) but not a crash of the machine.

    Raises:
        OSError: the write failed (``path`` is unchanged).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            _write_all(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_dir(path.parent)


class PathLock:
    """An exclusive ``flock`` on a file that dies with the process holding it.

    A crashed daemon's lock is released by the kernel, so a restart with the same command
    always works, while a live daemon can never be displaced. The lock file's name is
    predictable, so it is opened without following links and must be ours.

    Args:
        path: the lock file.
        what: what it guards, for the error message.

    Raises:
        DaemonLockedError: a live process holds it.
        UnsafePathError: a link, or another user's file, is at ``path``.
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self._fd = open_private(path, f"lock file of {what}")
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise DaemonLockedError(
                f"{what} is already served by a live daemon (pid {holder})"
            ) from None
        with contextlib.suppress(OSError):  # the pid is for humans; a full disk may refuse it
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Drop the lock (safe to call twice)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def remove_stale_socket(path: Path) -> None:
    """Remove a socket file left by a dead daemon (its lock is free); refuse anything else.

    Raises:
        UnsafePathError: ``path`` is a regular file, a link or another user's socket.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePathError(f"refusing to replace {path}: it is not a socket; remove it yourself")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"refusing to replace socket {path}: owned by uid {st.st_uid}")
    path.unlink()
