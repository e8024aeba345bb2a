"""Exclusive locks on outputs shared between processes: one embed job per shard store, one
workflow run per ``outdir`` (docs/cluster.md, "One run per outdir").

A lock is an ``flock`` on a small file that records its holder (pid, host). The kernel drops
it when the holder dies, however it dies, so a lock left by a dead process is simply taken
over; the recorded holder only names who is there when a second process is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from embedpipe.core.errors import EmbedpipeError


class LockedError(EmbedpipeError):
    """Another live process holds the lock; the message names the lock file and the holder."""


def _holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").split()
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a+", encoding="utf-8")  # the open handle is the lock
    except OSError as exc:
        raise EmbedpipeError(f"{what}: cannot create its lock {path} ({exc.strerror or exc})") from None


def _is_current(path: Path, handle: IO[str]) -> bool:
    """Whether ``handle`` is still the file at ``path``: a holder that let go may have removed
    it (:func:`holding` with ``remove``), and a lock on a removed file guards nothing."""
    try:
        st, mine = os.stat(path), os.fstat(handle.fileno())
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
            handle.close()
            raise LockedError(f"{what} is locked by another process ({_holder(path)}; lock {path}); "
                              f"wait for it to finish, or use {instead}") from None
        except OSError as exc:
            handle.close()
            raise EmbedpipeError(f"{path}: cannot lock ({exc.strerror}); the file system must support flock") from None
        if _is_current(path, handle):
            break
        handle.close()
    else:
        raise EmbedpipeError(f"{path}: cannot lock (it is removed and made again as fast as it is opened)")
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
