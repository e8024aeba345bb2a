"""Store integrity beyond checksums: which files a merged store was made from, and whether
each record's stored mean is the mean of its stored per-residue rows.

A checksum proves that a chunk holds the bytes that were written, not that the bytes of
two files belong to the same run. A merged store copies the pooled vectors but reads
per-residue rows from its shard stores, so rewriting a shard after merging would silently
mix two runs. Every store therefore carries a random ``store_uuid`` written at creation, and
a merged store records each source's identity (``merged_sources``); the checks here are the
one implementation that ``embedpipe validate``, ``open_store`` and ``crosscheck`` share.
See docs/store-format.md ("Merged stores", "Checking a store").
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.checksums import file_sha256
from embedpipe.errors import StoreError

#: root attribute: random uuid4 hex written when a store is created; a rewrite gets a new one
STORE_UUID_ATTR = "store_uuid"
#: root attribute of merged stores: JSON list of {path, store_uuid, size[, sha256]}
MERGED_SOURCES_ATTR = "merged_sources"


def new_store_uuid() -> str:
    """A fresh identity for a store being created."""
    return uuid.uuid4().hex


def resolve_source(store_dir: Path, file_name: str) -> Path:
    """A merged store's source path (relative to the merged file's directory) on this machine."""
    p = Path(file_name)
    return p if p.is_absolute() else store_dir / p


def _attr_str(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def source_identity(path: Path, rel: str, store_uuid: str | None) -> dict[str, Any]:
    """What a merge records about one source store. Stores from before ``store_uuid`` existed
    are identified by their sha256, computed now (one extra read of the file)."""
    entry: dict[str, Any] = {"path": rel, "store_uuid": store_uuid, "size": int(path.stat().st_size)}
    if store_uuid is None:
        try:
            entry["sha256"] = file_sha256(path)
        except OSError as exc:
            raise StoreError(f"{path}: cannot read store to compute its sha256: {exc.strerror or exc}") from None
    return entry


@dataclass(frozen=True)
class SourceProblem:
    """One source of a merged store that is missing or no longer the file that was merged."""

    rel: str
    message: str
    missing: bool


def recorded_sources(f: h5py.File) -> dict[str, dict[str, Any]]:
    """``merged_sources`` by path; empty for shard stores and for stores merged before it existed."""
    raw = _attr_str(f.attrs.get(MERGED_SOURCES_ATTR))
    if raw is None:
        return {}
    try:
        entries = json.loads(raw)
        return {str(e["path"]): dict(e) for e in entries}
    except (ValueError, TypeError, KeyError):
        raise StoreError(f"root attribute {MERGED_SOURCES_ATTR} is not a JSON list of sources") from None


def _identity_change(src: Path, entry: dict[str, Any], *, full: bool) -> str | None:
    """Why ``src`` is not the file recorded in ``entry`` (None when it still is)."""
    want_uuid = entry.get("store_uuid")
    try:
        with h5py.File(src, "r") as g:
            have_uuid = _attr_str(g.attrs.get(STORE_UUID_ATTR))
    except OSError as exc:
        return f"is unreadable ({str(exc).splitlines()[0] if str(exc) else exc})"
    if have_uuid != want_uuid:
        return (f"was rewritten after the merge (store_uuid {have_uuid or 'none'}, "
                f"merged {want_uuid or 'none'})")
    size = src.stat().st_size
    if size != entry.get("size"):
        return f"changed after the merge (size {size} bytes, merged {entry.get('size')})"
    if full and want_uuid is None and entry.get("sha256"):
        try:
            digest = file_sha256(src)
        except OSError as exc:
            return f"is unreadable ({exc.strerror or exc})"
        if digest != entry["sha256"]:
            return f"changed after the merge (sha256 {digest[:16]}..., merged {str(entry['sha256'])[:16]}...)"
    return None


def source_problems(f: h5py.File, store_path: Path, *, full: bool) -> list[SourceProblem]:
    """Sources of the merged store ``f`` that are missing or were rewritten since the merge.

    ``full`` also re-hashes legacy sources (recorded by sha256, no ``store_uuid``); without it
    they are compared by size and by still having no ``store_uuid`` (cheap: no data read).
    """
    store_dir = Path(store_path).resolve().parent
    recorded = recorded_sources(f)
    names = [_attr_str(v) or "" for v in np.atleast_1d(f.attrs.get("merged_from", []))]
    names += [rel for rel in recorded if rel not in names]
    out: list[SourceProblem] = []
    for rel in names:
        src = resolve_source(store_dir, rel)
        if not src.exists():
            out.append(SourceProblem(rel, f"source store {rel} is missing (looked for {src}); "
                                          "merged stores read per-residue data from their shard stores", True))
            continue
        why = _identity_change(src, recorded[rel], full=full) if rel in recorded else None
        if why:
            out.append(SourceProblem(rel, f"source store {rel} {why}: the merged store would mix runs; "
                                          "re-run embedpipe merge", False))
    return out


def require_sources(f: h5py.File, store_path: Path) -> None:
    """Raise StoreError (one line, naming the shard) unless every source is present and unchanged."""
    problems = source_problems(f, store_path, full=False)
    if problems:
        raise StoreError(f"{store_path}: {problems[0].message}")


# ---------------------------------------------------------------------------------------------
# stored mean vs per-residue rows


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
