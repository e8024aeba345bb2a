"""The ID index built, and checked, by an external sort: memory independent of the record count.

``merge`` writes ``id_index/`` (docs/store-format.md, "ID index") and ``validate`` checks it;
both used to hold every ID in memory. Here every record ID, alias ID and skipped ID is one
row of :mod:`embedpipe.external_sort` (key, tag, row, line, the alias's target ID), sorted
bytewise; one pass over the sorted blocks finds IDs that occur twice, drops an alias that
names its own record or repeats another, and streams the index's keys and rows to disk
(:class:`IndexWriter`) or compares them with the stored index block by block
(:func:`index_problems_sorted`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import numpy as np

from embedpipe.external_sort import ExternalSort, group_starts
from embedpipe.store.format import ARRAY, ID_INDEX, STRINGS, string_dtype, tag
from embedpipe.store.idindex import BLOCK_ROWS, GROUP

__all__ = ["ALIAS", "STORED", "SKIP", "IndexWriter", "entries", "index_sort", "sorted_index", "id_rows"]

STORED, ALIAS, SKIP = 0, 1, 2
ORDER = ("key", "tag", "line", "row")  # an alias group: the earliest manifest line first


def entries(keys: np.ndarray, tag_: int, rows: np.ndarray, *, lines: np.ndarray | None = None,
            other: np.ndarray | None = None) -> np.ndarray:
    """Sort rows: ``keys`` (bytes), their ``tag``, ``rows`` and optional manifest ``lines``
    and ``other`` IDs (an alias's target)."""
    keys = np.asarray(keys)
    if keys.dtype.kind != "S":
        keys = np.array([k.encode("utf-8") for k in keys.tolist()], dtype="S") if len(keys) else np.zeros(0, "S1")
    other = np.zeros(len(keys), "S1") if other is None else np.asarray(other)
    out = np.empty(len(keys), dtype=[("key", keys.dtype), ("tag", "u1"), ("row", "i8"), ("line", "i8"),
                                     ("other", other.dtype)])
    out["key"], out["tag"], out["row"], out["other"] = keys, tag_, rows, other
    out["line"] = -1 if lines is None else lines
    return out


def index_sort(work: Path | None = None) -> ExternalSort:
    return ExternalSort(ORDER, work=work)


def id_rows(ds: h5py.Dataset, lo: int, hi: int) -> np.ndarray:
    """Stored ``ids[lo:hi]`` as bytes (numpy ``S``), for :func:`entries`."""
    block = np.asarray(ds[lo:hi])
    return block.astype(f"S{max(1, block.dtype.itemsize)}") if block.dtype.kind in "SO" else block


Problem = Callable[[str, int], None]  # (message, manifest line or -1)


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


def _group_problem(block: np.ndarray, lo: int, hi: int, stores: Callable[[int], str], problem: Problem) -> bool:
    """Whether the group ``block[lo:hi]`` (one key, several rows) may be indexed; else a problem."""
    g = block[lo:hi]
    rid = _text(g["key"][0])
    tags = g["tag"].tolist()
    if tags.count(STORED) > 1:
        r0, r1 = int(g["row"][0]), int(g["row"][1])
        problem(f"duplicate id {rid!r} in {stores(r0)} and {stores(r1)}", -1)
        return False
    if SKIP in tags:
        problem(f"id {rid!r} occurs twice (record ids, aliases and skipped ids must be distinct)",
                int(g["line"][tags.index(SKIP)]))
        return False
    first_row = int(g["row"][0])
    for j in range(1, len(g)):
        if int(g["row"][j]) == first_row:
            continue  # an alias naming its own record, or a repeat of the same alias
        line = int(g["line"][j])
        if tags[0] == STORED:
            problem(f"id {rid!r} is both a stored record and a duplicate of {_text(g['other'][j])!r}", line)
        else:
            problem(f"id {rid!r} is a duplicate of both {_text(g['other'][0])!r} and {_text(g['other'][j])!r}", line)
        return False
    return True


def sorted_index(sort: ExternalSort, stores: Callable[[int], str],
                 problem: Problem) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(keys, rows, kept alias rows) per sorted block: one entry per distinct key, its row
    (a record's own, an alias's target, ``-(j+1)`` for skipped entry j). A key that cannot be
    indexed (see :func:`_group_problem`) goes to ``problem`` and is left out."""
    for block in sort:
        starts = group_starts(block["key"])
        ends = np.append(starts[1:], len(block))
        keep = np.ones(len(starts), dtype=bool)
        for g in np.flatnonzero(ends - starts > 1).tolist():
            keep[g] = _group_problem(block, int(starts[g]), int(ends[g]), stores, problem)
        firsts = block[starts[keep]]
        yield firsts["key"], firsts["row"], firsts[firsts["tag"] == ALIAS]


def _resizable(g: h5py.Group, name: str, dtype: np.dtype, encoding: str) -> h5py.Dataset:
    ds = g.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(BLOCK_ROWS,),
                          compression="gzip", shuffle=True, fletcher32=True)
    tag(ds, encoding)
    return ds


def _append(ds: h5py.Dataset, values: np.ndarray) -> None:
    n = ds.shape[0]
    ds.resize((n + len(values),))
    ds[n:] = values


class IndexWriter:
    """``id_index/`` written as sorted blocks arrive (keys, rows; fences at the end)."""

    def __init__(self, f: h5py.Group, key_width: int) -> None:
        self.g = f.create_group(GROUP)
        tag(self.g, ID_INDEX, block_rows=np.int64(BLOCK_ROWS))
        self.dtype = string_dtype(max(1, key_width))
        self.keys = _resizable(self.g, "keys", self.dtype, STRINGS)
        self.rows = _resizable(self.g, "rows", np.dtype(np.int64), ARRAY)
        self.fences: list[np.ndarray] = []
        self.n = 0
        self.last: bytes | None = None

    def add(self, keys: np.ndarray, rows: np.ndarray) -> None:
        if not len(keys):
            return
        first = -self.n % BLOCK_ROWS
        self.fences.append(keys[first::BLOCK_ROWS].astype(self.dtype))
        _append(self.keys, keys.astype(self.dtype))
        _append(self.rows, rows.astype(np.int64))
        self.n += len(keys)

    def close(self) -> None:
        fences = np.concatenate(self.fences) if self.fences else np.zeros(0, self.dtype)
        ds = self.g.create_dataset("fences", data=fences, chunks=(max(1, min(BLOCK_ROWS, len(fences))),),
                                   maxshape=(None,) if not len(fences) else None, compression="gzip",
                                   shuffle=True, fletcher32=True)
        tag(ds, STRINGS)
        self.keys.flush()
        self.rows.flush()
