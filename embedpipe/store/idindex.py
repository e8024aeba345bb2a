"""ID lookup without reading every ID: the on-disk ``id_index/`` of format 2, and ``ids`` as a
lazy sequence.

``id_index/keys`` holds every record ID, alias ID and skipped ID, sorted bytewise, in blocks of
``block_rows`` (one HDF5 chunk each); ``id_index/rows`` the row of each key (a record's own
row; an alias's target row; ``-(j+1)`` for ``skipped`` entry j); ``id_index/fences`` the first
key of each block. A lookup bisects the fences (kept in memory: N / block_rows keys), reads
one block of keys and rows (a small LRU cache keeps recent blocks) and bisects it: O(log N)
and one chunk read, in memory independent of N. Format-1 stores have no index: the reader
builds the same arrays in memory. docs/store-format.md, "ID index".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import h5py
import numpy as np
from h5py import h5s

from embedpipe.core.errors import StoreError
from embedpipe.store import filters
from embedpipe.store.format import ARRAY, ID_INDEX, STRINGS, dataset_label, decode_strings, string_dtype, tag

GROUP = "id_index"
#: keys per block (= per HDF5 chunk): ~100 KiB of UniRef-style IDs, decompressed per lookup
BLOCK_ROWS = 4096
_CACHE_BLOCKS = 32


def encode_ids(values: Sequence[str] | np.ndarray) -> np.ndarray:
    """IDs as a fixed-width bytes array (numpy ``S``: compares bytewise, as the index sorts)."""
    if isinstance(values, np.ndarray) and values.dtype.kind == "S":
        return values
    encoded = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values]
    width = max((len(b) for b in encoded), default=1)
    return np.array(encoded, dtype=f"S{max(1, width)}")


def _dataset(g: h5py.Group, name: str, data: np.ndarray, encoding: str, compress: bool) -> None:
    ds = g.create_dataset(name, data=data, chunks=(max(1, min(BLOCK_ROWS, len(data))),),
                          maxshape=(None,) if not len(data) else None, **filters.numbers(compress))
    tag(ds, encoding)


def write_id_index(f: h5py.Group, keys: np.ndarray, rows: np.ndarray) -> None:
    """``id_index/`` from unsorted ``keys`` (bytes) and their ``rows``; a duplicate key is refused."""
    order = np.argsort(keys, kind="stable")
    keys, rows = keys[order], np.asarray(rows, dtype=np.int64)[order]
    if len(keys) > 1 and (dup := np.flatnonzero(keys[1:] == keys[:-1])).size:
        raise StoreError(f"id {keys[int(dup[0])].decode('utf-8', 'replace')!r} occurs twice "
                         "(record ids, aliases and skipped ids must be distinct)")
    g = f.create_group(GROUP)
    tag(g, ID_INDEX, block_rows=np.int64(BLOCK_ROWS))
    keys = keys.astype(string_dtype(keys.dtype.itemsize)) if len(keys) else np.zeros(0, dtype=string_dtype(1))
    _dataset(g, "keys", keys, STRINGS, True)
    _dataset(g, "rows", rows, ARRAY, True)
    _dataset(g, "fences", keys[::BLOCK_ROWS], STRINGS, True)


def index_keys(ids: np.ndarray, aliases: Sequence[tuple[str, str]] = (),
               skipped: Sequence[tuple[str, str]] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(keys, rows) of a store's index: its ``ids`` (bytes, row order), aliases -> their
    target's row, skipped -> ``-(j+1)``. An alias target that is not a record is refused."""
    rows = np.arange(len(ids), dtype=np.int64)
    parts, part_rows = [ids], [rows]
    if aliases:
        order = np.argsort(ids)
        targets = encode_ids([of for _, of in aliases])
        pos = np.clip(np.searchsorted(ids[order], targets), 0, max(0, len(ids) - 1))
        found = ids[order][pos] == targets if len(ids) else np.zeros(len(targets), bool)
        if not found.all():
            raise StoreError(f"alias target {aliases[int(np.argmin(found))][1]!r} is not a stored record")
        parts.append(encode_ids([a for a, _ in aliases]))
        part_rows.append(order[pos])
    if skipped:
        parts.append(encode_ids([s for s, _ in skipped]))
        part_rows.append(-1 - np.arange(len(skipped), dtype=np.int64))
    width = max(p.dtype.itemsize for p in parts)
    return np.concatenate([p.astype(f"S{width}") for p in parts]), np.concatenate(part_rows)


