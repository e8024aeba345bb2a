"""Shard's per-record columns on disk: fixed-width files appended in pass 1, read back in chunks.

What only the manifest and the duplicate-ID check need (the ID text, the sha256 digest, the
file and line, a 64-bit hash of the ID) goes to files in the work directory instead of
memory, so ``shard``'s memory per record is a few fixed-width integers (docs/benchmarks.md,
"Sharding at scale"). Every read is a bounded chunk or a gather of a sorted set of rows by
one sequential scan; nothing is memory-mapped (mapped pages would count as this process's
memory).
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import IO, Any

import numpy as np

from embedpipe.core.atomic import write_error
from embedpipe.shard.output import open_for_writing

__all__ = ["CHUNK", "COLUMNS", "Spill"]

#: records per chunk: pass 1 flushes its buffers, and later passes read, this many at a time
CHUNK = 1 << 16
#: the fixed-width columns: name -> (array typecode, numpy dtype, values per record)
COLUMNS = {
    "idkey": ("q", np.int64, 1),  # hash(id): the duplicate-ID check sorts these
    "file": ("I", np.uint32, 1),  # index of the input file
    "line": ("q", np.int64, 1),  # line of the header
    "digest": ("B", np.uint8, 32),  # sha256 of the normalised sequence (zeros when invalid)
}
IDS = "ids"  # one ID per line, UTF-8, in input order


@dataclass
class Spill:
    """The column files under ``root``; :meth:`append` buffers, :meth:`flush` writes."""

    root: Path
    buffers: dict[str, Any] = field(default_factory=dict)
    ids: list[bytes] = field(default_factory=list)
    records: int = 0  # records written to the files so far
    _files: dict[str, IO[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir()
        for name, (code, _, _) in COLUMNS.items():
            self.buffers[name] = bytearray() if code == "B" else array(code)
        for name in (*COLUMNS, IDS):
            self._files[name] = open_for_writing(self.root / name, "wb", buffering=1 << 20)

    def flush(self) -> None:
        """Write the buffered records to the column files and empty the buffers."""
        try:
            for name, buf in self.buffers.items():
                self._files[name].write(buf)
                del buf[:]
            if self.ids:
                self._files[IDS].write(b"\n".join(self.ids) + b"\n")
                self.records += len(self.ids)
                self.ids.clear()
        except OSError as exc:
            raise write_error(self.root, exc, known=True) from None

    def close(self) -> None:
        """Flush and close the files (before reading them back)."""
        self.flush()
        for fh in self._files.values():
            try:
                fh.close()
            except OSError as exc:
                raise write_error(self.root, exc, known=True) from None

    def abort(self) -> None:
        """Close whatever is still open, without writing (after an error)."""
        for fh in self._files.values():
            with contextlib.suppress(OSError):
                fh.close()

    def path(self, name: str) -> Path:
        return self.root / name

    def chunks(self, name: str, n: int, chunk: int = 0) -> Iterator[np.ndarray]:
        """Column ``name`` of records ``0..n`` in order, ``chunk`` (default :data:`CHUNK`) at a time."""
        _, dtype, width = COLUMNS[name]
        chunk = chunk or CHUNK
        with open(self.path(name), "rb") as fh:
            for start in range(0, n, chunk):
                count = min(chunk, n - start)
                block = np.fromfile(fh, dtype=dtype, count=count * width)
                yield block.reshape(count, width) if width > 1 else block

    def column(self, name: str, n: int) -> np.ndarray:
        """Column ``name`` of records ``0..n`` whole (only for the 8-byte ID hashes)."""
        _, dtype, _ = COLUMNS[name]
        return np.fromfile(self.path(name), dtype=dtype, count=n)

    def gather(self, name: str, rows: np.ndarray, n: int) -> np.ndarray:
        """Column ``name`` at the ascending record indices ``rows``, by one chunked scan."""
        _, dtype, width = COLUMNS[name]
        out = np.empty((len(rows), width) if width > 1 else len(rows), dtype=dtype)
        lo = 0
        for k, block in enumerate(self.chunks(name, n)):
            hi = int(np.searchsorted(rows, (k + 1) * CHUNK))
            out[lo:hi] = block[rows[lo:hi] - k * CHUNK]
            lo = hi
        return out

    def gather_ids(self, rows: np.ndarray) -> dict[int, str]:
        """The IDs of the ascending record indices ``rows`` (few: the duplicate-ID check)."""
        wanted = iter(rows.tolist())
        found: dict[int, str] = {}
        target = next(wanted, None)
        with open(self.path(IDS), "rb") as fh:
            for k, line in enumerate(fh):
                if k == target:
                    found[k] = line[:-1].decode("utf-8")
                    target = next(wanted, None)
                    if target is None:
                        break
        return found

    def id_chunks(self, n: int, chunk: int) -> Iterator[list[str]]:
        """The IDs of records ``0..n`` in order, ``chunk`` at a time."""
        with open(self.path(IDS), "rb") as fh:
            for start in range(0, n, chunk):
                text = b"".join(islice(fh, min(chunk, n - start))).decode("utf-8")
                yield text.split("\n")[:-1]
