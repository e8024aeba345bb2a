"""Exclusive locks on outputs shared between processes: one embed job per shard store, one
workflow run per ``outdir`` (docs/cluster.md, "One run per outdir").

A lock is an ``flock`` on a small file that records its holder (pid, host). The kernel drops
it when the holder dies, however it dies, so a lock left by a dead process is simply taken
over; the recorded holder only names who is there when a second process is refused.

Lock files live in directories other users may write (a shared results directory, the GPU
lock directory), so one is never opened through a symbolic link (``O_NOFOLLOW``), and only a
regular file with no other name is used (:func:`open_lock_file`): a planted
``.x.h5.lock -> victim`` is refused in one line naming it, never truncated or chmod'ed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.paths import display_path


class LockedError(EmbedpipeError):
    """Another live process holds the lock; the message names the lock file and the holder."""


class UnsafeLockError(EmbedpipeError):
    """A lock path that is a symbolic link, not a regular file, or a file with another name
    (a hard link): whoever can write its directory may have planted it to make a writer
    truncate or chmod another file, so it is refused, naming the path."""


#: how a lock file is opened whatever else is asked: never through a symbolic link, never
#: waiting on a planted FIFO, never inherited by a child process
SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_lock_file(path: Path, flags: int, *, what: str, dir_fd: int | None = None) -> int:
    """``os.open(path, flags)`` (``O_CREAT`` makes it mode 0666 less the umask) for a lock
    file: the descriptor of a regular file with one link; an :class:`UnsafeLockError` naming
    ``path`` (``what`` says whose lock it is) for a symbolic link, a FIFO, a device, a
    directory or a hard link, which is closed unused. Other ``OSError`` propagate. With
    ``dir_fd`` (the directory already opened), ``path``'s name is opened in that directory."""
    try:
        fd = os.open(path if dir_fd is None else path.name, flags | SAFE_OPEN, 0o666, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeLockError(_unsafe(path, what, "is a symbolic link")) from None
        if exc.errno == errno.EISDIR:
            raise UnsafeLockError(_unsafe(path, what, "is a directory")) from None
        raise
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_nlink > 1:
        problem = f"has {info.st_nlink} links (a hard link to another file)"
    if problem is not None:
        os.close(fd)
        raise UnsafeLockError(_unsafe(path, what, problem))
    return fd


def _unsafe(path: Path, what: str, problem: str) -> str:
    return (f"{what}: its lock {display_path(path)} {problem}; refusing to use it (a lock is never opened "
            f"through a link: remove it if you did not make it)")


def _holder(fd: int) -> str:
    """Who holds the lock, as its file (the one just opened, never the path again) records it."""
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace").split()
    except OSError:
        return "unknown"
    fields = dict(part.split("=", 1) for part in text if "=" in part)
    return f"pid {fields.get('pid', '?')} on host {fields.get('host', '?')}"


def lock_path_for(output: Path) -> Path:
    """The lock of an output file (a store, a model, an export): a hidden ``.NAME.lock`` beside
    it, never the file itself (which is replaced by rename). Every writer of ``output`` takes
    this one lock: a group embed job for each of its stores, a single command for its outputs."""
    output = Path(output)
    return output.parent / f".{output.name}.lock"


def _open(path: Path, what: str) -> IO[str]:
    """The lock file, opened (created when missing) safely (:func:`open_lock_file`); the open
    handle is the lock. Another user's lock file (in a shared directory) opens read-only:
    enough for ``flock``, and it is not ours to write."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = open_lock_file(path, os.O_RDWR | os.O_CREAT, what=what)
        except PermissionError as denied:
            try:
                fd = open_lock_file(path, os.O_RDONLY, what=what)
            except FileNotFoundError:  # not another user's lock file: a directory we cannot write
                raise denied from None
    except OSError as exc:
        raise EmbedpipeError(f"{what}: cannot create its lock {path} ({exc.strerror or exc})") from None
    writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    return os.fdopen(fd, "r+" if writable else "r", encoding="utf-8")


def _ours(handle: IO[str]) -> bool:
    """Whether the lock file is this user's and open for writing: only then is its holder
    line rewritten (another user's lock file is locked, never truncated)."""
    return handle.writable() and os.fstat(handle.fileno()).st_uid == os.geteuid()


def _is_current(path: Path, handle: IO[str]) -> bool:
    """Whether ``handle`` is still the file at ``path`` (not a link planted since): a holder
    that let go may have removed it (:func:`holding` with ``remove``), and a lock on a removed
    file guards nothing."""
    try:
        st, mine = os.lstat(path), os.fstat(handle.fileno())
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def acquire(path: Path, what: str, *, instead: str = "another directory") -> IO[str]:
    """Take the lock ``path`` (created when missing) without waiting; the open handle holds it
    until closed or the process ends. Raises :class:`LockedError` naming the holder, and
    ``instead`` as the way around it."""
    path = Path(path)
    for _ in range(100):  # each retry: a holder removed the file as we opened it
        handle = _open(path, what)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(handle.fileno())
            handle.close()
            raise LockedError(f"{what} is locked by another process ({holder}; lock {path}); "
                              f"wait for it to finish, or use {instead}") from None
        except OSError as exc:
            handle.close()
            raise EmbedpipeError(f"{path}: cannot lock ({exc.strerror}); the file system must support flock") from None
        if _is_current(path, handle):
            break
        handle.close()
    else:
        raise EmbedpipeError(f"{path}: cannot lock (it is removed and made again as fast as it is opened)")
    if not _ours(handle):
        return handle  # another user's lock file: held, not rewritten
    try:  # who holds it, for the message of a refused process; the lock holds without it (a full disk)
        os.ftruncate(handle.fileno(), 0)  # unbuffered: nothing left to fail when the handle closes
        os.pwrite(handle.fileno(), f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass
    return handle


def _remove(path: Path, handle: IO[str]) -> None:
    """Remove the lock file while still holding it (then closed): a waiting opener of the old
    file sees it is no longer current and opens the path afresh (:func:`_is_current`)."""
    if _is_current(path, handle):
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def holding(paths: Sequence[tuple[Path, str]], *, instead: str = "another directory",
            remove: bool = False) -> Iterator[None]:
    """Hold every lock of ``paths`` ((lock file, what it guards)) for the block; taken in
    sorted order, all released (and none kept) when one is refused. With ``remove``, each lock
    file is removed as it is let go (no ``.NAME.lock`` left beside a command's outputs)."""
    with contextlib.ExitStack() as stack:
        for path, what in sorted(paths, key=lambda p: str(p[0])):
            handle = stack.enter_context(acquire(path, what, instead=instead))
            if remove:
                stack.callback(_remove, Path(path), handle)
        yield
