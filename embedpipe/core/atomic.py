"""Atomic output files: write under a temporary name in the same directory, fsync, rename.

A killed or failed job therefore never leaves a file at the final path that looks complete.
Temporary names carry the writer's PID and host (``.NAME.PID-HOST-RANDOM.tmp``), so the next
run that writes ``NAME`` removes the temporaries of writers that died (``kill -9``, a node
lost): :func:`remove_dead_temporaries`, shared with ``shard``'s spool directories.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal, overload

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.paths import display_path as _display


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


_KINDS = {
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "FIFO (named pipe)",
    stat.S_IFSOCK: "socket",
}


def refuse_non_regular(path: Path) -> None:
    """Refuse an existing ``path`` that is not a regular file: renaming over a device node or
    FIFO would replace it (as root, ``--out /dev/null`` would replace /dev/null)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # absent (or unreadable): creating the temp file next to it says what is wrong
    if stat.S_ISDIR(mode):
        raise EmbedpipeError(f"output {path} is a directory; give a file name")
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "special file")
        raise EmbedpipeError(f"output {path} exists and is a {kind}, not a regular file; refusing to replace it")


def check_output_path(path: Path) -> None:
    """Fail before any work when ``path`` cannot become an output file (a directory, a device
    node or FIFO, an unwritable or uncreatable parent), rather than after hours of compute at
    the rename. Every output writer calls this before it starts."""
    path = Path(path)
    refuse_non_regular(path)
    temp_path_for(path).unlink()


def check_output_entries(directory: Path, names: Iterable[str]) -> None:
    """:func:`refuse_non_regular` for each entry of an output directory that a run will
    replace or remove."""
    for name in names:
        refuse_non_regular(Path(directory) / name)


# errno values that mean "this file could not be written" rather than a bug
WRITE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG", "EIO", "EROFS", "EACCES", "EPERM") if hasattr(errno, name)
)
_HDF5_ERRNO = re.compile(r"errno = (\d+)")
_HDF5_FILE = re.compile(r"(?:file)?name = '([^']*)'")


_WORK_DIR = re.compile(r"^\.(?P<out>.+)\.tmp-\d+-")


def _write_errno(path: Path, tmp: Path | None, exc: BaseException) -> int | None:
    """The errno of ``exc`` when it is a write failure of ``path`` (or ``tmp``), else None."""
    if isinstance(exc, EmbedpipeError) or not isinstance(exc, (OSError, RuntimeError)):
        return None
    text = str(exc)
    mine = {str(path), str(tmp)} if tmp is not None else {str(path)}
    named = getattr(exc, "filename", None) or (m.group(1) if (m := _HDF5_FILE.search(text)) else None)
    if named is not None and str(named) not in mine:
        return None
    code = getattr(exc, "errno", None)
    if code is None and (m := _HDF5_ERRNO.search(text)):
        code = int(m.group(1))
    return code if isinstance(code, int) and code in WRITE_ERRNOS else None


@overload
def write_error(path: Path, exc: BaseException, tmp: Path | None = None, *, known: Literal[True]) -> EmbedpipeError: ...
@overload
def write_error(path: Path, exc: BaseException, tmp: Path | None = None, *,
                known: bool = False) -> EmbedpipeError | None: ...
def write_error(path: Path, exc: BaseException, tmp: Path | None = None, *,
                known: bool = False) -> EmbedpipeError | None:
    """The one-line error for a failed write of ``path``, the one message every writer gives
    (docs/store-format.md, "Atomic writes"): ``cannot write PATH: REASON``; a file in the
    hidden work directory of an output is named by the output it becomes, ``cannot write OUT
    (NAME in the work directory DIR): REASON`` (a full disk says only ``No space left on device``).

    ``known``: the caller caught ``exc`` writing ``path`` itself, so it is one whatever its
    errno. Otherwise None when ``exc`` is not a write failure of ``path`` (through its
    temporary ``tmp``): a bug, an interrupt, a problem with another file. Understands plain
    ``OSError`` and h5py's errors, which carry HDF5's message
    (``... filename = '...', errno = 28, error message = 'No space left on device' ...``).
    """
    if known:
        reason = str(getattr(exc, "strerror", None) or exc)
    elif (code := _write_errno(path, tmp, exc)) is not None:
        reason = os.strerror(code)
    else:
        return None
    for work_dir in Path(path).parents:
        work = _WORK_DIR.match(work_dir.name)
        if work is not None:
            out = work_dir.parent / work["out"]
            inside = f"{_display(Path(path).relative_to(work_dir))} in the work directory {_display(work_dir)}"
            return EmbedpipeError(f"cannot write {_display(out)} ({inside}): {reason}")
    return EmbedpipeError(f"cannot write {_display(path)}: {reason}")


