"""``h5-per-id``: one dataset per input ID at the file root, the layout bio_embeddings, the
ProtT5 embedder, protspace, LightAttention and TMbed read (docs/exports.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from embedpipe.export.blocks import ExportBlock
from embedpipe.export.keys import encode_key
from embedpipe.store.format import write_root_attrs
from embedpipe.store.h5write import atomic_h5


def write_h5_per_id(out: Path, blocks: Iterable[ExportBlock], attrs: Mapping[str, Any],
                    on_block: Callable[[ExportBlock], None]) -> None:
    """Write ``out`` atomically: dataset ``encode_key(id)`` holds the vector (D,) or the
    per-residue rows (L, D), with ``original_id``, ``precision_used`` and ``fallback_reason``
    as attributes, and ``alias_of`` on the IDs that duplicate a stored record. (Each HDF5
    attribute costs about as much as the dataset itself: lengths and digests are in parquet.)"""
    with atomic_h5(out) as target, target.create() as f:
        write_root_attrs(f, attrs)
        for block in blocks:
            precision, reason = block.table["precision_used"], block.table["fallback_reason"]
            for j, record_id in enumerate(block.ids):
                ds = f.create_dataset(encode_key(record_id), data=block.record_rows(j))
                i = int(block.source[j])
                ds.attrs["original_id"] = record_id
                ds.attrs["precision_used"] = precision[i]
                ds.attrs["fallback_reason"] = reason[i]
                if block.alias_of[j]:
                    ds.attrs["alias_of"] = block.alias_of[j]
            on_block(block)


def export(out: Path, store: Any, blocks: Iterable[ExportBlock], attrs: Mapping[str, Any], per_residue: bool,
           on_block: Callable[[ExportBlock], None]) -> None:
    """The registry's entry point (``formats.py``)."""
    write_h5_per_id(out, blocks, attrs, on_block)
