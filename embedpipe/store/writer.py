"""Writing a store: :class:`StoreWriter`, and the header and "complete written last" steps that
every store is written with (merge uses them too). docs/store-format.md, "File level".

The file only appears under its final name (temp file in the same directory, fsync, rename)
once it is complete; the root attribute ``complete`` is written last.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.core.idtext import bad_id_message
from embedpipe.core.options import STORAGE_DTYPES
from embedpipe.store.attr_digests import write_attr_digests
from embedpipe.store.columns import COLUMNS, EmbeddedRecord, write_column
from embedpipe.store.create import create_array_dataset, create_per_residue_group, create_pooled_group
from embedpipe.store.digests import COVERED_SINCE, digest_parts, record_digest
from embedpipe.store.format import (
    FORMAT,
    FORMAT_VERSION,
    LIBVER,
    LONG_HANDLING,
    RESERVED_ATTRS,
    STORE_UUID_ATTR,
    chars_per_residue,
    new_store_uuid,
    stored_poolings,
    tag,
    utc_now,
    write_root_attrs,
)
from embedpipe.store.h5write import H5Target, check_free_space
from embedpipe.store.idindex import encode_ids, index_keys, write_id_index
from embedpipe.store.record_digest import covered_columns, record_part
from embedpipe.store.sequences import write_sequences

#: root attributes the writer derives from its arguments; callers may repeat them only unchanged
DERIVED_ATTRS = frozenset({"storage_dtype", "layers", "dim", "per_residue", "pooling"})

#: ``h5py.File`` options of every store being written. Chunk cache per dataset: w0=1 evicts
#: fully written chunks first, so rows arriving out of order within a few chunks are
#: assembled in memory, not re-read from disk.
WRITE_OPTIONS: dict[str, Any] = {"libver": LIBVER, "rdcc_nbytes": 32 << 20, "rdcc_w0": 1.0, "rdcc_nslots": 10_007}


def write_header(f: h5py.File, attrs: Mapping[str, Any], version: int = FORMAT_VERSION) -> None:
    """Format tags, a new ``store_uuid`` (a rewrite gets a new one) and the root attributes;
    ``created_utc`` defaults to now. ``version``: merge writes format 2 over older shards,
    whose ``row_digest`` it copies (docs/store-format.md, "Version rule")."""
    tag(f, FORMAT)
    f.attrs["format"] = FORMAT
    f.attrs["format_version"] = np.int64(version)
    f.attrs[STORE_UUID_ATTR] = new_store_uuid()
    root = dict(attrs)
    root.setdefault("created_utc", utc_now())
    write_root_attrs(f, root)


def mark_complete(f: h5py.File) -> None:
    """The last step of every store: everything else is on disk, the root attributes'
    digests (format 3: embedpipe.store.attr_digests), then ``complete = True``."""
    if int(f.attrs["format_version"]) >= COVERED_SINCE:
        write_attr_digests(f)
    f.flush()
    f.attrs["complete"] = np.bool_(True)


def _check_records(path: Path, ids: list[str], sequences: list[str]) -> None:
    if len(sequences) != len(ids):
        raise StoreError(f"{path}: {len(ids)} ids but {len(sequences)} sequences")
    if len(set(ids)) != len(ids):
        dup = next(k for k, c in Counter(ids).items() if c > 1)
        raise StoreError(f"{path}: duplicate record id {dup!r}")
    if any(not i for i in ids):
        raise StoreError(f"{path}: empty record id")
    if (bad := bad_id_message(ids, "record id")) is not None:
        raise StoreError(f"{path}: {bad}")


def _check_layout(storage_dtype: str, layers: Sequence[int], dim: int) -> tuple[list[int], int]:
    """(layers, dim) as ints, after checking them and the storage dtype."""
    if storage_dtype not in STORAGE_DTYPES:
        raise StoreError(f"storage dtype must be one of {', '.join(STORAGE_DTYPES)}, not {storage_dtype!r}")
    out = [int(k) for k in layers]
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise StoreError(f"layers must be distinct absolute indices >= 0, got {list(layers)}")
    if int(dim) < 1:
        raise StoreError(f"dim must be >= 1, got {dim}")
    return out, int(dim)


def _offsets(path: Path, ids: list[str], residue_rows: Sequence[int] | None) -> np.ndarray | None:
    """per_residue/offsets (N+1,) from the announced per-residue rows of each record."""
    if residue_rows is None:
        return None
    rr = np.asarray(list(residue_rows), dtype=np.int64)
    if rr.shape != (len(ids),):
        raise StoreError(f"{path}: residue_rows has {rr.size} entries for {len(ids)} records")
    if (rr < 0).any():
        raise StoreError(f"{path}: negative residue_rows for record {ids[int(np.argmax(rr < 0))]!r}")
    return np.concatenate([[0], np.cumsum(rr)]).astype(np.int64)


class StoreWriter:
    """Write one store atomically. Rows may be written in any order, each exactly once.

    ::

        with StoreWriter(out, ids=ids, sequences=seqs, residue_rows=rows, layers=[6], dim=320,
                         storage_dtype="float16", attrs=provenance, pooling=["mean", "bos"]) as writer:
            for index, record in results:
                writer.write(index, record)
            writer.set_attrs(fallback_count=3)
        # on normal exit: finalize(); on an exception: temp file removed, exception re-raised
    """

    def __init__(
        self,
        path: Path,
        *,
        ids: Sequence[str],
        sequences: Sequence[str],
        residue_rows: Sequence[int] | None,
        layers: Sequence[int],
        dim: int,
        storage_dtype: str,
        attrs: Mapping[str, Any],
        pooling: Sequence[str] = ("mean",),
    ) -> None:
        self.path = Path(path)
        self.ids = [str(i) for i in ids]
        self.sequences = [str(s) for s in sequences]
        _check_records(self.path, self.ids, self.sequences)
        self.layers, self.dim = _check_layout(storage_dtype, layers, dim)
        self.storage_dtype = storage_dtype
        self._np_dtype = np.dtype(storage_dtype)
        self.pooling = stored_poolings(pooling)  # mean always; docs/store-format.md, "Datasets"
        self.offsets = _offsets(self.path, self.ids, residue_rows)
        self.residue_rows = None if self.offsets is None else np.diff(self.offsets)
        self._parts = digest_parts(self.pooling, self.layers, self.offsets is not None)  # row_digest's order
        self._covered = covered_columns()
        attrs = dict(attrs)
        self._check_attr_names(attrs)
        #: characters of a sequence one residue takes (the family's layout; SaProt: 2), which
        #: ``length`` and the per-residue rows count
        self.chars_per_residue = chars_per_residue(attrs)
        split = next((i for i, s in zip(self.ids, self.sequences) if len(s) % self.chars_per_residue), None)
        if split is not None:
            raise StoreError(f"{self.path}: record {split!r}: its sequence is not whole residues of "
                             f"{self.chars_per_residue} characters")

        self._n = n = len(self.ids)
        self._written = np.zeros(n, dtype=bool)
        # the columns known only once a record is embedded, filled row by row, written by finalize
        self._columns = {c.name: c.buffer(n) for c in COLUMNS.values() if not c.announced}
        self._finalized = False
        self._closed = False

        total_rows = int(self.offsets[-1]) if self.offsets is not None else 0
        check_free_space(self.path, (n * len(self.pooling) + total_rows) * self.dim * len(self.layers) * self._np_dtype.itemsize)
        # temp name beside the store, renamed once complete (store/h5write.py, like every HDF5 output)
        self._target = H5Target(self.path)
        self._file: h5py.File | None = None
        try:
            self._file = self._target.open(**WRITE_OPTIONS)
            self._create(attrs)
        except BaseException as exc:
            self._fail(exc)
            raise

    # -- setup -------------------------------------------------------------------------------

    def _check_attr_names(self, attrs: Mapping[str, Any]) -> None:
        bad = sorted(RESERVED_ATTRS.intersection(attrs))
        if bad:
            raise StoreError(f"store attribute(s) {', '.join(bad)} are written by the store writer itself")
        derived = {
            "storage_dtype": self.storage_dtype,
            "layers": sorted(self.layers),
            "dim": self.dim,
            "per_residue": self.residue_rows is not None,
            "pooling": self.pooling,
        }
        for key in DERIVED_ATTRS.intersection(attrs):
            given = attrs[key]
            if key == "layers":
                given = sorted(int(v) for v in given)
            if key == "pooling":
                given = list(given)
            if given != derived[key]:
                raise StoreError(f"store attribute {key}={attrs[key]!r} disagrees with the writer's {derived[key]!r}")

    def _create(self, attrs: dict[str, Any]) -> None:
        """Header, the columns known up front (a bad id fails before any compute), and the
        vector datasets that ``write`` fills."""
        f = self._file
        n, d = self._n, self.dim
        root = {k: v for k, v in attrs.items() if k not in DERIVED_ATTRS}
        root.update(
            storage_dtype=self.storage_dtype,
            layers=np.array(sorted(self.layers), dtype=np.int64),
            dim=self.dim,
            per_residue=self.residue_rows is not None,
            pooling=self.pooling,
        )
        write_header(f, root)
        announced = [EmbeddedRecord(id=i, sequence=s, precision_used="", chars_per_residue=self.chars_per_residue)
                     for i, s in zip(self.ids, self.sequences)]
        for column in COLUMNS.values():
            if column.name == "sequence":  # ragged since format 2 (embedpipe.store.sequences)
                write_sequences(f, self.sequences, n)
            elif column.announced:
                write_column(f, column, [column.value(r) for r in announced])
        write_id_index(f, *index_keys(encode_ids(self.ids)))

        self._pooled: dict[str, dict[int, h5py.Dataset]] = {}
        for pooling in self.pooling:
            group = create_pooled_group(f, pooling)
            self._pooled[pooling] = {
                k: create_array_dataset(group, f"layer_{k}", shape=(n, d), dtype=self._np_dtype) for k in self.layers
            }
        self._per_residue: dict[int, h5py.Dataset] = {}
        if self.offsets is not None:
            pr = create_per_residue_group(f, self.offsets)
            total = int(self.offsets[-1])
            self._per_residue = {
                k: create_array_dataset(pr, f"layer_{k}", shape=(total, d), dtype=self._np_dtype) for k in self.layers
            }

    # -- writing -----------------------------------------------------------------------------

    def _cast(self, values: Any, *, record: EmbeddedRecord, index: int, layer: int, what: str,
              shape: tuple[int, ...]) -> np.ndarray:
        arr = np.asarray(values)
        if arr.shape != shape:
            raise StoreError(
                f"record {record.id!r} (index {index}) layer {layer} {what}: shape {arr.shape}, expected {shape}"
            )
        with np.errstate(over="ignore", invalid="ignore"):
            out = arr.astype(self._np_dtype, copy=False)
        finite = np.isfinite(out)
        if not finite.all():
            bad = int(out.size - np.count_nonzero(finite))
            src_finite = bool(np.isfinite(arr).all()) if arr.dtype.kind == "f" else True
            why = (
                f"overflow when cast to {self.storage_dtype} (max |x| = {float(np.max(np.abs(arr))):.6g})"
                if src_finite
                else "non-finite input"
            )
            raise StoreError(
                f"record {record.id!r} (index {index}) layer {layer} {what}: {bad} non-finite value(s): {why}; "
                "refusing to write non-finite values"
            )
        return out

    def _check_record(self, index: int, record: EmbeddedRecord) -> None:
        """``record`` may be stored as row ``index``: announced there, not yet written."""
        if self._closed or self._finalized:
            raise StoreError(f"{self.path}: writer is closed")
        if not 0 <= index < self._n:
            raise StoreError(f"{self.path}: record index {index} out of range (0..{self._n - 1})")
        if self._written[index]:
            raise StoreError(f"{self.path}: record {self.ids[index]!r} (index {index}) written twice")
        if record.id != self.ids[index]:
            raise StoreError(f"{self.path}: index {index} is record {self.ids[index]!r}, got record {record.id!r}")
        if record.sequence != self.sequences[index]:
            raise StoreError(f"{self.path}: record {record.id!r} has a different sequence than announced")
        for pooling in self.pooling:
            given = getattr(record, pooling) or {}
            if set(given) != set(self.layers):
                raise StoreError(
                    f"record {record.id!r}: {pooling} layers {sorted(given)} != store layers {sorted(self.layers)}"
                )
        if record.long_handling not in LONG_HANDLING:
            raise StoreError(
                f"record {record.id!r}: long_handling {record.long_handling!r} not one of {', '.join(LONG_HANDLING)}"
            )

    def _embedded_length(self, index: int, record: EmbeddedRecord) -> int:
        """Residues embedded (``embedded_length`` -1 means all of them), checked."""
        length = len(record.sequence) // self.chars_per_residue
        if self.residue_rows is not None:
            rows = int(self.residue_rows[index])
            embedded = rows if record.embedded_length < 0 else int(record.embedded_length)
            if embedded != rows:
                raise StoreError(
                    f"record {record.id!r}: embedded_length {embedded} != announced per-residue rows {rows}"
                )
        else:
            embedded = length if record.embedded_length < 0 else int(record.embedded_length)
        if embedded > length:
            raise StoreError(f"record {record.id!r}: embedded_length {embedded} > sequence length {length}")
        return embedded

    def _vectors(self, index: int, record: EmbeddedRecord,
                 embedded: int) -> tuple[dict[str, dict[int, np.ndarray]], dict[int, np.ndarray]]:
        """(pooled vectors by pooling and layer, per-residue rows by layer), cast to the
        storage dtype and checked."""
        pooled = {
            pooling: {
                k: self._cast(getattr(record, pooling)[k], record=record, index=index, layer=k, what=pooling,
                              shape=(self.dim,))
                for k in self.layers
            }
            for pooling in self.pooling
        }
        if self.residue_rows is None:
            return pooled, {}
        pr = record.per_residue or {}
        if set(pr) != set(self.layers):
            raise StoreError(
                f"record {record.id!r}: per-residue layers {sorted(pr)} != store layers {sorted(self.layers)}"
            )
        residues = {
            k: self._cast(pr[k], record=record, index=index, layer=k, what="per-residue", shape=(embedded, self.dim))
            for k in self.layers
        }
        return pooled, residues

    def write(self, index: int, record: EmbeddedRecord) -> None:
        """Store ``record`` as row ``index`` (its position in ``ids``)."""
        index = int(index)
        self._check_record(index, record)
        embedded = self._embedded_length(index, record)
        pooled, residues = self._vectors(index, record, embedded)
        try:
            for pooling, vectors in pooled.items():
                for k, vec in vectors.items():
                    self._pooled[pooling][k][index] = vec
            if residues:
                start, stop = int(self.offsets[index]), int(self.offsets[index + 1])  # type: ignore[index]
                if stop > start:
                    for k, block in residues.items():
                        self._per_residue[k][start:stop] = block
        except BaseException as exc:
            self._fail(exc)
            raise
        # the digest of the bytes just written, dataset by dataset (embedpipe.store.digests)
        values = {f"{p}/layer_{k}": v for p, vectors in pooled.items() for k, v in vectors.items()}
        values |= {f"per_residue/layer_{k}": v for k, v in residues.items()}
        stored = dataclasses.replace(record, embedded_length=embedded, chars_per_residue=self.chars_per_residue)
        # then the record part: its ID, sequence and every other column as stored (embedpipe.store.record_digest)
        digest = record_digest([values[name] for name in self._parts[:-1]])
        digest += record_part([c.value(stored) for c in self._covered], self._covered)
        stored.row_digest = digest
        for name, buffer in self._columns.items():
            COLUMNS[name].fill(buffer, index, stored)
        self._written[index] = True

    def set_attrs(self, **attrs: Any) -> None:
        """Extra root attributes (e.g. fallback counts), before finalize."""
        if self._closed or self._finalized:
            raise StoreError(f"{self.path}: writer is closed")
        self._check_attr_names(attrs)
        try:
            write_root_attrs(self._file, {k: v for k, v in attrs.items() if k not in DERIVED_ATTRS})
        except BaseException as exc:
            self._fail(exc)
            raise

    def finalize(self) -> None:
        """Check every record was written, write the per-record columns and ``complete`` (last),
        then fsync and rename into place. On failure the temp file is removed."""
        if self._finalized:
            return
        if self._closed:
            raise StoreError(f"{self.path}: writer is closed")
        try:
            missing = np.flatnonzero(~self._written)
            if missing.size:
                first = int(missing[0])
                raise StoreError(
                    f"{self.path}: {missing.size} record(s) never written; first missing id "
                    f"{self.ids[first]!r} (index {first})"
                )
            f = self._file
            assert f is not None  # open until closed, and closing twice returns above
            for name, buffer in self._columns.items():
                write_column(f, COLUMNS[name], buffer)
            mark_complete(f)
            f.flush()
            self._target.commit()  # close, fsync, rename into place
            self._closed = self._finalized = True
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        """Abort, and raise a write failure of the temp file (a full disk) as one line naming
        the output path; any other exception is left for the caller to re-raise."""
        self._closed = True
        self._target.discard(exc)

    def abort(self) -> None:
        """Close and delete the temporary file; the final path is never touched. Safe after a
        failed write (see embedpipe.store.h5write)."""
        self._closed = True
        if not self._finalized:
            self._target.discard()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
            return None
        self.finalize()
        return None
