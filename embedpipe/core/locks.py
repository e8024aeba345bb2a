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


def acquire(path: Path, what: str) -> IO[str]:
    """Take the lock ``path`` (created when missing) without waiting; the open handle holds it
    until closed or the process ends. Raises :class:`LockedError` naming the holder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - the handle is the lock
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise LockedError(f"{what} is locked by another process ({_holder(path)}; lock {path}); "
                          f"wait for it to finish, or use another directory") from None
    except OSError as exc:
        handle.close()
        raise EmbedpipeError(f"{path}: cannot lock ({exc.strerror}); the file system must support flock") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid={os.getpid()} host={socket.gethostname()}\n")
    handle.flush()
    return handle


@contextlib.contextmanager
def holding(paths: Sequence[tuple[Path, str]]) -> Iterator[None]:
    """Hold every lock of ``paths`` ((lock file, what it guards)) for the block; taken in
    sorted order, all released (and none kept) when one is refused."""
    with contextlib.ExitStack() as stack:
        for path, what in sorted(paths, key=lambda p: str(p[0])):
            stack.enter_context(acquire(path, what))
        yield
