"""Writing HDF5 files that fail cleanly: a full disk mid-write is one line, not a crash.

After a write fails (``ENOSPC``), HDF5 keeps the dirty cache entries it could not write and
retries them when the file is flushed or closed; a close that fails again leaves h5py
objects whose release later crashes the interpreter (seen as exit 139 with h5py 3.16 /
HDF5 2.0). :func:`abandon` therefore points the file's descriptor at ``/dev/null`` before
closing, so the close succeeds and frees everything; the temporary file is then deleted by
name. See docs/store-format.md ("Atomic writes").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py

from embedpipe.core.atomic import commit, temp_path_for, write_error
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.units import human_bytes


def check_free_space(path: Path, needed: int) -> None:
    """Refuse up front when the file system of ``path`` has less free space than ``needed``
    bytes (a lower bound of the output's size), rather than after hours of compute. A file
    system that reports no sizes is not judged; a disk that fills later is still handled."""
    try:
        st = os.statvfs(Path(path).parent)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if st.f_blocks and needed > free:
        raise EmbedpipeError(
            f"cannot write {path}: it needs at least {human_bytes(needed)} and only {human_bytes(free)} "
            "is free on its file system"
        )


def abandon(f: h5py.File | None) -> None:
    """Close ``f`` whatever state a failed write left it in, discarding unwritten data."""
    if f is None:
        return
    with contextlib.suppress(Exception):
        if f.id.valid and f.driver == "sec2":
            fd = f.id.get_vfd_handle()
            null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, fd)
            finally:
                os.close(null)
    with contextlib.suppress(Exception):
        f.flush()
    with contextlib.suppress(Exception):
        f.close()


def discard(f: h5py.File | None, tmp: Path) -> None:
    """Abandon ``f`` and delete its temporary file."""
    abandon(f)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)


def reraise(path: Path, tmp: Path, exc: BaseException) -> None:
    """Raise ``exc`` as the one-line error for writing ``path`` when it is a write failure."""
    err = write_error(path, exc, tmp)
    if err is not None:
        raise err from None


class H5Target:
    """An HDF5 file written under a temporary name beside ``path`` and renamed into place only
    once complete: :func:`atomic_h5`'s target, and :class:`~embedpipe.store.writer.StoreWriter`'s
    for its whole life (open, then ``commit`` or ``discard``)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tmp = temp_path_for(self.path)
        self.file: h5py.File | None = None

    def open(self, **kwargs: Any) -> h5py.File:
        """``h5py.File(tmp, "w", **kwargs)``; the caller ends with ``commit`` or ``discard``."""
        self.file = h5py.File(self.tmp, "w", **kwargs)
        return self.file

    @contextlib.contextmanager
    def create(self, **kwargs: Any) -> Iterator[h5py.File]:
        """:meth:`open`, closed on success and abandoned on failure."""
        f = self.open(**kwargs)
        try:
            yield f
        except BaseException:
            abandon(f)
            # abandoned once: h5py's handle of a file whose close failed must not be touched
            # again (asking it for its driver segfaults), so discard only deletes the file
            self.file = None
            raise
        self.close()

    def close(self) -> None:
        """Close the file; one whose close fails stays for :meth:`discard` to abandon."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def commit(self) -> None:
        """Close the file, fsync it and rename it to ``path``."""
        self.close()
        commit(self.tmp, self.path)

    def discard(self, exc: BaseException | None = None) -> None:
        """Abandon the file and delete it; ``path`` is never touched. A write failure ``exc``
        (a full disk) is raised as one line naming ``path``; any other is left to the caller."""
        discard(self.file, self.tmp)
        self.file = None
        if exc is not None:
            reraise(self.path, self.tmp, exc)


@contextlib.contextmanager
def atomic_h5(path: Path) -> Iterator[H5Target]:
    """Write an HDF5 file atomically: ``with atomic_h5(out) as t, t.create(**kw) as f: ...``.

    On success the temporary file is renamed to ``path``; on any exception it is discarded
    (no partial file, no crash) and a write failure becomes ``cannot write PATH: <reason>``.
    """
    target = H5Target(path)
    try:
        yield target
        target.commit()
    except BaseException as exc:
        target.discard(exc)
        raise
