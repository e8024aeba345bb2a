"""Shard's first pass: read every input once, keep a compact index per record, spool sequences.

Memory holds per record its ID, file, line, length, status, normalisations and sha256 digest
(arrays of machine integers, not Python objects), never the sequences: each valid sequence
goes to a spool file next to ``out`` and is read back from there when the shards are written.
Then duplicates are found by digest (:func:`dedupe`), and at the end the index is written
out as ``manifest.tsv`` (:func:`write_manifest`; docs/store-format.md, "Shard manifest").
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from embedpipe.errors import InputError
from embedpipe.fasta import iter_fasta
from embedpipe.manifest import MANIFEST_COLUMNS, ManifestWriter, quote, quote_all
from embedpipe.progress import progress_bar
from embedpipe.residues import INVALID_REASONS, NORMALISATION_KINDS
from embedpipe.shard_output import Syncer, open_for_writing, write_errors

__all__ = ["DUPLICATE", "NORM_BIT", "OK", "REASON_CODE", "SKIP_BASE", "RecordIndex", "Unique", "dedupe", "read_inputs",
           "write_manifest"]

# Per-record status codes (a bytearray in memory): OK, DUPLICATE, then one per invalid reason.
OK = 0
DUPLICATE = 1
SKIP_BASE = 2
REASON_CODE = {reason: SKIP_BASE + k for k, reason in enumerate(INVALID_REASONS)}
NORM_BIT = {kind: 1 << k for k, kind in enumerate(NORMALISATION_KINDS)}


@dataclass
class RecordIndex:
    """Per input record, in input order; ``offset`` is where its sequence starts in the spool
    (-1 for an invalid record), ``digests`` 32 bytes per record (zeros when invalid)."""

    ids: list[str] = field(default_factory=list)
    file_index: array = field(default_factory=lambda: array("I"))
    line: array = field(default_factory=lambda: array("q"))
    length: array = field(default_factory=lambda: array("q"))
    offset: array = field(default_factory=lambda: array("q"))
    status: bytearray = field(default_factory=bytearray)
    norm: bytearray = field(default_factory=bytearray)
    digests: bytearray = field(default_factory=bytearray)


def read_inputs(paths: list[Path], spool_path: Path, total_bytes: int, skipping: bool, quiet: bool) -> RecordIndex:
    """Pass 1: read, validate, normalise, hash; spool every valid sequence.

    An invalid record raises :class:`InputError` unless ``skipping``. The loop binds what it
    uses to locals: it runs once per record, millions of times.
    """
    index = RecordIndex()
    ids, file_index, line, length = index.ids, index.file_index, index.line, index.length
    offset, status, norm, digests = index.offset, index.status, index.norm, index.digests
    zero_digest = bytes(32)
    sha256 = hashlib.sha256
    norm_bit = NORM_BIT
    reason_code = REASON_CODE
    spool_pos = 0
    spool = open_for_writing(spool_path, "wb", buffering=8 << 20)
    with write_errors(spool, spool_path), progress_bar(
        quiet=quiet, total=total_bytes, unit="B", unit_scale=True, desc="reading"
    ) as bar:
        for rec in iter_fasta(paths, on_bytes=bar.update):
            ids.append(rec.id)
            file_index.append(rec.file_index)
            line.append(rec.line)
            data = rec.data
            size = len(data)
            length.append(size)
            flags = 0
            for kind in rec.normalised:
                flags |= norm_bit[kind]
            norm.append(flags)
            if rec.invalid is not None:
                if not skipping:
                    raise InputError(rec.error or f"{rec.source}: record '{rec.id}': {rec.invalid}")
                status.append(reason_code[rec.invalid])
                digests += zero_digest
                offset.append(-1)
                continue
            digests += sha256(data).digest()
            status.append(OK)
            offset.append(spool_pos)
            spool.write(data)
            spool_pos += size
    return index


@dataclass
class Unique:
    """The index's records grouped by sequence: ``status`` with duplicates marked,
    ``unique_rec`` the first copy of each unique sequence (input order), ``unique_of`` each
    record's unique sequence (-1 for an invalid record)."""

    status: np.ndarray
    unique_rec: np.ndarray
    unique_of: np.ndarray


