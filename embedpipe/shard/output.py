"""Where shard writes: a spool directory next to ``out``, files fsynced in the background.

Everything a run writes goes into ``.NAME.tmp-PID-HOST-RANDOM`` beside ``out`` and is moved
into ``out`` only when complete (``shard._install``). The directory is removed on error, on
SIGTERM, and (by the next run) after SIGKILL or power loss. A write error, such as a full
disk, becomes one line naming the file.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from embedpipe.core.atomic import host_tag, remove_dead_temporaries, write_error

#: files waiting for their background fsync (each open until then): far below any ``ulimit -n``
MAX_PENDING = 32

__all__ = ["MAX_PENDING", "Syncer", "host_tag", "open_for_writing", "spool_directory", "write_errors"]


@contextlib.contextmanager
def spool_directory(out: Path) -> Iterator[Path]:
    """A fresh spool directory beside ``out``, removed when the block ends, however it ends.

    Stale spools of killed runs go first. Not mkdtemp: its 0700 mode would stick to ``out``
    after the rename; mkdir honours the umask.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_spools(out)
    with _sigterm_exits():
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{host_tag()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_spools(out: Path) -> None:
    """Remove ``.NAME.tmp-PID-*`` spool directories left by killed runs (SIGKILL, power loss).

    Only those of this host (or of older versions, which did not name the host) whose
    process no longer exists; a live run's spool is left alone. The same mechanism as the
    atomic files' temporaries (:func:`embedpipe.core.atomic.remove_dead_temporaries`).
    """
    remove_dead_temporaries(out.parent, re.compile(rf"\.{re.escape(out.name)}\.tmp-(\d+)-(?:([0-9a-f]{{8}})-)?[0-9a-f]+"))


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """While shard runs, SIGTERM raises ``SystemExit(143)`` so ``finally`` blocks clean up.

    The previous handler comes back afterwards. Signal handlers belong to the main thread;
    elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
            signal.SIG_DFL, None):
        yield  # not the main thread, or the command line already turns SIGTERM into an exception
        return

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def open_for_writing(path: Path, mode: str, **kwargs: Any) -> IO[Any]:
    """``open(path, mode, **kwargs)``; failure is one line naming ``path``. The caller closes it."""
    try:
        return open(path, mode, **kwargs)  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise write_error(path, exc, known=True) from None


@contextlib.contextmanager
def write_errors(fh: IO[Any], path: Path) -> Iterator[IO[Any]]:
    """Close ``fh`` at the end of the block; a write failure (full disk) becomes one line naming it."""
    try:
        with fh:
            yield fh
    except OSError as exc:
        raise write_error(path, exc, known=True) from None


class Syncer:
    """Write files and fsync them on a background thread.

    ``fsync`` releases the GIL, so the disk writeback of one shard overlaps the CPU work of the
    next. A file stays open until its fsync is done, so at most ``max_pending`` files wait:
    handing over one more first waits for the oldest, and a run with any number of shards
    keeps a bounded number of files open. Leaving the ``with`` block waits for every fsync
    (and re-raises its error); only then are the files moved into place.
    """

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedpipe-fsync")
        self._pending: deque[Future[None]] = deque()
        self._max_pending = max_pending

    def __enter__(self) -> Syncer:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        try:
            for future in self._pending:
                if exc_type is None:
                    future.result()
                else:
                    future.exception()  # wait, but let the first error propagate
        finally:
            self._pool.shutdown(wait=True)

    @staticmethod
    def _finish(fh: IO[Any], path: Path) -> None:
        try:
            fh.flush()
            os.fsync(fh.fileno())
        except OSError as exc:
            raise write_error(path, exc, known=True) from None
        finally:
            with contextlib.suppress(OSError):
                fh.close()

    @contextlib.contextmanager
    def syncing(self, fh: IO[Any], path: Path) -> Iterator[IO[Any]]:
        """Use an open file; on success it is flushed, fsynced and closed in the background.

        A write error (a full disk) becomes one line naming ``path``.
        """
        try:
            yield fh
        except OSError as exc:
            with contextlib.suppress(OSError):
                fh.close()
            raise write_error(path, exc, known=True) from None
        except BaseException:
            with contextlib.suppress(OSError):
                fh.close()
            raise
        while len(self._pending) >= self._max_pending:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._finish, fh, path))

    def write(self, path: Path, data: bytes) -> None:
        with self.syncing(open_for_writing(path, "wb"), path) as fh:
            fh.write(data)
