"""From the shard manifest to a merged store's ``aliases`` and ``skipped`` groups, checked
against the stores being merged: every ``ok`` row is a stored record with its
``sequence_sha256``, and every ``duplicate`` row's target too (a stale manifest would otherwise
alias IDs to other sequences). docs/store-format.md, "Merged stores" and "Shard manifest".

Memory does not grow with the records (docs/benchmarks.md, "Merge and validate at scale"):
the stored records (ID, row, sequence digest) and the manifest rows (ID or ``duplicate_of``,
line, claimed digest) are rows of one :class:`~embedpipe.core.external_sort.ExternalSort` by ID;
one pass over it checks each ID's group and hands the resolved aliases and the skipped IDs
to the ID index's sort (:mod:`embedpipe.store.idsort`), which drops repeats and refuses
conflicts. Duplicate rows without ``duplicate_of`` are resolved by a second sort, by digest.
A problem is reported at the earliest manifest line of its pass, re-reading that line.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import IO, Protocol

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.core.external_sort import ExternalSort, group_starts
from embedpipe.core.idtext import bad_id_message
from embedpipe.shard.manifest import iter_manifest
from embedpipe.store.idsort import ALIAS, SKIP, entries, id_rows
from embedpipe.store.sequences import iter_sequence_blocks

BATCH = 4096  # manifest rows handled at once
OK, DUPOF = 1, 2  # tags of manifest rows in the by-ID sort (stored records are 0)


class StoredIds(Protocol):
    """A store being merged, as far as the manifest check needs it."""

    path: Path
    count: int


class Stores:
    """The stores being merged, in merged row order: which store holds a row."""

    def __init__(self, shards: Sequence[StoredIds]) -> None:
        self.shards = shards
        self.starts = np.cumsum([0] + [s.count for s in shards]).tolist()

    def of(self, row: int) -> StoredIds:
        return self.shards[bisect_right(self.starts, row) - 1]

    def name(self, row: int) -> str:
        return str(self.of(row).path)

    def blocks(self, digests: bool) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """(first merged row, IDs as bytes, sha256 of each sequence (m, 32) or None) per block."""
        for shard, start in zip(self.shards, self.starts):
            with h5py.File(shard.path, "r") as f:
                if not digests:
                    for lo in range(0, shard.count, 1 << 16):
                        yield start + lo, id_rows(f["ids"], lo, min(shard.count, lo + (1 << 16))), None
                    continue
                for lo, block in iter_sequence_blocks(f, shard.path):  # either layout (format 1 or 2)
                    sha = b"".join(hashlib.sha256(s if isinstance(s, bytes) else str(s).encode()).digest()
                                   for s in block)
                    yield (start + lo, id_rows(f["ids"], lo, lo + len(block)),
                           np.frombuffer(sha, np.uint8).reshape(len(block), 32))


class PairSpool:
    """(id, text) pairs spooled to a file in order (the aliases and skipped IDs): their
    datasets need the widest value before they are written."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh, self.count, self.widths = fh, 0, [1, 1]

    def add(self, a: bytes, b: bytes) -> None:
        self.fh.write(struct.pack("<II", len(a), len(b)) + a + b)
        self.count += 1
        self.widths = [max(self.widths[0], len(a)), max(self.widths[1], len(b))]

    def pairs(self) -> Iterator[tuple[bytes, bytes]]:
        self.fh.flush()
        self.fh.seek(0)
        for _ in range(self.count):
            la, lb = struct.unpack("<II", self.fh.read(8))
            yield self.fh.read(la), self.fh.read(lb)


def _where(manifest: Path, line: int) -> str:
    return f"manifest {manifest} line {line}"


def _row_at(manifest: Path, line: int) -> dict[str, str]:
    """The manifest row at ``line`` (read again for an error message)."""
    return next(row for at, row in iter_manifest(manifest) if at == line)


class _Problems:
    """The problem at the earliest manifest line of a pass (a store's problem after all lines)."""

    def __init__(self, manifest: Path) -> None:
        self.manifest = manifest
        self.first: tuple[float, str] | None = None

    def add(self, line: float, message: str) -> None:
        if self.first is None or line < self.first[0]:
            self.first = (line, message)

    def raise_first(self) -> None:
        if self.first is not None:
            raise StoreError(self.first[1])


def _digests(shas: list[str]) -> np.ndarray:
    out = bytearray()
    for sha in shas:
        try:
            out += bytes.fromhex(sha.strip().lower()).ljust(32, b"\0")[:32]
        except ValueError:
            out += bytes(32)
    return np.frombuffer(bytes(out), np.uint8).reshape(len(shas), 32)


def _rows(keys: list[str], tag: int, lines: list[int], shas: list[str], other: list[str] | None = None) -> np.ndarray:
    e = entries(np.array(keys, dtype=object), tag, np.full(len(keys), -1, np.int64), lines=np.array(lines, np.int64),
                other=None if other is None else np.array([o.encode() for o in other], dtype="S"))
    return _with_sha(e, _digests(shas))


