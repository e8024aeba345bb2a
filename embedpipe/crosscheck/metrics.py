"""Pure numpy metrics for comparing embeddings with their fp32 reference.

Nothing here knows about stores, models or torch: every function takes arrays and returns
numbers, so each can be checked against an independent computation. Conventions:

* the *reference* is always the second argument (``ref``), the fp32 recomputation;
* all arithmetic is float64, whatever the inputs' dtype (float16 stores included);
* non-finite inputs give non-finite (NaN) results rather than raising: the caller turns
  them into a ``fail`` verdict.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from embedpipe.core.stats import aggregate

__all__ = [
    "Z95",
    "aggregate",
    "allocate_proportional",
    "compare_pooled",
    "compare_residues",
    "cosine",
    "describe_length_bins",
    "is_finite_number",
    "knn_overlap",
    "length_bins",
    "max_abs_diff",
    "mean_abs_diff",
    "rel_l2",
    "stratified_sample",
    "top_k_neighbours",
    "wilson_interval",
]

#: two-sided 95% normal quantile
Z95 = 1.959963984540054



# --------------------------------------------------------------------------- element metrics


def is_finite_number(x: Any) -> bool:
    """A Python or numpy number that is neither NaN nor infinite (None and strings are not)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def cosine(a: Any, b: Any) -> np.ndarray | float:
    """Cosine similarity along the last axis (a scalar for 1-D inputs).

    Two all-zero vectors count as identical (1.0); a zero vector against a non-zero one
    as 0.0. Any non-finite element gives NaN.
    """
    a, b = _f64(a), _f64(b)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {b.shape}")
    dot = np.sum(a * b, axis=-1)
    na = np.sqrt(np.sum(a * a, axis=-1))
    nb = np.sqrt(np.sum(b * b, axis=-1))
    denom = na * nb
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(denom > 0, dot / np.where(denom > 0, denom, 1.0), np.where((na == 0) & (nb == 0), 1.0, 0.0))
    finite = np.all(np.isfinite(a), axis=-1) & np.all(np.isfinite(b), axis=-1)
    out = np.where(finite, np.clip(out, -1.0, 1.0), np.nan)
    return float(out) if np.ndim(out) == 0 else out


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest |a - b| over all elements (NaN when any element is non-finite)."""
    d = np.abs(_f64(a) - _f64(b))
    if d.size == 0:
        return 0.0
    return float(d.max()) if np.all(np.isfinite(d)) else math.nan


def mean_abs_diff(a: Any, b: Any) -> float:
    """Mean |a - b| over all elements (NaN when any element is non-finite)."""
    d = np.abs(_f64(a) - _f64(b))
    if d.size == 0:
        return 0.0
    return float(d.mean()) if np.all(np.isfinite(d)) else math.nan


def rel_l2(a: Any, ref: Any) -> float:
    """Relative L2 (Frobenius) error ``||a - ref|| / ||ref||``; 0 when both are zero, inf
    when only ``ref`` is, NaN when anything is non-finite."""
    a, ref = _f64(a), _f64(ref)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(ref))):
        return math.nan
    num = float(np.linalg.norm((a - ref).ravel()))
    den = float(np.linalg.norm(ref.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def compare_pooled(stored: Any, ref: Any) -> dict[str, float]:
    """One pooled vector (D,) against its reference (D,)."""
    stored, ref = _f64(stored), _f64(ref)
    if stored.shape != ref.shape or stored.ndim != 1:
        raise ValueError(f"pooled vectors must be (D,) of equal shape: {stored.shape} vs {ref.shape}")
    return {
        "cosine": float(cosine(stored, ref)),
        "max_abs_diff": max_abs_diff(stored, ref),
        "mean_abs_diff": mean_abs_diff(stored, ref),
        "rel_l2": rel_l2(stored, ref),
    }


def compare_residues(stored: Any, ref: Any) -> dict[str, float]:
    """Per-residue vectors (L, D) against the reference (L, D): the cosine of every residue
    (min and mean reported), max and mean |difference|, relative L2 over the whole matrix."""
    stored, ref = _f64(stored), _f64(ref)
    if stored.shape != ref.shape or stored.ndim != 2:
        raise ValueError(f"per-residue arrays must be (L, D) of equal shape: {stored.shape} vs {ref.shape}")
    if stored.shape[0] == 0:
        return {"min_cosine": math.nan, "mean_cosine": math.nan, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "rel_l2": 0.0}
    cos = np.atleast_1d(cosine(stored, ref))
    finite = bool(np.all(np.isfinite(cos)))
    return {
        "min_cosine": float(cos.min()) if finite else math.nan,
        "mean_cosine": float(cos.mean()) if finite else math.nan,
        "max_abs_diff": max_abs_diff(stored, ref),
        "mean_abs_diff": mean_abs_diff(stored, ref),
        "rel_l2": rel_l2(stored, ref),
    }


# --------------------------------------------------------------------------- aggregates


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (default 95%); (0, 1) when n == 0."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    # exact ends: all successes -> upper bound 1, none -> lower bound 0
    if successes == n:
        hi = 1.0
    if successes == 0:
        lo = 0.0
    return lo, hi


# --------------------------------------------------------------------------- sampling


def length_bins(lengths: Sequence[int] | np.ndarray, n_bins: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Quantile bins over ``lengths``: ``(edges, bin_of_each)``.

    ``edges`` are unique, ascending; bin ``b`` holds lengths in ``[edges[b], edges[b+1])``
    (the last bin includes its upper edge). Fewer bins than asked when lengths repeat or
    there are few records; at least one bin when there is any record.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(1, dtype=np.float64), np.zeros(0, dtype=np.int64)
    n_bins = max(1, min(int(n_bins), int(np.unique(lengths).size)))
    edges = np.unique(np.quantile(lengths.astype(np.float64), np.linspace(0.0, 1.0, n_bins + 1)))
    if edges.size == 1:  # every record has the same length
        edges = np.array([edges[0], edges[0]], dtype=np.float64)
    inner = edges[1:-1]
    which = np.searchsorted(inner, lengths, side="right").astype(np.int64)
    # drop bins that ended up empty (possible with heavy ties) and renumber
    used = np.unique(which)
    if used.size != edges.size - 1:
        keep_lo = edges[:-1][used]
        edges = np.concatenate([keep_lo, edges[-1:]])
        remap = np.full(int(which.max()) + 1, -1, dtype=np.int64)
        remap[used] = np.arange(used.size)
        which = remap[which]
    return edges, which


def describe_length_bins(edges: np.ndarray, bin_of: np.ndarray, sampled_rows: np.ndarray) -> list[dict[str, Any]]:
    """One row per bin of :func:`length_bins`: its length range, how many records of the
    store fall in it and how many of them ``sampled_rows`` holds (``length_bins`` in
    crosscheck.json)."""
    sampled = Counter(int(bin_of[r]) for r in np.asarray(sampled_rows).tolist())
    counts = Counter(int(b) for b in bin_of.tolist())
    return [
        {
            "bin": b,
            "min_length": float(edges[b]),
            "max_length": float(edges[b + 1]),
            "closed_right": b == len(edges) - 2,
            "records": counts.get(b, 0),
            "sampled": sampled.get(b, 0),
        }
        for b in range(len(edges) - 1)
    ]


def allocate_proportional(sizes: Sequence[int], total: int) -> list[int]:
    """Split ``total`` over groups of ``sizes`` in proportion, with at least one for every
    non-empty group (while ``total`` allows) and never more than a group holds.

    One each first (largest groups first when ``total`` is smaller than the number of
    groups), then one at a time to the group furthest below its proportional quota
    ``total * size / sum(sizes)`` (ties: larger group, then lower index).
    """
    sizes = [int(s) for s in sizes]
    capacity = sum(sizes)
    total = min(int(total), capacity)
    alloc = [0] * len(sizes)
    if total <= 0:
        return alloc
    nonempty = sorted((i for i, s in enumerate(sizes) if s > 0), key=lambda i: (-sizes[i], i))
    for i in nonempty[:total]:
        alloc[i] = 1
    quota = [total * s / capacity for s in sizes]
    for _ in range(total - sum(alloc)):
        spare = [i for i in range(len(sizes)) if alloc[i] < sizes[i]]
        best = max(spare, key=lambda i: (quota[i] - alloc[i], sizes[i], -i))
        alloc[best] += 1
    return alloc


def stratified_sample(lengths: Sequence[int] | np.ndarray, n: int, seed: int, n_bins: int = 4) -> np.ndarray:
    """Row indices of a length-stratified sample of ``n`` records (all when fewer), sorted.

    Quantile bins over all lengths (:func:`length_bins`), the sample split over bins in
    proportion to their sizes with at least one per non-empty bin, and drawn per bin
    without replacement with ``numpy.random.default_rng(seed)``; bins are visited in
    ascending order, so the same (lengths, n, seed, n_bins) always gives the same rows.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    total = lengths.size
    if n >= total:
        return np.arange(total, dtype=np.int64)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    _, which = length_bins(lengths, n_bins=min(n_bins, n))
    groups = [np.flatnonzero(which == b) for b in range(int(which.max()) + 1)]
    alloc = allocate_proportional([g.size for g in groups], n)
    rng = np.random.default_rng(seed)
    chosen = [rng.choice(g, size=k, replace=False) for g, k in zip(groups, alloc) if k > 0]
    return np.sort(np.concatenate(chosen).astype(np.int64))


