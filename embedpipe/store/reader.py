"""Public read API: ``open_store`` and ``Store``.

::

    import embedpipe

    with embedpipe.open_store("results/embeddings.h5") as store:
        X = store.mean()                  # dask array (N, D), last stored layer, lazy
        B = store.pooled(pooling="bos")   # the same for BOS vectors, when embedded with --pooling bos
        X.mean(axis=0).compute()
        v = store["P12345"]["mean"][store.layers[-1]]     # one record, aliases resolve
        R = store.per_residue("P12345")   # numpy (embedded_length, D)
        table = store.records()           # per-record columns (precision_used, fallback, ...)

Values come back in the storage dtype (float16 stores give float16; pass ``dtype=np.float32``
to upcast). Dask arrays open the file per chunk, so they survive pickling, forking and
distributed schedulers, and do not hold the file open. docs/store-format.md, "Reading".
The checks made at open are in ``embedpipe.store.opening``, the checked ID -> row lookup in
``embedpipe.store.lookup``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.store.checks import check_offsets, check_steps
from embedpipe.store.columns import COLUMNS
from embedpipe.store.digests import RECORD_PART, ROW_DIGEST, digest_problem
from embedpipe.store.format import decode_strings, read_root_attrs
from embedpipe.store.idindex import LazyIds, UnknownIdError
from embedpipe.store.lookup import RowLookup
from embedpipe.store.opening import open_checked
from embedpipe.store.readio import H5Rows, dask_array, dask_rows, dataset, read_from, row_range
from embedpipe.store.record_digest import block_mismatches, describe
from embedpipe.store.residues import ShardRows
from embedpipe.store.sequences import read_sequences
from embedpipe.store.sources import require_sources

__all__ = ["open_store", "Store", "UnknownIdError"]


def open_store(path: os.PathLike[str] | str) -> Store:
    """Open a complete store for reading (also a context manager)."""
    return Store(path)


class Store:
    """A complete embedpipe store, opened read-only. See ``docs/store-format.md``."""

    def __init__(self, path: os.PathLike[str] | str) -> None:
        self.path = Path(path).absolute()
        self._file: h5py.File | None = None
        self._open()

    # -- lifecycle ---------------------------------------------------------------------------

    def _open(self) -> None:
        """Open and check the file (embedpipe.store.opening), keeping what the reads need."""
        o = open_checked(self.path, self._is_record)
        self._version, self._provenance, self._deferred = o.version, o.provenance, o.deferred
        self._layers, self._pooling, self._n, self._ids = o.layers, o.pooling, o.n, o.ids
        self._offsets_ds, self._total_rows, self._shards = o.offsets, o.total_rows, o.shards
        self._dim, self._dtype, self._parts = o.dim, o.dtype, o.parts
        self._dsets: dict[str, h5py.Dataset] = {}
        self._lookup = RowLookup(self.path, lambda: self._h5, self._read, o.index, o.ids, o.n, o.n_skipped)
        self._file = o.file

    def _read(self, name: str, key: Any) -> np.ndarray:
        """A read through a kept dataset handle (per-ID reads do not re-open datasets)."""
        ds = self._dsets.get(name)
        if ds is None:
            ds = self._dsets[name] = dataset(self._h5, self.path, name)
        return read_from(ds, self.path, name, key)

    def _residues(self, name: str, start: int, stop: int) -> np.ndarray:
        """Per-residue rows ``start:stop``: from the shard stores themselves for a merged store."""
        if self._shards is not None:
            return self._shards.read(name, start, stop, self._dim, self._dtype)
        return self._read(name, slice(start, stop))

    def check_sources(self) -> None:
        """A merged store: every source's ``store_uuid`` now, not when first read (opens each
        source: O(sources); ``crosscheck`` does this before its sample)."""
        require_sources(self._h5, self.path)

    @property
    def _h5(self) -> h5py.File:
        if self._file is None:
            raise StoreError(f"{self.path}: store is closed")
        return self._file

    def close(self) -> None:
        if self._file is not None:
            if self._shards is not None:
                self._shards.close()
            self._dsets.clear()
            self._file.close()
            self._file = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "open": self._file is not None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = Path(state["path"])
        self._file = None
        self._open()
        if not state.get("open", True):
            self.close()

    def __repr__(self) -> str:
        return (
            f"<embedpipe Store {str(self.path)!r}: {self._n} records, layers {self._layers}, "
            f"dim {self._dim}, {self._dtype}{', per-residue' if self.has_per_residue else ''}>"
        )

    # -- metadata ----------------------------------------------------------------------------

    @property
    def provenance(self) -> dict[str, Any]:
        """Root attributes as plain Python (``config`` parsed from JSON)."""
        if self._deferred:
            with h5py.File(self.path, "r") as f:
                self._provenance.update(read_root_attrs(f, only=self._deferred))
            self._deferred = []
        return dict(self._provenance)

    @property
    def ids(self) -> LazyIds:
        """Record IDs in row order (aliases not included; see ``aliases``): a sequence read
        from the store block by block (``len``, indexing, iteration, ``in``; ``list(ids)``
        copies them all)."""
        return self._ids

    @property
    def layers(self) -> list[int]:
        """Absolute layer indices stored, ascending."""
        return list(self._layers)

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def dtype(self) -> np.dtype:
        """Storage dtype of the vectors (float32 or float16)."""
        return self._dtype

    @property
    def pooling(self) -> list[str]:
        """Pooled outputs stored: ``mean`` always, ``bos`` when embedded with ``--pooling bos``."""
        return list(self._pooling)

    @property
    def has_per_residue(self) -> bool:
        return self._offsets_ds is not None

    @property
    def aliases(self) -> dict[str, str]:
        """Merged stores: duplicate-sequence ID -> the ID of the stored record (look one up
        with ``resolve``; ``store.ids`` and iteration hold record IDs only)."""
        return dict(self._lookup.pairs("aliases", "of"))

    @property
    def skipped(self) -> dict[str, str]:
        """Merged stores with a manifest: skipped input ID -> reason."""
        return dict(self._lookup.pairs("skipped", "reason"))

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __contains__(self, record_id: object) -> bool:
        """A record ID or an alias: what ``store[...]`` accepts (``in store.ids``: records only)."""
        return isinstance(record_id, str) and (row := self._lookup.checked(record_id)[0]) is not None and row >= 0

    def _is_record(self, record_id: object) -> bool:
        """``record_id in store.ids``: a record ID, not an alias (agrees with iterating ``ids``)."""
        if not isinstance(record_id, str):
            return False
        row, alias = self._lookup.checked(record_id)
        return row is not None and row >= 0 and not alias

    def resolve(self, record_id: str) -> str:
        """The stored record ID for ``record_id`` (itself, or the record an alias points to):
        the lookup for aliases, which ``store.ids`` does not hold."""
        return self._ids.one(self._lookup.row(record_id))

    def index(self, record_id: str) -> int:
        """Row of ``record_id``; aliases resolve to the row of the record they duplicate."""
        return self._lookup.row(record_id)

    def layer(self, layer: int = -1) -> int:
        """Absolute layer index for ``layer``: a stored absolute index, or a negative index
        into the stored layers (-1 = the highest stored layer)."""
        layer = int(layer)
        if layer in self._layers:
            return layer
        if layer < 0 and -len(self._layers) <= layer:
            return self._layers[layer]
        raise StoreError(f"layer {layer} is not stored in {self.path.name} (stored: {self._layers})")

    # -- data --------------------------------------------------------------------------------

    def _dask(self, name: str, label: str, dtype: Any, shards: ShardRows | None = None) -> Any:
        """Dataset ``name`` as a lazy dask array in whole HDF5 chunks, named by the file's
        path, mtime and size (a rewritten store never reuses cached chunks)."""
        if shards is None:
            ds = dataset(self._h5, self.path, name)
            shape, dt, chunks = tuple(ds.shape), np.dtype(ds.dtype), ds.chunks
        else:  # read from the shard stores: the virtual dataset is not opened (embedpipe.store.opening)
            shape, dt, chunks = (self._total_rows, self._dim), self._dtype, None
        arr = dask_array(H5Rows(str(self.path), name, shape, dt, shards), dask_rows(shape, dt, chunks), label)
        return arr if dtype is None else arr.astype(dtype)

    def _pooled_name(self, pooling: str, layer: int) -> str:
        """The dataset of ``pooling`` at ``layer``, or one StoreError when it is not stored."""
        if pooling not in self._pooling:
            raise StoreError(f"{self.path.name} has no {pooling} vectors (stored: {', '.join(self._pooling)}; "
                             "BOS vectors need embedpipe embed --pooling bos)")
        return f"{pooling}/layer_{self.layer(layer)}"

    def mean(self, layer: int = -1, *, dtype: Any = None) -> Any:
        """Mean-pooled vectors of ``layer`` as a lazy dask array (N, D), row order = ``ids``."""
        return self.pooled(layer, "mean", dtype=dtype)

    def pooled(self, layer: int = -1, pooling: str = "mean", *, dtype: Any = None) -> Any:
        """Pooled vectors (``mean`` or ``bos``, see ``pooling``) of ``layer`` as a lazy dask array (N, D)."""
        name = self._pooled_name(pooling, layer)
        return self._dask(name, name.replace("/layer_", "-"), dtype)

    def mean_vector(self, record_id: str, layer: int = -1, *, dtype: Any = None, pooling: str = "mean") -> np.ndarray:
        """One record's mean vector (D,) as numpy (its BOS vector with ``pooling="bos"``)."""
        row = self.index(record_id)
        name = self._pooled_name(pooling, layer)
        vec = self._read(name, row)
        self.check_digests(name, slice(row, row + 1), vec[None])
        return vec if dtype is None else vec.astype(dtype)

    def _require_per_residue(self) -> h5py.Dataset:
        self._h5  # noqa: B018 - a closed store raises StoreError
        if self._offsets_ds is None:
            raise StoreError(f"{self.path.name} has no per-residue vectors (embedded without --per-residue)")
        return self._offsets_ds

    def per_residue(self, record_id: str, layer: int = -1, *, dtype: Any = None) -> np.ndarray:
        """Per-residue vectors (embedded_length, D) of one record (aliases resolve)."""
        self._require_per_residue()
        row = self.index(record_id)
        k = self.layer(layer)
        start, stop = (int(v) for v in self._checked_offsets(row, row + 1))
        out = self._residues(f"per_residue/layer_{k}", start, stop)
        self.check_digests(f"per_residue/layer_{k}", slice(row, row + 1), out, np.array([0, stop - start]))
        return out if dtype is None else out.astype(dtype)

    def per_residue_array(self, layer: int = -1, *, dtype: Any = None) -> Any:
        """All per-residue vectors of ``layer`` as one lazy dask array (rows, D); record i is
        rows ``offsets[i]:offsets[i+1]`` (see ``offsets``)."""
        self._require_per_residue()
        k = self.layer(layer)
        return self._dask(f"per_residue/layer_{k}", f"pr-{k}", dtype, self._shards)

    @property
    def offsets(self) -> np.ndarray | None:
        """per_residue/offsets (N+1,), or None without per-residue output (read when asked)."""
        if self._offsets_ds is None:
            return None
        return self._checked_offsets(0, self._n)

    def _checked_offsets(self, lo: int, hi: int) -> np.ndarray:
        """per_residue/offsets rows ``lo:hi+1``, checked before use: within 0..rows, not
        decreasing, each step the record's ``embedded_length`` (embedpipe.store.checks)."""
        name = "per_residue/offsets"
        if hi == lo + 1:  # one record (``per_residue``): plain int comparisons, no numpy calls
            start, stop = (int(v) for v in read_from(self._offsets_ds, self.path, name, slice(lo, lo + 2)))
            rows = int(self._read("embedded_length", lo)) if "embedded_length" in self._h5 else stop - start
            if 0 <= start <= stop <= self._total_rows and stop - start == rows:
                return np.array([start, stop], dtype=np.int64)
        off = check_offsets(read_from(self._require_per_residue(), self.path, name, slice(lo, hi + 1)), lo,
                            self._total_rows, self.path, name)
        if "embedded_length" in self._h5:
            check_steps(off, lo, self._read("embedded_length", slice(lo, hi)), self.path, name, "embedded_length")
        return off

    def _column(self, name: str, key: Any) -> Any:
        """Stored values of one per-record column (``sequence`` in either layout): one value for
        an integer ``key``, an array for a range."""
        if name != "sequence":
            return self._read(name, key)
        lo, hi = (key, key + 1) if isinstance(key, (int, np.integer)) else row_range(key, self._n)
        try:
            values = read_sequences(self._h5, int(lo), int(hi), self.path)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot read dataset sequence rows {lo}:{hi}: checksum mismatch or "
                             f"read error ({exc}); run embedpipe validate {self.path}") from None
        return values[0] if isinstance(key, (int, np.integer)) else np.array(values, dtype=object)

    def __getitem__(self, record_id: str) -> dict[str, Any]:
        """One record: its per-record fields and pooled vectors (``mean``, and ``bos`` when
        stored: layer -> (D,))."""
        row = self._lookup.row(record_id)
        canonical = self._ids[row]
        f = self._h5
        out: dict[str, Any] = {"id": record_id, "record_id": canonical,
                               "alias_of": canonical if canonical != record_id else None, "row": row}
        for name, column in COLUMNS.items():
            if name == "ids":
                continue
            if name in f:
                out[name] = column.to_python(self._column(name, row), f"{self.path}: dataset {name}", row)
            elif not column.required_in(self._version):
                out[name] = column.default
        for pooling in self._pooling:
            out[pooling] = {k: self._read(f"{pooling}/layer_{k}", row) for k in self._layers}
            for k, vec in out[pooling].items():
                self.check_digests(f"{pooling}/layer_{k}", slice(row, row + 1), vec[None])
        self.check_records(row, row + 1)
        return out

    def check_records(self, lo: int, hi: int) -> None:
        """Rows ``lo:hi``: each record's ID, sequence and per-record columns are the bytes
        written (format 3: the record part of ``row_digest``), else one StoreError naming the
        first record that differs. Every read of those fields comes through here."""
        if RECORD_PART not in self._parts or hi <= lo:
            return
        try:
            problem = describe(*block_mismatches(self._h5, self._parts, lo, hi, self._ids.one, self.path))
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot read rows {lo}:{hi}: checksum mismatch or read error ({exc}); "
                             f"run embedpipe validate {self.path}") from None
        if problem is not None:
            raise StoreError(f"{self.path}: {problem}: refusing to use them; run embedpipe validate {self.path}")

    def records(self, *, sequence: bool = False, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Per-record table, one array per column in row order (pass to ``pandas.DataFrame``):
        id, length, embedded_length, precision_used, fallback_reason, max_abs_activation,
        long_handling, windows (and sequence when asked); a later column an older store lacks
        reads as its default. ``rows`` (a step-1 slice) reads just those rows, so a whole
        store can be streamed block by block in bounded memory."""
        f = self._h5
        lo, hi = row_range(rows, self._n)
        key = slice(None) if rows is None else slice(lo, hi)
        table: dict[str, np.ndarray] = {"id": np.array(self._ids[key], dtype=object)}
        for name, column in COLUMNS.items():
            if name == "ids" or (name == "sequence" and not sequence):
                continue
            if name in f:
                table[name] = column.to_table(self._column(name, key), f"{self.path}: dataset {name}", lo)
            elif not column.required_in(self._version):
                table[name] = column.default_table(hi - lo)
        self.check_records(lo, hi)  # after the reads, whose failures name the dataset
        return table

    def mean_rows(self, rows: slice, layer: int = -1, *, pooling: str = "mean") -> np.ndarray:
        """Mean (or ``pooling``) vectors of the records in ``rows`` (a step-1 slice), as numpy
        in the storage dtype."""
        lo, hi = row_range(rows, self._n)
        return self._read(self._pooled_name(pooling, layer), slice(lo, hi))

    def digest_problem(self, name: str, rows: slice, values: np.ndarray, offsets: np.ndarray | None = None) -> str | None:
        """Whether ``values``, read from dataset ``name`` for the records in ``rows`` (pooled
        rows, or with ``offsets`` per-residue rows as :meth:`per_residue_rows` returns them),
        are the bytes the writer stored: None, or one line naming the first record that
        differs, its row and the dataset (docs/store-format.md, "Row digests"). A store without
        digests has nothing to compare."""
        if not self._parts:
            return None
        lo, hi = row_range(rows, self._n)
        recorded = decode_strings(self._read(ROW_DIGEST, slice(lo, hi)), f"{self.path}: dataset {ROW_DIGEST}", lo)
        return digest_problem(name, self._parts, recorded, values, self._ids.one, lo, offsets)

    def check_digests(self, name: str, rows: slice, values: np.ndarray, offsets: np.ndarray | None = None, *,
                      refusal: str = "refusing to use them") -> None:
        """:meth:`digest_problem` as one StoreError naming the store (``refusal``: what the
        command does about it)."""
        if (problem := self.digest_problem(name, rows, values, offsets)) is not None:
            raise StoreError(f"{self.path}: {problem}: {refusal}; run embedpipe validate {self.path}")

    def per_residue_rows(self, rows: slice, layer: int = -1) -> tuple[np.ndarray, np.ndarray]:
        """(vectors, offsets) of the records in ``rows``: record ``rows.start + i`` is
        ``vectors[offsets[i]:offsets[i+1]]``. One read for the whole block."""
        lo, hi = row_range(rows, self._n)
        offsets = self._checked_offsets(lo, hi)
        vectors = self._residues(f"per_residue/layer_{self.layer(layer)}", int(offsets[0]), int(offsets[-1]))
        return vectors, offsets - offsets[0]