def dedupe(index: RecordIndex) -> Unique:
    """Mark every later copy of a sequence (same sha256 of the normalised sequence) a duplicate."""
    status = np.frombuffer(index.status, dtype=np.uint8)
    kept = _first_copies(np.frombuffer(index.digests, dtype=np.uint64).reshape(-1, 4), status < SKIP_BASE)
    is_dup = kept >= 0
    is_dup[is_dup] = kept[is_dup] != np.flatnonzero(is_dup)
    status = status.copy()
    status[is_dup] = DUPLICATE
    unique_rec = np.flatnonzero(status == OK)  # kept copies, in input order
    unique_of = np.full(len(status), -1, dtype=np.int64)  # per record: its unique sequence
    unique_of[unique_rec] = np.arange(len(unique_rec))
    unique_of[is_dup] = unique_of[kept[is_dup]]
    return Unique(status=status, unique_rec=unique_rec, unique_of=unique_of)


def _first_copies(digests: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per record, the index of the first record with the same digest (-1 where not ``valid``).

    ``digests`` is (N, 4) uint64 (a view of the 32-byte sha256 digests). Sorting on the first
    word alone is exact unless two *different* digests share it (odds ~N^2/2^65); then all four
    words are sorted on. Stable sorts keep equal digests in input order, so the first of each
    run is the earliest record.
    """
    kept = np.full(len(digests), -1, dtype=np.int64)
    rec = np.flatnonzero(valid)
    if not len(rec):
        return kept
    d = digests[rec]
    order = np.argsort(d[:, 0], kind="stable")
    d = d[order]
    same_word = d[1:, 0] == d[:-1, 0]
    same = same_word & (d[1:] == d[:-1]).all(axis=1)
    if not np.array_equal(same, same_word):  # a first-word collision: sort on all four words
        d = digests[rec]
        order = np.lexsort((np.arange(len(rec)), d[:, 3], d[:, 2], d[:, 1], d[:, 0]))
        d = d[order]
        same = (d[1:] == d[:-1]).all(axis=1)
    starts = np.concatenate(([True], ~same))
    group = np.cumsum(starts) - 1
    first = rec[order][starts]
    kept[rec[order]] = first[group]
    return kept


def write_manifest(path: Path, syncer: Syncer, sources: list[str], index: RecordIndex, unique: Unique,
                   shard_of_unique: list[int]) -> None:
    """One row per input record, in input order, through :class:`ManifestWriter`.

    Rows are formatted here and written 65536 at a time (millions of rows); only the free-text
    cells (IDs, source paths) can need quoting, so they are quoted once up front.
    """
    # the source cell is "path:line": quoted as a whole when the path needs it
    quoted = [quote(src) for src in sources]
    src_open = [q[:-1] if q != src else src for q, src in zip(quoted, sources)]
    src_close = ['"' if q != src else "" for q, src in zip(quoted, sources)]
    ids = quote_all(index.ids)
    file_index, line, length, norm = index.file_index, index.line, index.length, index.norm
    first_of, shard_of = unique.unique_rec.tolist(), shard_of_unique
    status_text = ["ok", "duplicate"] + [f"skipped:{reason}" for reason in INVALID_REASONS]
    norm_text = [
        ",".join(kind for kind, bit in NORM_BIT.items() if flags & bit) for flags in range(1 << len(NORM_BIT))
    ]
    digest_view = memoryview(index.digests)
    with syncer.syncing(open_for_writing(path, "w", encoding="utf-8", newline="", buffering=8 << 20), path) as fh:
        writer = ManifestWriter(fh, MANIFEST_COLUMNS)
        rows: list[str] = []
        for i, code, u in zip(range(len(ids)), unique.status.tolist(), unique.unique_of.tolist()):
            source = f"{src_open[file_index[i]]}:{line[i]}{src_close[file_index[i]]}"
            if code >= SKIP_BASE:
                rows.append(f"{ids[i]}\t{source}\t{length[i]}\t\t\t{status_text[code]}\t\t{norm_text[norm[i]]}\n")
            else:
                rows.append(
                    f"{ids[i]}\t{source}\t{length[i]}\t{digest_view[32 * i : 32 * i + 32].hex()}\t{shard_of[u]}\t"
                    f"{status_text[code]}\t{ids[first_of[u]] if code == DUPLICATE else ''}\t{norm_text[norm[i]]}\n"
                )
            if len(rows) >= 65536:
                writer.write_lines("".join(rows))
                rows.clear()
        writer.write_lines("".join(rows))
    digest_view.release()