# --------------------------------------------------------------------------- neighbours


def _unit_rows(x: np.ndarray) -> np.ndarray:
    x = _f64(x)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


def top_k_neighbours(
    queries: Any,
    database_blocks: Iterable[tuple[int, Any]],
    k: int,
    exclude: Sequence[int] | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most cosine-similar database rows for each query, streamed over blocks.

    ``database_blocks`` yields ``(first_row, block (B, D))``; ``exclude[q]`` is a database
    row never returned for query q (the query's own record; -1 for none). Ties go to the
    lower row index, so the result is deterministic. Returns ``(rows (Q, k), sims (Q, k))``
    best first; with fewer than k candidates the tail holds row -1 and similarity -inf.
    Non-finite database rows are never neighbours; a non-finite query gets no neighbours.
    """
    q = _f64(np.atleast_2d(queries))
    q_finite = np.all(np.isfinite(q), axis=1)
    q = _unit_rows(np.where(q_finite[:, None], q, 0.0))
    n_q = q.shape[0]
    excl = np.full(n_q, -1, dtype=np.int64) if exclude is None else np.asarray(exclude, dtype=np.int64)
    best_rows = np.full((n_q, k), -1, dtype=np.int64)
    best_sims = np.full((n_q, k), -np.inf, dtype=np.float64)
    if k <= 0:
        return best_rows[:, :0], best_sims[:, :0]
    for start, block in database_blocks:
        block = _f64(block)
        if block.shape[0] == 0:
            continue
        finite = np.all(np.isfinite(block), axis=1)
        db = _unit_rows(np.where(finite[:, None], block, 0.0))
        sims = q @ db.T  # (Q, B)
        rows = np.arange(start, start + block.shape[0], dtype=np.int64)
        sims[:, ~finite] = -np.inf
        sims[rows[None, :] == excl[:, None]] = -np.inf
        sims[~q_finite, :] = -np.inf
        all_sims = np.concatenate([best_sims, sims], axis=1)
        all_rows = np.concatenate([best_rows, np.broadcast_to(rows, (n_q, rows.size))], axis=1)
        # order by (-sim, row); rows -1 (empty slots) and -inf similarities sort last
        key_rows = np.where(np.isneginf(all_sims) | (all_rows < 0), np.iinfo(np.int64).max, all_rows)
        order = np.lexsort((key_rows, -all_sims), axis=1)[:, :k]
        best_sims = np.take_along_axis(all_sims, order, axis=1)
        best_rows = np.take_along_axis(all_rows, order, axis=1)
        best_rows = np.where(np.isneginf(best_sims), -1, best_rows)
    return best_rows, best_sims


def knn_overlap(rows_a: np.ndarray, rows_b: np.ndarray) -> np.ndarray:
    """Per query, |neighbours_a ∩ neighbours_b| / k (empty slots, row -1, never match);
    NaN for a query whose either list is entirely empty (a non-finite query)."""
    rows_a, rows_b = np.atleast_2d(rows_a), np.atleast_2d(rows_b)
    k = rows_a.shape[1]
    if k == 0:
        return np.full(rows_a.shape[0], np.nan)
    out = np.empty(rows_a.shape[0], dtype=np.float64)
    for i, (a, b) in enumerate(zip(rows_a, rows_b)):
        if not (a >= 0).any() or not (b >= 0).any():
            out[i] = np.nan
            continue
        out[i] = len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) / k
    return out
