"""Batch planning: every piece once, within budget, less padding than a greedy fill."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from embedpipe.extraction.planning import Piece, padding_efficiency, plan_batches, plan_packed_batches


def _pieces(lengths):
    return [Piece(i, 0, n, 0, n) for i, n in enumerate(lengths)]


def _greedy(pieces, budget):
    ordered = sorted(pieces, key=lambda p: -p.tokens)
    batches, current = [], []
    for piece in ordered:
        if current and (len(current) + 1) * current[0].tokens > budget:
            batches.append(current)
            current = []
        current.append(piece)
    return batches + ([current] if current else [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=120), st.integers(3, 20000))
def test_batches_partition_pieces_within_budget(lengths, budget):
    pieces = _pieces(lengths)
    batches = plan_batches(pieces, budget)
    seen = sorted(p.record for b in batches for p in b)
    assert seen == list(range(len(lengths)))
    for batch in batches:
        longest = max(p.tokens for p in batch)
        assert len(batch) == 1 or len(batch) * longest <= budget
        assert batch[0].tokens == longest  # longest first inside a batch
    firsts = [b[0].tokens for b in batches]
    assert firsts == sorted(firsts, reverse=True)  # longest batches first


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(20, 1500), min_size=2, max_size=150))
def test_dynamic_cuts_pad_no_more_than_greedy_at_equal_or_fewer_batches_cost(lengths):
    pieces = _pieces(lengths)
    planned = plan_batches(pieces, 4096, overhead_tokens=256)
    greedy = _greedy(pieces, 4096)

    def cost(batches):
        return sum(len(b) * b[0].tokens + 256 for b in batches)

    assert cost(planned) <= cost(greedy)


def test_padding_efficiency_on_the_bundled_example_lengths():
    from pathlib import Path

    from embedpipe.inputs.fasta import read_sequences

    example = Path(__file__).resolve().parents[2] / "examples" / "swissprot100.fasta"
    lengths = [min(len(s), 1022) for _, s in read_sequences(example)]
    pieces = _pieces(lengths)
    planned = padding_efficiency(plan_batches(pieces, 4096))
    greedy = padding_efficiency(_greedy(pieces, 4096))
    assert planned >= 0.95 and planned > greedy, (planned, greedy)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=120), st.integers(3, 20000))
def test_packed_batches_partition_pieces_by_real_tokens(lengths, budget):
    """Packed batches count real tokens only: each fills the budget as far as the next piece
    allows (fewest batches for the longest-first order), and none is over budget unless alone."""
    pieces = _pieces(lengths)
    batches = plan_packed_batches(pieces, budget)
    assert sorted(p.record for b in batches for p in b) == list(range(len(lengths)))
    order = [p.tokens for b in batches for p in b]
    assert order == sorted(order, reverse=True)
    for index, batch in enumerate(batches):
        total = sum(p.tokens for p in batch)
        assert len(batch) == 1 or total <= budget
        if index + 1 < len(batches):
            assert total + batches[index + 1][0].tokens > budget  # the next piece did not fit
    assert padding_efficiency(batches, packed=True) == 1.0
    assert len(batches) <= len(plan_batches(pieces, budget))
