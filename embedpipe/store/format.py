"""Format primitives of the embedpipe HDF5 store: version, encoding tags, attributes, string
and array types, chunk sizes, opening and the version check (datasets are created in
``embedpipe.store.create``).

The format is specified in ``docs/store-format.md``; the writer, the reader, merge, validate
and info all build on this module, so each rule below exists once:

* every stored (non-virtual) dataset is chunked with a fletcher32 checksum (its filters:
  ``embedpipe.store.filters``); strings are fixed-length UTF-8 (HDF5 cannot filter, hence
  cannot checksum, variable-length strings);
* every group and dataset carries anndata-style ``encoding-type`` / ``encoding-version``
  tags, and ``encoding-version`` is the store's ``format_version`` (one version scheme; see
  ``embedpipe.store.encoding`` for the check readers make);
* root attributes that HDF5 cannot hold natively are JSON, listed in ``json_attrs``;
* timestamps are UTC ``%Y-%m-%dT%H:%M:%SZ`` (:func:`utc_now`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core import long_sequences
from embedpipe.core.errors import QUOTE_CHARS, StoreError
from embedpipe.core.interrupts import checkpoint
from embedpipe.core.options import POOLINGS
from embedpipe.store.attrjson import check_attr_text, load_json_attr

FORMAT = "embedpipe.store"
FORMAT_VERSION = 3

#: values of the ``long_handling`` column, from the long-sequence modes (core/long_sequences.py)
LONG_HANDLING = long_sequences.HANDLING
#: pooled outputs a store can hold, each a group ``{pooling}/layer_{k}`` (N, D); ``mean`` is
#: always stored, ``bos`` (the BOS token's hidden state) on request (docs/store-format.md)

#: root attribute: characters of a stored ``sequence`` one residue takes, where it is not 1
#: (SaProt's structure-aware sequences: 2); ``length`` and the per-residue rows count residues
CHARS_PER_RESIDUE = "chars_per_residue"


def chars_per_residue(attrs: Any) -> int:
    """A store's characters per residue from its root attributes (1 when absent)."""
    return int(attrs.get(CHARS_PER_RESIDUE, 1))


