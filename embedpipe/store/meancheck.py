"""Whether each record's stored mean is the mean of its stored per-residue rows, within the
rounding the worker can honestly introduce: catches pooled vectors and per-residue rows from
different runs (a shard rewritten after merging) or edited in place. Used by ``embedpipe
validate``; see docs/store-format.md ("Checking a store", check 7).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import h5py
import numpy as np

from embedpipe.store.format import STORE_UUID_ATTR, stored_layers
from embedpipe.store.storage_dtype import storage_limits


def mean_tolerance(stored_mean: np.ndarray, abs_mean: np.ndarray, rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Largest honest |stored mean - mean of stored rows|, per element (records x D).

    The worker sums a record's fp32 rows in fp32 (error <= rows * u32 * mean|x|), casts the
    mean to the storage dtype (<= u_s * |mean|) and casts each row on its own (the mean of
    the cast rows moves by <= u_s * mean|x|); float16 adds up to half its smallest subnormal
    per cast. u = eps / 2; the factor 2 covers the double rounding and the float64 re-sum.
    The storage dtype's rounding comes from :func:`~embedpipe.store.storage_dtype.storage_limits`
    (an integer dtype: no relative error, half a unit per cast).
    """
    storage = storage_limits(dtype)
    u_s = storage.relative_rounding
    u32 = storage_limits(np.float32).relative_rounding
    atol = 4.0 * storage.absolute_rounding  # half a unit (subnormal) per cast, two casts, doubled
    return 2.0 * (u_s * (np.abs(stored_mean) + abs_mean) + rows[:, None] * u32 * abs_mean) + atol


def mean_mismatch(stored: np.ndarray, sums: np.ndarray, abss: np.ndarray, rows: np.ndarray, dtype: np.dtype,
                  layer: int, record: Callable[[int], tuple[str, int]]) -> tuple[int, str] | None:
    """Check 7 on a batch of whole records, the one comparison validate's streamed check and
    ``embed --reuse``'s rows make: their stored means (``stored``) against the sums and absolute
    sums of their ``rows`` per-residue rows. (how many records fail, one line naming the first:
    ``record(i)`` gives its ID and store row), or None when every record passes."""
    diff = np.abs(stored - sums / rows[:, None])
    tol = mean_tolerance(stored, abss / rows[:, None], rows, dtype)
    bad = (diff > tol).any(axis=1)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    j = int(np.argmax(diff[i] - tol[i]))
    rid, row = record(i)
    return int(np.count_nonzero(bad)), (
        f"record {rid!r} (row {row}) layer {layer}: stored mean differs from the mean of its {int(rows[i])} "
        f"per-residue rows by {diff[i, j]:.3g} at element {j} (tolerance {tol[i, j]:.3g} for {dtype}): pooled "
        "vectors and per-residue rows come from different runs or were edited")


#: offsets read at a time by the mean check (8 B each): memory independent of N
OFFSET_ROWS = 1 << 16


