"""The per-record measures of the cross-check, defined once (docs/crosscheck.md, "Metrics").

Each is a key of a record in ``crosscheck.json``: computed by :mod:`embedpipe.crosscheck.compare`
from the ``source`` figure of ``metrics.compare_pooled`` or ``metrics.compare_residues``,
aggregated per layer by :mod:`embedpipe.crosscheck.verdict`, and shown by the report when it
has a ``column``. A new measure is one entry here and its figure in ``metrics.py``; the rules
that judge a record by a measure stay in ``verdict.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measure:
    """``key`` in a record; ``scope`` pooled or residue (only with per-residue vectors);
    ``source`` its name in the metrics function's dict; ``must_be_finite``: a non-finite value
    fails the record; ``column``: the report's heading in the worst-records table (or none);
    ``cosine``: shown with the cosine format."""

    key: str
    scope: str
    source: str
    must_be_finite: bool = False
    column: str | None = None
    cosine: bool = False


MEASURES: tuple[Measure, ...] = (
    Measure("pooled_cosine", "pooled", "cosine", must_be_finite=True, column="pooled cos", cosine=True),
    Measure("pooled_max_abs_diff", "pooled", "max_abs_diff", must_be_finite=True, column="max |diff|"),
    Measure("pooled_mean_abs_diff", "pooled", "mean_abs_diff"),
    Measure("pooled_rel_l2", "pooled", "rel_l2", must_be_finite=True, column="rel L2"),
    Measure("residue_min_cosine", "residue", "min_cosine", must_be_finite=True, column="min residue cos", cosine=True),
    Measure("residue_mean_cosine", "residue", "mean_cosine", cosine=True),
    Measure("residue_max_abs_diff", "residue", "max_abs_diff", must_be_finite=True),
    Measure("residue_mean_abs_diff", "residue", "mean_abs_diff"),
    Measure("residue_rel_l2", "residue", "rel_l2"),
)
POOLED: tuple[Measure, ...] = tuple(m for m in MEASURES if m.scope == "pooled")
RESIDUE: tuple[Measure, ...] = tuple(m for m in MEASURES if m.scope == "residue")
#: the measures the verdict's rules and the report's summary tables name (from the entries above)
POOLED_COSINE, POOLED_MAX_ABS_DIFF, _, POOLED_REL_L2 = (m.key for m in POOLED)
RESIDUE_MIN_COSINE = RESIDUE[0].key


def shown(per_residue: bool) -> tuple[Measure, ...]:
    """The measures the report's worst-records table shows, in order."""
    return tuple(m for m in MEASURES if m.column and (per_residue or m.scope == "pooled"))