def _with_sha(e: np.ndarray, sha: np.ndarray) -> np.ndarray:
    out = np.empty(len(e), dtype=e.dtype.descr + [("sha", "u1", (32,))])
    for name in e.dtype.names or ():
        out[name] = e[name]
    out["sha"] = sha
    return out


def _sha_problem(manifest: Path, line: int, rid: str, name: str, claimed: bytes, stored: bytes, store: str) -> str:
    what = f"id {rid!r}" if rid == name else f"duplicate {rid!r} of {name!r}"
    return (f"{_where(manifest, line)}: {what} has sequence_sha256 {claimed.hex()[:16]}... but the sequence "
            f"of {name!r} in {store} has {stored.hex()[:16]}...; is this manifest from another shard run (stale)?")


class _Plan:
    """One merge's manifest check: the sorts it feeds and what it found."""

    def __init__(self, manifest: Path, stores: Stores, index: ExternalSort, skipped: PairSpool,
                 work: Path | None) -> None:
        self.manifest, self.stores, self.index, self.skipped, self.work = manifest, stores, index, skipped, work
        self.by_id = ExternalSort(("key", "tag", "line", "row"), work=work)
        self.by_sha = ExternalSort(("key", "tag", "row", "line"), work=work)
        self.problems = _Problems(manifest)

    def feed(self) -> None:
        """The stored records, then every manifest row, into the sorts; skipped IDs to the spool."""
        for lo, ids, sha in self.stores.blocks(digests=True):
            assert sha is not None  # asked for
            self.by_id.add(_with_sha(entries(ids, 0, lo + np.arange(len(ids))), sha))
        rows = iter_manifest(self.manifest)
        while batch := list(islice(rows, BATCH)):
            ok: list[tuple[str, int, str]] = []
            dup: list[tuple[str, int, str, str]] = []
            by_sha: list[tuple[str, int, str, str]] = []
            skip: list[tuple[str, int, str]] = []
            for line, row in batch:
                status = row.get("status") or ""
                if status == "ok":
                    ok.append((row["id"], line, row.get("sequence_sha256", "")))
                elif status == "duplicate":
                    target = row.get("duplicate_of") or ""
                    (dup if target else by_sha).append((target, line, row.get("sequence_sha256", ""), row["id"]))
                elif status.startswith("skipped"):
                    reason = status.split(":", 1)[1] if ":" in status else ""
                    skip.append((row["id"], line, reason or "unspecified"))
                else:
                    raise StoreError(f"{_where(self.manifest, line)}: unknown status {status!r} for id {row['id']!r}")
            self._feed_batch(ok, dup, by_sha, skip)

    def _feed_batch(self, ok: list, dup: list, by_sha: list, skip: list) -> None:
        for what, pairs in (("alias id", dup + by_sha), ("skipped id", skip)):
            if (bad := bad_id_message([p[3] if what == "alias id" else p[0] for p in pairs], what)) is not None:
                raise StoreError(f"manifest {self.manifest}: {bad}")
        if ok:
            self.by_id.add(_rows([r for r, _, _ in ok], OK, [ln for _, ln, _ in ok], [s for _, _, s in ok]))
        if dup:
            self.by_id.add(_rows([t for t, _, _, _ in dup], DUPOF, [ln for _, ln, _, _ in dup],
                                 [s for _, _, s, _ in dup], [r for _, _, _, r in dup]))
        if by_sha:
            self._by_sha([ln for _, ln, _, _ in by_sha], _digests([s for _, _, s, _ in by_sha]),
                         [r for _, _, _, r in by_sha])
        for rid, line, reason in skip:
            j = self.skipped.count
            self.skipped.add(rid.encode(), reason.encode())
            self.index.add(entries(np.array([rid], dtype=object), SKIP, np.array([-1 - j]), lines=np.array([line])))

    def _by_sha(self, lines: list[int], sha: np.ndarray, ids: list[str]) -> None:
        keys = np.frombuffer(sha.tobytes().hex().encode(), dtype="S64") if len(sha) else np.zeros(0, "S64")
        self.by_sha.add(entries(keys, 1, np.full(len(keys), -1, np.int64), lines=np.array(lines, np.int64),
                                other=np.array([r.encode() for r in ids], dtype="S")))

    def check_by_id(self) -> None:
        """Each ID's group: at most one stored record; its ok rows' digests; a stored record
        without an ok row; each duplicate row's named target."""
        unlisted, first_unlisted = 0, None
        for block in self.by_id:
            starts = group_starts(block["key"])
            size = np.diff(np.append(starts, len(block)))
            group = np.repeat(np.arange(len(starts)), size)
            head = block[starts][group]  # the first row of each row's group: the stored record, when there is one
            stored = head["tag"] == 0
            tags = block["tag"]
            if (again := np.flatnonzero((tags == 0) & (np.arange(len(block)) != starts[group]))).size:
                j = int(again[0])
                raise StoreError(f"duplicate id {block['key'][j].decode()!r} in {self.stores.name(int(head['row'][j]))} "
                                 f"and {self.stores.name(int(block['row'][j]))}")
            listed = np.zeros(len(starts), bool)
            listed[group[tags == OK]] = True
            alone = np.flatnonzero((block["tag"][starts] == 0) & ~listed)
            if alone.size:
                unlisted += int(alone.size)
                row = int(block["row"][starts[alone]].min())
                first_unlisted = row if first_unlisted is None else min(first_unlisted, row)
            self._manifest_rows(block, head, stored)
        if first_unlisted is not None:
            self.problems.add(float("inf"), (
                f"manifest {self.manifest}: store {self.stores.name(first_unlisted)} holds an id, which the manifest "
                f"does not list as ok ({unlisted} such id(s)); wrong manifest for these stores?"))
            self._name_unlisted(first_unlisted)
        self.problems.raise_first()

    def _name_unlisted(self, row: int) -> None:
        shard = self.stores.of(row)
        with h5py.File(shard.path, "r") as f:
            lo = row - self.stores.starts[self.stores.shards.index(shard)]
            rid = id_rows(f["ids"], lo, lo + 1)[0].decode()
        assert self.problems.first is not None  # the problem this names the ID of
        line, message = self.problems.first
        if line == float("inf"):
            self.problems.first = (line, message.replace("holds an id,", f"holds id {rid!r},"))

    def _manifest_rows(self, block: np.ndarray, head: np.ndarray, stored: np.ndarray) -> None:
        tags, m = block["tag"], self.manifest
        bad_sha = (tags != 0) & stored & ~(block["sha"] == head["sha"]).all(axis=1)
        for j in np.flatnonzero(bad_sha).tolist():
            rid = block["other"][j].decode() if tags[j] == DUPOF else block["key"][j].decode()
            self.problems.add(int(block["line"][j]), _sha_problem(
                m, int(block["line"][j]), rid, block["key"][j].decode(), block["sha"][j].tobytes(),
                head["sha"][j].tobytes(), self.stores.name(int(head["row"][j]))))
        for j in np.flatnonzero((tags == OK) & ~stored).tolist():
            line = int(block["line"][j])
            if self.problems.first is None or line < self.problems.first[0]:
                row = _row_at(m, line)
                self.problems.add(line, f"{_where(m, line)}: id {row['id']!r} (status ok, shard {row.get('shard')!r}) "
                                        "is not in any of the stores being merged")
        resolved = (tags == DUPOF) & stored & ~bad_sha
        if resolved.any():
            r = block[resolved]
            self.index.add(entries(r["other"], ALIAS, head["row"][resolved], lines=r["line"], other=r["key"]))
        unresolved = block[(tags == DUPOF) & ~stored]
        if len(unresolved):
            self._by_sha(unresolved["line"].tolist(), unresolved["sha"], [o.decode() for o in unresolved["other"]])

    def check_by_sha(self) -> None:
        """Duplicate rows without a (stored) ``duplicate_of``: the first stored record with their digest."""
        if not self.by_sha.rows:
            return
        for lo, ids, sha in self.stores.blocks(digests=True):
            assert sha is not None  # asked for
            keys = np.frombuffer(sha.tobytes().hex().encode(), dtype="S64") if len(ids) else np.zeros(0, "S64")
            self.by_sha.add(entries(keys, 0, lo + np.arange(len(ids)), other=ids))
        for block in self.by_sha:
            starts = group_starts(block["key"])
            group = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(block))))
            head = block[starts][group]
            dup = block["tag"] == 1
            found = dup & (head["tag"] == 0)
            if found.any():
                r = block[found]
                self.index.add(entries(r["other"], ALIAS, head["row"][found], lines=r["line"], other=head["other"][found]))
            for j in np.flatnonzero(dup & ~found).tolist():
                line = int(block["line"][j])
                row = _row_at(self.manifest, line)
                self.problems.add(line, f"{_where(self.manifest, line)}: duplicate {row['id']!r} has no ok record with "
                                        f"sequence_sha256 {row.get('sequence_sha256')} (shard {row.get('shard')!r})")
        self.problems.raise_first()

    def close(self) -> None:
        self.by_id.close()
        self.by_sha.close()


def plan_manifest(manifest: Path, stores: Stores, index: ExternalSort, skipped: PairSpool,
                  work: Path | None = None) -> None:
    """Check the manifest against the stores; the resolved aliases (tag ``ALIAS``, row = the
    target's, ``other`` = its ID) and skipped IDs (``SKIP``, row ``-(j+1)``) go to ``index``,
    skipped (id, reason) pairs to ``skipped`` in manifest order. One StoreError line per problem."""
    plan = _Plan(Path(manifest), stores, index, skipped, work)
    try:
        plan.feed()
        plan.check_by_id()
        plan.check_by_sha()
    finally:
        plan.close()