def host_tag() -> str:
    """8 hex digits naming this host, so a run never judges another host's PIDs."""
    return hashlib.sha256(socket.gethostname().encode("utf-8", "surrogateescape")).hexdigest()[:8]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def remove_dead_temporaries(directory: Path, pattern: re.Pattern[str]) -> None:
    """Remove the entries of ``directory`` whose whole name matches ``pattern`` (group 1: the
    writer's PID, group 2: its host tag or None for names without one) and whose writer is
    gone: a process of this host that no longer exists. A live writer's, or another host's,
    is left alone. Files are unlinked, directories removed with their contents."""
    host = host_tag()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        pid = int(match[1])
        if match[2] not in (None, host) or pid == os.getpid() or _pid_alive(pid):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def work_dir_pattern(prefix: str) -> re.Pattern[str]:
    """The names :func:`owned_work_dir` gives its directories (``PREFIX PID-HOST-RANDOM``)."""
    return re.compile(rf"{re.escape(prefix)}(\d+)-([0-9a-f]{{8}})-[A-Za-z0-9_]+")


def make_owned_dir(prefix: str, parent: Path | None = None) -> Path:
    """A new scratch directory in ``parent`` (default: the temp dir) named by its owner's PID
    and host (``PREFIX PID-HOST-RANDOM``), after removing the directories of ``prefix`` whose
    owners died (``kill -9``, where no exit handler runs), as :func:`remove_dead_temporaries`
    does for files. The caller removes it."""
    parent = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    remove_dead_temporaries(parent, work_dir_pattern(prefix))
    try:
        return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-{host_tag()}-", dir=parent))
    except OSError as exc:
        raise EmbedpipeError(f"cannot create a work directory in {parent}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def owned_work_dir(prefix: str, parent: Path | None = None) -> Iterator[Path]:
    """:func:`make_owned_dir`, removed on exit."""
    path = make_owned_dir(prefix, parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def temp_pattern(path: Path) -> re.Pattern[str]:
    """The names :func:`temp_path_for` gives temporaries of ``path``."""
    return re.compile(rf"\.{re.escape(Path(path).name)}\.(\d+)-([0-9a-f]{{8}})-[A-Za-z0-9_]+\.tmp")


def temp_path_for(path: Path) -> Path:
    """A fresh, unused temporary name next to ``path`` (same filesystem, so rename is atomic),
    after removing the temporaries of ``path`` that dead writers left."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_temporaries(path.parent, temp_pattern(path))
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}-{host_tag()}-", suffix=".tmp",
                                    dir=path.parent)
    except OSError as exc:
        raise write_error(path, exc, known=True) from None
    os.close(fd)
    return Path(name)


def _default_mode() -> int:
    """0666 minus the umask: what a plainly created file would get (mkstemp makes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def commit(tmp: Path, path: Path) -> None:
    """fsync ``tmp``, give it ordinary permissions, and rename it over ``path``."""
    try:
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, _default_mode())
        refuse_non_regular(Path(path))  # a FIFO or device made while we worked
        os.replace(tmp, path)
    except OSError as exc:
        raise write_error(Path(path), exc, tmp, known=True) from None
    fsync_dir(Path(path).parent)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path; on success it becomes ``path``, on any exception it is removed
    (a failed write, e.g. a full disk, becomes one line naming ``path``)."""
    with atomic_paths(path) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_paths(*paths: Path) -> Iterator[tuple[Path, ...]]:
    """Like :func:`atomic_path` for files that belong together: all are written before any is
    renamed into place (in the order given), and a failure removes every temporary file."""
    finals = [Path(p) for p in paths]
    temps: list[Path] = []
    try:
        for final in finals:
            temps.append(temp_path_for(final))
        yield tuple(temps)
        for tmp, final in zip(temps, finals):
            commit(tmp, final)
    except BaseException as exc:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        for tmp, final in zip(temps, finals):
            if (err := write_error(final, exc, tmp)) is not None:
                raise err from None
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write a whole text file atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")

