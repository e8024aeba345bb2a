"""A store as a stream of blocks of input IDs, for exporters (docs/exports.md).

Every input ID comes out once: each stored record, directly followed by the IDs whose
sequence duplicates it (a merged store's aliases), so a consumer that looks up any input ID
finds its vector. Blocks are cut so that each holds about ``BLOCK_BYTES`` of vectors, which
bounds an exporter's memory whatever the store's size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from embedpipe.core.errors import StoreError, quote
from embedpipe.store import Store
from embedpipe.store.checks import nonfinite_rows
from embedpipe.store.id_checks import export_problems

#: vector bytes read per block
BLOCK_BYTES = 64 << 20
#: records per block at most: each carries Python strings (ID, digest), so narrow vectors must
#: not make a block hold millions of them
BLOCK_ROWS = 65_536
#: per-record columns every export carries
RECORD_COLUMNS = ("length", "precision_used", "fallback_reason")


@dataclass
class ExportBlock:
    """The input IDs of one block of stored records, and what they export.

    ``ids[j]`` is an input ID; ``alias_of[j]`` is ``""`` for a stored record, else the ID of
    the record whose sequence it duplicates; ``source[j]`` is that record's position in this
    block. ``vectors`` (records x D) holds the pooled (mean or BOS) vectors, or ``residues`` the
    per-residue ``(rows, offsets)`` of the block's records (record i is
    ``rows[offsets[i]:offsets[i+1]]``). ``table`` holds :data:`RECORD_COLUMNS` and
    ``sequence_sha256`` per record.
    """

    ids: list[str]
    alias_of: list[str]
    source: np.ndarray
    table: dict[str, np.ndarray]
    vectors: np.ndarray | None = None
    residues: tuple[np.ndarray, np.ndarray] | None = None

    def record_rows(self, j: int) -> np.ndarray:
        """The vector (D,) or per-residue rows (L, D) that input ID ``j`` exports."""
        i = int(self.source[j])
        if self.residues is None:
            return self.vectors[i]  # type: ignore[index]
        rows, offsets = self.residues
        return rows[offsets[i] : offsets[i + 1]]

    def gathered_residues(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-residue rows in output order (aliases copied) and their offsets per input ID."""
        rows, offsets = self.residues  # type: ignore[misc]
        lengths = np.diff(offsets)[self.source]
        starts = offsets[:-1][self.source]
        out_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        index = np.repeat(starts - out_offsets[:-1], lengths) + np.arange(out_offsets[-1])
        return rows[index], out_offsets


class AliasIndex:
    """A merged store's aliases ordered by the row of the record they duplicate."""

    def __init__(self, store: Store) -> None:
        aliases = store.aliases
        rows = np.fromiter((store.index(of) for of in aliases.values()), dtype=np.int64, count=len(aliases))
        order = np.argsort(rows, kind="stable")
        names = list(aliases)
        self.ids = [names[k] for k in order.tolist()]
        self.rows = rows[order]

    def __len__(self) -> int:
        return len(self.ids)

    def between(self, lo: int, hi: int) -> tuple[list[str], np.ndarray]:
        """(alias IDs, their target rows) for targets in rows ``lo:hi``."""
        a, b = np.searchsorted(self.rows, [lo, hi])
        return self.ids[a:b], self.rows[a:b]


def block_bounds(store: Store, per_residue: bool, block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[int, int]]:
    """Row ranges ``(lo, hi)`` of about ``block_bytes`` of vectors each (at least one record)."""
    n, row_bytes = len(store), max(1, store.dim * store.dtype.itemsize)
    if not per_residue:
        step = max(1, min(BLOCK_ROWS, block_bytes // row_bytes))
        yield from ((lo, min(n, lo + step)) for lo in range(0, n, step))
        return
    offsets, budget = store.offsets, max(1, block_bytes // row_bytes)
    lo = 0
    while lo < n:
        hi = int(np.searchsorted(offsets, offsets[lo] + budget, side="right")) - 1
        hi = min(n, lo + BLOCK_ROWS, max(lo + 1, hi))
        yield lo, hi
        lo = hi


def iter_blocks(store: Store, *, layer: int, per_residue: bool, pooling: str = "mean",
                block_bytes: int = BLOCK_BYTES) -> Iterator[ExportBlock]:
    """The store's input IDs as :class:`ExportBlock` s, in row order, aliases after their record."""
    aliases = AliasIndex(store)
    for lo, hi in block_bounds(store, per_residue, block_bytes):
        table = store.records(sequence=True, rows=slice(lo, hi))
        record_ids = table["id"].tolist()
        alias_ids, alias_rows = aliases.between(lo, hi)
        source = np.concatenate([np.arange(hi - lo), alias_rows - lo])
        order = np.argsort(source, kind="stable")  # each record, then the IDs duplicating it
        ids = record_ids + alias_ids
        alias_of = [""] * len(record_ids) + [record_ids[r] for r in (alias_rows - lo).tolist()]
        columns = {name: table[name] for name in RECORD_COLUMNS}
        columns["sequence_sha256"] = np.array(
            [hashlib.sha256(s.encode("utf-8")).hexdigest() for s in table["sequence"]], dtype=object
        )
        block = ExportBlock(
            ids=[ids[k] for k in order.tolist()],
            alias_of=[alias_of[k] for k in order.tolist()],
            source=source[order],
            table=columns,
        )
        offsets: np.ndarray | None = None
        if per_residue:
            name = f"per_residue/layer_{layer}"
            block.residues = values, offsets = store.per_residue_rows(slice(lo, hi), layer)
        else:
            name = f"{pooling}/layer_{layer}"
            block.vectors = values = store.mean_rows(slice(lo, hi), layer, pooling=pooling)
        require_finite(store, values, lo, record_ids, name, offsets)
        # the bytes the writer stored (docs/store-format.md, "Row digests"): an edit in place is refused
        store.check_digests(name, slice(lo, hi), values, offsets, refusal="export refuses them")
        yield block


def check_ids(store: Store, command: str) -> None:
    """validate's ID checks before a block is read (``export``, ``index``): IDs unique, UTF-8,
    without control characters, and ``id_index`` the index they give (a swapped index entry)."""
    problems = export_problems(store.path)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise StoreError(f"{store.path}: {problems[0]}{more}: {command} refuses a store embedpipe validate rejects; "
                         f"run embedpipe validate {store.path}")


def require_finite(store: Store, values: np.ndarray, lo: int, record_ids: list[str], name: str,
                   offsets: np.ndarray | None = None) -> None:
    """validate's finiteness check on what a block exports (a NaN mean was exported as data):
    one StoreError naming the store, the dataset, the record and its row. Raised while
    streaming, inside the format's atomic write, so no partial output remains."""
    bad = nonfinite_rows(values)
    if not bad.any():
        return
    r = int(np.argmax(bad))
    i = r if offsets is None else int(np.searchsorted(offsets, r, side="right")) - 1
    rows = f"row {lo + i}" if offsets is None else f"row {lo + i}, per-residue row {r - int(offsets[i])}"
    raise StoreError(f"{store.path}: dataset {name}: record {quote(record_ids[i])} ({rows}) holds non-finite "
                     f"values ({int(np.count_nonzero(bad))} row(s) of this block): export refuses them; "
                     f"run embedpipe validate {store.path}")
