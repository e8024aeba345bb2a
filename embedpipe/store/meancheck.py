"""Whether each record's stored mean is the mean of its stored per-residue rows, within the
rounding the worker can honestly introduce: catches pooled vectors and per-residue rows from
different runs (a shard rewritten after merging) or edited in place. Used by ``embedpipe
validate``; see docs/store-format.md ("Checking a store", check 7).
"""

from __future__ import annotations

import h5py
import numpy as np

from embedpipe.store.format import STORE_UUID_ATTR, stored_layers


def mean_tolerance(stored_mean: np.ndarray, abs_mean: np.ndarray, rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Largest honest |stored mean - mean of stored rows|, per element (records x D).

    The worker sums a record's fp32 rows in fp32 (error <= rows * u32 * mean|x|), casts the
    mean to the storage dtype (<= u_s * |mean|) and casts each row on its own (the mean of
    the cast rows moves by <= u_s * mean|x|); float16 adds up to half its smallest subnormal
    per cast. u = eps / 2; the factor 2 covers the double rounding and the float64 re-sum.
    """
    u_s = float(np.finfo(dtype).eps) / 2
    u32 = float(np.finfo(np.float32).eps) / 2
    atol = 2.0 * float(np.finfo(dtype).smallest_subnormal)
    return 2.0 * (u_s * (np.abs(stored_mean) + abs_mean) + rows[:, None] * u32 * abs_mean) + atol


class MeanCheck:
    """Streams one layer's per-residue rows, in order and in any blocks, and compares each
    record's mean with its stored ``mean/layer_k`` row. Holds one partial record at a time."""

    def __init__(self, mean: h5py.Dataset, offsets: np.ndarray, ids: list[str], layer: int) -> None:
        self.mean, self.offsets, self.ids, self.layer = mean, offsets, ids, layer
        self.dtype = np.dtype(mean.dtype)
        dim = int(mean.shape[1])
        self._sum = np.zeros(dim, dtype=np.float64)  # the record left open by the last block
        self._abs = np.zeros(dim, dtype=np.float64)
        self._open: int | None = None
        self.failed = 0
        self.first: str | None = None

    def feed(self, sl: slice, block: np.ndarray) -> None:
        s, e = sl.start, sl.stop
        off = self.offsets
        r0 = int(np.searchsorted(off[1:], s, side="right"))  # first record ending after s
        r1 = int(np.searchsorted(off[:-1], e, side="left"))  # records starting before e
        recs = np.arange(r0, r1)
        starts = np.clip(off[r0:r1], s, e) - s
        ends = np.clip(off[r0 + 1 : r1 + 1], s, e) - s
        keep = ends > starts
        recs, starts = recs[keep], starts[keep]
        if not recs.size:
            return
        b = block.astype(np.float64)
        sums = np.add.reduceat(b, starts, axis=0)
        abss = np.add.reduceat(np.abs(b), starts, axis=0)
        if self._open == int(recs[0]):
            sums[0] += self._sum
            abss[0] += self._abs
        done = off[recs + 1] <= e
        if not done[-1]:
            self._open, self._sum, self._abs = int(recs[-1]), sums[-1], abss[-1]
        else:
            self._open = None
        if done.any():
            self._compare(recs[done], sums[done], abss[done])

    def _compare(self, recs: np.ndarray, sums: np.ndarray, abss: np.ndarray) -> None:
        rows = (self.offsets[recs + 1] - self.offsets[recs]).astype(np.float64)
        try:
            stored = self.mean[int(recs[0]) : int(recs[-1]) + 1][recs - recs[0]].astype(np.float64)
        except OSError:
            return  # the checksum pass over mean/layer_k reports it
        computed = sums / rows[:, None]
        diff = np.abs(stored - computed)
        tol = mean_tolerance(stored, abss / rows[:, None], rows, self.dtype)
        bad = (diff > tol).any(axis=1)
        if bad.any():
            if self.first is None:
                i = int(np.argmax(bad))
                j = int(np.argmax(diff[i] - tol[i]))
                rid = self.ids[int(recs[i])] if self.ids else str(int(recs[i]))
                self.first = (f"record {rid!r} (row {int(recs[i])}) layer {self.layer}: stored mean differs from the "
                              f"mean of its {int(rows[i])} per-residue rows by {diff[i, j]:.3g} at element {j} "
                              f"(tolerance {tol[i, j]:.3g} for {self.dtype})")
            self.failed += int(np.count_nonzero(bad))

    def problem(self) -> str | None:
        """One line naming the first failing record, or None."""
        if self.first is None:
            return None
        more = f"; {self.failed} record(s) in this layer fail" if self.failed > 1 else ""
        return f"{self.first}: pooled vectors and per-residue rows come from different runs or were edited{more}"


def mean_check_applies(f: h5py.File) -> bool:
    """Stores with per-residue rows that carry a ``store_uuid`` (written since the check exists)
    or are merged (the only stores that can mix runs). Older single-run stores are skipped."""
    return "per_residue" in f and (STORE_UUID_ATTR in f.attrs or "merged_from" in f.attrs)


def mean_checks(f: h5py.File, ids: list[str] | None) -> dict[str, MeanCheck]:
    """per_residue/layer_k -> its mean check, when the check applies and the layout is sound
    (layout problems are reported by the structural checks; then there is nothing to compare)."""
    if not mean_check_applies(f) or ids is None:
        return {}
    pr = f["per_residue"]
    n = len(ids)
    if "offsets" not in pr or pr["offsets"].shape != (n + 1,):
        return {}
    try:
        offsets = pr["offsets"][:].astype(np.int64)
    except OSError:
        return {}
    if offsets[0] != 0 or (np.diff(offsets) < 0).any():
        return {}
    checks: dict[str, MeanCheck] = {}
    for k in stored_layers(f):
        name, mean_name = f"per_residue/layer_{k}", f"mean/layer_{k}"
        if name not in f or mean_name not in f:
            continue
        ds, mean = f[name], f[mean_name]
        if ds.ndim == 2 and mean.ndim == 2 and ds.shape == (offsets[-1], mean.shape[1]) and mean.shape[0] == n:
            checks[name] = MeanCheck(mean, offsets, ids, k)
    return checks
