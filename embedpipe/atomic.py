"""Atomic output files: write under a temporary name in the same directory, fsync, rename.

A killed or failed job therefore never leaves a file at the final path that looks complete.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from embedpipe.errors import EmbedpipeError


def fsync_dir(directory: Path) -> None:
    """Persist a rename: fsync the directory entry (best effort where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_output_path(path: Path) -> None:
    """Fail before any work when ``path`` cannot become an output file (a directory, an
    unwritable or uncreatable parent), rather than after hours of compute at the rename."""
    path = Path(path)
    if path.is_dir():
        raise EmbedpipeError(f"output {path} is a directory; give a file name")
    temp_path_for(path).unlink()


def temp_path_for(path: Path) -> Path:
    """A fresh, unused temporary name next to ``path`` (same filesystem, so rename is atomic)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise EmbedpipeError(f"cannot write {path}: {exc.strerror or exc}") from None
    os.close(fd)
    return Path(name)


def _default_mode() -> int:
    """0666 minus the umask: what a plainly created file would get (mkstemp makes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def commit(tmp: Path, path: Path) -> None:
    """fsync ``tmp``, give it ordinary permissions, and rename it over ``path``."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.chmod(tmp, _default_mode())
    try:
        os.replace(tmp, path)
    except OSError as exc:
        raise EmbedpipeError(f"cannot write {path}: {exc.strerror or exc}") from None
    fsync_dir(Path(path).parent)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path; on success it becomes ``path``, on any exception it is removed."""
    path = Path(path)
    tmp = temp_path_for(path)
    try:
        yield tmp
        commit(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write a whole text file atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
