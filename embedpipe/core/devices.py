"""Device selection, and one GPU per worker on a multi-GPU machine.

When Snakemake runs several embed jobs on one machine (``--resources gpu=4``), each worker
asked for ``cuda`` or ``auto`` takes an exclusive ``flock`` on one GPU's lock file and uses
that GPU; the lock dies with the process, so a killed job never leaves a GPU claimed. Lock
files are keyed by the GPU's UUID, so jobs that SLURM already confined to different GPUs
(``CUDA_VISIBLE_DEVICES``) never wait on each other.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.locks import SAFE_OPEN, open_lock_file
from embedpipe.core.paths import display_path

LOCK_DIR_ENV = "EMBEDPIPE_GPU_LOCK_DIR"
WAIT_ENV = "EMBEDPIPE_GPU_WAIT"
DEFAULT_WAIT_SECONDS = 24 * 3600.0
SHARED_DIR_MODE = 0o1777


def resolve_device(spec: str) -> torch.device:
    """auto -> cuda when available, else cpu; validate cuda:N against what is visible."""
    spec = spec.strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise EmbedpipeError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise EmbedpipeError(f"device {spec!r} requested but CUDA is not available here; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise EmbedpipeError(
                f"device {spec!r} requested but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    elif device.type != "cpu":
        raise EmbedpipeError(f"unsupported device {spec!r}; use auto, cpu, cuda or cuda:N")
    return device


def lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or default_lock_dir())


def default_lock_dir() -> Path:
    return Path(tempfile.gettempdir()) / "embedpipe-gpu-locks"


def gpu_wait_seconds() -> float:
    """How long a worker waits for a free GPU: ``EMBEDPIPE_GPU_WAIT`` seconds, default 24 h."""
    raw = os.environ.get(WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_WAIT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0 or seconds == float("inf"):
        raise EmbedpipeError(f"{WAIT_ENV}={raw!r} is not a number of seconds (>= 0)")
    return seconds


def ensure_lock_dir(directory: Path) -> int:
    """Create the lock directory usable by every user, like /tmp (mode 1777: world-writable,
    sticky), whatever this user's umask; accept one another user made. Returns a descriptor of
    the directory (the caller closes it): the lock files are opened in it, never through a
    path that may have been swapped for a link since."""
    try:
        directory.mkdir(parents=True)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:
        raise EmbedpipeError(f"cannot create the GPU lock directory {directory}: {exc.strerror}; "
                             f"set {LOCK_DIR_ENV} to a directory every job can write") from None
    fd = _open_dir(directory)
    try:
        info = os.fstat(fd)
        shared = created or directory == default_lock_dir()
        if shared and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != SHARED_DIR_MODE:
            os.fchmod(fd, SHARED_DIR_MODE)  # mkdir's mode is cut by the umask; chmod is not
        elif not os.access(directory, os.W_OK | os.X_OK):
            raise EmbedpipeError(
                f"cannot create GPU lock files in {directory} (owned by uid {info.st_uid}, mode "
                f"{stat.S_IMODE(info.st_mode):o}); its owner can `chmod 1777` it, or set {LOCK_DIR_ENV}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir(directory: Path) -> int:
    """The lock directory itself, not a symbolic link to one (whose target a chmod would open
    to every user), and a directory."""
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | SAFE_OPEN)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_DIRECTORY on a link: ENOTDIR
            kind = "a symbolic link" if directory.is_symlink() else "not a directory"
            raise EmbedpipeError(f"the GPU lock directory {display_path(directory)} is {kind}; refusing to use "
                                 f"it (remove it if you did not make it, or set {LOCK_DIR_ENV})") from None
        raise EmbedpipeError(f"cannot open the GPU lock directory {directory}: {exc.strerror}; "
                             f"set {LOCK_DIR_ENV}") from None


def _open_lock(path: Path, dir_fd: int) -> IO[bytes]:
    """Open (creating, mode 0666) the lock file ``path`` in the lock directory opened as
    ``dir_fd``. Read-only is enough for ``flock``, so a lock file another user created opens
    too; no O_CREAT on an existing file, which a sticky directory may refuse for another
    user's file (fs.protected_regular)."""
    what = f"the GPU lock directory {display_path(path.parent)}"
    while True:
        try:
            return _share(os.fdopen(open_lock_file(path, os.O_RDONLY, what=what, dir_fd=dir_fd), "rb"))
        except FileNotFoundError:
            pass
        except PermissionError as exc:
            raise EmbedpipeError(f"cannot open the GPU lock file {path}: {exc.strerror}; its owner can "
                                 f"`chmod 666` it, or set {LOCK_DIR_ENV}") from None
        try:
            fd = open_lock_file(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, what=what, dir_fd=dir_fd)
        except FileExistsError:
            continue  # another worker created it just now
        os.fchmod(fd, 0o666)  # the umask cut the mode given to open
        return os.fdopen(fd, "rb")


def _share(handle: IO[bytes]) -> IO[bytes]:
    """Make a lock file of ours readable by every user (one an older version made 0600/0644),
    through its descriptor: the file opened, never what a path points to."""
    info = os.fstat(handle.fileno())
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o666:
        os.fchmod(handle.fileno(), 0o666)
    return handle


def claim_slot(keys: Sequence[str], directory: Path, *, candidates: Sequence[int] | None = None,
               poll_seconds: float = 2.0, timeout: float | None = None) -> tuple[int, IO[bytes]]:
    """Take an exclusive lock on the first free slot among ``candidates`` (default: all keys).

    Returns the slot index and the open lock file, which must stay open while the slot is used.
    Waits (polling) while every slot is taken, at most ``timeout`` seconds (None: forever).
    """
    dir_fd = ensure_lock_dir(directory)
    try:
        return _claim(keys, directory, dir_fd, candidates, poll_seconds, timeout)
    finally:
        os.close(dir_fd)


def _claim(keys: Sequence[str], directory: Path, dir_fd: int, candidates: Sequence[int] | None,
           poll_seconds: float, timeout: float | None) -> tuple[int, IO[bytes]]:
    """:func:`claim_slot` in the lock directory opened as ``dir_fd``."""
    order = list(candidates) if candidates is not None else list(range(len(keys)))
    started = time.monotonic()
    while True:
        for index in order:
            handle = _open_lock(directory / f"gpu-{keys[index]}.lock", dir_fd)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            return index, handle
        waited = time.monotonic() - started
        if timeout is not None and waited >= timeout:
            raise EmbedpipeError(
                f"no free GPU after waiting {waited:.0f}s (another job holds each lock in {directory}; "
                f"{WAIT_ENV} sets the wait in seconds)"
            )
        time.sleep(poll_seconds if timeout is None else max(0.0, min(poll_seconds, timeout - waited)))


def _gpu_keys() -> list[str]:
    keys = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        keys.append(str(uuid) if uuid is not None else f"index{index}")
    return keys


@contextlib.contextmanager
def claim_device(spec: str) -> Iterator[torch.device]:
    """Resolve ``spec`` and, for CUDA, hold an exclusive per-GPU lock while the block runs."""
    device = resolve_device(spec)
    if device.type != "cuda":
        yield device
        return
    keys = _gpu_keys()
    candidates = None if device.index is None else [device.index]
    index, handle = claim_slot(keys, lock_dir(), candidates=candidates, timeout=gpu_wait_seconds())
    try:
        torch.cuda.set_device(index)
        yield torch.device("cuda", index)
    finally:
        handle.close()
