"""The neighbours of queries in an index, and their TSV (``query hit score rank``).

Why here and not in the API: the search of vectors already embedded is the index's business
(its kind, its metric, its IDs); the API only embeds the queries as the index says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedpipe.core.atomic import write_text_atomic
from embedpipe.core.errors import EmbedpipeError
from embedpipe.neighbours.build import unit_rows
from embedpipe.neighbours.index_file import LoadedIndex

__all__ = ["GROUPED_HEADER", "HEADER", "Hits", "check_k", "search_index"]

#: the TSV's header
HEADER = ("query", "hit", "score", "rank")
#: the TSV's header where hits are collapsed by alias group: ``group``, the group's IDs
GROUPED_HEADER = (*HEADER, "group")


@dataclass(frozen=True, eq=False)
class Hits:
    """Per query (``queries``: their IDs), its ``k`` nearest IDs (``hits``, best first) and their
    scores (cosine, or ``metric``): a (Q, k) float32 array, read-only; fewer than ``k`` hits where
    the index found fewer (HNSW may), the rest of their row of scores NaN.

    ``groups``, where hits were collapsed by alias group (one hit a group of IDs of one
    sequence, named by its stored record's ID): per query, per hit, the group's IDs (the
    record's first, then its aliases); None otherwise. Plain data that cannot be changed:
    tuples, and ``scores`` a read-only copy of the array given."""

    queries: tuple[str, ...]
    hits: tuple[tuple[str, ...], ...]
    scores: np.ndarray  # (Q, k) float32; NaN past a row's hits
    metric: str = "cosine"
    groups: tuple[tuple[tuple[str, ...], ...], ...] | None = None

    def __post_init__(self) -> None:
        scores = np.array(self.scores, copy=True)
        scores.flags.writeable = False
        object.__setattr__(self, "scores", scores)

    def rows(self) -> list[tuple[str, str, float, int]]:
        """(query, hit, score, rank) rows, rank from 1, in query order."""
        return [(q, hit, float(self.scores[i, r]), r + 1)
                for i, q in enumerate(self.queries) for r, hit in enumerate(self.hits[i])]

    def to_tsv(self) -> str:
        """The TSV: ``query hit score rank``, and ``group`` (the group's IDs, separated by spaces:
        an ID is one word) where hits were collapsed."""
        lines = [f"{q}\t{h}\t{s:.7g}\t{r}" for q, h, s, r in self.rows()]
        if self.groups is None:
            return "\n".join(["\t".join(HEADER), *lines]) + "\n"
        named = [" ".join(group) for per_query in self.groups for group in per_query]
        return "\n".join(["\t".join(GROUPED_HEADER), *(f"{line}\t{g}" for line, g in zip(lines, named))]) + "\n"

    def write_tsv(self, path: Path | str) -> Path:
        """The TSV, written atomically."""
        write_text_atomic(Path(path), self.to_tsv())
        return Path(path)


def check_k(k: object) -> None:
    """``k`` is a positive whole number, or one line saying so."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise EmbedpipeError(f"--k must be a positive whole number, not {k!r}")


def search_index(index: LoadedIndex, queries: Sequence[str], vectors: np.ndarray, k: int) -> Hits:
    """The ``k`` nearest rows of ``index`` (opened by
    :func:`~embedpipe.neighbours.index_file.open_index`) to each of ``vectors`` (rows of
    ``queries``; as the store holds them, in its storage dtype) by cosine; fewer when the index
    holds fewer rows, or finds fewer (FAISS's label -1: no hit, never an ID)."""
    check_k(k)
    meta, ids = index.meta, index.ids
    k = max(1, min(k, meta.rows))
    if meta.kind == "hnsw":
        index.index.hnsw.efSearch = max(index.index.hnsw.efSearch, k)
    scores, found = index.index.search(unit_rows(vectors), k)
    kept = (found >= 0) & (found < len(ids))
    hits = tuple(tuple(ids[int(j)] for j in row[ok]) for row, ok in zip(found, kept))
    packed = np.full(scores.shape, np.nan, dtype=np.float32)  # each row's scores first, as its hits
    for i, ok in enumerate(kept):
        packed[i, : int(ok.sum())] = scores[i, ok]
    return Hits(tuple(queries), hits, packed, meta.metric)
