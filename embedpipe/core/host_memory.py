"""Keep freed host memory for reuse, so CPU batches do not page-fault fresh pages.

Why: glibc returns large blocks (above its mmap threshold) to the kernel when they are
freed, so every batch's activations (megabytes each) come back as new, zero-filled pages
(page-fault counts with and without: docs/benchmarks.md, "What the speed comes from").
The settings only change where glibc takes memory from; they never change a result. Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024

_applied = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; ``False`` where not glibc."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _applied
