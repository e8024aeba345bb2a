"""The one store-writing helper of the store tests: synthetic records into a store.

Each test module keeps its own records and provenance attributes (they are its data); how
they are written is here. Records are written in a shuffled order (the writer takes any
order), and the root attribute ``fallback_count`` is set as ``embed`` sets it.
"""

from __future__ import annotations

import dataclasses
import hashlib
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


def edit_store(path: Path, change: Callable[[h5py.File], object]) -> Path:
    """``change`` applied to the store opened for writing (a crafted store, as a hostile user makes one)."""
    with h5py.File(path, "r+") as f:
        change(f)
    return path


def set_row(f: h5py.File, name: str, row: int, value: bytes) -> None:
    """Row ``row`` of the string dataset ``name`` replaced by ``value`` (any bytes, same dtype)."""
    values = f[name][:].tolist()
    values[row] = value
    f[name][:] = np.array(values, dtype=f[name].dtype)


def rewrite_digests(f: h5py.File, rows: Sequence[int] | None = None) -> None:
    """``row_digest`` of ``rows`` (every record by default) recomputed with hashlib from the
    vectors ``f`` now holds: the store as a writer of these values would have written it (for
    tests that edit vectors to test what reads them, not the digests; docs/store-format.md,
    "Row digests")."""
    pooling = [v.decode() if isinstance(v, bytes) else str(v) for v in np.atleast_1d(f.attrs.get("pooling", ["mean"]))]
    layers = sorted(int(k) for k in np.atleast_1d(f.attrs["layers"]))
    names = [f"{p}/layer_{k}" for p in pooling for k in layers]
    names += [f"per_residue/layer_{k}" for k in layers] if "per_residue" in f else []
    digests = f["row_digest"].asstr()[()].tolist()
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
        digests[row] = "".join(parts)
    f["row_digest"][:] = np.array([d.encode() for d in digests], dtype=f["row_digest"].dtype)


def store_uuid(path: Path) -> str:
    """The store's ``store_uuid``: the same file (kept, not rewritten) has the same one."""
    with h5py.File(path, "r") as f:
        return str(f.attrs["store_uuid"])


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors, in float64 (the tests' independent figure)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
