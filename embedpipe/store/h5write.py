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
    err = write_error(path, tmp, exc)
    if err is not None:
        raise err from None


class H5Target:
    """The temporary file of :func:`atomic_h5`; ``create`` opens it for writing."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.file: h5py.File | None = None

    @contextlib.contextmanager
    def create(self, **kwargs: Any) -> Iterator[h5py.File]:
        """``h5py.File(tmp, "w", **kwargs)``, closed on success and abandoned on failure."""
        self.file = h5py.File(self.tmp, "w", **kwargs)
        try:
            yield self.file
        except BaseException:
            abandon(self.file)
            # abandoned once: h5py's handle of a file whose close failed must not be touched
            # again (asking it for its driver segfaults), so atomic_h5 only deletes the file
            self.file = None
            raise
        self.file.close()


@contextlib.contextmanager
def atomic_h5(path: Path) -> Iterator[H5Target]:
    """Write an HDF5 file atomically: ``with atomic_h5(out) as t, t.create(**kw) as f: ...``.

    On success the temporary file is renamed to ``path``; on any exception it is discarded
    (no partial file, no crash) and a write failure becomes ``cannot write PATH: <reason>``.
    """
    path = Path(path)
    target = H5Target(temp_path_for(path))
    try:
        yield target
        commit(target.tmp, path)
    except BaseException as exc:
        discard(target.file, target.tmp)
        reraise(path, target.tmp, exc)
        raise
