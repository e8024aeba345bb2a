"""From the shard manifest to a merged store's ``aliases`` and ``skipped`` groups, checked
against the stores being merged: every ``ok`` row is a stored record with its
``sequence_sha256``, and every ``duplicate`` row's target too (a stale manifest would otherwise
alias IDs to other sequences). docs/store-format.md, "Merged stores" and "Shard manifest".

Memory is compact arrays per stored record (a 64-bit ID hash, its row, the 32-byte sequence
digest: 48 bytes), never a Python object per record: the manifest is streamed and looked up
in batches by sorted search, and a hash match is confirmed against the stored ID text
(docs/benchmarks.md, "Sharding at scale", "Merging with the manifest").
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Protocol

import h5py
import numpy as np

from embedpipe.errors import StoreError
from embedpipe.manifest import iter_manifest
from embedpipe.store.sequences import iter_sequence_blocks

BATCH = 4096  # manifest rows looked up at once (a dict of cells each: a few MB)


class StoredIds(Protocol):
    """A store being merged, as far as the manifest check needs it."""

    path: Path
    ids: Sequence[str]


def store_of(shards: Sequence[StoredIds], row: int) -> StoredIds:
    for shard in shards:
        if row < len(shard.ids):
            return shard
        row -= len(shard.ids)
    raise IndexError(row)  # pragma: no cover - rows come from the stores' ids


def _sequence_digests(shards: Sequence[StoredIds], n: int) -> np.ndarray:
    """sha256 of every stored sequence, (n, 32) uint8 in merged order.

    The digest ``shard`` writes as ``sequence_sha256`` (of the normalised ASCII sequence), so
    a manifest row can be checked against the record it names. Read block by block.
    """
    digests = bytearray()
    sha256 = hashlib.sha256
    for shard in shards:
        with h5py.File(shard.path, "r") as f:
            for _, block in iter_sequence_blocks(f, shard.path):  # either layout (format 1 or 2)
                for seq in block:
                    digests += sha256(seq if isinstance(seq, bytes) else str(seq).encode("utf-8")).digest()
    return np.frombuffer(digests, dtype=np.uint8).reshape(n, 32)


class _Stored:
    """The stored records: ID -> row and digest -> first row, by sorted 64-bit keys."""

    def __init__(self, shards: Sequence[StoredIds]) -> None:
        self.shards = shards
        self.starts = np.cumsum([0] + [len(s.ids) for s in shards]).tolist()
        self.n = self.starts[-1]
        keys = np.fromiter((hash(rid) for shard in shards for rid in shard.ids), dtype=np.int64, count=self.n)
        self.id_order = np.argsort(keys, kind="stable")
        self.id_keys = keys[self.id_order]
        self.digests = _sequence_digests(shards, self.n)
        self._by_digest: tuple[np.ndarray, np.ndarray] | None = None

    def id_at(self, row: int) -> str:
        k = bisect_right(self.starts, row) - 1
        return self.shards[k].ids[row - self.starts[k]]

    def rows(self, ids: list[str]) -> np.ndarray:
        """The stored row of each of ``ids`` (-1: not stored)."""
        return _lookup(self.id_keys, self.id_order, np.fromiter(map(hash, ids), np.int64, len(ids)), ids,
                       self.id_at)

    def rows_by_digest(self, shas: list[str]) -> np.ndarray:
        """The first stored row whose sequence has each hex digest (-1: none)."""
        if self._by_digest is None:  # only for duplicate rows without duplicate_of
            words = self.digests[:, :8].copy().view(np.int64).ravel()
            order = np.argsort(words, kind="stable")
            self._by_digest = words[order], order
        wanted = [_digest_bytes(sha) for sha in shas]
        keys = np.fromiter((int.from_bytes(w[:8], "little", signed=True) for w in wanted), np.int64, len(wanted))
        return _lookup(*self._by_digest, keys, wanted, lambda row: self.digests[row].tobytes())

    def sha(self, row: int) -> str:
        return self.digests[row].tobytes().hex()


def _digest_bytes(sha: str) -> bytes:
    try:
        return bytes.fromhex(sha.strip().lower()).ljust(32, b"\0")[:32]
    except ValueError:
        return bytes(32)


def _lookup(sorted_keys: np.ndarray, order: np.ndarray, keys: np.ndarray, values: Sequence[object],
            value_at: object) -> np.ndarray:
    """For each key, the smallest stored row whose key and value (``value_at(row)``) match."""
    found = np.full(len(keys), -1, dtype=np.int64)
    lo = np.searchsorted(sorted_keys, keys, side="left")
    hi = np.searchsorted(sorted_keys, keys, side="right")
    for j in np.flatnonzero(hi > lo).tolist():
        for at in range(int(lo[j]), int(hi[j])):  # rows ascending: the stable sort kept them in order
            row = int(order[at])
            if value_at(row) == values[j]:  # type: ignore[operator]
                found[j] = row
                break
    return found


def _batches(manifest: Path) -> Iterator[list[tuple[int, dict[str, str]]]]:
    rows = iter_manifest(manifest)
    while batch := list(islice(rows, BATCH)):
        yield batch


def _where(manifest: Path, line: int) -> str:
    return f"manifest {manifest} line {line}"


def _check_sha(manifest: Path, stored: _Stored, line: int, row: dict[str, str], target: int) -> None:
    """The row's sequence_sha256 must be that of stored row ``target``'s sequence."""
    claimed, sha = row.get("sequence_sha256", "").strip().lower(), stored.sha(target)
    if claimed == sha:
        return
    name = stored.id_at(target)
    what = f"id {row['id']!r}" if row["id"] == name else f"duplicate {row['id']!r} of {name!r}"
    raise StoreError(
        f"{_where(manifest, line)}: {what} has sequence_sha256 {claimed[:16] or '(empty)'}... but the sequence "
        f"of {name!r} in {store_of(stored.shards, target).path} has {sha[:16]}...; "
        "is this manifest from another shard run (stale)?"
    )


def _check_ok_rows(manifest: Path, stored: _Stored) -> None:
    """Pass 1 over the manifest: every ``ok`` row is stored with its sequence; every stored ID is ``ok``."""
    seen = np.zeros(stored.n, dtype=bool)
    for batch in _batches(manifest):
        ok = [(line, row) for line, row in batch if row.get("status") == "ok"]
        found = stored.rows([row["id"] for _, row in ok])
        for (line, row), at in zip(ok, found.tolist()):
            if at < 0:
                raise StoreError(
                    f"{_where(manifest, line)}: id {row['id']!r} (status ok, shard {row.get('shard')!r}) "
                    "is not in any of the stores being merged"
                )
            _check_sha(manifest, stored, line, row, at)
        seen[found] = True
    if not seen.all():
        missing = int(np.argmin(seen))
        raise StoreError(
            f"manifest {manifest}: store {store_of(stored.shards, missing).path} holds id {stored.id_at(missing)!r}, "
            f"which the manifest does not list as ok ({int((~seen).sum())} such id(s)); "
            "wrong manifest for these stores?"
        )


def plan_manifest(manifest: Path, shards: Sequence[StoredIds]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(aliases [(id, of)], skipped [(id, reason)]) from the manifest, checked against the stores.

    Streams the manifest twice (``ok`` rows first) in batches; per stored record it holds
    only :class:`_Stored`'s arrays, per duplicate or skipped row its output pair.
    """
    stored = _Stored(shards)
    _check_ok_rows(manifest, stored)
    aliases: list[tuple[str, str]] = []
    lines = array("q")  # the line of each alias, for an error naming it
    skipped: list[tuple[str, str]] = []
    for batch in _batches(manifest):
        dups = []
        for line, row in batch:
            status = row.get("status") or ""
            if status == "duplicate":
                dups.append((line, row))
            elif status.startswith("skipped"):
                reason = status.split(":", 1)[1] if ":" in status else ""
                skipped.append((row["id"], reason or "unspecified"))
            elif status != "ok":
                list(_duplicate_targets(manifest, stored, dups))  # an earlier line's error comes first
                raise StoreError(f"{_where(manifest, line)}: unknown status {status!r} for id {row['id']!r}")
        for line, rid, of in _duplicate_targets(manifest, stored, dups):
            aliases.append((rid, stored.id_at(of)))
            lines.append(line)
    return _unique_aliases(manifest, aliases, lines), skipped


