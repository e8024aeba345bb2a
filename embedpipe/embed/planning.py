"""Pure planning for the worker: long sequences cut into windows, pieces grouped into batches.

Kept free of torch (numpy only) so the invariants (windows within the trained length, every residue
covered exactly once when stitching, batches within budget) are cheap to test. The trained window
is the model's (``EmbeddingModel.trained_window``), passed in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from embedpipe.core.errors import InputError
from embedpipe.core.options import LONG_SEQUENCE_MODES
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


def window_starts(length: int, window: int, overlap: int) -> list[int]:
    """Evenly spread window starts so consecutive windows overlap by at least ``overlap``."""
    if length <= window:
        return [0]
    stride = window - overlap
    count = math.ceil((length - window) / stride) + 1
    last = length - window
    return [round(i * last / (count - 1)) for i in range(count)]


def plan_record(record: int, length: int, mode: str, *, window: int,
                overlap: int = DEFAULT_OVERLAP, record_id: str = "",
                layout: TokenLayout = ESM2_LAYOUT) -> tuple[list[Piece], str]:
    """The pieces for one record and what happened to it (none, chunked, truncated, full);
    ``window``: residues per forward window (the model's trained window); ``layout``: the
    family's special tokens around each window. The overlap is at most half a window, so
    that windows advance for models with short windows."""
    if length <= window:
        return [Piece(record, 0, length, 0, length, layout)], "none"
    if mode == "full":
        return [Piece(record, 0, length, 0, length, layout)], "full"
    if mode == "truncate":
        return [Piece(record, 0, window, 0, window, layout)], "truncated"
    if mode == "error":
        raise InputError(
            f"record {record_id!r} has {length} residues, over the model's trained length of {window}; "
            "use --long-sequences chunk, truncate or full"
        )
    if mode != "chunk":
        raise InputError(f"--long-sequences must be one of {', '.join(LONG_SEQUENCE_MODES)}, not {mode!r}")
    starts = window_starts(length, window, min(overlap, window // 2))
    centres = [s + window / 2 for s in starts]
    pieces = []
    for i, start in enumerate(starts):
        keep_start = 0 if i == 0 else math.floor((centres[i - 1] + centres[i]) / 2)
        keep_end = length if i == len(starts) - 1 else math.floor((centres[i] + centres[i + 1]) / 2)
        pieces.append(Piece(record, start, start + window, keep_start, keep_end, layout))
    return pieces, "chunked"


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
