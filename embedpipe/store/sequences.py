"""The ``sequence`` column: ragged UTF-8 bytes + offsets since format 2, fixed-width (padded
to the longest protein) in format 1.

A fixed-width column pads every record to the longest one: one 35,000-aa record made a
merged store hold 5 GB of padding at 1M records and every sequence read 300x slower. Format 2
stores ``sequence/data`` (uint8, all sequences concatenated) and ``sequence/offsets`` (N+1):
record i is ``data[offsets[i]:offsets[i+1]]``, like per-residue rows. Readers read both
layouts through this module. docs/store-format.md, "Datasets" and "Version rule".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.core.interrupts import checkpoint
from embedpipe.store import filters
from embedpipe.store.checks import check_offsets, check_steps
from embedpipe.store.format import (
    ARRAY,
    OFFSETS,
    RAGGED_STRINGS,
    READ_BLOCK_BYTES,
    SMALL_CHUNK_BYTES,
    chars_per_residue,
    chunk_rows,
    iter_row_blocks,
    tag,
)

NAME = "sequence"
#: at most this many sequences per block read
SEQUENCE_ROWS = 1 << 16


def _create(f: h5py.Group, n: int, total: int | None) -> tuple[h5py.Dataset, h5py.Dataset]:
    """``sequence/`` with empty ``data`` (resizable when ``total`` is None) and ``offsets`` (N+1)."""
    g = f.create_group(NAME)
    tag(g, RAGGED_STRINGS)
    size = 0 if total is None else total
    chunks = (chunk_rows(1, max(size, 1 << 20), target=SMALL_CHUNK_BYTES),)
    data = g.create_dataset("data", shape=(size,), dtype=np.uint8, chunks=chunks, maxshape=(None,), **filters.TEXT)
    tag(data, ARRAY)
    offsets = g.create_dataset("offsets", shape=(n + 1,), dtype=np.int64,
                               chunks=(chunk_rows(8, n + 1, target=SMALL_CHUNK_BYTES),),
                               **filters.NUMBERS)
    tag(offsets, OFFSETS)
    return data, offsets


def _encode(values: Iterable[str | bytes]) -> list[bytes]:
    out = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values]
    if any(b"\x00" in b for b in out):
        raise StoreError("strings stored in an embedpipe store may not contain NUL characters")
    return out


def write_sequences(f: h5py.Group, values: Iterable[str | bytes], n: int) -> None:
    """The whole column from its values in row order (the writer: sequences are announced)."""
    sink = SequenceSink(f, n)
    sink.append(values)
    sink.close()


class SequenceSink:
    """Appends sequences block by block (merge copies shard after shard in bounded memory)."""

    def __init__(self, f: h5py.Group, n: int) -> None:
        self.data, self.offsets = _create(f, n, None)
        self.n, self.rows, self.size = n, 0, 0
        self.offsets[0:1] = 0

    def append(self, values: Iterable[str | bytes]) -> None:
        encoded = _encode(values)
        if not encoded:
            return
        ends = self.size + np.cumsum([len(b) for b in encoded], dtype=np.int64)
        blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.data.resize((self.size + blob.size,))
        self.data[self.size :] = blob
        self.offsets[self.rows + 1 : self.rows + 1 + len(encoded)] = ends
        self.rows += len(encoded)
        self.size = int(ends[-1])

    def close(self) -> None:
        if self.rows != self.n:
            raise StoreError(f"sequence column has {self.rows} rows, expected {self.n}")
        self.data.flush()
        self.offsets.flush()


def sequence_count(f: h5py.Group) -> int | None:
    """Rows of the column (either layout), or None when it is absent or malformed."""
    if NAME not in f:
        return None
    obj = f[NAME]
    if isinstance(obj, h5py.Dataset):
        return int(obj.shape[0]) if obj.ndim == 1 else None
    if "offsets" in obj and "data" in obj and obj["offsets"].ndim == 1:
        return int(obj["offsets"].shape[0]) - 1
    return None


def read_sequences(f: h5py.Group, lo: int, hi: int, path: Path | str = "") -> list[bytes]:
    """Rows ``lo:hi`` as UTF-8 bytes (either layout). Format 2's offsets are checked before
    use (within the data, not decreasing, each step the record's ``length``, in characters): a crafted
    offset gave all sequences joined as one (embedpipe.store.checks)."""
    obj = f[NAME]
    if isinstance(obj, h5py.Dataset):
        return [bytes(v) for v in obj[lo:hi].tolist()]
    if hi <= lo:
        return []
    off = check_offsets(obj["offsets"][lo : hi + 1], lo, int(obj["data"].shape[0]), path, "sequence/offsets")
    blob = obj["data"][int(off[0]) : int(off[-1])].tobytes()
    rel = (off - off[0]).tolist()
    out = [blob[a:b] for a, b in zip(rel[:-1], rel[1:])]
    if "length" in f and f["length"].shape == (sequence_count(f),):
        lengths = f["length"][lo:hi].astype(np.int64) * chars_per_residue(f.attrs)  # in characters
        chars = np.array([len(b) for b in out], dtype=np.int64)
        if not np.array_equal(chars, lengths):  # residues are ASCII: bytes == characters, unless not
            chars = np.array([len(b.decode("utf-8", "replace")) for b in out], dtype=np.int64)
            check_steps(np.concatenate([[0], np.cumsum(chars)]), lo, lengths, path, "sequence/offsets", "length")
    return out


def iter_sequence_blocks(f: h5py.Group, path: Path | str | None = None) -> Iterator[tuple[int, list[bytes]]]:
    """(first row, sequences as bytes) over the whole column, ~64 MiB of sequence per block;
    a failed read (checksum mismatch) is one StoreError naming the column and rows."""
    obj = f[NAME]
    n = sequence_count(f) or 0
    blocks: Iterator[tuple[int, int]]
    if isinstance(obj, h5py.Dataset):  # at most SEQUENCE_ROWS: short padded values are many Python objects
        blocks = ((lo, min(sl.stop, lo + SEQUENCE_ROWS)) for sl in iter_row_blocks(obj)
                  for lo in range(sl.start, sl.stop, SEQUENCE_ROWS))
    else:
        blocks = _ragged_blocks(obj["offsets"], n)
    for lo, hi in blocks:
        checkpoint()  # between blocks, never inside h5py (embedpipe.core.interrupts)
        try:
            yield lo, read_sequences(f, lo, hi, path or "")
        except OSError as exc:
            where = "" if path is None else f"{path}: "
            raise StoreError(f"{where}dataset sequence rows {lo}:{hi}: checksum mismatch or read error ({exc})") from None


def _ragged_blocks(offsets: h5py.Dataset, n: int) -> Iterator[tuple[int, int]]:
    """Row ranges of about READ_BLOCK_BYTES of sequence each (offsets read block by block)."""
    step = SEQUENCE_ROWS
    lo = 0
    while lo < n:
        off = offsets[lo : min(n, lo + step) + 1]
        hi = lo + max(1, int(np.searchsorted(off - off[0], READ_BLOCK_BYTES, side="right")) - 1)
        hi = min(hi, lo + step, n)
        yield lo, hi
        lo = hi
