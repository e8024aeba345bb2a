"""Device selection, and one GPU per worker on a multi-GPU machine.

When Snakemake runs several embed jobs on one machine (``--resources gpu=4``), each worker
asked for ``cuda`` or ``auto`` takes an exclusive ``flock`` on one GPU's lock file and uses
that GPU; the lock dies with the process, so a killed job never leaves a GPU claimed. Lock
files are keyed by the GPU's UUID, so jobs that SLURM already confined to different GPUs
(``CUDA_VISIBLE_DEVICES``) never wait on each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import torch

from embedpipe.errors import EmbedpipeError

LOCK_DIR_ENV = "EMBEDPIPE_GPU_LOCK_DIR"


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
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "embedpipe-gpu-locks")


def claim_slot(keys: Sequence[str], directory: Path, *, candidates: Sequence[int] | None = None,
               poll_seconds: float = 2.0, timeout: float | None = None) -> tuple[int, IO[bytes]]:
    """Take an exclusive lock on the first free slot among ``candidates`` (default: all keys).

    Returns the slot index and the open lock file, which must stay open while the slot is used.
    Waits (polling) while every slot is taken.
    """
    directory.mkdir(parents=True, exist_ok=True)
    order = list(candidates) if candidates is not None else list(range(len(keys)))
    started = time.monotonic()
    while True:
        for index in order:
            handle = open(directory / f"gpu-{keys[index]}.lock", "ab")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            return index, handle
        if timeout is not None and time.monotonic() - started > timeout:
            raise EmbedpipeError(f"no free GPU after {timeout:.0f}s (locks in {directory})")
        time.sleep(poll_seconds)


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
    index, handle = claim_slot(keys, lock_dir(), candidates=candidates)
    try:
        torch.cuda.set_device(index)
        yield torch.device("cuda", index)
    finally:
        handle.close()
