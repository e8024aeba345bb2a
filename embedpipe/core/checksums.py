"""sha256 of files, with a stat-keyed cache for checkpoints.

Every embed job records the sha256 of its checkpoint; for a 15B model that is tens of GB
read once more per shard. The cache (``$XDG_CACHE_HOME/embedpipe/sha256``) is keyed by the
file's real path and trusted only while its size, mtime, inode, device and ctime are unchanged.
The ctime matters: a checkpoint rewritten in place at the same size with its mtime set back
(``rsync --inplace --times``, ``cp -p`` over it) keeps size, mtime and inode, but the kernel
moves its ctime, which no user can set back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from embedpipe.core.atomic import write_text_atomic
from embedpipe.core.progress import progress_bar

_CHUNK = 8 << 20


def _cache_file(path: Path) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "embedpipe" / "sha256"
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return root / f"{key}.json"


def _stamp(stat: os.stat_result) -> dict[str, int]:
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino,
            "device": stat.st_dev, "ctime_ns": stat.st_ctime_ns}


def file_sha256(path: Path, *, quiet: bool = True, cache: bool = False) -> str:
    """sha256 hex digest of ``path``, read in chunks; a progress bar for files over 1 GiB.

    With ``cache``, a digest computed earlier for the same unchanged file is reused.
    Raises ``OSError`` for unreadable files (callers turn it into their own error).
    """
    path = Path(path)
    stat = path.stat()
    entry = _cache_file(path) if cache else None
    if entry is not None:
        try:
            saved = json.loads(entry.read_text())
            if saved.get("stamp") == _stamp(stat):
                return str(saved["sha256"])
        except (OSError, ValueError, KeyError):
            pass
    digest = hashlib.sha256()
    bar = progress_bar(quiet=quiet or stat.st_size < (1 << 30), total=stat.st_size, unit="B",
                       unit_scale=True, desc="sha256")
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
                bar.update(len(chunk))
    finally:
        bar.close()
    hexdigest = digest.hexdigest()
    if entry is not None:
        try:
            write_text_atomic(entry, json.dumps({"path": str(path.resolve()), "stamp": _stamp(stat), "sha256": hexdigest}))
        except Exception:  # a read-only home is no reason to fail a job
            pass
    return hexdigest
