"""Which records the cross-check re-embeds: the risky ones always, besides a seeded random sample.

A random sample of a large store rarely holds the records where half precision goes wrong:
the longest ones, those over the model's window (chunked and stitched, truncated, or
embedded whole past it) and those whose output held NaN or inf and were re-run in fp32.
:func:`select` takes, from the candidate rows (every record; with ``--labels`` the
labelled ones; after ``embed --reuse`` the computed ones):

* the :data:`LONGEST` longest records (``longest``);
* up to :data:`LONG_HANDLED` records over the window, chosen by their ``long_handling``
  (``chunked``, ``truncated``, ``full``);
* up to :data:`FALLBACK` records re-run in fp32 (a ``fallback_reason``: ``fp32 fallback``);
* and the random sample the caller drew as before (length-stratified, or class-stratified
  with labels), unchanged: the same seed gives the same random rows, whatever else is added.

A group larger than its bound is spread evenly over its lengths (by length rank, its
shortest and longest record included), so the choice is deterministic and does not depend
on the seed. A record chosen by several rules is one record with every reason
(``chosen_because``). The sample holds at most ``--sample`` + :data:`MAX_RISK` records,
however large the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from embedpipe.core.long_sequences import HANDLING, WITHIN_WINDOW

__all__ = ["FALLBACK", "LONGEST", "LONG_HANDLED", "LONG_RULE", "MAX_RISK", "REASON_FALLBACK", "REASON_LONGEST", "Selection",
           "select"]

#: the longest records always sampled: long-range precision loss grows with length
LONGEST = 4
#: at most this many records over the model's window (chunked, truncated or embedded whole)
#: always sampled: stitching and truncation live there
LONG_HANDLED = 16
#: at most this many records re-run in fp32 (their output held NaN or inf) always sampled
FALLBACK = 16
#: the most records the rules add to the random sample, whatever the store's size
MAX_RISK = LONGEST + LONG_HANDLED + FALLBACK

REASON_LONGEST = "longest"
REASON_FALLBACK = "fp32 fallback"
#: the ``long_handling`` values of records over the window, each its own reason
LONG_REASONS = tuple(h for h in HANDLING if h != WITHIN_WINDOW)
#: the long-handling rule's name in the report's rules (a record's reason is its own handling)
LONG_RULE = " / ".join(LONG_REASONS)


@dataclass(frozen=True)
class Selection:
    """The sampled rows (ascending), why each was chosen, what each rule found, and how many
    sampled records each reason holds."""

    rows: np.ndarray
    chosen_because: list[list[str]]
    rules: list[dict[str, Any]]
    counts: dict[str, int]  # sampled records per reason, in rule order


def _spread(rows: np.ndarray, lengths: np.ndarray, bound: int) -> np.ndarray:
    """``rows`` when at most ``bound``; else ``bound`` of them evenly spaced by length rank
    (ties by row), the shortest and the longest included."""
    if rows.size <= bound:
        return rows
    order = rows[np.lexsort((rows, lengths[rows]))]
    picks = np.round(np.linspace(0, rows.size - 1, bound)).astype(np.int64)
    return np.sort(order[picks])


def _longest(rows: np.ndarray, lengths: np.ndarray, bound: int) -> np.ndarray:
    """The ``bound`` longest of ``rows`` (ties: the lower row); only the records at least as
    long as the ``bound``-th longest are sorted, not the whole store."""
    if rows.size > bound:
        cut = np.partition(lengths[rows], rows.size - bound)[rows.size - bound]
        rows = rows[lengths[rows] >= cut]
    return np.sort(rows[np.lexsort((rows, -lengths[rows]))][:bound])


def select(lengths: np.ndarray, long_handling: np.ndarray, fallback_reason: np.ndarray, random_rows: np.ndarray,
           *, random_reason: str, random_rule: str, sample: int, candidates: np.ndarray | None = None) -> Selection:
    """The sample: the risky candidate rows (rules above) and ``random_rows``, each row with
    its reasons in rule order; ``lengths``, ``long_handling`` and ``fallback_reason`` hold
    every record of the store, ``random_rows`` what the random draw (``random_reason``, its
    rule ``random_rule``, of ``sample`` records) chose."""
    lengths = np.asarray(lengths, dtype=np.int64)
    pool = np.arange(lengths.size, dtype=np.int64) if candidates is None else np.asarray(candidates, dtype=np.int64)
    handling = np.asarray(long_handling, dtype=object)[pool]
    long_rows = pool[np.isin(handling, LONG_REASONS)]
    fallback_rows = pool[np.asarray(fallback_reason, dtype=object)[pool] != ""]
    picked = [
        (REASON_LONGEST, _longest(pool, lengths, LONGEST), pool.size, LONGEST,
         f"the {LONGEST} longest records"),
        (LONG_RULE, _spread(long_rows, lengths, LONG_HANDLED), long_rows.size, LONG_HANDLED,
         f"records over the model's window ({', '.join(LONG_REASONS)}): all, or {LONG_HANDLED} spread over their "
         "lengths"),
        (REASON_FALLBACK, _spread(fallback_rows, lengths, FALLBACK), fallback_rows.size, FALLBACK,
         f"records re-run in fp32 (their output held NaN or inf): all, or {FALLBACK} spread over their lengths"),
        (random_reason, np.asarray(random_rows, dtype=np.int64), pool.size, sample, random_rule),
    ]
    why: dict[int, list[str]] = {}
    for name, rows, _, _, _ in picked:
        for row in rows.tolist():
            reason = str(long_handling[row]) if name == LONG_RULE else name
            why.setdefault(row, []).append(reason)
    rows = np.array(sorted(why), dtype=np.int64)
    rules = [{"reason": name, "rule": rule, "bound": int(bound), "eligible": int(eligible), "chosen": int(chosen.size)}
             for name, chosen, eligible, bound, rule in picked]
    order = [REASON_LONGEST, *LONG_REASONS, REASON_FALLBACK, random_reason]
    counts = {reason: sum(reason in w for w in why.values()) for reason in order}
    return Selection(rows=rows, chosen_because=[why[r] for r in rows.tolist()], rules=rules,
                     counts={reason: n for reason, n in counts.items() if n})
