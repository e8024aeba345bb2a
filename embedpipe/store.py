"""The embedpipe HDF5 store, format version 1: atomic writer, low-level reading, info, validate.

The format is specified in ``docs/store-format.md``; this module is its reference
implementation. Summary:

* one row per record in every per-record dataset (``ids``, ``sequence``, ``length``,
  ``precision_used``, ``fallback_reason``, ``max_abs_activation``, ``long_handling``,
  ``embedded_length``, ``windows``), same order everywhere;
* ``mean/layer_{k}`` (N, D) pooled vectors; ``per_residue/layer_{k}`` (sum of embedded
  lengths, D) ragged per-residue vectors with ``per_residue/offsets`` (N+1,) int64;
* every stored (non-virtual) dataset is chunked with a fletcher32 checksum; strings are
  fixed-length UTF-8 (HDF5 cannot filter, hence cannot checksum, variable-length strings);
* the root attribute ``complete`` is written last, and the file only appears under its
  final name (temp file in the same directory, fsync, rename) once it is complete.

The public read API lives in :mod:`embedpipe.io`; merging in :mod:`embedpipe.merge`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.atomic import commit, temp_path_for
from embedpipe.h5write import abandon, check_free_space, reraise
from embedpipe.errors import StoreError
from embedpipe.integrity import (
    STORE_UUID_ATTR,
    MeanCheck,
    mean_check_applies,
    new_store_uuid,
    resolve_source,
    source_problems,
)
from embedpipe.records import EmbeddedRecord

FORMAT = "embedpipe.store"
FORMAT_VERSION = 1

STORAGE_DTYPES = ("float32", "float16")
LONG_HANDLING = ("none", "chunked", "truncated", "full")

#: per-record datasets of a v1 store, name -> kind ("str", "int", "float")
PER_RECORD: dict[str, str] = {
    "ids": "str",
    "sequence": "str",
    "length": "int",
    "precision_used": "str",
    "fallback_reason": "str",
    "max_abs_activation": "float",
    "long_handling": "str",
    "embedded_length": "int",
    "windows": "int",
}
STRING_FIELDS = tuple(k for k, v in PER_RECORD.items() if v == "str")

#: root attributes the writer owns; callers may not set them through ``attrs``/``set_attrs``
RESERVED_ATTRS = frozenset(
    {"format", "format_version", "complete", "json_attrs", "encoding-type", "encoding-version", STORE_UUID_ATTR}
)
#: root attributes the writer derives from its arguments; callers may repeat them only unchanged
DERIVED_ATTRS = frozenset({"storage_dtype", "layers", "dim", "per_residue"})

# Chunking: ~4 MiB per chunk of a 2-D float dataset, ~1 MiB per chunk of a string dataset.
_TARGET_CHUNK_BYTES = 4 << 20
_TARGET_STRING_CHUNK_BYTES = 1 << 20
# Writer chunk cache, per dataset. w0=1: fully written chunks are evicted first, so rows
# arriving out of order within a few chunks are assembled in memory, not re-read from disk.
_WRITE_CACHE_BYTES = 32 << 20
_WRITE_CACHE_SLOTS = 10_007
# Validation reads blocks of about this many bytes at a time.
_READ_BLOCK_BYTES = 64 << 20

ENCODING_VERSION = "1"
# File format objects of HDF5 1.10 (needed for virtual datasets; compact chunk indexes keep
# small stores small), and nothing newer, so HDF5 >= 1.10 can read every store.
LIBVER = ("v110", "v110")


# ---------------------------------------------------------------------------------------------
# small helpers shared by the writer, the readers and merge


def _tag(obj: h5py.HLObject, encoding_type: str, **extra: Any) -> None:
    """anndata-style self-description on every group and dataset."""
    obj.attrs["encoding-type"] = encoding_type
    obj.attrs["encoding-version"] = ENCODING_VERSION
    for key, value in extra.items():
        obj.attrs[key] = value


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def chunk_rows(row_bytes: int, n_rows: int, *, target: int = _TARGET_CHUNK_BYTES, cap: int = 65_536) -> int:
    """Rows per chunk: about ``target`` bytes, at least 1, at most ``n_rows`` (when > 0)."""
    rows = max(1, min(cap, target // max(1, row_bytes)))
    return max(1, min(rows, n_rows)) if n_rows > 0 else rows


def string_dtype(width: int) -> np.dtype:
    """Fixed-length, null-padded UTF-8 string type of ``width`` bytes (HDF5 needs >= 1)."""
    return h5py.string_dtype("utf-8", max(1, int(width)))


def encode_strings(values: Sequence[str]) -> np.ndarray:
    """Python strings -> fixed-length UTF-8 byte array, as wide as the longest encoding."""
    encoded = [str(v).encode("utf-8") for v in values]
    if any(b"\x00" in b for b in encoded):
        raise StoreError("strings stored in an embedpipe store may not contain NUL characters")
    width = max((len(b) for b in encoded), default=1)
    return np.array(encoded, dtype=string_dtype(width)) if encoded else np.zeros(0, dtype=string_dtype(1))


def decode_strings(raw: np.ndarray) -> list[str]:
    """Fixed-length (or variable-length) HDF5 strings read by h5py -> list of Python str."""
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in np.asarray(raw).ravel().tolist()]


def create_fixed_string_dataset(group: h5py.Group, name: str, n: int, width: int) -> h5py.Dataset:
    """An (n,) fixed-length UTF-8 string dataset: chunked, gzip (the padding compresses), fletcher32."""
    dtype = string_dtype(width)
    rows = chunk_rows(dtype.itemsize, n, target=_TARGET_STRING_CHUNK_BYTES)
    ds = group.create_dataset(
        name,
        shape=(n,),
        dtype=dtype,
        chunks=(rows,),
        maxshape=(None,) if n == 0 else None,
        compression="gzip",
        compression_opts=4,
        fletcher32=True,
    )
    _tag(ds, "fixed-utf8-array")
    return ds


def create_string_dataset(group: h5py.Group, name: str, values: Sequence[str]) -> h5py.Dataset:
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
        compression="gzip" if compress else None,
        shuffle=compress,
        fletcher32=True,
    )
    if data is not None and shape[0]:
        ds[...] = data
        ds.flush()  # a write failure surfaces here, not when the dataset is garbage collected
    _tag(ds, "array")
    return ds


def attr_to_python(value: Any) -> Any:
    """h5py attribute value -> plain Python (str, int, float, bool, list)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return [attr_to_python(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [attr_to_python(v) for v in value]
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def python_to_attr(value: Any) -> tuple[Any, bool]:
    """Python value -> (HDF5 attribute value, stored_as_json)."""
    if isinstance(value, Path):
        return str(value), False
    if isinstance(value, (bool, np.bool_)):
        return np.bool_(value), False
    if isinstance(value, (int, np.integer)):
        return np.int64(value), False
    if isinstance(value, (float, np.floating)):
        return np.float64(value), False
    if isinstance(value, str):
        return str(value), False  # plain str: h5py refuses str subclasses such as torch's TorchVersion
    if isinstance(value, (list, tuple, np.ndarray)):
        items = list(value.tolist() if isinstance(value, np.ndarray) else value)
        if items and all(isinstance(v, (bool, np.bool_)) for v in items):
            return np.array(items, dtype=bool), False
        if items and all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in items):
            return np.array(items, dtype=np.int64), False
        if items and all(isinstance(v, (float, np.floating, int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in items):
            return np.array(items, dtype=np.float64), False
        if items and all(isinstance(v, str) for v in items):
            return [str(v) for v in items], False
    return json.dumps(value, sort_keys=True, default=str), True


def write_root_attrs(obj: h5py.HLObject, attrs: Mapping[str, Any]) -> None:
    """Write attributes; values that HDF5 cannot hold natively (dicts, None, mixed lists) are
    stored as JSON strings and their names listed in the ``json_attrs`` attribute."""
    json_names = set(attr_to_python(obj.attrs.get("json_attrs", [])) or [])
    for key, value in attrs.items():
        stored, as_json = python_to_attr(value)
        if key == "config" and not as_json:  # config is always JSON, even a plain string
            stored, as_json = (value if isinstance(value, str) else json.dumps(value, default=str)), True
        obj.attrs[key] = stored
        if as_json:
            json_names.add(key)
        else:
            json_names.discard(key)
    obj.attrs["json_attrs"] = sorted(json_names)


def read_root_attrs(obj: h5py.HLObject) -> dict[str, Any]:
    """All attributes as plain Python; JSON-encoded ones (``json_attrs``, ``config``) parsed."""
    out = {key: attr_to_python(obj.attrs[key]) for key in obj.attrs}
    json_names = set(out.pop("json_attrs", []) or [])
    json_names.add("config")
    for key in json_names:
        if isinstance(out.get(key), str):
            with contextlib.suppress(ValueError):
                out[key] = json.loads(out[key])
    return out


def major_version(value: Any) -> int | None:
    try:
        return int(str(attr_to_python(value)).split(".")[0])
    except (TypeError, ValueError):
        return None


def check_format(f: h5py.File, path: Path | str) -> int:
    """Raise StoreError unless ``f`` is an embedpipe store this version can read."""
    fmt = attr_to_python(f.attrs.get("format"))
    if fmt != FORMAT:
        raise StoreError(f"{path}: not an embedpipe store (format attribute is {fmt!r})")
    version = major_version(f.attrs.get("format_version"))
    if version is None:
        raise StoreError(f"{path}: unreadable format_version {attr_to_python(f.attrs.get('format_version'))!r}")
    if version > FORMAT_VERSION:
        raise StoreError(f"{path}: written by a newer embedpipe (format {version}); upgrade embedpipe to read it")
    if version < 1:
        raise StoreError(f"{path}: unknown store format version {version}")
    return version


def open_h5(path: Path | str) -> h5py.File:
    """Open read-only, turning 'missing', 'not HDF5' and 'truncated' into one-line StoreErrors."""
    path = Path(path)
    if not path.exists():
        raise StoreError(f"{path}: no such file")
    if path.is_dir():
        raise StoreError(f"{path}: is a directory, not a store file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        if "already open for write" in str(exc):
            raise StoreError(
                f"{path}: incomplete store: the file was never closed (its writer was killed or is still running)"
            ) from None
        reason = str(exc).split("(", 1)[-1].rstrip(")") if "(" in str(exc) else str(exc)
        raise StoreError(f"{path}: not a readable HDF5 file (truncated or corrupt?): {reason}") from None


def stored_layers(f: h5py.File) -> list[int]:
    layers = f.attrs.get("layers")
    if layers is None:
        return sorted(int(k.split("_", 1)[1]) for k in f.get("mean", {}) if k.startswith("layer_"))
    return sorted(int(v) for v in np.atleast_1d(layers))


def is_complete(f: h5py.File) -> bool:
    return bool(attr_to_python(f.attrs.get("complete", False)))


def iter_row_blocks(ds: h5py.Dataset, *, block_bytes: int = _READ_BLOCK_BYTES) -> Iterator[slice]:
    """Row slices covering ``ds`` with about ``block_bytes`` each, aligned to its chunks."""
    n = ds.shape[0] if ds.shape else 0
    row_bytes = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64)) if ds.shape else 1
    rows = max(1, block_bytes // max(1, row_bytes))
    if ds.chunks:
        c = ds.chunks[0]
        rows = max(c, rows // c * c)
    for start in range(0, n, rows):
        yield slice(start, min(n, start + rows))


# ---------------------------------------------------------------------------------------------
# writer


class StoreWriter:
    """Write one store atomically. Rows may be written in any order, each exactly once.

    ::

        with StoreWriter(out, ids=ids, sequences=seqs, residue_rows=rows, layers=[6], dim=320,
                         storage_dtype="float16", attrs=provenance) as writer:
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
    ) -> None:
        self.path = Path(path)
        self.ids = [str(i) for i in ids]
        self.sequences = [str(s) for s in sequences]
        n = len(self.ids)
        if len(self.sequences) != n:
            raise StoreError(f"{self.path}: {n} ids but {len(self.sequences)} sequences")
        if len(set(self.ids)) != n:
            dup = next(k for k, c in Counter(self.ids).items() if c > 1)
            raise StoreError(f"{self.path}: duplicate record id {dup!r}")
        if any(not i for i in self.ids):
            raise StoreError(f"{self.path}: empty record id")
        if storage_dtype not in STORAGE_DTYPES:
            raise StoreError(f"storage dtype must be one of {', '.join(STORAGE_DTYPES)}, not {storage_dtype!r}")
        self.layers = [int(k) for k in layers]
        if not self.layers or len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise StoreError(f"layers must be distinct absolute indices >= 0, got {list(layers)}")
        self.dim = int(dim)
        if self.dim < 1:
            raise StoreError(f"dim must be >= 1, got {dim}")
        self.storage_dtype = storage_dtype
        self._np_dtype = np.dtype(storage_dtype)
        if residue_rows is not None:
            rr = np.asarray(list(residue_rows), dtype=np.int64)
            if rr.shape != (n,):
                raise StoreError(f"{self.path}: residue_rows has {rr.size} entries for {n} records")
            if (rr < 0).any():
                raise StoreError(f"{self.path}: negative residue_rows for record {self.ids[int(np.argmax(rr < 0))]!r}")
            self.residue_rows: np.ndarray | None = rr
            self.offsets: np.ndarray | None = np.concatenate([[0], np.cumsum(rr)]).astype(np.int64)
        else:
            self.residue_rows = None
            self.offsets = None
        attrs = dict(attrs)
        self._check_attr_names(attrs, initial=True)

        self._n = n
        self._written = np.zeros(n, dtype=bool)
        self._precision_used: list[str] = [""] * n
        self._fallback_reason: list[str] = [""] * n
        self._long_handling: list[str] = [""] * n
        self._max_abs = np.full(n, np.nan, dtype=np.float32)
        self._embedded_length = np.zeros(n, dtype=np.int64)
        self._windows = np.zeros(n, dtype=np.int64)
        self._finalized = False
        self._closed = False

        total_rows = int(self.offsets[-1]) if self.offsets is not None else 0
        check_free_space(self.path, (n + total_rows) * self.dim * len(self.layers) * self._np_dtype.itemsize)
        self._tmp = temp_path_for(self.path)
        self._file: h5py.File | None = None
        try:
            self._file = h5py.File(
                self._tmp,
                "w",
                libver=LIBVER,
                rdcc_nbytes=_WRITE_CACHE_BYTES,
                rdcc_w0=1.0,
                rdcc_nslots=_WRITE_CACHE_SLOTS,
            )
            self._create(attrs)
        except BaseException as exc:
            self._fail(exc)
            raise

    # -- setup -------------------------------------------------------------------------------

    def _check_attr_names(self, attrs: Mapping[str, Any], *, initial: bool) -> None:
        bad = sorted(RESERVED_ATTRS.intersection(attrs))
        if bad:
            raise StoreError(f"store attribute(s) {', '.join(bad)} are written by the store writer itself")
        derived = {
            "storage_dtype": self.storage_dtype,
            "layers": sorted(self.layers),
            "dim": self.dim,
            "per_residue": self.residue_rows is not None,
        }
        for key in DERIVED_ATTRS.intersection(attrs):
            given = attrs[key]
            if key == "layers":
                given = sorted(int(v) for v in given)
            if given != derived[key]:
                raise StoreError(f"store attribute {key}={attrs[key]!r} disagrees with the writer's {derived[key]!r}")

    def _create(self, attrs: dict[str, Any]) -> None:
        f = self._file
        n, d = self._n, self.dim
        _tag(f, FORMAT)
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = np.int64(FORMAT_VERSION)
        f.attrs[STORE_UUID_ATTR] = new_store_uuid()  # identity of this file: a rewrite gets a new one
        root = {k: v for k, v in attrs.items() if k not in DERIVED_ATTRS}
        root.setdefault("created_utc", utc_now())
        root.update(
            storage_dtype=self.storage_dtype,
            layers=np.array(sorted(self.layers), dtype=np.int64),
            dim=self.dim,
            per_residue=self.residue_rows is not None,
        )
        write_root_attrs(f, root)

        create_string_dataset(f, "ids", self.ids)
        create_string_dataset(f, "sequence", self.sequences)
        create_array_dataset(
            f, "length", shape=(n,), dtype=np.int64, data=np.array([len(s) for s in self.sequences], dtype=np.int64),
            rows=chunk_rows(8, n, target=_TARGET_STRING_CHUNK_BYTES), compress=True,
        )

        mean = f.create_group("mean")
        _tag(mean, "pooled-layers", pooling="mean")
        self._mean = {
            k: create_array_dataset(mean, f"layer_{k}", shape=(n, d), dtype=self._np_dtype) for k in self.layers
        }
        self._per_residue: dict[int, h5py.Dataset] = {}
        if self.offsets is not None:
            pr = f.create_group("per_residue")
            _tag(pr, "ragged-layers")
            create_array_dataset(
                pr, "offsets", shape=(n + 1,), dtype=np.int64, data=self.offsets,
                rows=chunk_rows(8, n + 1, target=_TARGET_STRING_CHUNK_BYTES), compress=True,
            )
            pr["offsets"].attrs["encoding-type"] = "offsets"
            total = int(self.offsets[-1])
            self._per_residue = {
                k: create_array_dataset(pr, f"layer_{k}", shape=(total, d), dtype=self._np_dtype) for k in self.layers
            }

    # -- writing -----------------------------------------------------------------------------

    def _cast(self, values: Any, *, record: EmbeddedRecord, index: int, layer: int, what: str, shape: tuple[int, ...]) -> np.ndarray:
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

    def write(self, index: int, record: EmbeddedRecord) -> None:
        """Store ``record`` as row ``index`` (its position in ``ids``)."""
        if self._closed or self._finalized:
            raise StoreError(f"{self.path}: writer is closed")
        index = int(index)
        if not 0 <= index < self._n:
            raise StoreError(f"{self.path}: record index {index} out of range (0..{self._n - 1})")
        if self._written[index]:
            raise StoreError(f"{self.path}: record {self.ids[index]!r} (index {index}) written twice")
        if record.id != self.ids[index]:
            raise StoreError(f"{self.path}: index {index} is record {self.ids[index]!r}, got record {record.id!r}")
        if record.sequence != self.sequences[index]:
            raise StoreError(f"{self.path}: record {record.id!r} has a different sequence than announced")
        if set(record.mean) != set(self.layers):
            raise StoreError(
                f"record {record.id!r}: mean layers {sorted(record.mean)} != store layers {sorted(self.layers)}"
            )
        if record.long_handling not in LONG_HANDLING:
            raise StoreError(
                f"record {record.id!r}: long_handling {record.long_handling!r} not one of {', '.join(LONG_HANDLING)}"
            )
        length = len(record.sequence)
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

        means = {
            k: self._cast(record.mean[k], record=record, index=index, layer=k, what="mean", shape=(self.dim,))
            for k in self.layers
        }
        residues: dict[int, np.ndarray] = {}
        if self.residue_rows is not None:
            pr = record.per_residue or {}
            if set(pr) != set(self.layers):
                raise StoreError(
                    f"record {record.id!r}: per-residue layers {sorted(pr)} != store layers {sorted(self.layers)}"
                )
            residues = {
                k: self._cast(pr[k], record=record, index=index, layer=k, what="per-residue", shape=(embedded, self.dim))
                for k in self.layers
            }

        try:
            for k, vec in means.items():
                self._mean[k][index] = vec
            if residues:
                start, stop = int(self.offsets[index]), int(self.offsets[index + 1])  # type: ignore[index]
                if stop > start:
                    for k, block in residues.items():
                        self._per_residue[k][start:stop] = block
        except BaseException as exc:
            self._fail(exc)
            raise
        self._precision_used[index] = str(record.precision_used)
        self._fallback_reason[index] = str(record.fallback_reason or "")
        self._long_handling[index] = record.long_handling
        self._max_abs[index] = np.float32(record.max_abs_activation)
        self._embedded_length[index] = embedded
        self._windows[index] = int(record.windows)
        self._written[index] = True

    def set_attrs(self, **attrs: Any) -> None:
        """Extra root attributes (e.g. fallback counts), before finalize."""
        if self._closed or self._finalized:
            raise StoreError(f"{self.path}: writer is closed")
        self._check_attr_names(attrs, initial=False)
        try:
            write_root_attrs(self._file, {k: v for k, v in attrs.items() if k not in DERIVED_ATTRS})
        except BaseException as exc:
            self._fail(exc)
            raise

    def finalize(self) -> None:
        """Check every record was written, write the per-record tables and ``complete`` (last),
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
            n = self._n
            small = chunk_rows(8, n, target=_TARGET_STRING_CHUNK_BYTES)
            create_string_dataset(f, "precision_used", self._precision_used)
            create_string_dataset(f, "fallback_reason", self._fallback_reason)
            create_string_dataset(f, "long_handling", self._long_handling)
            create_array_dataset(f, "max_abs_activation", shape=(n,), dtype=np.float32, data=self._max_abs, rows=small, compress=True)
            create_array_dataset(f, "embedded_length", shape=(n,), dtype=np.int64, data=self._embedded_length, rows=small, compress=True)
            create_array_dataset(f, "windows", shape=(n,), dtype=np.int64, data=self._windows, rows=small, compress=True)
            f.flush()
            f.attrs["complete"] = np.bool_(True)  # last
            f.flush()
            f.close()
            self._closed = True
            commit(self._tmp, self.path)
            self._finalized = True
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        """Abort, and raise a write failure of the temp file (a full disk) as one line naming
        the output path; any other exception is left for the caller to re-raise."""
        self.abort()
        reraise(self.path, self._tmp, exc)

    def abort(self) -> None:
        """Close and delete the temporary file; the final path is never touched. Safe after a
        failed write (see embedpipe.h5write)."""
        if not self._closed:
            self._closed = True
            abandon(self._file)
        if not self._finalized:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
            return None
        self.finalize()
        return None


# ---------------------------------------------------------------------------------------------
# info


def _distribution(values: np.ndarray) -> dict[str, Any]:
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    out: dict[str, Any] = {"count": int(finite.size), "nonfinite": int(values.size - finite.size)}
    if finite.size:
        out.update(min=float(finite.min()), median=float(np.median(finite)), max=float(finite.max()))
    return out


def _read_strings_blockwise(ds: h5py.Dataset) -> list[str]:
    out: list[str] = []
    for sl in iter_row_blocks(ds):
        out.extend(decode_strings(ds[sl]))
    return out


def store_info(path: Path) -> dict[str, Any]:
    """Provenance, counts, precision/fallback statistics and sizes of a store (JSON-friendly)."""
    path = Path(path)
    with open_h5(path) as f:
        try:
            version = check_format(f, path)
            attrs = read_root_attrs(f)
            n = int(f["ids"].shape[0]) if "ids" in f else 0
            info: dict[str, Any] = {
                "path": str(path),
                "file_size": path.stat().st_size,
                "format": attrs.get("format"),
                "format_version": version,
                "complete": bool(attrs.get("complete", False)),
                "provenance": {k: v for k, v in attrs.items() if k not in ("format", "format_version", "complete", "encoding-type", "encoding-version")},
                "layers": stored_layers(f),
                "dim": attrs.get("dim"),
                "storage_dtype": attrs.get("storage_dtype"),
            }
            counts: dict[str, Any] = {"records": n}
            if "length" in f:
                counts["residues"] = int(np.sum(f["length"][:], dtype=np.int64))
            if "embedded_length" in f:
                counts["embedded_residues"] = int(np.sum(f["embedded_length"][:], dtype=np.int64))
            if "per_residue/offsets" in f:
                counts["per_residue_rows"] = int(f["per_residue/offsets"][-1]) if n else 0
            info["counts"] = counts
            info["per_residue"] = "per_residue" in f
            if "precision_used" in f:
                info["precision_used"] = dict(Counter(_read_strings_blockwise(f["precision_used"])))
            if "fallback_reason" in f:
                reasons = Counter(r for r in _read_strings_blockwise(f["fallback_reason"]) if r)
                total = sum(reasons.values())
                info["fallback"] = {"count": total, "rate": (total / n) if n else 0.0, "by_reason": dict(reasons)}
            if "max_abs_activation" in f:
                info["max_abs_activation"] = _distribution(f["max_abs_activation"][:])
            if "long_handling" in f:
                info["long_handling"] = dict(Counter(_read_strings_blockwise(f["long_handling"])))
            if "windows" in f and n:
                info["windows"] = {"max": int(np.max(f["windows"][:]))}
            datasets: dict[str, Any] = {}

            def visit(name: str, obj: Any) -> None:
                if isinstance(obj, h5py.Dataset):
                    datasets[name] = {
                        "shape": list(obj.shape),
                        "dtype": str(obj.dtype),
                        "stored_bytes": int(obj.id.get_storage_size()),
                        "virtual": bool(obj.is_virtual),
                    }

            f.visititems(visit)
            info["datasets"] = datasets
            info["aliases"] = int(f["aliases/id"].shape[0]) if "aliases/id" in f else 0
            info["skipped"] = int(f["skipped/id"].shape[0]) if "skipped/id" in f else 0
            if "merged_from" in attrs:
                info["merged_from"] = attrs["merged_from"]
            return info
        except StoreError:
            raise
        except (OSError, KeyError, ValueError) as exc:
            raise StoreError(f"{path}: cannot read store: {exc}") from None


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _fmt_counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k or '(empty)'} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def render_info(info: Mapping[str, Any]) -> str:
    """Compact human-readable summary of :func:`store_info`."""
    prov = info.get("provenance", {})
    counts = info.get("counts", {})
    lines = [
        f"{info.get('path')}: {info.get('format')} v{info.get('format_version')}"
        + ("" if info.get("complete") else "  ** INCOMPLETE **"),
        f"  model       {prov.get('model_name', '?')}  sha256 {str(prov.get('model_sha256', '?'))[:16]}"
        + ("" if prov.get("model_trained", True) else "  (UNTRAINED test model)"),
        f"  precision   policy {prov.get('precision_policy', '?')}: weights {prov.get('weight_dtype', '?')}, "
        f"matmuls {prov.get('compute_dtype', '?')}, islands {prov.get('island_dtype', '?')}, "
        f"fallback {prov.get('fallback_dtype', '?')}; attention {prov.get('attention', '?')}",
        f"  storage     {info.get('storage_dtype')}; device {prov.get('device', '?')}",
        f"  software    embedpipe {prov.get('embedpipe_version', '?')}, torch {prov.get('torch_version', '?')}, "
        f"fair-esm {prov.get('fair_esm_version', '?')}; created {prov.get('created_utc', '?')}",
        f"  layers      {info.get('layers')}  dim {info.get('dim')}  per-residue "
        + ("on" if info.get("per_residue") else "off"),
        f"  records     {counts.get('records', 0)}  residues {counts.get('residues', 0)}"
        + (f"  embedded {counts['embedded_residues']}" if "embedded_residues" in counts else "")
        + (f"  per-residue rows {counts['per_residue_rows']}" if "per_residue_rows" in counts else ""),
    ]
    if "precision_used" in info:
        lines.append(f"  used        {_fmt_counts(info['precision_used'])}")
    fb = info.get("fallback")
    if fb is not None:
        lines.append(
            f"  fallback    {fb['count']} ({100 * fb['rate']:.2f}%)"
            + (f": {_fmt_counts(fb['by_reason'])}" if fb["by_reason"] else "")
        )
    mx = info.get("max_abs_activation")
    if mx:
        if mx.get("count"):
            lines.append(
                f"  max|act|    min {mx['min']:.4g}  median {mx['median']:.4g}  max {mx['max']:.4g}"
                + (f"  (non-finite/unknown {mx['nonfinite']})" if mx.get("nonfinite") else "")
            )
        else:
            lines.append(f"  max|act|    not recorded ({mx.get('nonfinite', 0)} records)")
    if "long_handling" in info:
        lines.append(f"  long seqs   {_fmt_counts(info['long_handling'])}")
    if info.get("merged_from"):
        lines.append(
            f"  merged      {len(info['merged_from'])} store(s); aliases {info.get('aliases', 0)}; "
            f"skipped {info.get('skipped', 0)}"
        )
    ds = info.get("datasets", {})
    stored = sum(v["stored_bytes"] for v in ds.values())
    virtual = sum(1 for v in ds.values() if v["virtual"])
    lines.append(
        f"  size        file {_human_bytes(info.get('file_size', 0))}; datasets {len(ds)} "
        f"({_human_bytes(stored)} stored" + (f", {virtual} virtual" if virtual else "") + ")"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# validate


def _read_all(ds: h5py.Dataset, name: str, problems: list[str], *, check_finite: bool,
              check: MeanCheck | None = None) -> None:
    """Read every block (verifying checksums at the source), optionally check finiteness and
    hand each block to ``check`` (so the mean check costs no second read)."""
    nonfinite = 0
    first_bad: int | None = None
    for sl in iter_row_blocks(ds):
        try:
            block = ds[sl]
        except OSError as exc:
            problems.append(
                f"dataset {name} rows {sl.start}:{sl.stop}: checksum mismatch or read error ({exc})"
            )
            return
        if check_finite:
            bad = ~np.isfinite(block)
            if bad.any():
                if block.ndim > 1:
                    bad = bad.reshape(bad.shape[0], -1).any(axis=1)
                nonfinite += int(np.count_nonzero(bad))
                if first_bad is None:
                    first_bad = sl.start + int(np.argmax(bad))
        if check is not None:
            check.feed(sl, block)
    if check is not None and (problem := check.problem()):
        problems.append(problem)
    if nonfinite:
        problems.append(f"dataset {name}: {nonfinite} row(s) with non-finite values (first at row {first_bad})")


def _virtual_sources(f: h5py.File) -> dict[str, set[str]]:
    """Source file -> dataset names that the virtual datasets of ``f`` read from."""
    sources: dict[str, set[str]] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and obj.is_virtual:
            for vmap in obj.virtual_sources():
                if vmap.file_name != ".":
                    sources.setdefault(vmap.file_name, set()).add(vmap.dset_name)

    f.visititems(visit)
    return sources


def _check_source(f: h5py.File, g: h5py.File, rel: str, datasets: set[str], rows: tuple[int, int] | None,
                  ids: list[str] | None, problems: list[str]) -> bool:
    """One present source: complete, has the datasets read through it, same ids and offsets."""
    if not is_complete(g):
        problems.append(f"source store {rel} is incomplete")
        return False
    ok = True
    for dname in sorted(datasets):
        if dname not in g:
            problems.append(f"source store {rel} lacks dataset {dname}")
            ok = False
        elif not g[dname].fletcher32:
            problems.append(f"source store {rel} dataset {dname} has no fletcher32 checksum")
    if ids is not None and rows is not None:
        lo, hi = rows
        if _read_strings_blockwise(g["ids"]) != ids[lo:hi]:
            problems.append(f"source store {rel} holds different records than when merged (ids differ)")
            return False
        if "per_residue/offsets" in f and "per_residue/offsets" in g:
            merged_off = f["per_residue/offsets"][lo : hi + 1]
            if not np.array_equal(merged_off - merged_off[0], g["per_residue/offsets"][:]):
                problems.append(f"source store {rel} per-residue offsets differ from the merged store's")
                return False
    return ok


def _validate_sources(f: h5py.File, path: Path, ids: list[str] | None, problems: list[str]) -> bool:
    """Merged stores: every source exists, is the very file that was merged (store_uuid, size,
    sha256 for legacy sources), is complete and matches. Returns False when a source is missing
    or unusable (reads through the virtual datasets would be meaningless)."""
    store_dir = path.resolve().parent
    sources = _virtual_sources(f)
    merged_from = [str(p) for p in (attr_to_python(f.attrs.get("merged_from")) or [])]
    merged_rows = [int(v) for v in (attr_to_python(f.attrs.get("merged_rows")) or [])]
    rows_known = len(merged_rows) == len(merged_from) + 1
    merged_from += [name for name in sources if name not in merged_from]
    ok = True
    missing: set[str] = set()
    try:
        for problem in source_problems(f, path, full=True):
            problems.append(problem.message)
            if problem.missing:
                missing.add(problem.rel)
                ok = False
    except StoreError as exc:
        problems.append(str(exc))
    for i, rel in enumerate(merged_from):
        src = resolve_source(store_dir, rel)
        if rel in missing or not src.exists():
            ok = False
            continue
        rows = (merged_rows[i], merged_rows[i + 1]) if rows_known and i + 1 < len(merged_rows) else None
        try:
            with h5py.File(src, "r") as g:
                check_format(g, src)
                ok = _check_source(f, g, rel, sources.get(rel, set()), rows, ids, problems) and ok
        except StoreError as exc:
            problems.append(f"source store {rel}: {exc}")
            ok = False
        except (OSError, KeyError) as exc:
            problems.append(f"source store {rel} is unreadable: {exc}")
            ok = False
    return ok


def _validate_open(f: h5py.File, path: Path, problems: list[str]) -> None:
    if not is_complete(f):
        problems.append("store is incomplete (attribute 'complete' is not true): the writer did not finish")
    attrs = read_root_attrs(f)
    storage = attrs.get("storage_dtype")
    if storage not in STORAGE_DTYPES:
        problems.append(f"storage_dtype attribute is {storage!r}, not one of {', '.join(STORAGE_DTYPES)}")
    if "ids" not in f:
        problems.append("dataset ids is missing")
        return
    n = int(f["ids"].shape[0])

    for name in PER_RECORD:
        if name not in f:
            problems.append(f"dataset {name} is missing")
        elif f[name].shape != (n,):
            problems.append(f"dataset {name} has shape {f[name].shape}, expected ({n},)")

    ids: list[str] | None = None
    try:
        ids = _read_strings_blockwise(f["ids"])
    except OSError as exc:
        problems.append(f"dataset ids: checksum mismatch or read error ({exc})")
    if ids is not None:
        dup = [k for k, c in Counter(ids).items() if c > 1]
        if dup:
            problems.append(f"ids are not unique ({len(dup)} duplicated, e.g. {dup[0]!r})")
        if any(not i for i in ids):
            problems.append("ids contains an empty id")

    layers_attr = f.attrs.get("layers")
    layers = stored_layers(f)
    mean_layers = sorted(int(k.split("_", 1)[1]) for k in f.get("mean", {}) if k.startswith("layer_"))
    if layers_attr is None:
        problems.append("root attribute 'layers' is missing")
    elif mean_layers != layers:
        problems.append(f"layers attribute {layers} != mean datasets {mean_layers}")
    dim = attrs.get("dim")
    for k in mean_layers:
        ds = f[f"mean/layer_{k}"]
        if ds.ndim != 2 or ds.shape[0] != n or (dim is not None and ds.shape[1] != dim):
            problems.append(f"dataset mean/layer_{k} has shape {ds.shape}, expected ({n}, {dim})")
        if storage in STORAGE_DTYPES and ds.dtype != np.dtype(storage):
            problems.append(f"dataset mean/layer_{k} has dtype {ds.dtype}, storage_dtype says {storage}")

    lengths = embedded = None
    if "length" in f and f["length"].shape == (n,) and "embedded_length" in f and f["embedded_length"].shape == (n,):
        try:
            lengths = f["length"][:].astype(np.int64)
            embedded = f["embedded_length"][:].astype(np.int64)
        except OSError as exc:
            problems.append(f"per-record lengths unreadable: checksum mismatch or read error ({exc})")
    if lengths is not None and embedded is not None:
        if (embedded < 0).any() or (embedded > lengths).any():
            i = int(np.argmax((embedded < 0) | (embedded > lengths)))
            problems.append(f"record {ids[i] if ids else i!r}: embedded_length {embedded[i]} outside 0..length {lengths[i]}")
    if "sequence" in f and lengths is not None and f["sequence"].shape == (n,):
        try:
            seq_lengths = np.fromiter((len(s) for s in _read_strings_blockwise(f["sequence"])), dtype=np.int64, count=n)
            if not np.array_equal(seq_lengths, lengths):
                i = int(np.argmax(seq_lengths != lengths))
                problems.append(f"record {ids[i] if ids else i!r}: length {lengths[i]} != len(sequence) {seq_lengths[i]}")
        except OSError as exc:
            problems.append(f"dataset sequence: checksum mismatch or read error ({exc})")
    if "long_handling" in f and f["long_handling"].shape == (n,):
        try:
            bad = sorted(set(_read_strings_blockwise(f["long_handling"])) - set(LONG_HANDLING))
            if bad:
                problems.append(f"long_handling has unknown value(s) {bad}")
        except OSError as exc:
            problems.append(f"dataset long_handling: checksum mismatch or read error ({exc})")

    per_residue_on = attr_to_python(attrs.get("per_residue", "per_residue" in f))
    if per_residue_on and "per_residue" not in f:
        problems.append("per_residue attribute is true but the per_residue group is missing")
    if "per_residue" in f:
        pr = f["per_residue"]
        pr_layers = sorted(int(k.split("_", 1)[1]) for k in pr if k.startswith("layer_"))
        if pr_layers != layers:
            problems.append(f"per_residue datasets {pr_layers} != layers attribute {layers}")
        if "offsets" not in pr:
            problems.append("dataset per_residue/offsets is missing")
        elif pr["offsets"].shape != (n + 1,):
            problems.append(f"dataset per_residue/offsets has shape {pr['offsets'].shape}, expected ({n + 1},)")
        else:
            try:
                offsets = pr["offsets"][:].astype(np.int64)
            except OSError as exc:
                problems.append(f"dataset per_residue/offsets: checksum mismatch or read error ({exc})")
                offsets = None
            if offsets is not None:
                if offsets[0] != 0:
                    problems.append(f"per_residue/offsets[0] is {offsets[0]}, not 0")
                steps = np.diff(offsets)
                if (steps < 0).any():
                    problems.append(f"per_residue/offsets not monotonic (first drop after row {int(np.argmax(steps < 0))})")
                elif embedded is not None and not np.array_equal(steps, embedded):
                    i = int(np.argmax(steps != embedded))
                    problems.append(
                        f"record {ids[i] if ids else i!r}: {steps[i]} per-residue rows but embedded_length {embedded[i]}"
                    )
                for k in pr_layers:
                    ds = pr[f"layer_{k}"]
                    if ds.ndim != 2 or ds.shape[0] != offsets[-1] or (dim is not None and ds.shape[1] != dim):
                        problems.append(
                            f"dataset per_residue/layer_{k} has shape {ds.shape}, expected ({offsets[-1]}, {dim})"
                        )

    if "aliases" in f:
        g = f["aliases"]
        if "id" not in g or "of" not in g or g["id"].shape != g["of"].shape:
            problems.append("aliases group needs datasets id and of of equal length")
        elif ids is not None:
            alias_ids = _read_strings_blockwise(g["id"])
            targets = _read_strings_blockwise(g["of"])
            known = set(ids)
            missing = [t for t in targets if t not in known]
            if missing:
                problems.append(f"{len(missing)} alias(es) point to unknown ids (e.g. {missing[0]!r})")
            clash = [a for a in alias_ids if a in known]
            if clash:
                problems.append(f"alias id {clash[0]!r} is also a record id")
            if len(set(alias_ids)) != len(alias_ids):
                problems.append("alias ids are not unique")
    if "skipped" in f:
        g = f["skipped"]
        if "id" not in g or "reason" not in g or g["id"].shape != g["reason"].shape:
            problems.append("skipped group needs datasets id and reason of equal length")

    sources_ok = True
    if "merged_from" in f.attrs or any(
        isinstance(obj, h5py.Dataset) and obj.is_virtual for obj in _all_datasets(f)
    ):
        sources_ok = _validate_sources(f, path, ids, problems)

    # Read everything once: checksums (at the source, for virtual datasets), finiteness and
    # whether each stored mean is the mean of its per-residue rows.
    checks = _mean_checks(f, ids) if sources_ok else {}
    for name, ds in _datasets_by_name(f):
        if not ds.is_virtual and not ds.fletcher32:
            problems.append(f"dataset {name} has no fletcher32 checksum")
        if ds.is_virtual and not sources_ok:
            continue
        is_float = ds.dtype.kind == "f"
        _read_all(ds, name, problems, check_finite=is_float and (name.startswith("mean/") or name.startswith("per_residue/")),
                  check=checks.get(name))


def _mean_checks(f: h5py.File, ids: list[str] | None) -> dict[str, MeanCheck]:
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


def _all_datasets(f: h5py.File) -> list[h5py.Dataset]:
    return [ds for _, ds in _datasets_by_name(f)]


def _datasets_by_name(f: h5py.File) -> list[tuple[str, h5py.Dataset]]:
    out: list[tuple[str, h5py.Dataset]] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            out.append((name, obj))

    f.visititems(visit)
    return out


def validate_store(path: Path) -> list[str]:
    """Problems with the store at ``path``; empty only for a complete, consistent, checksummed,
    finite store. Never raises for a bad file: every failure is a problem string."""
    path = Path(path)
    problems: list[str] = []
    try:
        f = open_h5(path)
    except StoreError as exc:
        return [str(exc).removeprefix(f"{path}: ")]
    try:
        with f:
            try:
                check_format(f, path)
            except StoreError as exc:
                return [str(exc).removeprefix(f"{path}: ")]
            _validate_open(f, path, problems)
    except Exception as exc:  # noqa: BLE001 - validate must report, never crash
        problems.append(f"unreadable store structure: {type(exc).__name__}: {exc}")
    return problems
