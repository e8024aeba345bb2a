"""Per-residue rows of a merged store, read from its shard stores one file at a time.

A merged store's ``per_residue/layer_{k}`` are HDF5 virtual datasets over K shard stores. A
read through one virtual dataset handle keeps every source file it touched open until the
handle closes, and a source HDF5 cannot open (too many open files, ``ulimit -n``) silently
reads as the fill value: with K above the open-file limit, reads returned NaN and ``validate``
reported non-finite rows that were really a resource limit. So embedpipe's readers do not read
through the virtual datasets: they map a row range to its shard stores (``merged_rows`` and
``per_residue/offsets``) and read each from its own file, keeping at most a few open (a small
LRU). A failure to open a shard because of the open-file limit is reported as such, never as
corruption. Plain h5py readers can still read the virtual datasets (docs/store-format.md,
"Merged stores").
"""

from __future__ import annotations

import errno
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.store.attrjson import load_json_attr
from embedpipe.store.format import STORE_UUID_ATTR, attr_to_python, iter_row_blocks

#: shard stores kept open at once by one reader
OPEN_SOURCES = 8


def is_resource_error(exc: BaseException) -> bool:
    """An OSError that is a resource limit (too many open files), not a problem of the file."""
    return getattr(exc, "errno", None) in (errno.EMFILE, errno.ENFILE) or "Too many open files" in str(exc)


def open_error(store: Path | str, rel: str, exc: OSError) -> StoreError:
    """One line for a shard store that could not be opened; resource limits say so."""
    if is_resource_error(exc):
        return StoreError(f"{store}: cannot open shard store {rel}: too many open files (a resource limit of this "
                          "process, ulimit -n, not a problem of the store); raise the limit and retry")
    if isinstance(exc, PermissionError):
        return StoreError(f"{store}: cannot read shard store {rel}: permission denied (check the file's and its "
                          "directories' permissions)")
    reason = (str(exc).splitlines() or [type(exc).__name__])[0]
    return StoreError(f"{store}: cannot read shard store {rel} ({reason}); run embedpipe validate {store}")


def _pins(f: h5py.File) -> dict[str, Any]:
    """``merged_sources`` as rel -> store_uuid (empty when absent or malformed: validate says so)."""
    try:
        listed = load_json_attr(attr_to_python(f.attrs.get("merged_sources")) or "[]", "merged_sources")
        return {str(e["path"]): e.get("store_uuid") for e in listed}
    except (ValueError, TypeError, KeyError, AttributeError, StoreError):
        return {}


def read_from_sources(f: h5py.File) -> list[str]:
    """The datasets whose rows embedpipe reads from the shard stores, so never opens: a merged
    store's ``per_residue/layer_k`` (virtual datasets; opening one decodes every source's
    mapping, ~56 MiB at 16,000 sources, and its properties copy them again). Empty for other
    stores."""
    try:  # the attributes' shapes only: decoding 16,000 paths is for ShardRows.of
        sources = f.attrs.get_id("merged_from").shape
        rows = f.attrs.get_id("merged_rows").shape
    except KeyError:
        return []
    if (len(sources or ()) != 1 or not sources[0] or rows != (sources[0] + 1,) or "per_residue/offsets" not in f
            or not isinstance(f.get("per_residue"), h5py.Group)):
        return []
    return [f"per_residue/{k}" for k in f["per_residue"] if k.startswith("layer_")]


