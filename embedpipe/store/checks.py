"""Checks before a reader trusts a store's bytes: declared shapes against the root attributes,
index and offset bounds.

A checksum proves a chunk holds what was written, not that what was written is consistent: a
crafted or mis-edited store (offsets past the data, an index pointing at another record, a
dataset declared far larger than the file) gave wrong data, tracebacks or 8 GiB allocations.
So readers run the cheap structural checks here once at open (:func:`check_layout`: shapes,
sizes, the ends of every offsets dataset, the index's block layout; a few small reads), and
check each block of offsets they read before using it (:func:`check_offsets`,
:func:`check_steps`). Every failure is one :class:`StoreError` naming the file, the dataset
and the row. docs/store-format.md, "What readers check".
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.store.format import POOLINGS, attr_to_python, layer_names

#: a chunk larger than this is not one the writer makes (~4 MiB target): reading it would
#: allocate it whole
MAX_CHUNK_BYTES = 256 << 20


class Problem(NamedTuple):
    """One structural problem: the dataset it is about, the line, and whether ``embedpipe
    validate`` already reports it in its own words (``kind == "shape"``)."""

    dataset: str
    message: str
    kind: str


def _declared_bytes(ds: h5py.Dataset) -> int:
    return int(np.prod(ds.shape, dtype=object)) * ds.dtype.itemsize if ds.shape else ds.dtype.itemsize


def store_dims(f: h5py.File) -> tuple[int, int | None]:
    """(N from ``ids``, D from the root attribute ``dim``, else from the last mean dataset)."""
    n = int(f["ids"].shape[0]) if "ids" in f and f["ids"].ndim == 1 else -1
    dim = attr_to_python(f.attrs.get("dim"))
    if isinstance(dim, int) and not isinstance(dim, bool):
        return n, dim
    layers = layer_names(f.get("mean", {}))
    ds = f[f"mean/layer_{layers[-1]}"] if layers else None
    return n, (int(ds.shape[1]) if isinstance(ds, h5py.Dataset) and ds.ndim == 2 else None)


def size_problems(f: h5py.File, file_size: int, skip: Collection[str] = ()) -> list[Problem]:
    """Datasets declaring more data than the file can hold (uncompressed, not virtual: every
    byte is stored), or chunks larger than :data:`MAX_CHUNK_BYTES`. The datasets ``skip`` are
    not opened (a merged store's virtual datasets: embedpipe reads their rows from the sources)."""
    out: list[Problem] = []

    def visit(name: str) -> None:
        if name in skip or not isinstance(f.get(name, getlink=True), h5py.HardLink):
            return
        obj = f.get(name)
        if not isinstance(obj, h5py.Dataset) or obj.is_virtual:
            return
        declared = _declared_bytes(obj)
        if obj.compression is None and declared > file_size:
            out.append(Problem(name, f"dataset {name} declares shape {obj.shape} ({declared} bytes) but the file "
                                     f"holds {file_size} bytes", "size"))
        elif obj.chunks and int(np.prod(obj.chunks, dtype=object)) * obj.dtype.itemsize > MAX_CHUNK_BYTES:
            out.append(Problem(name, f"dataset {name} has chunks of shape {obj.chunks}, larger than "
                                     f"{MAX_CHUNK_BYTES >> 20} MiB", "size"))

    f.visit_links(visit)  # links only: visititems opens (and visit reads the header of) every object
    return out


def _shape(f: h5py.File, name: str, expected: tuple[int, ...], why: str) -> list[Problem]:
    obj = f.get(name)
    if not isinstance(obj, h5py.Dataset):
        return [Problem(name, f"dataset {name} is missing", "shape")] if obj is None else \
            [Problem(name, f"{name} is not a dataset", "shape")]
    if obj.shape != expected:
        return [Problem(name, f"dataset {name} declares shape {obj.shape}, expected {expected} ({why})", "shape")]
    return []


def vector_problems(f: h5py.File, n: int, dim: int | None, skip: Collection[str] = ()) -> list[Problem]:
    """Each ``{pooling}/layer_k`` is (N, D); per-residue offsets start at 0 and each
    ``per_residue/layer_k`` is (offsets[N], D) (those in ``skip`` are not opened: their rows are
    read from the shard stores, whose shapes are checked there)."""
    out: list[Problem] = []
    if dim is None or dim < 1:
        return [Problem("mean", f"root attribute dim is {attr_to_python(f.attrs.get('dim'))!r}, not a positive "
                                "integer", "shape")]
    for pooling in POOLINGS:
        if isinstance(f.get(pooling), h5py.Group):
            for k in layer_names(f[pooling]):
                out += _shape(f, f"{pooling}/layer_{k}", (n, dim), f"N = {n} records, dim = {dim}")
    if not isinstance(f.get("per_residue"), h5py.Group):
        return out
    problems, total = offsets_ends(f, "per_residue/offsets", n, None)
    out += problems
    if total is not None:
        for k in layer_names(f["per_residue"]):
            name = f"per_residue/layer_{k}"
            if name not in skip:
                out += _shape(f, name, (total, dim), f"per_residue/offsets row {n} is {total}, dim = {dim}")
    return out


def offsets_ends(f: h5py.File, name: str, n: int, data_rows: int | None) -> tuple[list[Problem], int | None]:
    """An (N+1,) integer offsets dataset whose row 0 is 0 and row N is ``data_rows`` (when
    given; else at least 0). Two element reads. Returns (problems, row N or None)."""
    ds = f.get(name)
    if not isinstance(ds, h5py.Dataset) or ds.shape != (n + 1,) or ds.dtype.kind not in "iu":
        shape = getattr(ds, "shape", None)
        return [Problem(name, f"dataset {name} declares shape {shape}, expected ({n + 1},) integers", "shape")], None
    try:
        first, last = int(ds[0]), int(ds[n])
    except OSError as exc:
        return [Problem(name, f"dataset {name}: checksum mismatch or read error ({exc})", "read")], None
    if first != 0:
        return [Problem(name, f"dataset {name} row 0 is {first}, not 0", "offsets")], None
    if last < 0 or (data_rows is not None and last != data_rows):
        want = f"{data_rows}, the data's length" if data_rows is not None else "at least 0"
        return [Problem(name, f"dataset {name} row {n} is {last}, expected {want}", "offsets")], None
    return [], last


def sequence_problems(f: h5py.File, n: int) -> list[Problem]:
    """Format 2's ``sequence/``: offsets (N+1) from 0 to the length of ``sequence/data``."""
    g = f.get("sequence")
    if not isinstance(g, h5py.Group):
        return []
    data = g.get("data")
    if not isinstance(data, h5py.Dataset) or data.ndim != 1:
        return [Problem("sequence/data", "dataset sequence/data is missing or not 1-D", "sequence")]
    return offsets_ends(f, "sequence/offsets", n, int(data.shape[0]))[0]


def index_problems(f: h5py.File, n: int) -> list[Problem]:
    """``id_index/``: keys and rows of equal length, one key per record, alias and skipped ID,
    ``block_rows`` a positive integer and one fence per block."""
    g = f.get("id_index")
    if not isinstance(g, h5py.Group):
        return []
    if any(not isinstance(g.get(k), h5py.Dataset) or g[k].ndim != 1 for k in ("keys", "rows", "fences")):
        return [Problem("id_index", "group id_index needs 1-D datasets keys, rows and fences", "index")]
    k = int(g["keys"].shape[0])
    extra = sum(int(f[f"{grp}/id"].shape[0]) for grp in ("aliases", "skipped")
                if isinstance(f.get(f"{grp}/id"), h5py.Dataset))
    out = []
    if g["rows"].shape != (k,) or k != n + extra:
        out.append(Problem("id_index/rows", f"dataset id_index/keys has {k} keys and id_index/rows "
                           f"{g['rows'].shape[0]} rows, expected {n + extra} (records, aliases, skipped)", "index"))
    block = attr_to_python(g.attrs.get("block_rows"))
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        return out + [Problem("id_index", f"group id_index: attribute block_rows is {block!r}, not a positive "
                                          "integer", "index")]
    if g["fences"].shape[0] != -(-k // block):
        out.append(Problem("id_index/fences", f"dataset id_index/fences has {g['fences'].shape[0]} keys, expected "
                                              f"{-(-k // block)} (one per {block}-key block)", "index"))
    return out


def column_problems(f: h5py.File, n: int, names: list[str]) -> list[Problem]:
    """Per-record datasets present have N rows (``sequence`` is checked on its own)."""
    return [p for name in names if name != "sequence" and name in f
            for p in _shape(f, name, (n,), f"N = {n} records")]


def nonfinite_rows(block: np.ndarray) -> np.ndarray:
    """Which rows of a block of vectors hold a NaN or an infinity (validate, export)."""
    bad = ~np.isfinite(block)
    return bad.reshape(bad.shape[0], -1).any(axis=1) if block.ndim > 1 else bad


def _count(f: h5py.File, name: str) -> int | None:
    """An integer root attribute, or None when absent; a non-integer is -1 (refused)."""
    if name not in f.attrs:
        return None
    value = attr_to_python(f.attrs[name])
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def count_problems(f: h5py.File, n: int) -> list[str]:
    """Root attributes that count rows agree with the rows (a ``merged_rows`` of 10^12 on 20
    records passed validate): ``merged_rows`` is S+1 integer row starts from 0 to N, not
    decreasing, S the ``merged_from`` sources; ``alias_count`` and ``skipped_count`` are those
    groups' rows; ``reused_count`` and ``fallback_count`` lie in 0..N. Attributes only."""
    out: list[str] = []
    if "merged_rows" in f.attrs:
        rows = np.atleast_1d(np.asarray(f.attrs["merged_rows"]))
        sources = len(np.atleast_1d(f.attrs["merged_from"])) if "merged_from" in f.attrs else 0
        if rows.ndim != 1 or rows.dtype.kind not in "iu" or len(rows) != sources + 1:
            out.append(f"root attribute merged_rows has {rows.size} value(s) of type {rows.dtype}, expected "
                       f"{sources + 1} integers (one start per merged_from source, then N)")
        elif rows[0] != 0 or rows[-1] != n or (np.diff(rows.astype(np.int64)) < 0).any():
            out.append(f"root attribute merged_rows runs from {int(rows[0])} to {int(rows[-1])}"
                       + (" and decreases" if (np.diff(rows.astype(np.int64)) < 0).any() else "")
                       + f", expected 0 to {n} (the store's records) without decreasing")
    for name, group in (("alias_count", "aliases/id"), ("skipped_count", "skipped/id")):
        have = int(f[group].shape[0]) if isinstance(f.get(group), h5py.Dataset) else 0
        if (count := _count(f, name)) is not None and count != have:
            out.append(f"root attribute {name} is {attr_to_python(f.attrs[name])!r}, but dataset {group} holds "
                       f"{have} rows")
    for name in ("reused_count", "fallback_count"):
        if (count := _count(f, name)) is not None and not 0 <= count <= n:
            out.append(f"root attribute {name} is {attr_to_python(f.attrs[name])!r}, outside 0..{n} (the store's "
                       "records)")
    return out


def layout_problems(f: h5py.File, path: Path | str, columns: list[str], skip: Collection[str] = ()) -> list[Problem]:
    """Every structural check readers make at open: cheap (shapes, attributes and a few
    element reads), nothing proportional to the data; the datasets ``skip`` are not opened."""
    n, dim = store_dims(f)
    if n < 0:
        return [Problem("ids", "dataset ids is missing or not 1-D", "shape")]
    return (size_problems(f, Path(path).stat().st_size, skip) + vector_problems(f, n, dim, skip)
            + sequence_problems(f, n) + index_problems(f, n) + column_problems(f, n, columns))


def check_layout(f: h5py.File, path: Path | str, columns: list[str], skip: Collection[str] = ()) -> tuple[int, int]:
    """(N, D) after :func:`layout_problems` found nothing; else one StoreError line."""
    problems = layout_problems(f, path, columns, skip)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise StoreError(f"{path}: {problems[0].message}{more}; run embedpipe validate {path}")
    n, dim = store_dims(f)
    return n, int(dim)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# per read


def check_offsets(off: np.ndarray, lo: int, total: int, path: Path | str, name: str) -> np.ndarray:
    """Offsets rows ``lo:lo+len(off)`` as int64 once they lie in ``0..total`` and do not
    decrease; else one StoreError naming the first bad row."""
    off = np.asarray(off).astype(np.int64)
    outside = (off < 0) | (off > total)
    if outside.any():
        i = int(np.argmax(outside))
        raise StoreError(f"{path}: dataset {name} row {lo + i} is {off[i]}, outside 0..{total}; "
                         f"run embedpipe validate {path}")
    drops = np.diff(off) < 0
    if drops.any():
        i = int(np.argmax(drops)) + 1
        raise StoreError(f"{path}: dataset {name} row {lo + i} is {off[i]}, below row {lo + i - 1} ({off[i - 1]}): "
                         f"offsets must not decrease; run embedpipe validate {path}")
    return off


def check_steps(off: np.ndarray, lo: int, lengths: np.ndarray, path: Path | str, name: str, what: str) -> None:
    """Each record's step ``off[i+1] - off[i]`` equals its stored length (``what``)."""
    steps = np.diff(off)
    lengths = np.asarray(lengths).astype(np.int64)
    if steps.shape != lengths.shape or not np.array_equal(steps, lengths):
        i = int(np.argmax(steps != lengths)) if steps.shape == lengths.shape else 0
        raise StoreError(f"{path}: dataset {name} rows {lo + i}:{lo + i + 2} give record row {lo + i} "
                         f"{steps[i] if steps.size else 0} entries, but {what} says "
                         f"{lengths[i] if lengths.size else 0}; run embedpipe validate {path}")
