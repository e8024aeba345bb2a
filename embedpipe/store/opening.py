"""Opening a store for reading: every check ``open_store`` makes before it hands out a ``Store``
(format, completeness, encoding tags, a merged store's sources, the datasets' layout, the
digests a format records) and what the reader reads once (layers, poolings, sizes, the ID index).

Apart from ``embedpipe.store.reader``, whose ``Store`` is what users call, because these checks
run once per open (and again when a pickled ``Store`` is opened in another process) and hold
none of the read methods. Memory at open is constant: IDs, aliases and offsets are read on
demand, and a merged store's per-source attributes when first asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.store.attr_digests import check_attrs
from embedpipe.store.checks import check_layout
from embedpipe.store.columns import COLUMNS
from embedpipe.store.digests import COVERED_SINCE, ROW_DIGEST, digest_parts
from embedpipe.store.encoding import check_encodings
from embedpipe.store.format import (
    PER_SOURCE_ATTRS,
    check_format,
    is_complete,
    open_h5,
    poolings_of,
    read_root_attrs,
    stored_layers,
)
from embedpipe.store.idindex import IdIndex, LazyIds
from embedpipe.store.readio import dataset, shard_rows
from embedpipe.store.residues import ShardRows, read_from_sources
from embedpipe.store.sources import require_sources_present

# HDF5 chunk cache of the open store: per-ID reads of small datasets hit decoded chunks
_CHUNK_CACHE_BYTES = 4 << 20


@dataclass
class OpenedStore:
    """A store that passed the checks at open, with what the reader keeps of it."""

    file: h5py.File
    version: int
    provenance: dict[str, Any]  # root attributes but the per-source ones
    deferred: list[str]  # the per-source root attributes present, parsed when first asked for
    layers: list[int]
    pooling: list[str]
    n: int
    index: IdIndex
    ids: LazyIds
    n_skipped: int
    offsets: h5py.Dataset | None  # per_residue/offsets, None without per-residue output
    total_rows: int
    shards: ShardRows | None  # a merged store's per-residue rows, read from its shard stores
    dim: int
    dtype: np.dtype
    parts: list[str]  # what each row digest covers ([] without digests)


def open_checked(path: Path, is_record: Callable[[object], bool]) -> OpenedStore:
    """Open the complete store at ``path`` read-only and check it, or one StoreError (the file
    closed); ``is_record``: whether an ID is a record ID (``LazyIds``'s ``in``)."""
    f = open_h5(path, cache_bytes=_CHUNK_CACHE_BYTES)
    try:
        version = check_format(f, path)
        if not is_complete(f):
            raise StoreError(f"{path}: incomplete store (the writer did not finish); refusing to read")
        # a merged store's virtual per-residue datasets are never opened: their rows are read
        # from the shard stores, and opening one costs O(sources) (docs/benchmarks.md)
        unopened = read_from_sources(f)
        check_encodings(f, path, by_name=unopened)
        provenance = read_root_attrs(f, skip=PER_SOURCE_ATTRS)  # those parsed when asked for
        deferred = [k for k in PER_SOURCE_ATTRS if k in f.attrs]
        # A merged store reads per-residue data from its shard stores: they must exist (HDF5
        # would silently return fill values for a missing source) and be the very files that
        # were merged (a rewritten shard would mix runs). Cheap: ``stat`` of each source here,
        # its store_uuid when it is first read (embedpipe.store.residues).
        require_sources_present(f, path)
        layers = stored_layers(f)
        pooling = poolings_of(f)
        dataset(f, path, "ids")
        # shapes against N and dim, offsets' ends, the index's layout (embedpipe.store.checks)
        n, _ = check_layout(f, path, list(COLUMNS), skip=unopened)
        # constant memory at open: IDs, aliases and offsets are read on demand
        index = IdIndex.open(f, path)
        ids = LazyIds(f["ids"], is_record)
        n_skipped = int(f["skipped/id"].shape[0]) if "skipped/id" in f else 0
        offsets = f["per_residue/offsets"] if "per_residue/offsets" in f else None
        total_rows = int(offsets[n]) if offsets is not None else 0
        shards = shard_rows(f, path, layers)
        if unopened and shards is None:  # its rows are read through the virtual datasets
            check_layout(f, path, list(COLUMNS))
        first = dataset(f, path, f"mean/layer_{layers[-1]}")
        dim, dtype = int(first.shape[1]), np.dtype(first.dtype)
        # row_digest (embedpipe.store.digests): absent from stores written before it existed;
        # from format 3 it also covers each record's ID, sequence and columns, and the root
        # attributes have theirs (embedpipe.store.attr_digests): both required
        parts = digest_parts(pooling, layers, offsets is not None, version) if ROW_DIGEST in f else []
        if version >= COVERED_SINCE:
            if ROW_DIGEST not in f:
                raise StoreError(f"{path}: dataset {ROW_DIGEST} is missing; a store of format {version} "
                                 f"records one: refusing to read it; run embedpipe validate {path}")
            check_attrs(f, path)
        return OpenedStore(f, version, provenance, deferred, layers, pooling, n, index, ids, n_skipped, offsets,
                           total_rows, shards, dim, dtype, parts)
    except StoreError:
        f.close()
        raise
    except (OSError, KeyError, ValueError, IndexError) as exc:
        f.close()
        raise StoreError(f"{path}: cannot read store: {exc}") from None