class ShardRows:
    """Where each shard store's per-residue rows lie in the merged store, and reads of them."""

    def __init__(self, store: Path, rels: list[str], bounds: np.ndarray, pins: dict[str, Any] | None = None) -> None:
        self.store, self.rels, self.bounds = Path(store), rels, np.asarray(bounds, dtype=np.int64)
        self.pins = pins or {}  # rel -> the store_uuid merged (checked when a source is first opened)
        self._files: OrderedDict[int, h5py.File] = OrderedDict()

    @classmethod
    def of(cls, f: h5py.File, store: Path) -> ShardRows | None:
        """For a merged store with per-residue rows (None otherwise): per-residue row bounds of
        each source, read from ``merged_rows`` and ``per_residue/offsets`` (K+1 reads)."""
        rels = [str(r) for r in (attr_to_python(f.attrs.get("merged_from")) or [])]
        rows = [int(v) for v in (attr_to_python(f.attrs.get("merged_rows")) or [])]
        if not rels or len(rows) != len(rels) + 1 or "per_residue/offsets" not in f:
            return None
        offsets = f["per_residue/offsets"]
        if offsets.shape != (rows[-1] + 1,):
            return None
        bounds = np.array([int(v) for v in _read_points(offsets, rows)], dtype=np.int64)
        if (np.diff(rows) < 0).any() or (np.diff(bounds) < 0).any() or bounds[0] != 0:
            raise StoreError(f"{store}: root attribute merged_rows or dataset per_residue/offsets does not split the "
                             f"rows into shard stores in order; run embedpipe validate {store}")
        return cls(store, rels, bounds, _pins(f))

    def __getstate__(self) -> dict:
        return {"store": str(self.store), "rels": self.rels, "bounds": self.bounds, "pins": self.pins}

    def __setstate__(self, state: dict) -> None:
        self.__init__(Path(state["store"]), state["rels"], state["bounds"], state.get("pins"))  # type: ignore[misc]

    def _file(self, s: int) -> h5py.File:
        f = self._files.get(s)
        if f is not None:
            self._files.move_to_end(s)
            return f
        if len(self._files) >= OPEN_SOURCES:
            self._files.popitem(last=False)[1].close()
        src = Path(self.rels[s])
        path = src if src.is_absolute() else self.store.resolve().parent / src
        try:
            f = h5py.File(path, "r")
        except OSError as exc:
            raise open_error(self.store, self.rels[s], exc) from None
        self._check_pin(s, f)
        self._files[s] = f
        return f

    def _check_pin(self, s: int, f: h5py.File) -> None:
        """The source is the file that was merged (its ``store_uuid``): checked here, when it is
        first read, not at open (opening 16,000 sources took ~10 s; docs/store-format.md)."""
        rel = self.rels[s]
        if rel not in self.pins:
            return
        want, have = self.pins[rel], attr_to_python(f.attrs.get(STORE_UUID_ATTR))
        if have != want:
            f.close()
            raise StoreError(f"{self.store}: source store {rel} was rewritten after the merge (store_uuid "
                             f"{have or 'none'}, merged {want or 'none'}): the merged store would mix runs; "
                             "re-run embedpipe merge")

    def _source(self, s: int, name: str, dim: int) -> h5py.Dataset:
        """Source ``s``'s dataset ``name``, once its shape is the rows the merged store maps to it."""
        ds = self._file(s)[name]
        want = (int(self.bounds[s + 1] - self.bounds[s]), dim)
        if ds.shape != want:
            raise StoreError(f"{self.store}: shard store {self.rels[s]} dataset {name} declares shape {ds.shape}, "
                             f"expected {want}; run embedpipe validate {self.store}")
        return ds

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """(source, start, stop in that source) covering merged rows ``lo:hi`` in order."""
        s = int(np.searchsorted(self.bounds, lo, side="right")) - 1
        while lo < hi and s < len(self.rels):
            base, end = int(self.bounds[s]), int(self.bounds[s + 1])
            stop = min(hi, end)
            if stop > lo:
                yield s, lo - base, stop - base
            lo, s = max(lo, stop), s + 1

    def read(self, name: str, lo: int, hi: int, dim: int, dtype: np.dtype) -> np.ndarray:
        """Merged rows ``lo:hi`` of ``name`` (e.g. ``per_residue/layer_6``), shard by shard."""
        parts = []
        for s, a, b in self.pieces(lo, hi):
            try:
                parts.append(self._source(s, name, dim)[a:b])
            except StoreError:
                raise
            except (OSError, KeyError) as exc:
                reason = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise StoreError(f"{self.store}: cannot read dataset {name} rows {lo}:{hi}, stored in {self.rels[s]}: "
                                 f"checksum mismatch or read error ({reason}); run embedpipe validate {self.store}") from None
        return np.concatenate(parts) if parts else np.zeros((0, dim), dtype=dtype)

    def blocks(self, name: str) -> Iterator[tuple[slice, np.ndarray]]:
        """(merged rows, block) over all of ``name``, one shard store open at a time, blocks of
        ~64 MiB within each (``embedpipe validate``: memory bounded per source)."""
        for s, rel in enumerate(self.rels):
            base = int(self.bounds[s])
            try:
                g = h5py.File(self.store.resolve().parent / rel if not Path(rel).is_absolute() else rel, "r")
            except OSError as exc:
                raise open_error(self.store, rel, exc) from None
            with g:
                ds = g[name]
                for sl in iter_row_blocks(ds):
                    try:
                        block = ds[sl]
                    except OSError as exc:
                        raise StoreError(f"dataset {name} rows {base + sl.start}:{base + sl.stop} (stored in {rel}): "
                                         f"checksum mismatch or read error ({exc})") from None
                    yield slice(base + sl.start, base + sl.stop), block


def _read_points(ds: h5py.Dataset, points: list[int]) -> Iterator[int]:
    """``ds[p]`` for increasing ``points``, one block of the dataset at a time."""
    block, cached = 1 << 16, (-1, np.zeros(0, dtype=np.int64))
    for p in points:
        b = p // block
        if cached[0] != b:
            cached = (b, ds[b * block : (b + 1) * block])
        yield int(cached[1][p - b * block])
