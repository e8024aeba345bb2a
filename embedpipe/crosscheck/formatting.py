"""How numbers and text look in the cross-check's outputs: the HTML page, the verdict
reasons and the stderr summary share these, so all three show the same digits."""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np

__all__ = ["escape", "format_cosine", "format_number", "format_percent", "format_short", "json_safe"]


def escape(value: Any) -> str:
    """``value`` as HTML text (None as empty), quotes escaped too."""
    return html.escape("" if value is None else str(value), quote=True)


def format_number(x: Any, digits: int = 3) -> str:
    """Integers with thousands separators, floats to ``digits`` significant digits (scientific
    when tiny or huge), ``n/a`` for None or a non-finite value."""
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "n/a"
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}"
    return str(x)


def format_cosine(x: Any) -> str:
    """A cosine with enough decimals to show how far below 1 it is: at least 6, more when
    needed (``0.99999997``), at most 12; ``n/a`` for a missing or non-finite value. Shared by
    the HTML page, the verdict reasons and the stderr summary, so all three show the same digits."""
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    gap = 1.0 - x
    digits = min(12, math.ceil(-math.log10(gap)) + 1) if 0 < gap < 1e-5 else 6
    return f"{x:.{digits}f}"


def format_percent(x: Any) -> str:
    """A fraction as a percentage with one decimal; ``n/a`` when missing or non-finite."""
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    return f"{100 * x:.1f}%"


def format_count(x: Any) -> str:
    """A count or a length in residues: whole, with thousands separators (``3,148``, never
    ``3.15e+03``); ``n/a`` when missing."""
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    return f"{round(x):,}" if float(x).is_integer() else f"{x:,.1f}"


def format_short(x: Any) -> str:
    """Three significant digits; ``n/a`` for a missing or non-finite value."""
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    return f"{x:.3g}"


def json_safe(value: Any) -> Any:
    """numpy scalars/arrays to Python, non-finite floats to None (crosscheck.json is strict JSON)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return [json_safe(v) for v in value.tolist()]
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int)) or value is None:
        return value
    return str(value)
