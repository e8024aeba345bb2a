"""An ID to its row, checked: the on-disk index (embedpipe.store.idindex) answers with a row
value, and that row is read back to see that it holds the ID asked for (an alias: the record
it names; a skipped ID: its entry), so a swapped or edited index never returns another
record's data (docs/store-format.md, "ID index").

Apart from ``embedpipe.store.reader`` because every way ``Store`` finds a record (``store[id]``,
``in``, ``index``, ``resolve``, ``ids``'s ``in``) goes through this one check; it costs one ID
read per lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.store.format import decode_strings
from embedpipe.store.idindex import IdIndex, LazyIds, UnknownIdError
from embedpipe.store.readio import read_dataset


class RowLookup:
    """Record IDs, aliases and skipped IDs of one open store -> rows, each answer checked.
    ``h5`` gives the open file (a closed store raises StoreError); ``read`` is the store's
    read of ``(dataset, key)`` through its kept dataset handles."""

    def __init__(self, path: Path, h5: Callable[[], h5py.File], read: Callable[[str, Any], np.ndarray],
                 index: IdIndex, ids: LazyIds, n: int, n_skipped: int) -> None:
        self.path, self._h5, self._read = path, h5, read
        self._index, self._ids, self._n, self._n_skipped = index, ids, n, n_skipped
        self._pair_cache: dict[str, dict[str, str]] = {}

    def pairs(self, group: str, second: str) -> dict[str, str]:
        """``{group}/id`` -> ``{group}/{second}`` (aliases, skipped), read once when first asked."""
        if group not in self._pair_cache:
            f = self._h5()
            self._pair_cache[group] = {} if group not in f else dict(zip(
                decode_strings(read_dataset(f, self.path, f"{group}/id"), f"{self.path}: dataset {group}/id"),
                decode_strings(read_dataset(f, self.path, f"{group}/{second}"), f"{self.path}: dataset {group}/{second}")))
        return self._pair_cache[group]

    def _corrupt_index(self, record_id: str, row: int, why: str) -> StoreError:
        return StoreError(f"{self.path}: dataset id_index/rows: id {record_id!r} points to row {row}, {why}: "
                          f"the index is corrupt; run embedpipe validate {self.path}")

    def checked(self, record_id: str) -> tuple[int | None, bool]:
        """(stored row value or None, whether the ID is an alias), after checking that the
        row is in range and holds the ID asked for (or, for an alias, the record it names):
        one ID read per lookup, so a swapped index never returns another record's data."""
        self._h5()  # a closed store raises StoreError, not an h5py error
        row = self._index.lookup(record_id)
        if row is None:
            return None, False
        if not -self._n_skipped <= row < self._n:
            raise self._corrupt_index(record_id, row, f"outside {-self._n_skipped}..{self._n - 1}")
        if row < 0:
            stored = decode_strings(self._read("skipped/id", -1 - row), f"{self.path}: dataset skipped/id", -1 - row)[0]
            if stored != record_id:
                raise self._corrupt_index(record_id, row, f"skipped entry {-1 - row}, which is {stored!r}")
            return row, False
        stored = self._ids.one(row)
        if stored == record_id:
            return row, False
        if self.pairs("aliases", "of").get(record_id) != stored:
            raise self._corrupt_index(record_id, row, f"which holds {stored!r}")
        return row, True

    def row(self, record_id: str) -> int:
        """Row of a record ID or alias (the index, docs/store-format.md "ID index"); a skipped
        or unknown ID raises UnknownIdError."""
        row = self.checked(str(record_id))[0]
        if row is None:
            raise UnknownIdError(f"{record_id!r} is not in {self.path.name}")
        if row < 0:
            reason = decode_strings(self._read("skipped/reason", -1 - row), f"{self.path}: dataset skipped/reason",
                                    -1 - row)[0]
            raise UnknownIdError(f"{record_id!r} was skipped when sharding: {reason}")
        return row
