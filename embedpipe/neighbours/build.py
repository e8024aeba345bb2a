"""``embedpipe index``: a FAISS index over one stored layer and pooling of a store.

Why blocks: the store is read as ``export`` reads it (:func:`embedpipe.export.blocks.iter_blocks`:
every input ID once, aliases included, digests and finiteness checked), so memory holds one block
of vectors besides the index. Cosine is an inner product of unit vectors: each row is cast from
the storage dtype to float32 and normalised (a zero vector stays zero, and scores 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embedpipe.core.atomic import atomic_paths
from embedpipe.core.checksums import file_sha256
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import POOLINGS, check_choice
from embedpipe.core.output_guard import described_by, writing_outputs
from embedpipe.export.blocks import check_ids, iter_blocks
from embedpipe.neighbours.index_file import FORMAT, KINDS, IndexMeta, check_id, faiss_module, ids_path, meta_path
from embedpipe.store import open_store

__all__ = ["HNSW_M", "IndexSummary", "build_index", "unit_rows"]

#: HNSW's graph degree and its build-time and default search-time breadth (docs/python.md, "Recall")
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 64


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows as float32 unit vectors (cosine = inner product); a zero row stays zero."""
    rows = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms > 0, norms, 1.0).astype(np.float32)


@dataclass
class IndexSummary:
    out: Path
    meta: IndexMeta

    def render(self) -> str:
        return f"indexed {self.meta.rows} IDs ({self.meta.kind}, cosine) of {self.meta.describe()} -> {self.out}"


def _new_index(kind: str, dim: int) -> Any:
    faiss = faiss_module()
    if kind == "exact":
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    index.hnsw.efSearch = HNSW_EF_SEARCH
    return index


def build_index(store_path: Path, out: Path, *, layer: int = -1, pooling: str = "mean", kind: str = "exact") -> IndexSummary:
    """Index ``layer`` (``pooling``) of the store at ``store_path`` into ``out`` (with
    ``out.json`` and ``out.ids.txt``), written atomically together."""
    check_choice("--pooling", pooling, POOLINGS)
    check_choice("--kind", kind, KINDS)
    store_path, out = Path(store_path), Path(out)
    faiss = faiss_module()
    ours = described_by("an embedpipe index", meta_path(out), "format", FORMAT)  # replaces only an index
    outputs = [("--out", out, ours), ("--out", meta_path(out), ours), ("--out", ids_path(out), ours)]
    with writing_outputs("index", outputs, [store_path]), open_store(store_path) as store:
        absolute = store.layer(layer)
        if pooling not in store.pooling:
            raise EmbedpipeError(f"{store_path}: pooling {pooling!r} is not stored (stored: {', '.join(store.pooling)})")
        attrs = store.provenance
        identity = attrs.get("embed_identity")
        if not isinstance(identity, str):
            raise EmbedpipeError(f"{store_path}: records no embed_identity (written by an older embedpipe); "
                                 "embed it again to index it")
        check_ids(store, "index")  # IDs and id_index as validate checks them (embedpipe.export.blocks)
        index = _new_index(kind, store.dim)
        rows = 0
        with atomic_paths(ids_path(out), meta_path(out), out) as (tmp_ids, tmp_meta, tmp_index):
            with open(tmp_ids, "w", encoding="utf-8", newline="\n") as ids:
                for block in iter_blocks(store, layer=absolute, per_residue=False, pooling=pooling):
                    for record_id in block.ids:
                        check_id(record_id, store_path)
                    index.add(unit_rows(block.vectors[block.source]))  # type: ignore[index]
                    ids.writelines(f"{i}\n" for i in block.ids)
                    rows += len(block.ids)
            faiss.write_index(index, str(tmp_index))
            config = attrs.get("config")
            meta = IndexMeta(
                store=str(store_path.resolve()), store_uuid=str(attrs.get("store_uuid", "")),
                store_sha256=file_sha256(store_path, cache=True), layer=absolute, pooling=pooling, kind=kind,
                rows=rows, dim=store.dim, model_source=str(attrs.get("model_source", "")),
                model_sha256=str(attrs.get("model_sha256", "")),
                precision_policy=str(attrs.get("precision_policy", "")), storage_dtype=store.dtype.name,
                embed_identity=identity, options=config if isinstance(config, dict) else json.loads(str(config)),
                faiss_bytes=tmp_index.stat().st_size, faiss_sha256=file_sha256(tmp_index),
                ids_bytes=tmp_ids.stat().st_size, ids_sha256=file_sha256(tmp_ids))
            tmp_meta.write_text(meta.to_json() + "\n", encoding="utf-8")
    return IndexSummary(out, meta)
