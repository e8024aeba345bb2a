"""An external sort of fixed-width records: memory bounded by a chunk, whatever the input size.

``merge`` and ``validate`` join store IDs with manifest rows, aliases and skipped IDs, and
write or check the ID index, which is every key sorted bytewise. Holding them as Python
objects cost ~1 KiB per record (60 GB at UniRef50's 60M records). Instead every fact is a
row of a numpy structured array with a ``key`` field (bytes, ``S``: compares bytewise, as
the ID index sorts), appended here; full chunks are sorted and written to run files in a
temporary directory, and iteration merges the runs back, block by block, with the rows of
one key never split between two blocks (so a caller handles a key's group within one
block). Nothing is memory-mapped (mapped pages would count as this process's memory), as
in :mod:`embedpipe.shard.spill`. docs/benchmarks.md, "Merge and validate at scale".
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np

from embedpipe.core.atomic import make_owned_dir, write_error

__all__ = ["CHUNK_BYTES", "ExternalSort", "group_starts", "promote"]

#: bytes of rows sorted in memory at once (one run); the merge reads ~half this in all
CHUNK_BYTES = 64 << 20


def field_names(dtype: np.dtype) -> tuple[str, ...]:
    """The fields of a structured dtype (every block a sort holds has them)."""
    if dtype.names is None:
        raise TypeError(f"a structured dtype is needed, not {dtype}")
    return dtype.names


def field_dtype(dtype: np.dtype, name: str) -> np.dtype:
    """The dtype of field ``name`` of a structured dtype."""
    if dtype.fields is None:
        raise TypeError(f"a structured dtype is needed, not {dtype}")
    return dtype.fields[name][0]


def promote(dtypes: Sequence[np.dtype]) -> np.dtype:
    """One structured dtype for blocks that differ only in the widths of their ``S`` fields."""
    first = dtypes[0]
    fields = []
    for name in field_names(first):
        base = field_dtype(first, name)
        if base.kind == "S":
            base = np.dtype(f"S{max(field_dtype(d, name).itemsize for d in dtypes)}")
        fields.append((name, base))
    return np.dtype(fields)


def _cast(block: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if block.dtype == dtype:
        return block
    out = np.empty(len(block), dtype=dtype)
    for name in field_names(dtype):
        out[name] = block[name]
    return out


def group_starts(keys: np.ndarray) -> np.ndarray:
    """Indices where a new key starts in the sorted ``keys`` (0 first, when not empty)."""
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))


class _Run:
    """One sorted run file, read back a block at a time."""

    def __init__(self, path: Path, dtype: np.dtype, rows: int) -> None:
        self.path, self.dtype, self.left = path, dtype, rows
        self._fh: IO[bytes] | None = None

    def read(self, rows: int) -> np.ndarray:
        if self._fh is None:
            self._fh = open(self.path, "rb")
        count = min(rows, self.left)
        block = np.fromfile(self._fh, dtype=self.dtype, count=count) if count else np.empty(0, self.dtype)
        self.left -= len(block)
        if not self.left:
            self.close()
        return block

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class ExternalSort:
    """Rows appended with :meth:`add`, iterated sorted by ``order`` (``order[0]`` must be
    ``key``) in blocks that never split a key. Use as a context manager (removes its files)."""

    def __init__(self, order: Sequence[str], *, work: Path | None = None, chunk_bytes: int | None = None) -> None:
        self.order = list(order)
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        self._dir = make_owned_dir(".embedpipe-sort-", work)  # a killed sort's: swept by the next
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._runs: list[_Run] = []
        self.rows = 0  # rows added
        self._key_width = 1

    def __enter__(self) -> ExternalSort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for run in self._runs:
            run.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def key_width(self) -> int:
        """Bytes of the widest ``key`` field added (an upper bound of the longest key)."""
        return self._key_width

    def add(self, block: np.ndarray) -> None:
        """Append rows (a structured array with the fields of ``order``)."""
        if not len(block):
            return
        self._buffer.append(block)
        self._key_width = max(self._key_width, field_dtype(block.dtype, "key").itemsize)
        self._buffered += block.nbytes
        self.rows += len(block)
        if self._buffered >= self.chunk_bytes:
            self._spill()

    def _sorted(self, blocks: list[np.ndarray]) -> np.ndarray:
        dtype = promote([b.dtype for b in blocks])
        block = np.concatenate([_cast(b, dtype) for b in blocks]) if len(blocks) > 1 else blocks[0]
        return block[np.lexsort([block[name] for name in reversed(self.order)])]

    def _spill(self) -> None:
        if not self._buffer:
            return
        block = self._sorted(self._buffer)
        self._buffer, self._buffered = [], 0
        path = self._dir / f"run-{len(self._runs):05d}"
        try:
            block.tofile(path)
        except OSError as exc:
            raise write_error(path, exc, known=True) from None
        self._runs.append(_Run(path, block.dtype, len(block)))

    def __iter__(self) -> Iterator[np.ndarray]:
        """Sorted blocks; all rows of one key are in the same block."""
        if not self._runs:  # everything fits in one chunk: no files
            if self._buffer:
                yield self._sorted(self._buffer)
            return
        self._spill()
        yield from self._merge()

    def _merge(self) -> Iterator[np.ndarray]:
        dtype = promote([r.dtype for r in self._runs])
        rows = max(1024, self.chunk_bytes // 2 // dtype.itemsize // len(self._runs))
        runs = self._runs
        bufs = [_cast(r.read(rows), dtype) for r in runs]
        while True:
            live = [i for i, r in enumerate(runs) if r.left]
            if not live:
                rest = [b for b in bufs if len(b)]
                if rest:
                    yield self._sorted(rest)
                return
            bound = min(bufs[i]["key"][-1] for i in live)  # beyond it a live run may hold more
            cut = [int(np.searchsorted(b["key"], bound, side="left")) for b in bufs]
            if not any(cut):  # every row left is at the bound: read on in the runs that end there
                for i in live:
                    if bufs[i]["key"][-1] == bound:
                        bufs[i] = np.concatenate([bufs[i], _cast(runs[i].read(rows), dtype)])
                continue
            yield self._sorted([b[:c] for b, c in zip(bufs, cut) if c])
            bufs = [b[c:] for b, c in zip(bufs, cut)]
            for i in live:
                if not len(bufs[i]):
                    bufs[i] = _cast(runs[i].read(rows), dtype)
