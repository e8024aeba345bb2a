"""Shard's first pass: read every input once, keep a compact index per record, spool sequences.

Memory holds per record only what planning and writing the shards need: length, spool
offset, header size, status and normalisations, 18 bytes in fixed-width arrays. Each valid
record goes to a spool file as the exact shard-file entry (``>id\\nSEQ\\n``) and is read back
from there; the ID text, sha256 digest, file, line and an ID hash go to column files
(:mod:`embedpipe.shard.spill`). Duplicate IDs and duplicate sequences are found by sorting
64-bit keys and checking the rare equal keys against the full values on disk
(:func:`check_duplicate_ids`, :func:`dedupe`); docs/benchmarks.md, "Sharding at scale".
An ID that repeats one of the first :data:`CHUNK` records, or one of the current chunk, stops
the pass as it is met (:class:`_EarlyIds`) instead of after the whole input.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedpipe.core.errors import InputError
from embedpipe.core.options import FASTA_LIMITS, FastaLimits
from embedpipe.core.paths import display_path
from embedpipe.core.progress import progress_bar
from embedpipe.inputs.fasta import iter_fasta
from embedpipe.inputs.residue_rules import INVALID_REASONS, NORMALISATION_KINDS
from embedpipe.shard.manifest import MANIFEST_COLUMNS, ManifestWriter, quote, quote_all
from embedpipe.shard.output import Syncer, open_for_writing, write_errors
from embedpipe.shard.spill import CHUNK, Spill

__all__ = ["DUPLICATE", "NORM_BIT", "OK", "REASON_CODE", "SKIP_BASE", "RecordIndex", "Unique", "dedupe", "read_inputs",
           "write_manifest"]

# Per-record status codes (uint8): OK, DUPLICATE, then one per invalid reason.
OK = 0
DUPLICATE = 1
SKIP_BASE = 2
REASON_CODE = {reason: SKIP_BASE + k for k, reason in enumerate(INVALID_REASONS)}
NORM_BIT = {kind: 1 << k for k, kind in enumerate(NORMALISATION_KINDS)}
MANIFEST_ROWS = 8192  # rows formatted at once (a few MB of Python strings)


@dataclass
class RecordIndex:
    """Per input record, in input order: ``offset`` where its entry ``>id\\nSEQ\\n`` starts in
    the spool (-1 for an invalid record), ``head`` the size of ``>id\\n``; the other columns
    are in ``spill``."""

    spill: Spill
    spool: Path
    length: np.ndarray  # uint32
    offset: np.ndarray  # int64
    head: np.ndarray  # uint32
    status: np.ndarray  # uint8
    norm: np.ndarray  # uint8
    chars_per_residue: int = 1  # characters of ``length`` a residue takes (SaProt's pairs: 2)

    @property
    def n(self) -> int:
        return len(self.status)

    @property
    def residues(self) -> np.ndarray:
        """Each record's residues (``length`` counts the spooled sequence's characters)."""
        return self.length // self.chars_per_residue if self.chars_per_residue != 1 else self.length

    def entry_sizes(self, rows: np.ndarray) -> np.ndarray:
        """Bytes of the spool entries of ``rows``."""
        return self.head[rows].astype(np.int64) + self.length[rows] + 1

    def read_id(self, fd: int, row: int) -> str:
        """The ID of valid record ``row``, read back from the spool (open as ``fd``)."""
        return os.pread(fd, int(self.head[row]) - 2, int(self.offset[row]) + 1).decode("utf-8")


def read_inputs(paths: list[Path], work: Path, total_bytes: int, skipping: bool, quiet: bool,
                limits: FastaLimits = FASTA_LIMITS) -> RecordIndex:
    """Pass 1: read, validate, normalise, hash; spool every valid record.

    An invalid record raises :class:`InputError` unless ``skipping``; so does an ID seen
    before (checked on disk once the inputs are read, or when reading stops at an error, so
    the first problem in input order is the one reported).
    """
    spill = Spill(work / "columns")
    length, offset, head, status, norm = array("I"), array("q"), array("I"), bytearray(), bytearray()
    spool_path = work / "spool"
    spool = open_for_writing(spool_path, "wb", buffering=8 << 20)
    try:
        with write_errors(spool, spool_path), progress_bar(
            quiet=quiet, total=total_bytes, unit="B", unit_scale=True, desc="reading"
        ) as bar:
            try:
                _read(paths, spill, spool, (length, offset, head, status, norm), skipping, bar.update, limits)
            except InputError:
                spill.close()
                check_duplicate_ids(spill, paths, spill.records)
                raise
        spill.close()
    finally:
        spill.abort()
    check_duplicate_ids(spill, paths, len(status))
    as_np = np.frombuffer
    return RecordIndex(spill=spill, spool=spool_path, length=as_np(length, np.uint32), offset=as_np(offset, np.int64),
                       head=as_np(head, np.uint32), status=as_np(status, np.uint8), norm=as_np(norm, np.uint8),
                       chars_per_residue=limits.chars_per_residue)


def _read(paths: list[Path], spill: Spill, spool: object, columns: tuple, skipping: bool, on_bytes: Callable[[int], None] | None,
          limits: FastaLimits) -> None:
    """The per-record loop; it binds what it uses to locals (it runs millions of times)."""
    length, offset, head, status, norm = columns
    ids, idkey, file_index, line, digests = (spill.ids, spill.buffers["idkey"], spill.buffers["file"],
                                             spill.buffers["line"], spill.buffers["digest"])
    zero_digest = bytes(32)
    sha256 = hashlib.sha256
    norm_bit, reason_code = NORM_BIT, REASON_CODE
    write = spool.write  # type: ignore[attr-defined]
    spool_pos = 0
    early = _EarlyIds()
    first_ids, recent_ids = early.first, early.recent  # inline: this loop runs millions of times
    for rec in iter_fasta(paths, check_duplicate_ids=False, on_bytes=on_bytes, limits=limits):
        rid = rec.id
        idb = rid.encode("utf-8")
        ids.append(idb)
        idkey.append(hash(rid))
        file_index.append(rec.file_index)
        line.append(rec.line)
        if rid in first_ids or rid in recent_ids:  # read_inputs' except names both lines
            raise InputError(f"{display_path(paths[rec.file_index])}:{rec.line}: duplicate ID '{rid}'")
        (first_ids if len(first_ids) < CHUNK else recent_ids).add(rid)
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
            head.append(0)
        else:
            digests += sha256(data).digest()
            status.append(OK)
            offset.append(spool_pos)
            head.append(len(idb) + 2)
            write(b">%s\n%s\n" % (idb, data))
            spool_pos += len(idb) + size + 3
        if len(ids) >= CHUNK:
            spill.flush()
            recent_ids.clear()


class _EarlyIds:
    """The IDs of the first :data:`CHUNK` records and of the current chunk, in memory: a
    duplicate among them is reported when it is met, not after the sort of every ID hash
    (a repeat at line 3 of a 20M-record input stopped only after the full pass). Memory: two
    chunks of IDs, as the column buffers of :class:`~embedpipe.shard.spill.Spill` already hold
    one; the sort in :func:`check_duplicate_ids` still finds every other duplicate."""

    def __init__(self) -> None:
        self.first: set[str] = set()  # filled up to CHUNK IDs, then kept
        self.recent: set[str] = set()  # emptied at each flush of the spill


def check_duplicate_ids(spill: Spill, paths: list[Path], n: int) -> None:
    """Raise for the first record (input order) whose ID an earlier record has, naming both.

    Sorts the 64-bit ID hashes; only records whose hash repeats are compared by ID text.
    """
    keys = spill.column("idkey", n)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    same = keys[1:] == keys[:-1]
    if not same.any():
        return
    rows = np.unique(np.concatenate((order[1:][same], order[:-1][same])))
    del keys, order, same
    ids = spill.gather_ids(rows)
    first: dict[str, int] = {}
    for row in rows.tolist():
        rid = ids[row]
        if rid in first:
            both = np.array([first[rid], row])
            (f0, f1), (l0, l1) = spill.gather("file", both, n).tolist(), spill.gather("line", both, n).tolist()
            seen, again = f"{display_path(paths[f0])}:{l0}", f"{display_path(paths[f1])}:{l1}"
            raise InputError(f"{again}: duplicate ID '{rid}': first seen at {seen}, again at {again}")
        first[rid] = row


@dataclass
class Unique:
    """The index's records grouped by sequence: ``status`` with duplicates marked,
    ``unique_rec`` the first copy of each unique sequence (input order), and for the
    duplicates ``dup_rec`` (ascending) and ``dup_first`` the record each one repeats."""

    status: np.ndarray
    unique_rec: np.ndarray
    dup_rec: np.ndarray
    dup_first: np.ndarray


def dedupe(index: RecordIndex) -> Unique:
    """Mark every later copy of a sequence (same sha256 of the normalised sequence) a duplicate.

    The digests' first 64 bits, sorted, give the words that repeat; the records carrying
    such a word (the candidates) have their full digests read back and are grouped exactly,
    so two different sequences sharing a first word (odds ~N^2/2^65) are never merged. Stable
    sorts keep equal digests in input order: the first of each run is the earliest record.
    """
    n = index.n
    words = np.empty(n, dtype=np.uint64)
    for k, block in enumerate(_first_words(index)):
        words[k * CHUNK : k * CHUNK + len(block)] = block
    words.sort()
    repeated = np.unique(words[1:][words[1:] == words[:-1]])
    del words
    cand = np.concatenate([np.flatnonzero(_isin_sorted(block, repeated)) + k * CHUNK
                           for k, block in enumerate(_first_words(index))] or [np.empty(0, np.int64)])
    cand = cand[index.status[cand] < SKIP_BASE]
    d = index.spill.gather("digest", cand, n).view(np.uint64)  # (m, 4)
    o = np.lexsort((np.arange(len(cand)), d[:, 3], d[:, 2], d[:, 1], d[:, 0]))
    d = d[o]
    starts = np.concatenate(([True], ~(d[1:] == d[:-1]).all(axis=1))) if len(cand) else np.empty(0, dtype=bool)
    kept = np.empty(len(cand), dtype=np.int64)
    kept[o] = cand[o][starts][np.cumsum(starts) - 1]
    is_dup = kept != cand
    status = index.status.copy()
    status[cand[is_dup]] = DUPLICATE
    return Unique(status=status, unique_rec=np.flatnonzero(status == OK), dup_rec=cand[is_dup],
                  dup_first=kept[is_dup])


def _first_words(index: RecordIndex) -> Iterator[np.ndarray]:
    """The first 64 bits of every record's digest, a chunk at a time."""
    for block in index.spill.chunks("digest", index.n):
        yield block[:, :8].copy().view(np.uint64).ravel()


