"""The distribution summary every report and ``info`` prints (count, non-finite, quantiles,
mean), in plain numpy, below the packages that summarise numbers (store, crosscheck); and
:func:`spread`, picks evenly spaced over a sequence (the run's ``auto`` decision draws its
shards so, in the decide-precision job and in the rule that lists them)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

#: the input's files the run's ``auto`` decision draws its probe records from, evenly spaced over
#: them (the workflow's shards run short to long): here, torch-free, for the rule that lists them
DECISION_SAMPLE_FILES = 16

#: the quantiles an aggregate reports, by name
QUANTILES: dict[str, float] = {"min": 0.0, "p1": 0.01, "p5": 0.05, "median": 0.5, "p95": 0.95, "max": 1.0}


def spread(items: Sequence[T], most: int) -> list[T]:
    """At most ``most`` (at least 2) of ``items`` evenly spaced over them, the first and the last
    included; all of them when there are no more; ``spread(spread(x, n), n) == spread(x, n)``."""
    if len(items) <= most:
        return list(items)
    return [items[round(k * (len(items) - 1) / (most - 1))] for k in range(most)]


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


#: values an exact median selection gathers at once (8 MiB of float64) before it narrows further
SELECT_VALUES = 1 << 20
_SIGN = np.uint64(1 << 63)


def streamed_summary(blocks: Callable[[], Iterable[np.ndarray]]) -> dict[str, Any]:
    """``count``, ``nonfinite``, then ``min``, ``median`` and ``max`` of the finite values (absent
    when there are none) of the arrays ``blocks()`` yields, called once per pass over them.

    Why: ``info`` summarised a store's per-record column as one array (and :func:`aggregate`
    made it a list of Python floats): memory grew with the record count. Here memory is one
    block's: the median is exact, :func:`aggregate`'s (numpy's linear interpolation between the
    two middle values), found by selecting on the values' order-preserving bit patterns 16
    bits per pass until at most :data:`SELECT_VALUES` candidates are left (usually 2-3 passes)."""
    count = nonfinite = 0
    low, high = np.inf, -np.inf
    for block in blocks():
        x = np.asarray(block, dtype=np.float64).ravel()
        finite = x[np.isfinite(x)]
        count, nonfinite = count + x.size, nonfinite + x.size - finite.size
        if finite.size:
            low, high = min(low, float(finite.min())), max(high, float(finite.max()))
    out: dict[str, Any] = {"count": count, "nonfinite": nonfinite}
    n = count - nonfinite
    if n:
        k = (n - 1) // 2
        a = _select(blocks, k)
        b = a if n % 2 else _next_value(blocks, a, k)
        out.update(min=low, median=float(b - (b - a) * 0.5), max=high)  # numpy's lerp at t = 0.5
    return out


def _keys(block: np.ndarray) -> np.ndarray:
    """The finite values of ``block`` as uint64 keys in the values' order (IEEE bits, sign-folded)."""
    x = np.asarray(block, dtype=np.float64).ravel()
    bits = np.ascontiguousarray(x[np.isfinite(x)]).view(np.uint64)
    return np.where(bits >= _SIGN, ~bits, bits | _SIGN)


def _value(key: np.uint64 | int) -> float:
    key = np.uint64(key)
    bits = key & ~_SIGN if key >= _SIGN else ~key
    return float(np.array([bits], dtype=np.uint64).view(np.float64)[0])


def _select(blocks: Callable[[], Iterable[np.ndarray]], k: int) -> float:
    """The ``k``-th smallest (from 0) finite value, in passes over ``blocks()``."""
    prefix, known = 0, 0  # the top ``known`` bits of the wanted key
    while True:
        shift = np.uint64(64 - known - 16)
        hist = np.zeros(1 << 16, dtype=np.int64)
        for block in blocks():
            keys = _keys(block)
            if known:
                keys = keys[keys >> np.uint64(64 - known) == np.uint64(prefix)]
            hist += np.bincount(((keys >> shift) & np.uint64(0xFFFF)).astype(np.intp), minlength=1 << 16)
        below = np.cumsum(hist)
        digit = int(np.searchsorted(below, k, side="right"))
        k -= int(below[digit - 1]) if digit else 0
        prefix, known = (prefix << 16) | digit, known + 16
        if known == 64:
            return _value(prefix)
        if hist[digit] <= SELECT_VALUES:
            top = np.uint64(64 - known)
            found = np.concatenate([keys[keys >> top == np.uint64(prefix)] for keys in map(_keys, blocks())])
            return _value(np.partition(found, k)[k])


def _next_value(blocks: Callable[[], Iterable[np.ndarray]], a: float, k: int) -> float:
    """The ``k + 1``-th smallest finite value, given ``a``, the ``k``-th: ``a`` again when more
    than ``k + 1`` values are at most ``a``, else the smallest above it (one pass)."""
    at_most, above = 0, np.inf
    for block in blocks():
        x = np.asarray(block, dtype=np.float64).ravel()
        x = x[np.isfinite(x)]
        at_most += int(np.count_nonzero(x <= a))
        if (bigger := x[x > a]).size:
            above = min(above, float(bigger.min()))
    return a if at_most >= k + 2 else above
