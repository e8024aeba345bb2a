"""``row_digest``: a per-record digest of the vector bytes exactly as the writer stored them.

A fletcher32 checksum proves a chunk holds the bytes HDF5 wrote, but h5py recomputes it on
every write: a store opened with h5py, one record's mean overwritten (``d[0] = row``) and
closed, passed ``embedpipe validate`` and was copied by ``embed --reuse``. So the writer
records, for each record, the blake2b-128 digest of its stored values in every vector
dataset (:func:`digest_parts`: each layer's pooled rows, then its per-residue rows), and
every reader that trusts those bytes recomputes the digests of what it read and compares
(:func:`digest_problem`, the one per-record check: ``embedpipe validate``, ``embed --reuse``
before a row is copied, ``export``, ``crosscheck``). A record whose digest is empty (a merged
store's rows from a shard written before digests existed) is not checked.
docs/store-format.md, "Row digests".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.store.format import decode_strings
from embedpipe.store.meancheck import ResidueStream

#: the per-record column (docs/store-format.md, "Datasets")
ROW_DIGEST = "row_digest"
#: blake2b digest size in bytes, and the hex characters of one part's digest
DIGEST_SIZE = 16
HEX = 2 * DIGEST_SIZE
#: ``row_digest`` rows validate reads at a time (32 B each, decoded: ~100 B)
RECORDED_ROWS = 1 << 16
#: the part after every vector dataset's (format 3): the record's ID, sequence and per-record
#: columns (embedpipe.store.record_digest)
RECORD_PART = "record"
#: the first format whose ``row_digest`` ends with the record part and whose root attributes
#: carry ``attr_digests``: a store of it without them is refused, not excused
COVERED_SINCE = 3


def digest_parts(poolings: Sequence[str], layers: Sequence[int], per_residue: bool, version: int = COVERED_SINCE) -> list[str]:
    """What a record's digest covers, in its order: each pooling's layers ascending (``mean``
    first), then ``per_residue/layer_k`` ascending, then (format >= 3) :data:`RECORD_PART`."""
    ks = sorted(int(k) for k in layers)
    return ([f"{p}/layer_{k}" for p in poolings for k in ks] + [f"per_residue/layer_{k}" for k in ks if per_residue]
            + ([RECORD_PART] if version >= COVERED_SINCE else []))


def _hasher() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=DIGEST_SIZE)


def _le_bytes(values: np.ndarray) -> np.ndarray:
    """``values`` C-contiguous and little-endian: the same bytes on every platform."""
    data = np.ascontiguousarray(values)
    return data.astype(data.dtype.newbyteorder("<"), copy=False)


def part_digest(values: np.ndarray) -> str:
    """blake2b-128 (hex) of one record's values in one dataset, in the storage dtype."""
    return hashlib.blake2b(_le_bytes(values).data, digest_size=DIGEST_SIZE).hexdigest()


def _block_digests(values: np.ndarray, recorded: Sequence[str], offsets: np.ndarray | None = None) -> list[str]:
    """:func:`part_digest` of each record of a block (pooled rows, or per-residue rows split
    by ``offsets``), the block made little-endian once; "" where nothing is recorded."""
    data = _le_bytes(values)
    if offsets is None:
        return [hashlib.blake2b(data[i].data, digest_size=DIGEST_SIZE).hexdigest() if want else ""
                for i, want in enumerate(recorded)]
    bounds = np.asarray(offsets, dtype=np.int64).tolist()
    return [hashlib.blake2b(data[bounds[i] : bounds[i + 1]].data, digest_size=DIGEST_SIZE).hexdigest() if want else ""
            for i, want in enumerate(recorded)]


def record_digest(parts: Sequence[np.ndarray]) -> str:
    """A record's ``row_digest``: the digests of its values in each of :func:`digest_parts`, concatenated."""
    return "".join(part_digest(p) for p in parts)


def _compare(name: str, parts: Sequence[str], recorded: str, got: str, row: int, where: str,
             id_of: Callable[[int], str]) -> str | None:
    """One record's digest of dataset ``name`` against what its ``row_digest`` records (empty:
    not recorded, nothing to compare; in format 3, whose every record has one, a problem)."""
    if not recorded:
        if RECORD_PART in parts:
            return f"record {id_of(row)!r} (row {row}): row_digest is empty; every record of this format has one"
        return None
    p = parts.index(name)
    want = recorded[p * HEX : (p + 1) * HEX]
    if got == want and len(recorded) == HEX * len(parts):
        return None
    record = id_of(row)
    if len(recorded) != HEX * len(parts) or any(c not in "0123456789abcdef" for c in recorded):
        shown = recorded if len(recorded) <= 2 * HEX else recorded[: 2 * HEX] + "..."
        return (f"record {record!r} (row {row}): row_digest {shown!r} is not {len(parts)} blake2b-128 hex digest(s), "
                f"one per part ({', '.join(parts)})")
    if name == RECORD_PART:
        return (f"record {record!r} (row {row}): its ID, sequence or per-record columns hold other bytes than were "
                f"written (blake2b-128 {got}, row_digest records {want}): edited after the store was written")
    return (f"record {record!r} (row {row}): dataset {name}{where} holds other bytes than were written (blake2b-128 "
            f"{got}, row_digest records {want}): edited after the store was written")


