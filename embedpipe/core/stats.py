"""The distribution summary every report and ``info`` prints (count, non-finite, quantiles,
mean), in plain numpy, below the packages that summarise numbers (store, crosscheck)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

#: the quantiles an aggregate reports, by name
QUANTILES: dict[str, float] = {"min": 0.0, "p1": 0.01, "p5": 0.05, "median": 0.5, "p95": 0.95, "max": 1.0}


def aggregate(values: Iterable[float]) -> dict[str, Any]:
    """Distribution of ``values``: count, nonfinite count, then min, p1, p5, median, p95,
    max and mean over the finite values (None when there are none). Percentiles are
    numpy's default (linear interpolation)."""
    arr = np.asarray(list(values), dtype=np.float64).ravel()
    finite = arr[np.isfinite(arr)]
    out: dict[str, Any] = {"count": int(arr.size), "nonfinite": int(arr.size - finite.size)}
    if finite.size:
        qs = np.quantile(finite, list(QUANTILES.values()))
        out.update({name: float(q) for name, q in zip(QUANTILES, qs)})
        out["min"], out["max"] = float(finite.min()), float(finite.max())  # exact, not interpolated
        out["mean"] = float(finite.mean())
    else:
        out.update({name: None for name in QUANTILES})
        out["mean"] = None
    return out
