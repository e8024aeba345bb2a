"""The layout of an index's FAISS file, walked before FAISS reads it.

Why walk it ourselves: ``faiss.read_index`` sizes its arrays from the counts the file states
(up to 2^40 elements each) before it finds the file too short, so a 1.7 KB file claiming 2^31
rows took 8.7 GB before it failed. Here every count is checked against the bytes left in the
file and against what the index must hold (``rows`` of ``dim`` values), reading only the
headers and seeking over the arrays; only a file whose every array fits and whose end is the
file's end reaches FAISS. Only the two kinds ``embedpipe index`` writes are accepted: a flat
inner-product index (``IxFI``) and an HNSW graph over one (``IHNf``), as faiss's
``faiss/impl/index_write.cpp`` lays them out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from embedpipe.core.errors import EmbedpipeError

__all__ = ["FaissLayout", "faiss_layout"]

#: the fourcc of each kind embedpipe writes; FAISS's inner-product metric is 0
FOURCC = {b"IxFI": "exact", b"IHNf": "hnsw"}
METRIC_INNER_PRODUCT = 0
#: an index header after its fourcc: d, ntotal, two unused int64, is_trained, metric_type
_HEADER = struct.Struct("<iqqqBi")
#: HNSW's arrays in file order and their element sizes: assign_probas (double),
#: cum_nneighbor_per_level (int), levels (int), offsets (size_t), neighbors (int)
_HNSW_ARRAYS = (("assign_probas", 8), ("cum_nneighbor_per_level", 4), ("levels", 4), ("offsets", 8),
                ("neighbors", 4))
#: after the arrays: entry_point, max_level, efConstruction, efSearch and an unused int
_HNSW_TAIL = 5 * 4


@dataclass(frozen=True)
class FaissLayout:
    kind: str  # exact | hnsw
    dim: int
    rows: int


class _Walk:
    """Reads a FAISS file's headers and skips its arrays, each checked against what is left."""

    def __init__(self, fh: BinaryIO, path: Path, size: int) -> None:
        self.fh, self.path, self.size = fh, path, size

    def fail(self, why: str) -> EmbedpipeError:
        return EmbedpipeError(f"{self.path}: not a FAISS index embedpipe wrote ({why}); the index was "
                              "changed or damaged: rebuild it with embedpipe index")

    def read(self, n: int, what: str) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise self.fail(f"it ends inside its {what}")
        return data

    def header(self) -> tuple[str, int, int]:
        fourcc = self.read(4, "fourcc")
        kind = FOURCC.get(fourcc)
        if kind is None:
            raise self.fail("an index type embedpipe does not write")
        dim, rows, _, _, _, metric = _HEADER.unpack(self.read(_HEADER.size, "header"))
        if dim < 1 or rows < 0:
            raise self.fail(f"a header of {rows} rows of {dim} values")
        if metric != METRIC_INNER_PRODUCT:
            raise self.fail("a metric other than the inner product")
        return kind, dim, rows

    def skip_array(self, what: str, item: int, count: int | None = None) -> int:
        """Skip one array (its uint64 length, then its items); ``count``: the length it must have."""
        (n,) = struct.unpack("<Q", self.read(8, f"{what}'s length"))
        left = self.size - self.fh.tell()
        if n > left // item:
            raise self.fail(f"its {what} claims {n} items of {item} bytes, more than the {left} bytes left")
        if count is not None and n != count:
            raise self.fail(f"its {what} holds {n} items, {count} expected")
        self.fh.seek(n * item, 1)
        return n


def faiss_layout(path: Path) -> FaissLayout:
    """The kind, width and rows of the FAISS file at ``path``, every array within the file."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        walk = _Walk(fh, path, size)
        kind, dim, rows = walk.header()
        if kind == "hnsw":
            for what, item in _HNSW_ARRAYS:
                expect = {"levels": rows, "offsets": rows + 1}.get(what)
                walk.skip_array(what, item, expect)
            walk.read(_HNSW_TAIL, "HNSW parameters")
            storage = walk.header()
            if storage != ("exact", dim, rows):
                raise walk.fail(f"its storage holds {storage[2]} rows of {storage[1]} values, its graph {rows} of {dim}")
        if rows > (size - fh.tell()) // (4 * dim):
            raise walk.fail(f"it claims {rows} rows of {dim} values in {size} bytes")
        walk.skip_array("vectors", 4, rows * dim)
        if fh.tell() != size:
            raise walk.fail(f"{size - fh.tell()} bytes after its end")
    return FaissLayout(kind, dim, rows)