class UnknownIdError(StoreError, KeyError):
    """An ID that is neither a record nor an alias in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class IdIndex:
    """Key -> stored row value (see the module docstring), by bisection over blocks."""

    def __init__(self, keys: h5py.Dataset | np.ndarray, rows: h5py.Dataset | np.ndarray,
                 fences: np.ndarray, block_rows: int, path: Path | str = "") -> None:
        self._keys, self._rows, self._fences, self._block = keys, rows, fences, max(1, int(block_rows))
        self._path = path
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    @classmethod
    def open(cls, f: h5py.File, path: Path | str = "") -> IdIndex:
        """The store's ``id_index/``, or (format 1) one built in memory from ``ids`` and aliases.
        ``block_rows`` must be a positive integer (``embedpipe.store.checks`` checks it at open)."""
        if GROUP in f:
            g = f[GROUP]
            return cls(g["keys"], g["rows"], np.asarray(g["fences"][:]), int(g.attrs.get("block_rows", BLOCK_ROWS)), path)
        pairs = {group: _pairs(f, group, second) for group, second in (("aliases", "of"), ("skipped", "reason"))
                 if group in f}
        keys, rows = index_keys(encode_ids(np.asarray(f["ids"][:])), pairs.get("aliases", ()), pairs.get("skipped", ()))
        order = np.argsort(keys, kind="stable")
        keys, rows = keys[order], rows[order]
        return cls(keys, rows, keys[:1], max(1, len(keys)), path)

    def _load(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        hit = self._cache.get(b)
        if hit is not None:
            self._cache.move_to_end(b)
            return hit
        sl = slice(b * self._block, (b + 1) * self._block)
        try:
            block = (np.asarray(self._keys[sl]), np.asarray(self._rows[sl]))
        except OSError as exc:
            raise StoreError(f"{self._path}: cannot read dataset {GROUP}/keys or rows rows {sl.start}:{sl.stop}: "
                             f"checksum mismatch or read error ({exc}); run embedpipe validate {self._path}") from None
        self._check_block(b, *block)
        self._cache[b] = block
        if len(self._cache) > _CACHE_BLOCKS:
            self._cache.popitem(last=False)
        return block

    def _check_block(self, b: int, keys: np.ndarray, rows: np.ndarray) -> None:
        """Per block read: keys strictly increasing, starting at the block's fence; as many rows
        as keys (a lookup must never bisect an unsorted block and miss a stored ID)."""
        bad = ""
        if not len(keys) or keys[0] != self._fences[b]:
            bad = f"block {b} does not start at its fence"
        elif len(keys) > 1 and not (keys[1:] > keys[:-1]).all():
            bad = f"keys not sorted (row {b * self._block + int(np.argmax(keys[1:] <= keys[:-1])) + 1})"
        elif rows.shape != keys.shape:
            bad = f"{len(rows)} rows for {len(keys)} keys in block {b}"
        if bad:
            raise StoreError(f"{self._path}: dataset {GROUP}/keys: {bad}; run embedpipe validate {self._path}")

    def lookup(self, key: str) -> int | None:
        """The stored row value of ``key``, or None when it is not in the index."""
        if not len(self._fences):
            return None
        k = np.bytes_(key.encode("utf-8"))
        b = int(np.searchsorted(self._fences, k, side="right")) - 1
        if b < 0:
            return None
        keys, rows = self._load(b)
        i = int(np.searchsorted(keys, k))
        return int(rows[i]) if i < len(keys) and keys[i] == k else None


class LazyIds(Sequence[str]):
    """``Store.ids``: record IDs in row order, read block by block from ``ids`` on demand
    (``len``, indexing, slicing, iteration, ``in``, ``==`` with a list; ``list(...)`` copies).
    ``in`` agrees with iteration: record IDs only, never aliases (``contains`` decides)."""

    def __init__(self, ds: h5py.Dataset, contains: Any) -> None:
        self._ds, self._contains, self._n = ds, contains, int(ds.shape[0])
        self._rows = max(1, ds.chunks[0] if ds.chunks else 65536)
        self._cache: tuple[int, list[str]] | None = None
        self._one: tuple[Any, Any, np.ndarray] | None = None
        self._where = dataset_label(ds)  # how a row that is not UTF-8 is named

    def __len__(self) -> int:
        return self._n

    def _block(self, b: int) -> list[str]:
        if self._cache is None or self._cache[0] != b:
            self._cache = (b, decode_strings(self._ds[b * self._rows : (b + 1) * self._rows], self._where,
                                             b * self._rows))
        return self._cache[1]

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            lo, hi, step = i.indices(self._n)
            if step != 1:
                return list(self)[i]
            return decode_strings(self._ds[lo:hi], self._where, lo) if hi > lo else []
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._block(i // self._rows)[i % self._rows]

    def one(self, i: int) -> str:
        """ID of row ``i`` (0 <= i < len): from the cached block, else one element read through
        h5py's low-level API (a quarter of the high-level string read's cost; the HDF5 chunk
        cache keeps the decoded chunk): the lookup check reads one ID per lookup."""
        if self._cache is not None and self._cache[0] == i // self._rows:
            return self._cache[1][i % self._rows]
        if self._one is None:
            self._one = (self._ds.id.get_space(), h5s.create_simple((1,)), np.empty(1, dtype=self._ds.dtype))
        space, memory, out = self._one
        space.select_hyperslab((int(i),), (1,))
        self._ds.id.read(memory, space, out)
        return decode_strings(out, self._where, int(i))[0]

    def __iter__(self) -> Iterator[str]:
        for lo in range(0, self._n, self._rows):
            yield from decode_strings(self._ds[lo : lo + self._rows], self._where, lo)

    def __contains__(self, value: object) -> bool:
        return bool(self._contains(value))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (LazyIds, list, tuple)):
            return len(other) == self._n and list(self) == list(other)
        return NotImplemented

    def __add__(self, other: Sequence[str]) -> list[str]:  # ``store.ids + [...]``, as with the former list
        return list(self) + list(other)

    def __radd__(self, other: Sequence[str]) -> list[str]:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return f"<ids: {self._n} record IDs>"


def _pairs(f: h5py.File, group: str, second: str) -> list[tuple[str, str]]:
    """``{group}/id`` with ``{group}/{second}`` (format 1: no index on disk), decoded with names."""
    a, b = f[f"{group}/id"], f[f"{group}/{second}"]
    return list(zip(decode_strings(a[:], dataset_label(a)), decode_strings(b[:], dataset_label(b))))

