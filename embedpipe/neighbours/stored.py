"""Neighbours of records the index's store holds, named by ID (no model: their stored vectors
are the queries), and hits collapsed by alias group.

Why the store and not the index: FAISS may not give a row's vector back (HNSW keeps it, a
later index kind need not), and the store's reader checks every row it returns against its
digests. The index's description binds the store (its sha256 and uuid), so the vector read for
an ID is the very one indexed: the same layer and pooling (the description's), cast and
normalised by the same function as the build (:func:`~embedpipe.neighbours.build.unit_rows`,
applied by :func:`~embedpipe.neighbours.hits.search_index`).

Why alias groups: a merged store keeps one record for a sequence that several input IDs name
(its ``aliases``), and the index holds each of those IDs, with the same vector. A record's
nearest neighbours are then itself and its aliases, at cosine 1: an ID query leaves its group
out unless asked, and ``collapse`` makes one hit of each group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from embedpipe.core.errors import EmbedpipeError, quote
from embedpipe.neighbours.hits import Hits, check_k, search_index
from embedpipe.neighbours.index_file import REBUILD, LoadedIndex
from embedpipe.store import open_store
from embedpipe.store.reader import Store, UnknownIdError

__all__ = ["AliasGroups", "alias_groups", "filtered_search", "indexed_store", "stored_neighbours"]


@dataclass
class AliasGroups:
    """A store's alias groups: every input ID of one stored sequence. ``of``: alias -> its
    record's ID; ``aliases``: record ID -> its aliases, sorted."""

    of: dict[str, str]
    aliases: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def of_store(cls, store: Store) -> AliasGroups:
        of = store.aliases  # read once, whole: one pass builds the reverse map
        aliases: dict[str, list[str]] = {}
        for alias, record in sorted(of.items()):
            aliases.setdefault(record, []).append(alias)
        return cls(of, aliases)

    def record(self, record_id: str) -> str:
        """The stored record of ``record_id`` (itself, or the record an alias names)."""
        return self.of.get(record_id, record_id)

    def group(self, record_id: str) -> tuple[str, ...]:
        """The IDs of ``record_id``'s sequence: its record's ID first, then the aliases (a
        ``Hits.groups`` entry as it is)."""
        record = self.record(record_id)
        return (record, *self.aliases.get(record, ()))


@contextlib.contextmanager
def indexed_store(loaded: LoadedIndex, why: str) -> Iterator[Store]:
    """The store ``loaded`` was built from, opened by its checked reader, still the file that
    was indexed (its sha256, then its uuid); one line naming the index and the store else.
    ``why``: what needs it (a moved or removed store does not matter to a search by vectors)."""
    meta, path = loaded.meta, Path(loaded.meta.store)
    if not path.is_file():
        raise EmbedpipeError(f"{loaded.path}: its store {path} is not there (moved or removed); {why} reads it: "
                             f"put it back, or {REBUILD} from where it is now")
    meta.check_store(loaded.path)
    with open_store(path) as store:
        uuid = str(store.provenance.get("store_uuid", ""))
        if uuid != meta.store_uuid:
            raise EmbedpipeError(f"{loaded.path}: its store {path} is another store now (store_uuid {uuid}, indexed "
                                 f"{meta.store_uuid}); {REBUILD}")
        yield store


def _stored_rows(store: Store, loaded: LoadedIndex, ids: Sequence[str]) -> np.ndarray:
    """The vectors of ``ids`` the index holds: the store's rows of the index's layer and
    pooling, in the storage dtype, each checked against its row digest by the reader."""
    meta = loaded.meta
    rows = np.empty((len(ids), meta.dim), dtype=store.dtype)
    for i, record_id in enumerate(ids):
        try:
            rows[i] = store.mean_vector(record_id, meta.layer, pooling=meta.pooling)
        except UnknownIdError:
            reason = store.skipped.get(record_id)
            why = f"it was skipped when sharding ({reason})" if reason is not None else "no record or alias has it"
            raise EmbedpipeError(f"unknown ID {quote(record_id)}: not in the store {store.path} of the index "
                                 f"{loaded.path}: {why}") from None
    return rows


