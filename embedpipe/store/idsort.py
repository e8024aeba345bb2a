"""The ID index built, and checked, by an external sort: memory independent of the record count.

``merge`` writes ``id_index/`` (docs/store-format.md, "ID index") and ``validate`` checks it;
both used to hold every ID in memory. Here every record ID, alias ID and skipped ID is one
row of :mod:`embedpipe.core.external_sort` (key, tag, row, line, the alias's target ID), sorted
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

from embedpipe.core.errors import quote
from embedpipe.core.external_sort import ExternalSort, group_starts
from embedpipe.store import filters
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


Problem = Callable[[str, str, int], None]  # (kind: duplicate, skipped or alias; message; manifest line or -1)


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


def _group_problem(block: np.ndarray, lo: int, hi: int, stores: Callable[[int], str], problem: Problem) -> bool:
    """Whether the group ``block[lo:hi]`` (one key, several rows) may be indexed; else a problem."""
    g = block[lo:hi]
    rid = _text(g["key"][0])
    tags = g["tag"].tolist()
    if tags.count(STORED) > 1:
        r0, r1 = int(g["row"][0]), int(g["row"][1])
        problem("duplicate", f"duplicate id {quote(rid)} in {stores(r0)} and {stores(r1)}", -1)
        return False
    if SKIP in tags:
        problem("skipped", f"id {quote(rid)} occurs twice (record ids, aliases and skipped ids must be distinct)",
                int(g["line"][tags.index(SKIP)]))
        return False
    first_row = int(g["row"][0])
    for j in range(1, len(g)):
        if int(g["row"][j]) == first_row:
            continue  # an alias naming its own record, or a repeat of the same alias
        line = int(g["line"][j])
        if tags[0] == STORED:
            problem("alias", f"id {quote(rid)} is both a stored record and a duplicate of {quote(_text(g['other'][j]))}", line)
        else:
            problem("alias", f"id {quote(rid)} is a duplicate of both {quote(_text(g['other'][0]))} "
                             f"and {quote(_text(g['other'][j]))}", line)
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
                          **filters.NUMBERS)
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
                                   maxshape=(None,) if not len(fences) else None,
                                   **filters.NUMBERS)
        tag(ds, STRINGS)
        self.keys.flush()
        self.rows.flush()


# ---------------------------------------------------------------------------------------------
# embedpipe validate


def _pairs(f: h5py.File, group: str, second: str) -> tuple[h5py.Dataset, h5py.Dataset] | None:
    g = f.get(group)
    if not isinstance(g, h5py.Group) or "id" not in g or second not in g or g["id"].shape != g[second].shape:
        return None
    return g["id"], g[second]


def _resolve_aliases(f: h5py.File, n: int, index: ExternalSort, work: Path | None) -> list[str]:
    """Each alias's target row, by a sort of the record IDs and the aliases' targets; the
    resolved aliases go to ``index``. Problems: targets that are not records."""
    pairs = _pairs(f, "aliases", "of")
    if pairs is None or not pairs[0].shape[0]:
        return []
    ids_ds, of_ds = pairs
    unknown, example = 0, ""
    with ExternalSort(ORDER, work=work) as by_of:
        for lo in range(0, n, 1 << 16):
            by_of.add(entries(id_rows(f["ids"], lo, min(n, lo + (1 << 16))), STORED, lo + np.arange(min(n - lo, 1 << 16))))
        for lo in range(0, ids_ds.shape[0], 1 << 16):
            hi = min(ids_ds.shape[0], lo + (1 << 16))
            by_of.add(entries(id_rows(of_ds, lo, hi), ALIAS, np.full(hi - lo, -1), lines=np.arange(lo, hi),
                              other=id_rows(ids_ds, lo, hi)))
        for block in by_of:
            starts = group_starts(block["key"])
            group = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(block))))
            head = block[starts][group]
            alias = block["tag"] == ALIAS
            found = alias & (head["tag"] == STORED)
            if (alias & ~found).any():
                unknown += int((alias & ~found).sum())
                example = example or _text(block["key"][np.flatnonzero(alias & ~found)[0]])
            r = block[found]
            index.add(entries(r["other"], ALIAS, head["row"][found], lines=r["line"], other=r["key"]))
    return [f"{unknown} alias(es) point to unknown ids (e.g. {quote(example)})"] if unknown else []


def index_problems_sorted(f: h5py.File, n: int, *, compare: bool, work: Path | None = None) -> list[str]:
    """``embedpipe validate``'s ID checks in memory independent of N: record IDs unique, alias
    and skipped IDs distinct from them and each other, alias targets records, and (``compare``)
    the stored ``id_index`` exactly the index these give (keys, rows, fences)."""
    problems: list[str] = []
    dups: list[str] = []

    def collect(kind: str, message: str, line: int) -> None:
        if kind == "duplicate":  # "duplicate id 'X' in row 3 and row 4"
            dups.append(message.removeprefix("duplicate id "))
        elif kind == "alias" and " is both a stored record" in message:  # "id 'X' is both ..."
            problems.append(f"alias id {message[3 : message.index(' is both a stored record')]} is also a record id")
        elif kind == "alias":
            problems.append("alias ids are not unique")
        else:
            problems.append(message)

    with index_sort(work) as index:
        for lo in range(0, n, 1 << 16):
            index.add(entries(id_rows(f["ids"], lo, min(n, lo + (1 << 16))), STORED, lo + np.arange(min(n - lo, 1 << 16))))
        problems += _resolve_aliases(f, n, index, work)
        if (skipped := _pairs(f, "skipped", "reason")) is not None:
            for lo in range(0, skipped[0].shape[0], 1 << 16):
                hi = min(skipped[0].shape[0], lo + (1 << 16))
                index.add(entries(id_rows(skipped[0], lo, hi), SKIP, -1 - np.arange(lo, hi)))
        mismatch = _compare(f, sorted_index(index, lambda row: f"row {row}", collect), compare)
    if dups:
        problems.insert(0, f"ids are not unique ({len(dups)} duplicated, e.g. {dups[0]})")
    problems = list(dict.fromkeys(problems))
    return problems + mismatch


def _first_difference(keys_ds: h5py.Dataset, rows_ds: h5py.Dataset, at: int, keys: np.ndarray, rows: np.ndarray) -> str:
    """The first entry of an expected block the stored index holds otherwise, as words (the ID
    and its row: what an edited ``ids`` or ``id_index`` entry changed)."""
    if at + len(keys) > keys_ds.shape[0]:
        return ""
    stored, stored_rows = np.asarray(keys_ds[at : at + len(keys)]), np.asarray(rows_ds[at : at + len(keys)])
    j = int(np.argmax((stored != keys) | (stored_rows != rows)))
    said = f"row {int(stored_rows[j])}" if stored[j] == keys[j] else f"{stored[j].decode('utf-8', 'replace')!r}"
    return f"; first: id {keys[j].decode('utf-8', 'replace')!r} is in row {int(rows[j])}, the index says {said}"


def _compare(f: h5py.File, blocks: Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]], compare: bool) -> list[str]:
    """The expected index blocks against the stored ``id_index`` (read in step)."""
    g = f.get(GROUP)
    if not compare or g is None:
        for _ in blocks:  # the checks on the way still run
            pass
        return []
    keys_ds, rows_ds = g["keys"], g["rows"]
    block = int(g.attrs.get("block_rows", BLOCK_ROWS))
    at, same, fences, first = 0, True, [], ""
    try:
        for keys, rows, _ in blocks:
            fences.append(keys[-at % block :: block].copy())  # a view would keep every block alive
            hi = at + len(keys)
            if same and (hi > keys_ds.shape[0] or not np.array_equal(np.asarray(keys_ds[at:hi]), keys)
                         or not np.array_equal(np.asarray(rows_ds[at:hi]), rows)):
                same = False
                first = _first_difference(keys_ds, rows_ds, at, keys, rows)
            at = hi
        stored_fences = np.asarray(g["fences"][:])
    except OSError as exc:
        return [f"{GROUP}: checksum mismatch or read error ({exc})"]
    if not same or at != keys_ds.shape[0]:
        return [f"{GROUP} does not match the store's ids, aliases and skipped ids ({keys_ds.shape[0]} keys, "
                f"expected {at}{first}): ID lookups would give wrong rows"]
    expected = np.concatenate(fences) if fences else np.zeros(0, "S1")
    if not np.array_equal(stored_fences, expected):
        return [f"{GROUP}/fences is not the first key of every {block}-key block"]
    return []
