"""Paths as text: for files embedpipe writes (the manifest's ``source``) and for one-line
messages (control characters escaped), below every package that names a path."""

from __future__ import annotations

import os
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


def path_text(path: PathLike) -> str:
    """``path`` as UTF-8 text for files (the manifest's ``source``): non-UTF-8 bytes as ``\\xNN``.

    File names are bytes on POSIX; Python keeps undecodable ones as lone surrogates, which
    cannot be written to a UTF-8 file (docs/store-format.md, "Shard manifest").
    """
    return os.fsencode(path).decode("utf-8", errors="backslashreplace")


_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(32), 127)} | {9: "\\t", 10: "\\n", 13: "\\r"}


def display_path(path: PathLike) -> str:
    """``path`` for a one-line message: :func:`path_text` with control characters escaped too."""
    return path_text(path).translate(_CONTROL_ESCAPES)