def digest_problem(name: str, parts: Sequence[str], recorded: Sequence[str], values: np.ndarray,
                   id_of: Callable[[int], str], lo: int, offsets: np.ndarray | None = None) -> str | None:
    """The one per-record check: the first record of rows ``lo:lo+len(recorded)`` whose values
    in dataset ``name`` do not hash to what its ``row_digest`` records, as one line (record ID,
    row, dataset, both digests), or None. ``values``: the records' pooled rows (N, D), or with
    ``offsets`` their per-residue rows (record i is ``values[offsets[i]:offsets[i+1]]``);
    ``id_of(row)``: the ID of the record in ``row``, asked only for the one named."""
    if name not in parts:
        return None
    for i, (want, got) in enumerate(zip(recorded, _block_digests(values, recorded, offsets))):
        where = "" if offsets is None else f" (its {int(offsets[i + 1] - offsets[i])} per-residue rows)"
        if (problem := _compare(name, parts, str(want), got, lo + i, where, id_of)) is not None:
            return problem
    return None


class RecordedDigests:
    """``row_digest`` rows read a block at a time for checks that ask in row order. A block
    that cannot be read or decoded reads as not recorded: validate's checksum pass and its
    UTF-8 check of every string column report it."""

    def __init__(self, ds: h5py.Dataset, block: int = RECORDED_ROWS) -> None:
        self.ds, self.block = ds, block
        self._lo, self._values = 0, np.zeros(0, dtype=object)

    def __call__(self, lo: int, hi: int) -> list[str]:
        if not (self._lo <= lo and hi <= self._lo + len(self._values)):
            top = min(int(self.ds.shape[0]), max(hi, lo + self.block))
            try:
                self._values = np.array(decode_strings(self.ds[lo:top], "dataset row_digest", lo), dtype=object)
            except (OSError, StoreError):
                self._values = np.full(top - lo, "", dtype=object)
            self._lo = lo
        return self._values[lo - self._lo : hi - self._lo].tolist()


class DigestCheck(ResidueStream):
    """``embedpipe validate``'s digest check of one vector dataset, fed its blocks in row order
    by the checksum pass (no second read). Pooled datasets: blocks of record rows; per-residue
    datasets (``offsets`` given): each record's rows hashed as they stream, a record split
    between blocks carried over. ``recorded(lo, hi)`` reads ``row_digest`` rows ``lo:hi``."""

    def __init__(self, name: str, parts: Sequence[str], recorded: RecordedDigests, ids: Sequence[str],
                 offsets: h5py.Dataset | None = None) -> None:
        self.name, self.parts, self.recorded, self.ids = name, list(parts), recorded, ids
        self.residues = offsets is not None
        if offsets is not None:
            super().__init__(offsets)
        else:
            self.broken = False
        self._open_hash = _hasher()
        self.failed = 0
        self.unrecorded = 0  # records without a digest (counted on pooled datasets)
        self.first: str | None = None

    def _id(self, row: int) -> str:
        return str(self.ids[row])

    def _note(self, problem: str | None) -> None:
        if problem is not None:
            self.failed += 1
            self.first = self.first or problem

    def feed(self, sl: slice, block: np.ndarray) -> None:
        if not self.residues:
            wants = self.recorded(sl.start, sl.stop)
            self.unrecorded += wants.count("")
            for i, (want, got) in enumerate(zip(wants, _block_digests(block, wants))):
                self._note(_compare(self.name, self.parts, want, got, sl.start + i, "", self._id))
            return
        split = self.split(sl)
        if split is None:
            return
        recs, starts, ends, done = split
        data = _le_bytes(block)
        for rec, a, b, last in zip(recs.tolist(), starts.tolist(), ends.tolist(), done.tolist()):
            if self._open != rec:
                self._open, self._open_hash = rec, _hasher()
            self._open_hash.update(data[a:b].data)
            if last:
                want = self.recorded(rec, rec + 1)[0]
                rows = f" (its per-residue rows {self.record_rows(rec)})"
                self._note(_compare(self.name, self.parts, want, self._open_hash.hexdigest(), rec, rows, self._id))
                self._open = None

    def problem(self) -> str | None:
        """One line naming the first record whose bytes differ, or None."""
        if self.first is None or self.broken:
            return None
        more = f"; {self.failed} record(s) of this dataset differ" if self.failed > 1 else ""
        return self.first + more


def record_mismatches(parts: Sequence[str], recorded: Sequence[str], got: Sequence[str], lo: int,
                      id_of: Callable[[int], str]) -> tuple[int, str | None]:
    """The record part (:data:`RECORD_PART`) of rows ``lo:lo+len(got)`` computed from the stored
    bytes (``got``) against ``row_digest`` (``recorded``): (how many differ, the first as one line)."""
    if RECORD_PART not in parts:
        return 0, None
    failed, first = 0, None
    for i, (want, have) in enumerate(zip(recorded, got)):
        if (problem := _compare(RECORD_PART, parts, str(want), have, lo + i, "", id_of)) is not None:
            failed += 1
            first = first or problem
    return failed, first
