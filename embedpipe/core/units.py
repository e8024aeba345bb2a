"""Sizes as text for messages and ``info`` (KiB, MiB, ...), below every package that prints one."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit below 1024 of it (``512 B``, ``1.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
