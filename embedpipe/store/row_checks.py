"""``embedpipe validate``'s per-record checks, defined once here, and run on just the rows
``embed --reuse`` copies.

:func:`record_problem` (a record's fields against each other) and :func:`unknown_long_handling`
are the checks validate makes of every record and :class:`RowChecks` of each copied row; the
mean comparison is :func:`~embedpipe.store.meancheck.mean_mismatch`, the row digests
:mod:`embedpipe.store.digests`, finiteness :func:`~embedpipe.store.checks.nonfinite_rows`: one
function each, so validate and ``--reuse`` cannot disagree.

A copy is bit for bit, so whatever is wrong in the source row becomes wrong in the new store:
a tampered source (a mean edited, a dataset rewritten without its checksum, a NaN) was
copied with exit 0, and the new store then failed ``validate``. Validating the whole source
per job is no option (16,000 jobs over a 60M-record store), so before a row is copied the
checks ``validate`` makes are run on that row alone (docs/store-format.md, "Checking a
store": 2, the per-record fields; 3, its offsets; 6, checksums and finiteness: every chunk
holding it is read, which verifies the chunk's fletcher32; 7, its means against its
per-residue rows; 8, its row digest), plus once per store: every dataset a copy reads carries a checksum and
the vectors' dtype is ``storage_dtype``. Work and memory follow the rows copied (runs of at
most :data:`RUN_ROWS` records, per-residue reads of at most :data:`READ_BYTES`), each row
checked once. Every failure is one StoreError line naming the source and what failed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.core.options import STORAGE_DTYPES
from embedpipe.store.checks import nonfinite_rows
from embedpipe.store.columns import COLUMNS
from embedpipe.store.format import (
    LONG_HANDLING,
    attr_to_python,
    chars_per_residue,
    open_h5,
    residues_of,
)
from embedpipe.store.meancheck import mean_check_applies, mean_mismatch
from embedpipe.store.reader import Store
from embedpipe.store.reuse_checks import check_row_range

#: records checked per read of the pooled vectors and per-record columns
RUN_ROWS = 1024
#: per-residue bytes read at a time (at least one record's)
READ_BYTES = 64 << 20


def unknown_long_handling(values: Collection[str]) -> list[str]:
    """The ``long_handling`` values of ``values`` no long-sequence mode records, sorted."""
    return sorted(set(values) - set(LONG_HANDLING))


def record_problem(length: np.ndarray, embedded: np.ndarray | None = None, chars: np.ndarray | None = None,
                   handling: Collection[str] | None = None) -> tuple[int, str] | None:
    """The first record of a block whose fields disagree, and what (docs/store-format.md,
    "Checking a store": 2): ``embedded_length`` within 0..``length``, ``length`` equal to the
    sequence's characters (``chars``), a known ``long_handling``; a field not given is not
    checked. (index in the block, the problem without the record's name) or None."""
    found: list[tuple[int, str]] = []
    if embedded is not None and (bad := (embedded < 0) | (embedded > length)).any():
        i = int(np.argmax(bad))
        found.append((i, f"embedded_length {embedded[i]} outside 0..length {length[i]}"))
    if chars is not None and (bad := chars != length).any():
        i = int(np.argmax(bad))
        found.append((i, f"length {length[i]} != len(sequence) {chars[i]}"))
    if handling is not None and (unknown := unknown_long_handling(handling)):
        values = list(handling)
        i = min(values.index(value) for value in unknown)
        found.append((i, f"long_handling {values[i]!r} is not known"))
    return min(found, key=lambda problem: problem[0]) if found else None


def _runs(rows: list[int]) -> Iterator[tuple[int, int]]:
    """Contiguous (lo, hi) runs of sorted distinct ``rows``, each at most RUN_ROWS long."""
    i = 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and rows[j] == rows[j - 1] + 1 and j - i < RUN_ROWS:
            j += 1
        yield rows[i], rows[j - 1] + 1
        i = j


class RowChecks:
    """The checks of one opened source store; :meth:`check` each batch of rows before copying."""

    def __init__(self, store: Store, index: Path) -> None:
        self.store, self.index = store, Path(index)
        self.path = store.path
        self._checked: set[int] = set()
        self._mean_check: bool | None = None  # decided by the once-per-store checks

    def _fail(self, what: str) -> StoreError:
        return StoreError(f"--reuse {self.path}: {what}; refusing to copy from it (run embedpipe validate {self.path})")

    def check(self, rows: Iterable[int]) -> None:
        """Refuse (one line) unless every row passes; rows checked before are not read again."""
        todo = sorted(set(rows) - self._checked)
        if not todo:
            return
        check_row_range(np.asarray(todo, dtype=np.int64), len(self.store), self.index, self.path)
        if self._mean_check is None:
            self._once()
        for lo, hi in _runs(todo):
            self._run(lo, hi)
        self._checked.update(todo)

    def _copied_datasets(self, f: h5py.File) -> list[str]:
        """Every dataset a copy reads: the vectors, the per-record columns, the sequence's parts."""
        st = self.store
        names = [f"{p}/layer_{k}" for p in st.pooling for k in st.layers]
        if st.has_per_residue:
            names += ["per_residue/offsets", *(f"per_residue/layer_{k}" for k in st.layers)]
        for name in COLUMNS:
            obj = f.get(name)
            if isinstance(obj, h5py.Group):  # format 2's ragged sequence: data and offsets
                names += [f"{name}/{part}" for part in obj]
            elif obj is not None:
                names.append(name)
        return names

    def _once(self) -> None:
        """Checksums present (validate: "has no fletcher32 checksum"), vectors in ``storage_dtype``."""
        with open_h5(self.path) as f:
            storage = attr_to_python(f.attrs.get("storage_dtype"))
            if storage not in STORAGE_DTYPES:
                raise self._fail(f"storage_dtype attribute is {storage!r}, not one of {', '.join(STORAGE_DTYPES)}")
            for name in self._copied_datasets(f):
                ds = f[name]
                if not isinstance(ds, h5py.Dataset):
                    raise self._fail(f"{name} is not a dataset")
                if not ds.is_virtual and not ds.fletcher32:
                    raise self._fail(f"dataset {name} has no fletcher32 checksum, so its rows cannot be verified")
                if "layer_" in name and ds.dtype != np.dtype(storage):
                    raise self._fail(f"dataset {name} has dtype {ds.dtype}, storage_dtype says {storage}")
            self._mean_check = mean_check_applies(f)

    def _run(self, lo: int, hi: int) -> None:
        """Rows ``lo:hi``: every read verifies the checksums of the chunks holding them."""
        st = self.store
        table = st.records(sequence=True, rows=slice(lo, hi))
        ids, length, emb = table["id"], table["length"].astype(np.int64), table["embedded_length"].astype(np.int64)
        per_residue = chars_per_residue(st.provenance)
        chars = np.array([residues_of(len(s), per_residue) for s in table["sequence"]], dtype=np.int64)
        if (found := record_problem(length, emb, chars, list(table["long_handling"]))) is not None:
            i, what = found
            raise self._fail(f"record {ids[i]!r} (row {lo + i}): {what}")
        pooled: dict[str, np.ndarray] = {}
        for pooling in st.pooling:
            for k in st.layers:
                name = f"{pooling}/layer_{k}"
                pooled[name] = st.mean_rows(slice(lo, hi), k, pooling=pooling)
                self._finite(pooled[name], name, lo, ids)
        if st.has_per_residue:
            self._residues(lo, hi, emb, ids, {k: pooled[f"mean/layer_{k}"] for k in st.layers})
        for name, block in pooled.items():  # the bytes the writer stored (embedpipe.store.digests)
            self._digests(name, slice(lo, hi), block)

    def _digests(self, name: str, rows: slice, values: np.ndarray, offsets: np.ndarray | None = None) -> None:
        """validate's row digest check (docs/store-format.md, "Row digests") on what was read."""
        if (problem := self.store.digest_problem(name, rows, values, offsets)) is not None:
            raise self._fail(problem)

    def _finite(self, block: np.ndarray, name: str, lo: int, ids: np.ndarray, offsets: np.ndarray | None = None) -> None:
        """Every value finite; ``offsets``: ``block`` holds per-residue rows, record i's from offsets[i]."""
        bad = nonfinite_rows(block)
        if bad.any():
            i = int(np.argmax(bad))
            if offsets is not None:
                i = int(np.searchsorted(offsets, i, side="right")) - 1
            raise self._fail(f"dataset {name}: record {ids[i]!r} (row {lo + i}) holds non-finite values")

    def _residues(self, lo: int, hi: int, emb: np.ndarray, ids: np.ndarray, means: dict[int, np.ndarray]) -> None:
        """Per-residue rows in reads of at most READ_BYTES: finite, offsets' steps equal to
        ``embedded_length`` (the reader checks that), each mean the mean of its rows."""
        per_row = max(1, self.store.dim * self.store.dtype.itemsize)
        a = 0
        while a < hi - lo:
            b, size = a + 1, int(emb[a]) * per_row
            while b < hi - lo and size + int(emb[b]) * per_row <= READ_BYTES:
                size += int(emb[b]) * per_row
                b += 1
            for k in self.store.layers:
                vectors, offsets = self.store.per_residue_rows(slice(lo + a, lo + b), k)
                self._finite(vectors, f"per_residue/layer_{k}", lo + a, ids[a:b], offsets)
                if self._mean_check:
                    self._compare(vectors, offsets, means[k][a:b], k, lo + a, ids[a:b])
                self._digests(f"per_residue/layer_{k}", slice(lo + a, lo + b), vectors, offsets)
            a = b

    def _compare(self, vectors: np.ndarray, offsets: np.ndarray, stored: np.ndarray, layer: int, lo: int,
                 ids: np.ndarray) -> None:
        """validate's check 7 (embedpipe.store.meancheck) for these records (none without rows)."""
        rows = np.diff(offsets)
        has = rows > 0
        if not has.any():
            return
        x = vectors.astype(np.float64)
        starts = offsets[:-1][has]
        sums, abss = np.add.reduceat(x, starts, axis=0), np.add.reduceat(np.abs(x), starts, axis=0)
        kept = np.flatnonzero(has)

        def record(i: int) -> tuple[str, int]:
            return ids[kept[i]], lo + int(kept[i])

        found = mean_mismatch(stored[has].astype(np.float64), sums, abss, rows[has].astype(np.float64),
                              self.store.dtype, layer, record)
        if found is not None:
            raise self._fail(found[1])
