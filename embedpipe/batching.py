"""Pure planning for the worker: long-sequence windows and token-budget batches.

Kept free of torch so the invariants (windows within the trained length, every residue
covered exactly once when stitching, batches within budget) are cheap to test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from embedpipe.errors import InputError

TRAINED_RESIDUES = 1022  # ESM-2 was trained on 1024 tokens: 1022 residues plus BOS and EOS
DEFAULT_OVERLAP = 256
LONG_SEQUENCE_MODES = ("chunk", "truncate", "error", "full")


@dataclass(frozen=True)
class Piece:
    """One forward input: residues ``start:end`` of record ``record``.

    ``keep_start:keep_end`` (absolute residue positions) is the part of this window that is
    stitched into the record: each residue is taken from the window whose centre is nearest.
    """

    record: int
    start: int
    end: int
    keep_start: int
    keep_end: int

    @property
    def residues(self) -> int:
        return self.end - self.start

    @property
    def tokens(self) -> int:
        return self.residues + 2


def window_starts(length: int, window: int, overlap: int) -> list[int]:
    """Evenly spread window starts so consecutive windows overlap by at least ``overlap``."""
    if length <= window:
        return [0]
    stride = window - overlap
    count = math.ceil((length - window) / stride) + 1
    last = length - window
    return [round(i * last / (count - 1)) for i in range(count)]


def plan_record(record: int, length: int, mode: str, *, window: int = TRAINED_RESIDUES,
                overlap: int = DEFAULT_OVERLAP, record_id: str = "") -> tuple[list[Piece], str]:
    """The pieces for one record and what happened to it (none, chunked, truncated, full)."""
    if length <= window:
        return [Piece(record, 0, length, 0, length)], "none"
    if mode == "full":
        return [Piece(record, 0, length, 0, length)], "full"
    if mode == "truncate":
        return [Piece(record, 0, window, 0, window)], "truncated"
    if mode == "error":
        raise InputError(
            f"record {record_id!r} has {length} residues, over ESM-2's trained length of {window}; "
            "use --long-sequences chunk, truncate or full"
        )
    if mode != "chunk":
        raise InputError(f"--long-sequences must be one of {', '.join(LONG_SEQUENCE_MODES)}, not {mode!r}")
    starts = window_starts(length, window, overlap)
    centres = [s + window / 2 for s in starts]
    pieces = []
    for i, start in enumerate(starts):
        keep_start = 0 if i == 0 else math.floor((centres[i - 1] + centres[i]) / 2)
        keep_end = length if i == len(starts) - 1 else math.floor((centres[i] + centres[i + 1]) / 2)
        pieces.append(Piece(record, start, start + window, keep_start, keep_end))
    return pieces, "chunked"


def plan_batches(pieces: Sequence[Piece], tokens_per_batch: int) -> list[list[Piece]]:
    """Group pieces, longest first, so that batch size x longest piece <= the token budget.

    Longest first: the largest batch shapes run first, so memory trouble shows up at once.
    A piece longer than the budget runs alone.
    """
    ordered = sorted(pieces, key=lambda p: (-p.tokens, p.record, p.start))
    batches: list[list[Piece]] = []
    current: list[Piece] = []
    for piece in ordered:
        longest = current[0].tokens if current else piece.tokens
        if current and (len(current) + 1) * longest > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(piece)
    if current:
        batches.append(current)
    return batches


def padding_efficiency(batches: Sequence[Sequence[Piece]]) -> float:
    """Real tokens / computed tokens (padded batch area)."""
    real = sum(p.tokens for b in batches for p in b)
    computed = sum(len(b) * max(p.tokens for p in b) for b in batches)
    return real / computed if computed else 1.0
