"""Recall of ``embedpipe index --kind hnsw`` against the exact index (docs/python.md, "Recall"):
one synthetic store of clustered vectors (protein families: centres plus noise), both indexes
built by ``build_index``, held-out queries of the same clusters searched in each.

    python benchmarks/search_recall.py --rows 5000 --dim 64 --queries 500 --k 10

recall@k = the share of the exact index's k nearest IDs that HNSW also returns, over all queries.
A quality measurement, not a timing: it may run on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from embedpipe.neighbours.build import build_index
from embedpipe.neighbours.hits import search_index
from embedpipe.neighbours.index_file import open_index
from embedpipe.store import EmbeddedRecord, StoreWriter

LAYER = 6
ATTRS = {"model_name": "synthetic", "model_source": "synthetic", "model_sha256": "0" * 64, "model_trained": False,
         "precision_policy": "fp32", "device": "cpu", "embed_identity": "{}", "config": json.dumps({"layers": [LAYER]})}


def clustered(n: int, dim: int, clusters: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` vectors around ``clusters`` random centres (noise a third of a centre's spread);
    ``clusters`` 0: plain Gaussian vectors, the hardest case for an approximate index."""
    if clusters == 0:
        return rng.standard_normal((n, dim), dtype=np.float32)
    centres = rng.standard_normal((clusters, dim), dtype=np.float32)
    noise = rng.standard_normal((n, dim), dtype=np.float32) / np.float32(3)
    return centres[rng.integers(0, clusters, n)] + noise


def write_store(path: Path, vectors: np.ndarray) -> Path:
    ids = [f"P{i:07d}" for i in range(len(vectors))]
    with StoreWriter(path, ids=ids, sequences=["A"] * len(ids), residue_rows=None, layers=[LAYER],
                     dim=vectors.shape[1], storage_dtype="float32", attrs=ATTRS) as writer:
        for i, rid in enumerate(ids):
            writer.write(i, EmbeddedRecord(id=rid, sequence="A", precision_used="fp32", mean={LAYER: vectors[i]},
                                           max_abs_activation=1.0, embedded_length=1))
    return path


def measure(rows: int, dim: int, queries: int, k: int, clusters: int = 50, seed: int = 0) -> float:
    """recall@k of HNSW against the exact index on one synthetic store."""
    rng = np.random.default_rng(seed)
    vectors = clustered(rows + queries, dim, clusters, rng)
    with tempfile.TemporaryDirectory() as work:
        store = write_store(Path(work) / "store.h5", vectors[:rows])
        found = {}
        for kind in ("exact", "hnsw"):
            index = Path(work) / kind
            build_index(store, index, layer=LAYER, kind=kind)
            ids = [f"q{i}" for i in range(queries)]
            found[kind] = search_index(open_index(index), ids, vectors[rows:], k).hits
    hits = sum(len(set(a) & set(b)) for a, b in zip(found["exact"], found["hnsw"]))
    return hits / (queries * k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--clusters", type=int, default=50, help="0: plain Gaussian vectors (no structure)")
    args = parser.parse_args()
    recall = measure(args.rows, args.dim, args.queries, args.k, args.clusters)
    print(f"hnsw recall@{args.k}: {recall:.4f} ({args.rows} rows x {args.dim}, {args.queries} queries, "
          f"{args.clusters} clusters)")


if __name__ == "__main__":
    main()
