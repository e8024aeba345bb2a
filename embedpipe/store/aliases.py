"""From the shard manifest to a merged store's ``aliases`` and ``skipped`` groups, checked
against the stores being merged: every ``ok`` row is a stored record with its
``sequence_sha256``, and every ``duplicate`` row's target too (a stale manifest would otherwise
alias IDs to other sequences). docs/store-format.md, "Merged stores" and "Shard manifest".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import h5py

from embedpipe.errors import StoreError
from embedpipe.manifest import iter_manifest
from embedpipe.store.sequences import iter_sequence_blocks


class StoredIds(Protocol):
    """A store being merged, as far as the manifest check needs it."""

    path: Path
    ids: list[str]


def store_of(shards: Sequence[StoredIds], row: int) -> StoredIds:
    for shard in shards:
        if row < len(shard.ids):
            return shard
        row -= len(shard.ids)
    raise IndexError(row)  # pragma: no cover - rows come from the stores' ids


def _sequence_digests(shards: Sequence[StoredIds]) -> bytearray:
    """sha256 of every stored sequence, 32 bytes per row in merged order.

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
    return digests


class _ManifestCheck:
    """Checks manifest rows against the stores: every ``ok`` row names a stored record whose
    sequence has the row's ``sequence_sha256``, and so does every ``duplicate`` row's target
    (a stale manifest would otherwise alias IDs to other sequences)."""

    def __init__(self, manifest: Path, shards: Sequence[StoredIds], index: dict[str, int]) -> None:
        self.manifest, self.shards, self.index = manifest, shards, index
        self.digests = _sequence_digests(shards)
        self._by_digest: dict[bytes, str] | None = None

    def where(self, line: int) -> str:
        return f"manifest {self.manifest} line {line}"

    def stored_sha(self, rid: str) -> str:
        row = self.index[rid]
        return self.digests[32 * row : 32 * row + 32].hex()

    def check_sha(self, line: int, row: dict[str, str], target: str) -> None:
        """The row's sequence_sha256 must be that of ``target``'s stored sequence."""
        claimed, stored = row.get("sequence_sha256", "").strip().lower(), self.stored_sha(target)
        if claimed == stored:
            return
        what = f"id {row['id']!r}" if row["id"] == target else f"duplicate {row['id']!r} of {target!r}"
        raise StoreError(
            f"{self.where(line)}: {what} has sequence_sha256 {claimed[:16] or '(empty)'}... but the sequence "
            f"of {target!r} in {store_of(self.shards, self.index[target]).path} has {stored[:16]}...; "
            "is this manifest from another shard run (stale)?"
        )

    def by_content(self, sha: str) -> str | None:
        """The stored ID whose sequence has digest ``sha`` (duplicate rows without duplicate_of)."""
        if self._by_digest is None:
            ids = [rid for shard in self.shards for rid in shard.ids]
            self._by_digest = {}
            for row in range(len(ids) - 1, -1, -1):  # the first record wins
                self._by_digest[bytes(self.digests[32 * row : 32 * row + 32])] = ids[row]
        try:
            return self._by_digest.get(bytes.fromhex(sha))
        except ValueError:
            return None


def _check_ok_rows(check: _ManifestCheck) -> None:
    """Pass 1 over the manifest: every ``ok`` row is stored with its sequence; every stored ID is ``ok``."""
    seen = bytearray(len(check.index))
    for line, row in iter_manifest(check.manifest):
        if row.get("status") != "ok":
            continue
        rid = row["id"]
        if rid not in check.index:
            raise StoreError(
                f"{check.where(line)}: id {rid!r} (status ok, shard {row.get('shard')!r}) "
                "is not in any of the stores being merged"
            )
        check.check_sha(line, row, rid)
        seen[check.index[rid]] = 1
    missing = seen.find(0)
    if missing >= 0:
        shard = store_of(check.shards, missing)
        rid = next(r for r, k in check.index.items() if k == missing)
        raise StoreError(
            f"manifest {check.manifest}: store {shard.path} holds id {rid!r}, which the manifest "
            f"does not list as ok ({seen.count(0)} such id(s)); wrong manifest for these stores?"
        )


def plan_manifest(manifest: Path, shards: Sequence[StoredIds], index: dict[str, int]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(aliases [(id, of)], skipped [(id, reason)]) from the manifest, checked against the stores.

    Streams the manifest twice (``ok`` rows first), holding no per-row objects.
    """
    check = _ManifestCheck(manifest, shards, index)
    _check_ok_rows(check)
    aliases: list[tuple[str, str]] = []
    alias_seen: dict[str, str] = {}
    skipped: list[tuple[str, str]] = []
    for line, row in iter_manifest(manifest):
        status, rid = row.get("status") or "", row["id"]
        if status == "ok":
            continue
        if status == "duplicate":
            of = _duplicate_target(check, line, row)
            if of is None:
                continue
            if rid in alias_seen:
                if alias_seen[rid] != of:
                    raise StoreError(f"{check.where(line)}: id {rid!r} is a duplicate of both {alias_seen[rid]!r} and {of!r}")
                continue
            alias_seen[rid] = of
            aliases.append((rid, of))
        elif status.startswith("skipped"):
            reason = status.split(":", 1)[1] if ":" in status else ""
            skipped.append((rid, reason or "unspecified"))
        else:
            raise StoreError(f"{check.where(line)}: unknown status {status!r} for id {rid!r}")
    return aliases, skipped


def _duplicate_target(check: _ManifestCheck, line: int, row: dict[str, str]) -> str | None:
    """The stored ID a ``duplicate`` row aliases (``None``: it is that stored record itself)."""
    rid = row["id"]
    # the kept record: the manifest's duplicate_of column where present, else by content
    of = row.get("duplicate_of") or None
    if of not in check.index:
        of = check.by_content(row.get("sequence_sha256", "").strip().lower())
    if of is None:
        raise StoreError(
            f"{check.where(line)}: duplicate {rid!r} has no ok record with sequence_sha256 "
            f"{row.get('sequence_sha256')} (shard {row.get('shard')!r})"
        )
    check.check_sha(line, row, of)
    if rid == of:
        return None  # the same ID and sequence seen twice: already resolves
    if rid in check.index:
        raise StoreError(f"{check.where(line)}: id {rid!r} is both a stored record and a duplicate of {of!r}")
    return of