def _duplicate_targets(manifest: Path, stored: _Stored,
                       dups: list[tuple[int, dict[str, str]]]) -> Iterator[tuple[int, str, int]]:
    """``(line, id, stored row it aliases)`` per ``duplicate`` row, checked; a row naming the
    stored record itself (same ID and sequence seen twice) already resolves and is left out."""
    ids = [row["id"] for _, row in dups]
    # the kept record: the manifest's duplicate_of column where present, else by content
    target = stored.rows([row.get("duplicate_of") or "" for _, row in dups])
    missing = np.flatnonzero(target < 0)
    if len(missing):
        target[missing] = stored.rows_by_digest([dups[j][1].get("sequence_sha256", "") for j in missing.tolist()])
    itself = stored.rows(ids)
    for (line, row), rid, of, same in zip(dups, ids, target.tolist(), itself.tolist()):
        if of < 0:
            raise StoreError(
                f"{_where(manifest, line)}: duplicate {rid!r} has no ok record with sequence_sha256 "
                f"{row.get('sequence_sha256')} (shard {row.get('shard')!r})"
            )
        _check_sha(manifest, stored, line, row, of)
        if same == of:
            continue
        if same >= 0:
            raise StoreError(f"{_where(manifest, line)}: id {rid!r} is both a stored record and a duplicate of "
                             f"{stored.id_at(of)!r}")
        yield line, rid, of


def _unique_aliases(manifest: Path, aliases: list[tuple[str, str]], lines: array) -> list[tuple[str, str]]:
    """``aliases`` with repeats of the same pair left out; an ID aliased to two records is refused.

    Sorted 64-bit ID hashes find the repeats (none in a manifest ``shard`` wrote).
    """
    keys = np.fromiter((hash(rid) for rid, _ in aliases), np.int64, len(aliases))
    order = np.argsort(keys, kind="stable")
    same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if not len(same):
        return aliases
    first: dict[str, int] = {}
    drop = set()
    for k in sorted({int(order[j]) for j in same} | {int(order[j + 1]) for j in same}):
        rid, of = aliases[k]
        if rid not in first:
            first[rid] = k
        elif aliases[first[rid]][1] != of:
            raise StoreError(f"{_where(manifest, lines[k])}: id {rid!r} is a duplicate of both "
                             f"{aliases[first[rid]][1]!r} and {of!r}")
        else:
            drop.add(k)
    return [pair for k, pair in enumerate(aliases) if k not in drop]
