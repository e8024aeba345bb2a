"""The one store-writing helper of the store tests: synthetic records into a store.

Each test module keeps its own records and provenance attributes (they are its data); how
they are written is here. Records are written in a shuffled order (the writer takes any
order), and the root attribute ``fallback_count`` is set as ``embed`` sets it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.store import EmbeddedRecord, StoreWriter

#: the provenance a store gets when a test gives none (what ``embed`` records, made up)
ATTRS: dict[str, Any] = {
    "model_name": "esm2_test",
    "model_sha256": "0" * 64,
    "model_trained": False,
    "precision_policy": "fp16-mixed",
    "device": "cpu",
    "torch_version": "2.x",
    "fair_esm_version": "2.0.0",
    "embedpipe_version": "0.1.0",
    "config": {"tokens_per_batch": 4096, "layers": [-1]},
}

#: ``rows`` not given: the per-residue row count of each record (none when it has no rows)
FROM_RECORDS: Any = object()


def write_store(path: Path, records: Sequence[EmbeddedRecord], rows: Sequence[int] | None = FROM_RECORDS, *,
                attrs: Mapping[str, Any] = ATTRS, layers: Sequence[int] | None = None, dim: int | None = None,
                storage_dtype: str = "float32", shuffle_seed: int = 1) -> Path:
    """Write ``records`` to ``path``; ``layers`` and ``dim`` default to the first record's.

    ``rows=None`` writes no per-residue data, whatever the records hold."""
    layers = list(layers if layers is not None else records[0].mean)
    dim = dim if dim is not None else len(records[0].mean[layers[0]])
    if rows is FROM_RECORDS:
        rows = None if records and records[0].per_residue is None else [len(r.per_residue[layers[0]]) for r in records]
    order = list(range(len(records)))
    random.Random(shuffle_seed).shuffle(order)
    with StoreWriter(path, ids=[r.id for r in records], sequences=[r.sequence for r in records],
                     residue_rows=rows, layers=layers, dim=dim, storage_dtype=storage_dtype,
                     attrs=dict(attrs)) as writer:
        for i in order:
            record = records[i] if rows is not None else dataclasses.replace(records[i], per_residue=None)
            writer.write(i, record)
        writer.set_attrs(fallback_count=sum(1 for r in records if r.fallback_reason))
    return path


def edit_store(path: Path, change: Callable[[h5py.File], object], *, restamp: bool = True) -> Path:
    """``change`` applied to the store opened for writing (a crafted store, as a hostile user
    makes one). ``restamp``: then, as that user can, the record parts of ``row_digest`` and
    ``attr_digests`` recomputed (format 3), so the test reaches the check behind them; the
    vector digests are left as they were (docs/store-format.md, "Row digests")."""
    with h5py.File(path, "r+") as f:
        change(f)
        if restamp and int(f.attrs.get("format_version", 0)) >= 3:
            restamp_coverage(f)
    return path


def restamp_coverage(f: h5py.File) -> None:
    """The record part of every full ``row_digest`` and ``attr_digests`` (when present) as a
    writer of what ``f`` now holds would have written them; what cannot be read is left."""
    try:
        digests = f["row_digest"].asstr()[()].tolist()
        for row, digest in enumerate(digests):
            if len(digest) >= 32:
                digests[row] = digest[:-32] + record_part(f, row)
        f["row_digest"][:] = np.array([d.encode() for d in digests], dtype=f["row_digest"].dtype)
    except Exception:  # noqa: BLE001 - a column the change made unreadable stays as it is
        pass
    if "attr_digests" in f.attrs:
        rewrite_attr_digests(f)


def set_row(f: h5py.File, name: str, row: int, value: bytes) -> None:
    """Row ``row`` of the string dataset ``name`` replaced by ``value`` (any bytes, same dtype)."""
    values = f[name][:].tolist()
    values[row] = value
    f[name][:] = np.array(values, dtype=f[name].dtype)


#: the per-record columns the record part of a format-3 ``row_digest`` covers, in its order
#: (docs/store-format.md, "Row digests")
RECORD_COLUMNS = [("ids", "s"), ("sequence", "s"), ("length", "<i8"), ("precision_used", "s"), ("fallback_reason", "s"),
                  ("max_abs_activation", "<f4"), ("long_handling", "s"), ("embedded_length", "<i8"), ("windows", "<i8"),
                  ("reused_from", "s")]


def record_part(f: h5py.File, row: int) -> str:
    """The record part of row ``row``'s digest, from the stored bytes with hashlib: per column,
    its name, NUL, its byte length (8 bytes little-endian) and its bytes (text UTF-8, numbers
    little-endian)."""
    h = hashlib.blake2b(digest_size=16)
    for name, kind in RECORD_COLUMNS:
        if name == "sequence":
            a, b = f["sequence/offsets"][row : row + 2]
            data = f["sequence/data"][a:b].tobytes()
        elif kind == "s":
            data = bytes(f[name][row])
        else:
            data = np.asarray(f[name][row]).astype(kind).tobytes()
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def _attr_bytes(value: Any) -> bytes:
    def text(v: Any) -> bytes:
        return v.encode("utf-8", "surrogatepass") if isinstance(v, str) else bytes(v)

    if isinstance(value, (str, bytes)):
        return b"s" + text(value)
    arr = np.asarray(value)
    if arr.dtype.kind in "OSU":
        return b"a" + repr(arr.shape).encode() + b"".join(len(text(v)).to_bytes(8, "little") + text(v)
                                                          for v in arr.ravel().tolist())
    le = arr.dtype.newbyteorder("<")
    return b"n" + le.str.encode() + repr(arr.shape).encode() + arr.astype(le).tobytes()


def attr_digests(f: h5py.File) -> dict[str, str]:
    """``attr_digests`` recomputed with hashlib: blake2b-64 of each root attribute's name, NUL and
    value bytes, every attribute but ``complete``, the encoding tags and ``attr_digests``."""
    return {name: hashlib.blake2b(name.encode() + b"\0" + _attr_bytes(f.attrs[name]), digest_size=8).hexdigest()
            for name in f.attrs if name not in ("complete", "attr_digests", "encoding-type", "encoding-version")}


def as_format2(f: h5py.File) -> None:
    """The store as format 2 wrote it: ``format_version`` 2, ``row_digest`` without its record
    parts, no ``attr_digests`` (for tests of what older stores may lack)."""
    f.attrs["format_version"] = np.int64(2)
    if "attr_digests" in f.attrs:
        del f.attrs["attr_digests"]
    if "row_digest" in f:
        digests = [d[:-32] if len(d) > 32 else d for d in f["row_digest"].asstr()[()].tolist()]
        f["row_digest"][:] = np.array([d.encode() for d in digests], dtype=f["row_digest"].dtype)


def rewrite_attr_digests(f: h5py.File) -> None:
    """``attr_digests`` as a writer of the attributes ``f`` now holds would have written it."""
    f.attrs["attr_digests"] = json.dumps(attr_digests(f), sort_keys=True)


def rewrite_digests(f: h5py.File, rows: Sequence[int] | None = None) -> None:
    """``row_digest`` of ``rows`` (every record by default) recomputed with hashlib from the
    vectors and (format 3) the per-record columns ``f`` now holds, and (format 3) the root
    attributes' digests: the store as a writer of these values would have written it (for
    tests that edit a store to test what reads it, not the digests; docs/store-format.md,
    "Row digests")."""
    pooling = [v.decode() if isinstance(v, bytes) else str(v) for v in np.atleast_1d(f.attrs.get("pooling", ["mean"]))]
    layers = sorted(int(k) for k in np.atleast_1d(f.attrs["layers"]))
    names = [f"{p}/layer_{k}" for p in pooling for k in layers]
    names += [f"per_residue/layer_{k}" for k in layers] if "per_residue" in f else []
    digests = f["row_digest"].asstr()[()].tolist()
    covered = int(f.attrs["format_version"]) >= 3
    for row in range(len(digests)) if rows is None else rows:
        parts = []
        for name in names:
            if name.startswith("per_residue/"):
                a, b = f["per_residue/offsets"][row : row + 2]
                values = f[name][a:b]
            else:
                values = f[name][row]
            data = np.ascontiguousarray(values)
            parts.append(hashlib.blake2b(data.astype(data.dtype.newbyteorder("<")).tobytes(), digest_size=16).hexdigest())
        if covered:
            parts.append(record_part(f, row))
        digests[row] = "".join(parts)
    f["row_digest"][:] = np.array([d.encode() for d in digests], dtype=f["row_digest"].dtype)
    if covered:
        rewrite_attr_digests(f)


def store_uuid(path: Path) -> str:
    """The store's ``store_uuid``: the same file (kept, not rewritten) has the same one."""
    with h5py.File(path, "r") as f:
        return str(f.attrs["store_uuid"])


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors, in float64 (the tests' independent figure)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
