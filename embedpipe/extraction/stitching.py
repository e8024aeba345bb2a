"""Window stitching: a record assembled from the results of its pieces.

Batches finish in any order and a long record's windows may sit in different batches, so the
pieces of each record are collected until the last arrives (:class:`Assemblies`); then the
record's mean is the residue-weighted mean of its windows' kept residues, its per-residue rows
are the kept rows in residue order, and its BOS is the one of the window that starts at residue
0 (docs/store-format.md). Which residues a window keeps is decided by the planner
(:func:`embedpipe.extraction.planning.plan_record`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from embedpipe.extraction.planning import Piece
from embedpipe.store import EmbeddedRecord


@dataclass
class PieceResult:
    """One piece's outputs on the host, and the largest values its checks look at."""

    sums: dict[int, np.ndarray]  # layer -> (D,) float32 sum over the kept residues
    residues: dict[int, np.ndarray] | None  # layer -> (keep_len, D) float32, when needed
    max_abs: float
    stored_max: float  # largest |value| over the stored outputs (NaN/inf propagate)
    bos: dict[int, np.ndarray] | None = None  # layer -> (D,) float32 at BOS, for a first window with bos pooling


Results = list[tuple[Piece, PieceResult]]


@dataclass
class _Assembly:
    """A record whose pieces are being collected."""

    pieces_left: int
    results: Results = field(default_factory=list)


class Assemblies:
    """The records of a run whose pieces are still arriving."""

    def __init__(self, batches: Iterable[Sequence[Piece]]) -> None:
        counts = Counter(piece.record for batch in batches for piece in batch)
        self._pending = {record: _Assembly(pieces_left=n) for record, n in counts.items()}

    def add(self, piece: Piece, result: PieceResult) -> Results | None:
        """Collect one piece's result; the record's results once its last piece arrived, else None."""
        assembly = self._pending[piece.record]
        assembly.results.append((piece, result))
        assembly.pieces_left -= 1
        if assembly.pieces_left:
            return None
        del self._pending[piece.record]
        return assembly.results


def _residues(result: PieceResult) -> dict[int, np.ndarray]:
    """A piece's per-residue rows, which every piece has when per-residue output is on."""
    if result.residues is None:
        raise AssertionError("per-residue output is on but a piece came back without its rows")
    return result.residues


def stitch(rid: str, seq: str, results: Results, how: str, layers: Sequence[int], *,
           per_residue: bool, bos: bool, precision: str) -> EmbeddedRecord:
    """The record ``rid`` from its pieces' results (any order), its ``long_handling`` ``how``."""
    results = sorted(results, key=lambda item: item[0].keep_start)
    embedded = sum(p.keep_end - p.keep_start for p, _ in results)
    mean = {}
    for layer in layers:
        total = np.sum([res.sums[layer] for _, res in results], axis=0, dtype=np.float64)
        mean[layer] = (total / embedded).astype(np.float32)
    rows = None
    if per_residue:
        rows = {layer: np.concatenate([_residues(res)[layer] for _, res in results], axis=0) for layer in layers}
    # BOS: the hidden state at token 0 of the window that starts at residue 0 (docs/store-format.md)
    first = results[0][1]
    return EmbeddedRecord(
        id=rid,
        sequence=seq,
        precision_used=precision,
        mean=mean,
        per_residue=rows,
        bos=first.bos if bos else None,
        long_handling=how,
        embedded_length=embedded,
        windows=len(results),
    )
