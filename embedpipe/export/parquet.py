"""``parquet``: one row per input ID with its vector as a fixed-size list, readable by
pandas, polars, DuckDB and Hugging Face ``datasets`` without help (docs/exports.md)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embedpipe.core.atomic import atomic_path
from embedpipe.core.output_guard import OutputKind
from embedpipe.export.blocks import ExportBlock

_ARROW_TYPES = {np.dtype(np.float32): pa.float32(), np.dtype(np.float16): pa.float16()}
VECTOR_COLUMN = "embedding"
METADATA_KEY = b"embedpipe"


def schema(dim: int, dtype: np.dtype, per_residue: bool, attrs: Mapping[str, Any]) -> pa.Schema:
    """id, alias_of, sequence_sha256, length, precision_used, fallback_reason, embedding."""
    vector = pa.list_(_ARROW_TYPES[np.dtype(dtype)], dim)
    fields = [
        ("id", pa.string()), ("alias_of", pa.string()), ("sequence_sha256", pa.string()),
        ("length", pa.int64()), ("precision_used", pa.string()), ("fallback_reason", pa.string()),
        (VECTOR_COLUMN, pa.list_(vector) if per_residue else vector),
    ]
    metadata = {METADATA_KEY: json.dumps(dict(attrs), sort_keys=True, default=str).encode("utf-8")}
    return pa.schema(fields, metadata=metadata)


def _table(block: ExportBlock, schema_: pa.Schema, dim: int) -> pa.Table:
    src = block.source
    if block.residues is None:
        values = block.vectors[src]  # type: ignore[index]
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), dim)
    else:
        rows, offsets = block.gathered_residues()
        inner = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), dim)
        vectors = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), inner)
    columns = {
        "id": block.ids,
        "alias_of": block.alias_of,
        "sequence_sha256": block.table["sequence_sha256"][src].tolist(),
        "length": block.table["length"][src].astype(np.int64),
        "precision_used": block.table["precision_used"][src].tolist(),
        "fallback_reason": block.table["fallback_reason"][src].tolist(),
    }
    arrays = [pa.array(columns[f.name], type=f.type) for f in schema_ if f.name != VECTOR_COLUMN]
    return pa.Table.from_arrays([*arrays, vectors], schema=schema_)


def write_parquet(out: Path, blocks: Iterable[ExportBlock], attrs: Mapping[str, Any], *, dim: int,
                  dtype: np.dtype, per_residue: bool, on_block: Callable[[ExportBlock], None]) -> None:
    """Write ``out`` atomically, one row group per block (bounded memory when reading too);
    the store's provenance is the file's key-value metadata under ``embedpipe``."""
    schema_ = schema(dim, dtype, per_residue, attrs)
    with atomic_path(out) as tmp:
        with pq.ParquetWriter(tmp, schema_, compression="zstd") as writer:
            for block in blocks:
                writer.write_table(_table(block, schema_, dim))
                on_block(block)


def _is_export(path: Path) -> bool:
    """Whether ``path`` is a Parquet file whose ``embedpipe`` metadata says parquet export."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != b"PAR1":
                return False
        metadata = pq.read_schema(path).metadata or {}
        return bool(json.loads(metadata.get(METADATA_KEY, b"{}")).get("export_format") == "parquet")
    except Exception:  # noqa: BLE001 - a file pyarrow cannot read is no export of ours
        return False


def ours(out: Path) -> OutputKind:
    """What a parquet export may replace: an earlier one (its ``embedpipe`` metadata)."""
    return OutputKind("a parquet export", _is_export)


def export(out: Path, store: Any, blocks: Iterable[ExportBlock], attrs: Mapping[str, Any], per_residue: bool,
           on_block: Callable[[ExportBlock], None]) -> None:
    """The registry's entry point (``core/export_formats.py``)."""
    write_parquet(out, blocks, attrs, dim=store.dim, dtype=store.dtype, per_residue=per_residue, on_block=on_block)