class ResidueStream:
    """A dataset of per-residue rows streamed in order and in any blocks, split into records by
    ``offsets`` (a dataset or an array), of which only the rows the current block touches are
    held, never all N+1. The base of the checks validate makes as its checksum pass streams
    (the mean check here, the row digests in :mod:`embedpipe.store.digests`)."""

    def __init__(self, offsets: h5py.Dataset | np.ndarray) -> None:
        self.offsets = offsets
        self._lo, self._buf = 0, np.asarray(offsets[0:1], dtype=np.int64)  # offsets[_lo : _lo + len(_buf)]
        self._open: int | None = None  # the record left open by the last block
        self.broken = False  # offsets decrease: the offsets check reports it, nothing to compare

    def _window(self, s: int, e: int) -> tuple[int, np.ndarray]:
        """(lo, offsets[lo:...]) from the record holding row ``s`` through the first offset at or
        past ``e`` (or the last); offsets before are dropped. Blocks arrive in row order."""
        end = int(self.offsets.shape[0])
        k = max(0, int(np.searchsorted(self._buf, s, side="right")) - 1)
        lo, parts = self._lo + k, [self._buf[k:]]
        top = lo + len(parts[0])
        while int(parts[-1][-1]) < e and top < end:
            try:
                nxt = np.asarray(self.offsets[top : top + OFFSET_ROWS], dtype=np.int64)
            except OSError:  # the checksum pass over per_residue/offsets reports it
                self.broken = True
                break
            if nxt[0] < parts[-1][-1] or (np.diff(nxt) < 0).any():
                self.broken = True
            parts.append(nxt)
            top += len(nxt)
        self._lo, self._buf = lo, parts[0] if len(parts) == 1 else np.concatenate(parts)
        return lo, self._buf

    def split(self, sl: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The records holding rows of the block ``sl``: (record rows, start and end of each
        one's piece within the block, whether the piece ends the record); None when there is
        nothing to compare (no rows, or broken offsets)."""
        s, e = sl.start, sl.stop
        lo, off = self._window(s, e)
        if self.broken:
            return None
        r0 = int(np.searchsorted(off[1:], s, side="right"))  # first record ending after s
        r1 = int(np.searchsorted(off[:-1], e, side="left"))  # records starting before e
        local = np.arange(r0, r1)
        starts = np.clip(off[r0:r1], s, e) - s
        ends = np.clip(off[r0 + 1 : r1 + 1], s, e) - s
        keep = ends > starts
        local, starts, ends = local[keep], starts[keep], ends[keep]
        if not local.size:
            return None
        return lo + local, starts, ends, off[local + 1] <= e

    def record_rows(self, rec: int) -> str:
        """``a:b``, the per-residue rows of record ``rec`` (one the current block touches)."""
        i = rec - self._lo
        return f"{int(self._buf[i])}:{int(self._buf[i + 1])}"


class MeanCheck(ResidueStream):
    """Streams one layer's per-residue rows (:class:`ResidueStream`) and compares each record's
    mean with its stored ``mean/layer_k`` row. Holds one partial record."""

    def __init__(self, mean: h5py.Dataset, offsets: h5py.Dataset | np.ndarray, ids: Sequence[str] | None,
                 layer: int) -> None:
        super().__init__(offsets)
        self.mean, self.ids, self.layer = mean, ids, layer
        self.dtype = np.dtype(mean.dtype)
        dim = int(mean.shape[1])
        self._sum = np.zeros(dim, dtype=np.float64)  # the record left open by the last block
        self._abs = np.zeros(dim, dtype=np.float64)
        self.failed = 0
        self.first: str | None = None

    def feed(self, sl: slice, block: np.ndarray) -> None:
        split = self.split(sl)
        if split is None:
            return
        recs, starts, _, done = split
        b = block.astype(np.float64)
        sums = np.add.reduceat(b, starts, axis=0)
        abss = np.add.reduceat(np.abs(b), starts, axis=0)
        if self._open == int(recs[0]):
            sums[0] += self._sum
            abss[0] += self._abs
        if not done[-1]:
            self._open, self._sum, self._abs = int(recs[-1]), sums[-1], abss[-1]
        else:
            self._open = None
        if done.any():
            local = recs[done] - self._lo
            rows = (self._buf[local + 1] - self._buf[local]).astype(np.float64)
            self._compare(recs[done], rows, sums[done], abss[done])

    def _compare(self, recs: np.ndarray, rows: np.ndarray, sums: np.ndarray, abss: np.ndarray) -> None:
        try:
            stored = self.mean[int(recs[0]) : int(recs[-1]) + 1][recs - recs[0]].astype(np.float64)
        except OSError:
            return  # the checksum pass over mean/layer_k reports it
        def record(i: int) -> tuple[str, int]:
            row = int(recs[i])
            return (self.ids[row] if self.ids else str(row)), row

        found = mean_mismatch(stored, sums, abss, rows, self.dtype, self.layer, record)
        if found is not None:
            self.first = self.first or found[1]
            self.failed += found[0]

    def problem(self) -> str | None:
        """One line naming the first failing record, or None."""
        if self.first is None or self.broken:
            return None
        more = f"; {self.failed} record(s) in this layer fail" if self.failed > 1 else ""
        return f"{self.first}{more}"


def mean_check_applies(f: h5py.File) -> bool:
    """Stores with per-residue rows that carry a ``store_uuid`` (written since the check exists)
    or are merged (the only stores that can mix runs). Older single-run stores are skipped."""
    return "per_residue" in f and (STORE_UUID_ATTR in f.attrs or "merged_from" in f.attrs)


def mean_checks(f: h5py.File, ids: Sequence[str] | None) -> dict[str, MeanCheck]:
    """per_residue/layer_k -> its mean check, when the check applies and the layout is sound
    (layout problems are reported by the structural checks; then there is nothing to compare).
    Reads two offsets here; each check reads the rest as its blocks advance."""
    if not mean_check_applies(f) or ids is None:
        return {}
    pr = f["per_residue"]
    n = len(ids)
    if "offsets" not in pr or pr["offsets"].shape != (n + 1,):
        return {}
    offsets = pr["offsets"]
    try:
        first, total = int(offsets[0]), int(offsets[n])
    except OSError:
        return {}
    if first != 0 or total < 0:
        return {}
    checks: dict[str, MeanCheck] = {}
    for k in stored_layers(f):
        name, mean_name = f"per_residue/layer_{k}", f"mean/layer_{k}"
        if name not in f or mean_name not in f:
            continue
        ds, mean = f[name], f[mean_name]
        if ds.ndim == 2 and mean.ndim == 2 and ds.shape == (total, mean.shape[1]) and mean.shape[0] == n:
            checks[name] = MeanCheck(mean, offsets, ids, k)
    return checks
