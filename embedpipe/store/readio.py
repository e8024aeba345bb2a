"""Reading store data with one-line errors: ``read_dataset`` / ``read_from`` (a failed read names
the store, the dataset, the rows and, for a merged store, the shard file) and ``_H5Rows``, the
picklable loader behind the reader's dask arrays. docs/store-format.md, "Reading".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dask.array as da
import h5py
import numpy as np
from dask.base import tokenize

from embedpipe.core.errors import StoreError
from embedpipe.store.format import open_h5
from embedpipe.store.residues import ShardRows

# dask chunks: whole HDF5 chunks, about this many bytes per dask chunk
_DASK_CHUNK_BYTES = 64 << 20


def _rows_text(key: Any) -> str:
    if isinstance(key, (int, np.integer)):
        return f" row {int(key)}"
    if isinstance(key, slice) and key.step in (None, 1) and key.start is not None and key.stop is not None:
        return f" rows {key.start}:{key.stop}"
    if isinstance(key, tuple) and key:
        return _rows_text(key[0])
    return ""


def _sources_of(ds: h5py.Dataset, key: Any) -> str:
    """For a virtual dataset: the shard store(s) holding the rows read (where a bad chunk lies)."""
    if not ds.is_virtual:
        return ""
    key = key[0] if isinstance(key, tuple) and key else key
    if isinstance(key, (int, np.integer)):
        key = slice(int(key), int(key) + 1)
    if not isinstance(key, slice) or key.start is None or key.stop is None:
        return ""
    names = []
    for vmap in ds.virtual_sources():
        (lo, *_), (hi, *_) = vmap.vspace.get_select_bounds()
        if lo < key.stop and key.start <= hi and vmap.file_name not in names:
            names.append(vmap.file_name)
    return f", stored in {', '.join(names)}" if names else ""


def dataset(f: h5py.File, path: Path | str, name: str) -> h5py.Dataset:
    """``f[name]``, or one StoreError naming the store and the missing dataset."""
    try:
        return f[name]
    except KeyError:
        raise StoreError(f"{path}: dataset {name} is missing (run embedpipe validate {path})") from None


def read_dataset(f: h5py.File, path: Path | str, name: str, key: Any = slice(None)) -> np.ndarray:
    """``f[name][key]`` for every read of store data: a missing dataset or a failed read
    (checksum mismatch, truncation, a merged store's unreadable source) becomes one StoreError
    naming the store, the dataset and the rows, instead of h5py's bare message."""
    return read_from(dataset(f, path, name), path, name, key)


def read_from(ds: h5py.Dataset, path: Path | str, name: str, key: Any) -> np.ndarray:
    """``ds[key]`` of an open dataset handle, failures as in :func:`read_dataset`."""
    try:
        return np.asarray(ds[key])
    except (OSError, KeyError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise StoreError(
            f"{path}: cannot read dataset {name}{_rows_text(key)}{_sources_of(ds, key)}: checksum mismatch "
            f"or read error ({reason}); run embedpipe validate {path}"
        ) from None


class H5Rows:
    """A picklable array-like over one dataset: every read opens the file, reads, closes.

    Handed to ``dask.array.from_array``; holds only the path and the dataset name (and, for a
    merged store's per-residue rows, where each shard store's rows lie), so it is safe after
    fork, pickling and in other processes (no shared HDF5 handle).
    """

    def __init__(self, path: str, name: str, shape: tuple[int, ...], dtype: np.dtype,
                 shards: ShardRows | None = None) -> None:
        self.path = path
        self.name = name
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.ndim = len(shape)
        self.shards = shards

    def __getitem__(self, key: Any) -> np.ndarray:
        if self.shards is not None:  # one shard store open at a time (embedpipe.store.residues)
            rows, cols = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
            lo, hi, _ = rows.indices(self.shape[0])
            try:
                out = self.shards.read(self.name, lo, hi, self.shape[1], self.dtype)
            finally:
                self.shards.close()
            columns = (slice(None), *cols)
            return out[columns] if cols else out
        with open_h5(self.path) as f:
            return read_dataset(f, self.path, self.name, key)

    def __reduce__(self) -> tuple[Any, ...]:
        return (H5Rows, (self.path, self.name, self.shape, self.dtype.str, self.shards))


def dask_array(rows: H5Rows, chunk_rows: int, label: str) -> Any:
    """``rows`` as a lazy dask array of ``chunk_rows`` per chunk, named by the file's path,
    mtime and size (a rewritten store never reuses cached chunks)."""
    stat = Path(rows.path).stat()
    return da.from_array(rows, chunks=(chunk_rows, rows.shape[1]), lock=False, asarray=True,
                         meta=np.empty((0, rows.shape[1]), dtype=rows.dtype),
                         name=f"embedpipe-{label}-" + tokenize(rows.path, stat.st_mtime_ns, stat.st_size, rows.name))


def shard_rows(f: h5py.File, path: Path, layers: list[int]) -> ShardRows | None:
    """Where a merged store's per-residue rows lie (None for stores whose per-residue rows
    are their own): reads bypass the virtual datasets, which are not even opened (a merged
    store is known by ``merged_from`` and ``merged_rows``; embedpipe.store.residues)."""
    if f"per_residue/layer_{layers[-1]}" not in f:
        return None
    return ShardRows.of(f, path)


def row_range(rows: slice | None, n: int) -> tuple[int, int]:
    """(start, stop) of a step-1 row slice within ``n`` rows (stop >= start)."""
    if rows is None:
        return 0, n
    start, stop, step = rows.indices(n)
    if step != 1:
        raise StoreError(f"rows must be a contiguous slice (step 1), not {rows}")
    return start, max(start, stop)


def dask_rows(shape: tuple[int, ...], dtype: np.dtype, chunks: tuple[int, ...] | None) -> int:
    """Rows per dask chunk: ~64 MiB, whole HDF5 chunks (``chunks``) when the data has them."""
    row_bytes = max(1, np.dtype(dtype).itemsize * int(np.prod(shape[1:], dtype=np.int64)))
    rows = max(1, _DASK_CHUNK_BYTES // row_bytes)
    if chunks:
        c = chunks[0]
        rows = max(c, rows // c * c)
    return max(1, min(rows, shape[0])) if shape[0] else 1
