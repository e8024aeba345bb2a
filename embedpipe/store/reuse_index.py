"""A sorted sequence-sha256 index of a store, for ``embed --reuse`` (docs/cluster.md,
"Release to release").

A new release's embed job looks up its own records' sequence hashes in an earlier store. At
UniRef50 scale (60M records, 16,000 jobs) no job may read the earlier store's 60M sequences,
so the index is built once per reuse store (``embedpipe reuse-index``, or the workflow's
``reuse_index`` rule): every distinct ``sha256(sequence)`` with the first row that holds it,
sorted bytewise through :class:`~embedpipe.core.external_sort.ExternalSort` (memory bounded
by one sort chunk), in blocks of :data:`BLOCK` entries, plus ``fence``, the first key of each
block. A lookup holds the fence (32 bytes per block: ~1.9 MB at 60M records) and reads only
the blocks its keys fall in: memory and I/O follow the job's own records.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.core.external_sort import ExternalSort, group_starts
from embedpipe.core.output_guard import writing_outputs
from embedpipe.store import filters
from embedpipe.store.format import STORE_UUID_ATTR, attr_to_python, check_format, is_complete, open_h5, read_root_attrs
from embedpipe.store.h5write import atomic_h5
from embedpipe.store.reuse_checks import check_block, index_problem, read_fence, read_index_rows
from embedpipe.store.sequences import iter_sequence_blocks
from embedpipe.store.sources import pinned_by

INDEX_FORMAT = "embedpipe.reuse-index"
INDEX_VERSION = 1
#: index entries per block (one HDF5 chunk): a lookup reads whole blocks of 40 KiB
BLOCK = 1024
_ENTRY = np.dtype([("key", "S32"), ("row", "<i8")])
#: root attributes of the indexed store copied into the index (the job checks them without the store)
_STORE_ATTRS = ("embed_identity", "model_num_layers", "model_sha256", "dim")


def sequence_digests(sequences: Iterable[str | bytes]) -> np.ndarray:
    """``sha256`` of each normalised sequence (the manifest's ``sequence_sha256``), as ``S32``."""
    return np.array([hashlib.sha256(s if isinstance(s, bytes) else s.encode("ascii")).digest() for s in sequences],
                    dtype="S32")


def is_index(path: Path) -> bool:
    """Whether ``path`` is a reuse index (not a store); a ``format`` attribute of another type
    (a crafted file) is not."""
    try:
        with h5py.File(path, "r") as f:
            return attr_to_python(f.attrs.get("format")) == INDEX_FORMAT
    except (OSError, TypeError, ValueError):
        return False


def _sorted_entries(f: h5py.File, path: Path, work: Path | None) -> Iterable[np.ndarray]:
    """The store's (sha256, row) entries, sorted, the first row of each sha256 only."""
    with ExternalSort(["key", "row"], work=work) as sort:
        for lo, block in iter_sequence_blocks(f, path):
            entries = np.empty(len(block), dtype=_ENTRY)
            entries["key"] = sequence_digests(block)
            entries["row"] = np.arange(lo, lo + len(block), dtype=np.int64)
            sort.add(entries)
        for entries in sort:
            yield entries[group_starts(entries["key"])]


def build_index(store: Path, out: Path, *, work: Path | None = None) -> int:
    """Write the reuse index of ``store`` to ``out`` (atomic); the number of distinct sequences."""
    store, out = Path(store), Path(out)
    # --out locked for the whole run; a source the store pins is an input (embedpipe.core.output_guard)
    with writing_outputs("reuse-index", [("--out", out)], [store], pinned=pinned_by([store])), open_h5(store) as f:
        check_format(f, store)
        if not is_complete(f):
            raise StoreError(f"{store}: incomplete store; refusing to index it")
        attrs = read_root_attrs(f, only=[STORE_UUID_ATTR, *_STORE_ATTRS])
        with atomic_h5(out) as target, target.create(libver="latest") as g:
            # one chunk per block; filters from store/filters.py (checksummed, not compressed: the
            # sha256 keys do not compress, and a lookup reads whole blocks)
            keys = g.create_dataset("keys", shape=(0,), maxshape=(None,), dtype="S32", chunks=(BLOCK,), **filters.PLAIN)
            rows = g.create_dataset("rows", shape=(0,), maxshape=(None,), dtype="<i8", chunks=(BLOCK,), **filters.PLAIN)
            fence: list[bytes] = []
            n = 0
            for block in _sorted_entries(f, store, work):
                fence += block["key"][(-n) % BLOCK::BLOCK].tolist()
                keys.resize((n + len(block),))
                rows.resize((n + len(block),))
                keys[n:], rows[n:] = block["key"], block["row"]
                n += len(block)
            # contiguous and unfiltered (docs/store-format.md, "Reuse index"): read whole at open
            # and checked key by key there (strictly increasing, one per block)
            g.create_dataset("fence", data=np.array(fence, dtype="S32"))
            g.attrs.update({"format": INDEX_FORMAT, "format_version": INDEX_VERSION, "block": BLOCK,
                            "entries": n, "store_path": str(store.absolute()),
                            **{k: str(v) for k, v in attrs.items() if k != "json_attrs"}})
    return n


class ReuseIndex:
    """An opened index: its fence in memory, blocks read on demand. Every field is checked
    before use against the real datasets (:mod:`embedpipe.store.reuse_checks`):
    a crafted index gives one line naming the file and the field, never a traceback or an
    allocation sized by what it declares (docs/store-format.md, "Reuse index")."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._file = h5py.File(self.path, "r")
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot read reuse index: {exc}") from None
        f = self._file
        try:
            if attr_to_python(f.attrs.get("format")) != INDEX_FORMAT or \
                    attr_to_python(f.attrs.get("format_version")) != INDEX_VERSION:
                raise StoreError(f"{self.path}: not a reuse index of format version {INDEX_VERSION} "
                                 "(build it with embedpipe reuse-index)")
            if (problem := index_problem(f, self.path)) is not None:
                raise StoreError(f"{self.path}: reuse index {problem}; build the index again (embedpipe reuse-index)")
            self.attrs: dict[str, Any] = {k: attr_to_python(f.attrs[k]) for k in f.attrs}
            self.block = int(self.attrs["block"])
            self.fence = read_fence(f, self.path)
            self._checked: set[int] = set()  # blocks whose first key was seen to be their fence key
        except BaseException:
            self.close()
            raise

    @property
    def store_uuid(self) -> str:
        return str(self.attrs.get(STORE_UUID_ATTR, ""))

    def close(self) -> None:
        self._file.close()

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, rows) of block ``b``, checked before use (:func:`check_block`)."""
        lo = b * self.block
        keys = read_index_rows(self._file, self.path, "keys", lo, lo + self.block)
        rows = read_index_rows(self._file, self.path, "rows", lo, lo + self.block)
        check_block(keys, rows, self.fence, b, self.block, self.path)
        self._checked.add(b)
        return keys, rows

    def _starts_at_fence(self, b: int) -> None:
        """Block ``b``'s first key is fence entry ``b`` (one key read): a digest that missed
        block ``b - 1`` past its last key really is absent, not routed there by an edited fence."""
        if 0 <= b < len(self.fence) and b not in self._checked:
            first = read_index_rows(self._file, self.path, "keys", b * self.block, b * self.block + 1)
            check_block(first, np.zeros(1, dtype=np.int64), self.fence, b, self.block, self.path)
            self._checked.add(b)

    def lookup(self, digests: Sequence[bytes] | np.ndarray) -> np.ndarray:
        """The store row of each digest, -1 where the store has no such sequence. Reads only
        the blocks the digests fall in, each once."""
        q = np.asarray(digests, dtype="S32")
        out = np.full(len(q), -1, dtype=np.int64)
        if not len(q) or not len(self.fence):
            return out
        blocks = np.searchsorted(self.fence, q, side="right") - 1
        order = np.argsort(blocks, kind="stable")  # the digests of one block together: O(q log q)
        ordered = blocks[order]
        starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
        for first, last in zip(starts.tolist(), [*starts[1:].tolist(), len(ordered)]):
            b = int(ordered[first])
            if b < 0:  # before the first key: not in the store
                self._starts_at_fence(0)
                continue
            keys, rows = self._block(b)
            mine = order[first:last]
            at = np.minimum(np.searchsorted(keys, q[mine]), len(keys) - 1)
            hit = keys[at] == q[mine]
            if hit.any():
                out[mine[hit]] = rows[at[hit]]
            if (q[mine][~hit] > keys[-1]).any():
                self._starts_at_fence(b + 1)
        return out


#: root attributes of a store written with ``embed --reuse`` (docs/store-format.md)
REUSED_ATTRS = ("reused_count", "reused_sources")


def reused_totals(attrs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The merged store's ``reused_count`` (the shards' sum) and ``reused_sources`` (their
    union, records summed per source uuid); shards written before ``--reuse`` count 0."""
    per: dict[str, dict[str, Any]] = {}
    for shard in attrs:
        listed = shard.get("reused_sources") or "[]"
        for source in json.loads(listed) if isinstance(listed, str) else listed:
            entry = per.setdefault(source["store_uuid"], {**source, "records": 0})
            entry["records"] += int(source["records"])
    return {"reused_count": sum(int(a.get("reused_count", 0)) for a in attrs),
            "reused_sources": json.dumps(list(per.values()))}
