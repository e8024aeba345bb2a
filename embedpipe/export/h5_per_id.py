"""``h5-per-id``: one dataset per input ID at the file root, the layout bio_embeddings, the
ProtT5 embedder, protspace, LightAttention and TMbed read (docs/exports.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.output_guard import OutputKind, hdf5_kind
from embedpipe.export.blocks import ExportBlock
from embedpipe.export.keys import encode_key
from embedpipe.store.format import write_root_attrs
from embedpipe.store.h5write import atomic_h5


class _PerId:
    """Datasets and their string attributes through h5py's low-level API: the high-level calls
    cost ~0.7-1 ms per ID, mostly in checks and attribute replacement (docs/benchmarks.md).
    The objects are those h5py writes: every dataset has the creation properties of the first,
    which h5py makes; attributes are scalar variable-length UTF-8 strings."""

    def __init__(self, f: h5py.File) -> None:
        self.f = f
        self.dcpl: h5py.h5p.PropDCID | None = None
        self.types: dict[np.dtype, h5py.h5t.TypeID] = {}
        self.str_dtype = h5py.string_dtype("utf-8")
        self.str_type = h5py.h5t.py_create(self.str_dtype, logical=True)
        self.scalar = h5py.h5s.create(h5py.h5s.SCALAR)

    def dataset(self, name: str, data: np.ndarray) -> h5py.h5d.DatasetID:
        if self.dcpl is None:
            ds = self.f.create_dataset(name, data=data)
            self.dcpl = ds.id.get_create_plist()
            return ds.id
        data = np.ascontiguousarray(data)
        tid = self.types.get(data.dtype)
        if tid is None:
            tid = self.types[data.dtype] = h5py.h5t.py_create(data.dtype)
        d = h5py.h5d.create(self.f.id, name.encode("utf-8"), tid, h5py.h5s.create_simple(data.shape), dcpl=self.dcpl)
        if data.size:
            d.write(h5py.h5s.ALL, h5py.h5s.ALL, data)
        return d

    def attr(self, d: h5py.h5d.DatasetID, name: str, value: str) -> None:
        h5py.h5a.create(d, name.encode("utf-8"), self.str_type, self.scalar).write(np.array(str(value), dtype=self.str_dtype))


def write_h5_per_id(out: Path, blocks: Iterable[ExportBlock], attrs: Mapping[str, Any],
                    on_block: Callable[[ExportBlock], None]) -> None:
    """Write ``out`` atomically: dataset ``encode_key(id)`` holds the vector (D,) or the
    per-residue rows (L, D), with ``original_id``, ``precision_used`` and ``fallback_reason``
    as attributes, and ``alias_of`` on the IDs that duplicate a stored record. (Each HDF5
    attribute costs about as much as the dataset itself: lengths and digests are in parquet.)"""
    with atomic_h5(out) as target, target.create() as f:
        write_root_attrs(f, attrs)
        writer = _PerId(f)
        for block in blocks:
            precision, reason = block.table["precision_used"], block.table["fallback_reason"]
            for j, record_id in enumerate(block.ids):
                d = writer.dataset(encode_key(record_id), block.record_rows(j))
                i = int(block.source[j])
                writer.attr(d, "original_id", record_id)
                writer.attr(d, "precision_used", precision[i])
                writer.attr(d, "fallback_reason", reason[i])
                if block.alias_of[j]:
                    writer.attr(d, "alias_of", block.alias_of[j])
            on_block(block)


def ours(out: Path) -> OutputKind:
    """What an h5-per-id export may replace: an earlier one (its root ``export_format``)."""
    return hdf5_kind("an h5-per-id export", "export_format", "h5-per-id")


def export(out: Path, store: Any, blocks: Iterable[ExportBlock], attrs: Mapping[str, Any], per_residue: bool,
           on_block: Callable[[ExportBlock], None]) -> None:
    """The registry's entry point (``core/export_formats.py``)."""
    write_h5_per_id(out, blocks, attrs, on_block)