def _keep(hits: Sequence[str], scores: np.ndarray, exclude: Collection[str], groups: AliasGroups | None,
          k: int) -> tuple[tuple[str, ...], list[float], tuple[tuple[str, ...], ...]]:
    """The first ``k`` of ``hits`` not in ``exclude``; with ``groups``, one a group (its
    record's ID, at its best score)."""
    kept: list[str] = []
    kept_scores: list[float] = []
    named: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for hit, score in zip(hits, scores.tolist()):
        if len(kept) == k:
            break
        if hit in exclude:
            continue
        if groups is not None:
            record = groups.record(hit)
            if record in seen:
                continue
            seen.add(record)
            hit = record
            named.append(groups.group(record))
        kept.append(hit)
        kept_scores.append(score)
    return tuple(kept), kept_scores, tuple(named)


def filtered_search(loaded: LoadedIndex, queries: Sequence[str], vectors: np.ndarray, k: int,
                    exclude: Sequence[Collection[str]], groups: AliasGroups | None) -> Hits:
    """:func:`~embedpipe.neighbours.hits.search_index`'s ``k`` nearest, ``exclude[i]`` left
    out of query i's, and with ``groups`` one hit a group: the index is asked for ``k`` plus
    the most any query leaves out, and, where collapsing leaves a query fewer than ``k``, for
    twice as many again, until it holds no more rows."""
    check_k(k)
    rows = loaded.meta.rows
    want = min(rows, k + max((len(e) for e in exclude), default=0))
    while True:
        found = search_index(loaded, queries, vectors, max(1, want))
        kept = [_keep(found.hits[i], found.scores[i], exclude[i], groups, k) for i in range(len(queries))]
        if want >= rows or all(len(hits) == k for hits, _, _ in kept):
            break
        want = min(rows, 2 * want)
    scores = np.full((len(queries), max(1, min(k, rows))), np.nan, dtype=np.float32)
    for i, (_, values, _) in enumerate(kept):
        scores[i, : len(values)] = values
    return Hits(tuple(queries), tuple(hits for hits, _, _ in kept), scores, found.metric,
                None if groups is None else tuple(named for _, _, named in kept))


def stored_neighbours(loaded: LoadedIndex, ids: Sequence[str], k: int, *, include_self: bool = False,
                      collapse: bool = False) -> Hits:
    """The ``k`` nearest IDs in ``loaded`` to each of ``ids``, a record or alias of the index's
    store, searched with its stored vector (no model). Each ID's own alias group (its record
    and the record's aliases) is left out unless ``include_self``; ``collapse``: one hit a
    group. An unknown ID is one line naming it and the store."""
    check_k(k)
    ids = list(ids)
    if not ids:
        raise EmbedpipeError(f"{loaded.path}: no IDs to search with")
    for record_id in ids:
        if not isinstance(record_id, str) or not record_id:
            raise EmbedpipeError(f"IDs are non-empty text, not {quote(record_id)}")
    with indexed_store(loaded, "a search by stored IDs") as store:
        vectors = _stored_rows(store, loaded, ids)
        groups = AliasGroups.of_store(store)
    exclude: list[Collection[str]] = [() if include_self else set(groups.group(store_id)) for store_id in ids]
    return filtered_search(loaded, ids, vectors, k, exclude, groups if collapse else None)


def alias_groups(loaded: LoadedIndex) -> AliasGroups:
    """The alias groups of the index's store, to collapse hits by (the store checked as
    :func:`indexed_store` checks it): read before queries are embedded, so that a missing or
    changed store refuses the search first."""
    with indexed_store(loaded, "collapsing hits by alias group") as store:
        return AliasGroups.of_store(store)
