"""Pure planning for the worker: long sequences cut into windows (the spans of the long-sequence
modes, core/long_sequences.py), pieces grouped into batches.

Kept free of torch (numpy only) so the invariants (windows within the trained length, every residue
covered exactly once when stitching, batches within budget) are cheap to test. The trained window
is the model's (``EmbeddingModel.trained_window``), passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from embedpipe.core.errors import InputError
from embedpipe.core.long_sequences import BY_NAME, EMBEDDING, NAMES, WITHIN_WINDOW
from embedpipe.model.layout import ESM2_LAYOUT, TokenLayout

DEFAULT_OVERLAP = 256


@dataclass(frozen=True)
class Piece:
    """One forward input: residues ``start:end`` of record ``record``, plus the special tokens
    of the model family's ``layout`` (ESM-2: BOS and EOS around every window).

    ``keep_start:keep_end`` (absolute residue positions) is the part of this window that is
    stitched into the record: each residue is taken from the window whose centre is nearest.
    """

    record: int
    start: int
    end: int
    keep_start: int
    keep_end: int
    layout: TokenLayout = ESM2_LAYOUT

    @property
    def residues(self) -> int:
        return self.end - self.start

    @property
    def tokens(self) -> int:
        return self.residues + self.layout.extra_tokens


def plan_record(record: int, length: int, mode: str, *, window: int,
                overlap: int = DEFAULT_OVERLAP, record_id: str = "",
                layout: TokenLayout = ESM2_LAYOUT) -> tuple[list[Piece], str]:
    """The pieces for one record and its ``long_handling``: within ``window`` (residues per
    forward, the model's trained window) one piece; over it, the spans the long-sequence
    ``mode`` cuts (core/long_sequences.py). ``layout``: the family's special tokens around
    each window."""
    if length <= window:
        return [Piece(record, 0, length, 0, length, layout)], WITHIN_WINDOW
    chosen = BY_NAME.get(mode)
    if chosen is None:
        raise InputError(f"--long-sequences must be one of {', '.join(NAMES)}, not {mode!r}")
    if chosen.spans is None or chosen.handling is None:
        raise InputError(
            f"record {record_id!r} has {length} residues, over the model's trained length of {window}; "
            f"use --long-sequences {', '.join(EMBEDDING[:-1])} or {EMBEDDING[-1]}"
        )
    return [Piece(record, *span, layout) for span in chosen.spans(length, window, overlap)], chosen.handling


BATCH_OVERHEAD_TOKENS = 256  # what one more forward call costs, in padded tokens (launches, Python)


def plan_batches(pieces: Sequence[Piece], tokens_per_batch: int,
                 overhead_tokens: int = BATCH_OVERHEAD_TOKENS) -> list[list[Piece]]:
    """Group pieces, longest first, into batches with batch size x longest piece <= the budget.

    The cut points minimise computed (padded) tokens plus ``overhead_tokens`` per batch,
    by dynamic programming over the length-sorted pieces: a greedy fill pads more when
    neighbouring lengths are far apart (typical of small shards and proteome tails).
    Longest first, so the largest shapes run first and memory trouble shows up at once.
    A piece longer than the budget runs alone.
    """
    ordered = sorted(pieces, key=lambda p: (-p.tokens, p.record, p.start))
    n = len(ordered)
    if n == 0:
        return []
    tokens = np.array([p.tokens for p in ordered], dtype=np.int64)
    best = np.zeros(n + 1, dtype=np.float64)
    cut = np.zeros(n + 1, dtype=np.int64)
    for end in range(1, n + 1):
        # a batch ordered[start:end] is padded to tokens[start] (the longest, sorted descending)
        widest = max(1, tokens_per_batch // int(tokens[end - 1]))
        starts = np.arange(max(0, end - widest), end)
        counts = end - starts
        feasible = (counts * tokens[starts] <= tokens_per_batch) | (counts == 1)
        costs = np.where(feasible, best[starts] + counts * tokens[starts] + overhead_tokens, np.inf)
        pick = int(np.argmin(costs))
        best[end] = costs[pick]
        cut[end] = starts[pick]
    batches: list[list[Piece]] = []
    end = n
    while end > 0:
        start = int(cut[end])
        batches.append(ordered[start:end])
        end = start
    batches.reverse()
    return batches


def plan_packed_batches(pieces: Sequence[Piece], tokens_per_batch: int) -> list[list[Piece]]:
    """Group pieces, longest first, into packed batches whose real tokens sum to at most the
    budget (a packed batch computes no padding, so only the sum counts: a greedy fill is
    optimal, and linear). A piece longer than the budget runs alone."""
    ordered = sorted(pieces, key=lambda p: (-p.tokens, p.record, p.start))
    batches: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for piece in ordered:
        if current and used + piece.tokens > tokens_per_batch:
            batches.append(current)
            current, used = [], 0
        current.append(piece)
        used += piece.tokens
    if current:
        batches.append(current)
    return batches


def padding_efficiency(batches: Sequence[Sequence[Piece]], packed: bool = False) -> float:
    """Real tokens / computed tokens (the padded batch area; packed batches compute no padding)."""
    if packed:
        return 1.0
    real = sum(p.tokens for b in batches for p in b)
    computed = sum(len(b) * max(p.tokens for p in b) for b in batches)
    return real / computed if computed else 1.0