def residues_of(chars: int, per_residue: int) -> int:
    """Residues of a stored sequence of ``chars`` characters; a part of a residue counts as one,
    so that ``length`` disagrees with a sequence that is not whole residues (validate)."""
    return -(-chars // per_residue)


def chars_attr(per_residue: int) -> dict[str, int]:
    """The root attribute for a family's ``chars_per_residue``: none where it is 1."""
    return {CHARS_PER_RESIDUE: per_residue} if per_residue != 1 else {}


#: root attribute: random uuid4 hex written when a store is created; a rewrite gets a new one
STORE_UUID_ATTR = "store_uuid"
#: root attributes the writer owns; callers may not set them through ``attrs``/``set_attrs``
RESERVED_ATTRS = frozenset(
    {"format", "format_version", "complete", "json_attrs", "encoding-type", "encoding-version", STORE_UUID_ATTR,
     "attr_digests"}
)

# encoding-type of each kind of object (docs/store-format.md, "File level")
ARRAY = "array"
STRINGS = "fixed-utf8-array"
POOLED = "pooled-layers"
RAGGED = "ragged-layers"
OFFSETS = "offsets"
VIRTUAL = "virtual-array"
ALIASES = "aliases"
SKIPPED = "skipped"
RAGGED_STRINGS = "ragged-utf8"  # v2 ``sequence/``: UTF-8 bytes + offsets
ID_INDEX = "id-index"  # v2 ``id_index/``: sorted IDs -> rows

# Chunking: ~4 MiB per chunk of a 2-D float dataset, ~1 MiB per chunk of a string dataset or
# of a per-record column.
TARGET_CHUNK_BYTES = 4 << 20
SMALL_CHUNK_BYTES = 1 << 20
# Validation and merge read blocks of about this many bytes at a time.
READ_BLOCK_BYTES = 64 << 20

# File format objects of HDF5 1.10 (needed for virtual datasets; compact chunk indexes keep
# small stores small), and nothing newer, so HDF5 >= 1.10 can read every store.
LIBVER = ("v110", "v110")


def tag(obj: h5py.HLObject, encoding_type: str, **extra: Any) -> None:
    """anndata-style self-description on every group and dataset."""
    obj.attrs["encoding-type"] = encoding_type
    obj.attrs["encoding-version"] = str(FORMAT_VERSION)
    for key, value in extra.items():
        obj.attrs[key] = value


def utc_now() -> str:
    """The one timestamp format of a store (``created_utc``, ``finished_utc``)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_store_uuid() -> str:
    """A fresh identity for a store being created."""
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------
# datasets


def chunk_rows(row_bytes: int, n_rows: int, *, target: int = TARGET_CHUNK_BYTES, cap: int = 65_536) -> int:
    """Rows per chunk: about ``target`` bytes, at least 1, at most ``n_rows`` (when > 0)."""
    rows = max(1, min(cap, target // max(1, row_bytes)))
    return max(1, min(rows, n_rows)) if n_rows > 0 else rows


def string_dtype(width: int) -> np.dtype:
    """Fixed-length, null-padded UTF-8 string type of ``width`` bytes (HDF5 needs >= 1)."""
    return h5py.string_dtype("utf-8", max(1, int(width)))


def encode_strings(values: Sequence[str] | np.ndarray) -> np.ndarray:
    """Python strings -> fixed-length UTF-8 byte array, as wide as the longest encoding."""
    encoded = [str(v).encode("utf-8") for v in values]
    if any(b"\x00" in b for b in encoded):
        raise StoreError("strings stored in an embedpipe store may not contain NUL characters")
    width = max((len(b) for b in encoded), default=1)
    return np.array(encoded, dtype=string_dtype(width)) if encoded else np.zeros(0, dtype=string_dtype(1))


def dataset_label(ds: h5py.Dataset) -> str:
    """``FILE: dataset NAME``, how an error names a dataset it read."""
    return f"{ds.file.filename}: dataset {ds.name.lstrip('/')}"


def decode_strings(raw: np.ndarray | Sequence[bytes], where: str = "a stored string", start: int = 0) -> list[str]:
    """Fixed-length (or variable-length) HDF5 strings read by h5py -> list of Python str.
    Bytes that are not UTF-8 (a crafted store) are one StoreError naming ``where`` (e.g.
    :func:`dataset_label`) and the row (``start`` + position), not a UnicodeDecodeError."""
    values = np.asarray(raw).ravel().tolist()
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]
    except UnicodeDecodeError:
        i, exc = next((i, e) for i, v in enumerate(values) if (e := _utf8_error(v)) is not None)
        v = values[i]
        shown = repr(v[:QUOTE_CHARS]) + (f"... ({len(v)} bytes)" if len(v) > QUOTE_CHARS else "")
        raise StoreError(f"{where} row {start + i}: {shown} is not valid UTF-8 (byte 0x{v[exc.start]:02x} at "
                         f"position {exc.start})") from None


def _utf8_error(value: Any) -> UnicodeDecodeError | None:
    try:
        value.decode("utf-8") if isinstance(value, bytes) else None
    except UnicodeDecodeError as exc:
        return exc
    return None


def stored_poolings(requested: Sequence[str] = ()) -> list[str]:
    """The poolings a store holds for ``requested``: always ``mean``, then the rest in
    :data:`POOLINGS` order."""
    unknown = sorted(set(requested) - set(POOLINGS))
    if unknown:
        raise StoreError(f"pooling must be one of {', '.join(POOLINGS)}, not {', '.join(map(repr, unknown))}")
    return [p for p in POOLINGS if p == "mean" or p in requested]


def poolings_of(f: h5py.File) -> list[str]:
    """The poolings stored in ``f`` (root attribute ``pooling``; stores without it hold ``mean``)."""
    value = attr_to_python(f.attrs.get("pooling", ["mean"]))
    return [str(v) for v in (value if isinstance(value, list) else [value])]


# ---------------------------------------------------------------------------------------------
# attributes


def attr_to_python(value: Any) -> Any:
    """h5py attribute value -> plain Python (str, int, float, bool, list)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):  # bytes decoded here: 16,000 source paths, one call each
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else attr_to_python(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [attr_to_python(v) for v in value]
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def _list_to_attr(items: list[Any]) -> Any:
    """A homogeneous list as a native HDF5 array, or None (then it is stored as JSON)."""
    if not items:
        return None
    is_bool = [isinstance(v, (bool, np.bool_)) for v in items]
    if all(is_bool):
        return np.array(items, dtype=bool)
    if any(is_bool):
        return None
    if all(isinstance(v, (int, np.integer)) for v in items):
        return np.array(items, dtype=np.int64)
    if all(isinstance(v, (float, np.floating, int, np.integer)) for v in items):
        return np.array(items, dtype=np.float64)
    if all(isinstance(v, str) for v in items):
        return [str(v) for v in items]
    return None


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
        native = _list_to_attr(list(value.tolist() if isinstance(value, np.ndarray) else value))
        if native is not None:
            return native, False
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


#: root attributes of a merged store that grow with its sources (~1-2 KB each: 16,000 sources
#: took most of ``open_store``): readers parse them when first asked (docs/benchmarks.md)
PER_SOURCE_ATTRS = ("shard_provenance", "merged_sources", "merged_from", "merged_rows")


def read_root_attrs(obj: h5py.HLObject, *, skip: Sequence[str] = (), only: Sequence[str] | None = None) -> dict[str, Any]:
    """All attributes (except ``skip``; or ``only`` those) as plain Python; JSON-encoded ones
    (``json_attrs``, ``config``) parsed."""
    keys = [key for key in obj.attrs if key not in skip and (only is None or key in only)]
    raw = {key: obj.attrs[key] for key in keys}
    for key, value in raw.items():
        check_attr_text(value, key, obj.file.filename)  # not UTF-8: one line, not a later traceback
    out = {key: attr_to_python(value) for key, value in raw.items()}
    if only is not None and "json_attrs" in obj.attrs:
        out["json_attrs"] = attr_to_python(obj.attrs["json_attrs"])
    json_names = set(out.pop("json_attrs", []) or [])
    json_names.add("config")
    for key in json_names:
        if isinstance(out.get(key), str):
            with contextlib.suppress(ValueError):
                out[key] = load_json_attr(out[key], key, obj.file.filename)
    return out



# ---------------------------------------------------------------------------------------------
# opening and reading


def major_version(value: Any) -> int | None:
    try:
        return int(str(attr_to_python(value)).split(".")[0])
    except (TypeError, ValueError):
        return None


def newer_version_error(path: Path | str, version: int, where: str = "") -> StoreError:
    return StoreError(f"{path}: {where}written by a newer embedpipe (format {version}); upgrade embedpipe to read it")


def check_format(f: h5py.File, path: Path | str) -> int:
    """Raise StoreError unless ``f`` is an embedpipe store this version can read."""
    fmt = attr_to_python(f.attrs.get("format"))
    if fmt != FORMAT:
        raise StoreError(f"{path}: not an embedpipe store (format attribute is {fmt!r})")
    version = major_version(f.attrs.get("format_version"))
    if version is None:
        raise StoreError(f"{path}: unreadable format_version {attr_to_python(f.attrs.get('format_version'))!r}")
    if version > FORMAT_VERSION:
        raise newer_version_error(path, version)
    if version < 1:
        raise StoreError(f"{path}: unknown store format version {version}")
    return version


def open_h5(path: Path | str, *, cache_bytes: int | None = None) -> h5py.File:
    """Open read-only, turning 'missing', 'not HDF5' and 'truncated' into one-line StoreErrors;
    ``cache_bytes``: HDF5's chunk cache per dataset (default 1 MiB)."""
    checkpoint()  # between files: where a held-back Ctrl-C or SIGTERM ends a merge (core/interrupts.py)
    path = Path(path)
    if not path.exists():
        raise StoreError(f"{path}: no such file")
    if path.is_dir():
        raise StoreError(f"{path}: is a directory, not a store file")
    try:
        return h5py.File(path, "r") if cache_bytes is None else h5py.File(path, "r", rdcc_nbytes=cache_bytes)
    except OSError as exc:
        if "already open for write" in str(exc):
            raise StoreError(
                f"{path}: incomplete store: the file was never closed (its writer was killed or is still running)"
            ) from None
        if "Too many open files" in str(exc) or getattr(exc, "errno", None) == errno.EMFILE:
            raise StoreError(f"{path}: cannot open: too many open files (a resource limit of this process, "
                             "ulimit -n, not a problem of the store); raise the limit and retry") from None
        reason = str(exc).split("(", 1)[-1].rstrip(")") if "(" in str(exc) else str(exc)
        raise StoreError(f"{path}: not a readable HDF5 file (truncated or corrupt?): {reason}") from None


def layer_names(group: h5py.Group | Mapping[str, Any]) -> list[int]:
    """Absolute layer indices of a group's ``layer_{k}`` members, ascending."""
    return sorted(int(k.split("_", 1)[1]) for k in group if k.startswith("layer_"))


def stored_layers(f: h5py.File) -> list[int]:
    layers = f.attrs.get("layers")
    if layers is None:
        return layer_names(f.get("mean", {}))
    return sorted(int(v) for v in np.atleast_1d(layers))


def is_complete(f: h5py.File) -> bool:
    return bool(attr_to_python(f.attrs.get("complete", False)))


def iter_row_blocks(ds: h5py.Dataset, *, block_bytes: int | None = None) -> Iterator[slice]:
    """Row slices covering ``ds`` with about ``block_bytes`` (default READ_BLOCK_BYTES) each,
    aligned to its chunks."""
    block_bytes = block_bytes or READ_BLOCK_BYTES
    n = ds.shape[0] if ds.shape else 0
    row_bytes = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64)) if ds.shape else 1
    rows = max(1, block_bytes // max(1, row_bytes))
    if ds.chunks:
        c = ds.chunks[0]
        rows = max(c, rows // c * c)
    for start in range(0, n, rows):
        checkpoint()  # between blocks, never inside h5py (embedpipe.core.interrupts)
        yield slice(start, min(n, start + rows))


def read_blocks(ds: h5py.Dataset, name: str, path: Path | str | None = None) -> Iterator[tuple[slice, np.ndarray]]:
    """(rows, block) over ``ds``; a failed read (checksum mismatch) is one StoreError naming the
    dataset, the rows and, when given, the store."""
    for sl in iter_row_blocks(ds):
        try:
            block = ds[sl]
        except OSError as exc:
            where = "" if path is None else f"{path}: "
            raise StoreError(
                f"{where}dataset {name} rows {sl.start}:{sl.stop}: checksum mismatch or read error ({exc})"
            ) from None
        yield sl, block


def string_counts(ds: h5py.Dataset, where: str, rows: int) -> Iterator[tuple[list[str], np.ndarray]]:
    """Per block of ``rows`` rows of a string column: its distinct values as text and how many
    rows hold each, from the stored bytes (decoding every value of a block to Python strings
    cost ~100 B a record); a value that is not UTF-8 is one StoreError naming ``where`` and its row."""
    for lo in range(0, ds.shape[0], rows):
        checkpoint()  # between blocks, never inside h5py (embedpipe.core.interrupts)
        block = ds[lo : lo + rows]
        unique, counts = np.unique(block, return_counts=True)
        try:
            values = decode_strings(unique)
        except StoreError:
            decode_strings(block, where, lo)  # raises, naming the row
            raise
        yield values, counts


def read_strings(ds: h5py.Dataset) -> list[str]:
    """A whole string dataset, read block by block."""
    out: list[str] = []
    for sl in iter_row_blocks(ds):
        out.extend(decode_strings(ds[sl], dataset_label(ds), sl.start))
    return out