def _isin_sorted(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``np.isin(values, table)`` for an ascending ``table``, in memory of ``values``' size."""
    if not len(table):
        return np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(table, values), len(table) - 1)
    return table[at] == values


def write_manifest(path: Path, syncer: Syncer, sources: list[str], index: RecordIndex, unique: Unique,
                   shard_of_record: np.ndarray) -> None:
    """One row per input record, in input order, through :class:`ManifestWriter`.

    Streams the column files :data:`CHUNK` records at a time; a duplicate's ``duplicate_of``
    is read back from the spool entry of the record it repeats. Only the free-text cells (IDs,
    source paths) can need quoting.
    """
    # the source cell is "path:line": quoted as a whole when the path needs it
    quoted = [quote(src) for src in sources]
    src_open = [q[:-1] if q != src else src for q, src in zip(quoted, sources)]
    src_close = ['"' if q != src else "" for q, src in zip(quoted, sources)]
    status_text = ["ok", "duplicate"] + [f"skipped:{reason}" for reason in INVALID_REASONS]
    norm_text = [
        ",".join(kind for kind, bit in NORM_BIT.items() if flags & bit) for flags in range(1 << len(NORM_BIT))
    ]
    spill, n, rows_at_once = index.spill, index.n, MANIFEST_ROWS
    columns = zip(*(spill.id_chunks(n, rows_at_once),
                    *(spill.chunks(name, n, rows_at_once) for name in ("file", "line", "digest"))))
    with open(index.spool, "rb") as spool, syncer.syncing(
        open_for_writing(path, "w", encoding="utf-8", newline="", buffering=8 << 20), path
    ) as fh:
        writer = ManifestWriter(fh, MANIFEST_COLUMNS)
        for k, (ids, file_index, line, digests) in enumerate(columns):
            lo, hi = k * rows_at_once, k * rows_at_once + len(ids)
            first = _duplicate_targets(index, unique, spool.fileno(), lo, hi)
            ids = quote_all(ids)
            hexes = digests.tobytes().hex()
            rows = []
            for j, (i, f, ln, size, code, shard, flags) in enumerate(zip(
                range(lo, hi), file_index.tolist(), line.tolist(), index.residues[lo:hi].tolist(),
                unique.status[lo:hi].tolist(), shard_of_record[lo:hi].tolist(), index.norm[lo:hi].tolist(),
            )):
                source = f"{src_open[f]}:{ln}{src_close[f]}"
                if code >= SKIP_BASE:
                    rows.append(f"{ids[j]}\t{source}\t{size}\t\t\t{status_text[code]}\t\t{norm_text[flags]}\n")
                else:
                    rows.append(f"{ids[j]}\t{source}\t{size}\t{hexes[64 * j : 64 * j + 64]}\t{shard}\t"
                                f"{status_text[code]}\t{first.get(i, '')}\t{norm_text[flags]}\n")
            writer.write_lines("".join(rows))


def _duplicate_targets(index: RecordIndex, unique: Unique, fd: int, lo: int, hi: int) -> dict[int, str]:
    """``{record: quoted ID of the record it repeats}`` for the duplicates among records ``lo..hi``."""
    a, b = np.searchsorted(unique.dup_rec, (lo, hi))
    return {int(r): quote(index.read_id(fd, int(f))) for r, f in zip(unique.dup_rec[a:b], unique.dup_first[a:b])}
