"""Creating the store's datasets and groups, each the way docs/store-format.md lays it out:
chunked (about ``TARGET_CHUNK_BYTES`` a chunk), with the filters of ``embedpipe.store.filters``
and its encoding tag. The writer and merge create every dataset through here, so a store
written by either has the same layout; readers never call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

from embedpipe.store import filters
from embedpipe.store.format import (
    ARRAY,
    OFFSETS,
    POOLED,
    RAGGED,
    SMALL_CHUNK_BYTES,
    STRINGS,
    chunk_rows,
    encode_strings,
    string_dtype,
    tag,
)


def create_fixed_string_dataset(group: h5py.Group, name: str, n: int, width: int) -> h5py.Dataset:
    """An (n,) fixed-length UTF-8 string dataset: chunked, gzip (the padding compresses), fletcher32."""
    dtype = string_dtype(width)
    rows = chunk_rows(dtype.itemsize, n, target=SMALL_CHUNK_BYTES)
    ds = group.create_dataset(
        name,
        shape=(n,),
        dtype=dtype,
        chunks=(rows,),
        maxshape=(None,) if n == 0 else None,
        **filters.TEXT,
    )
    tag(ds, STRINGS)
    return ds


def create_string_dataset(group: h5py.Group, name: str, values: Sequence[str] | np.ndarray) -> h5py.Dataset:
    data = encode_strings(values)
    ds = create_fixed_string_dataset(group, name, len(data), data.dtype.itemsize)
    if len(data):
        ds[...] = data
        ds.flush()  # a write failure surfaces here, not when the dataset is garbage collected
    return ds


def create_array_dataset(
    group: h5py.Group,
    name: str,
    *,
    shape: tuple[int, ...],
    dtype: Any,
    data: np.ndarray | None = None,
    rows: int | None = None,
    compress: bool = False,
    encoding: str = ARRAY,
) -> h5py.Dataset:
    dtype = np.dtype(dtype)
    row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    if rows is None:
        rows = chunk_rows(row_bytes, shape[0])
    ds = group.create_dataset(
        name,
        shape=shape,
        dtype=dtype,
        chunks=(rows, *shape[1:]),
        maxshape=(None, *shape[1:]) if shape[0] == 0 else None,
        **filters.numbers(compress),
    )
    if data is not None and shape[0]:
        ds[...] = data
        ds.flush()  # a write failure surfaces here, not when the dataset is garbage collected
    tag(ds, encoding)
    return ds


def create_pooled_group(f: h5py.File, pooling: str) -> h5py.Group:
    """``{pooling}/`` (one of :data:`POOLINGS`); the caller adds ``layer_{k}``."""
    g = f.create_group(pooling)
    tag(g, POOLED, pooling=pooling)
    return g


def create_per_residue_group(f: h5py.File, offsets: np.ndarray | int) -> h5py.Group:
    """``per_residue/`` with its ``offsets``: (N+1,) written, or that many rows (an int) the
    caller writes (``merge``, block by block); the caller adds ``layer_{k}``."""
    pr = f.create_group("per_residue")
    tag(pr, RAGGED)
    rows = offsets if isinstance(offsets, int) else len(offsets)
    create_array_dataset(pr, "offsets", shape=(rows,), dtype=np.int64, data=None if isinstance(offsets, int) else offsets,
                         rows=chunk_rows(8, rows, target=SMALL_CHUNK_BYTES), compress=True, encoding=OFFSETS)
    return pr
