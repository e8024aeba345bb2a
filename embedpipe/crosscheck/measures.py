"""The per-record measures of the cross-check, defined once (docs/crosscheck.md, "Metrics").

Each is a key of a record in ``crosscheck.json``: computed by :mod:`embedpipe.crosscheck.compare`
from the ``source`` figure of ``metrics.compare_pooled`` or ``metrics.compare_residues``,
aggregated per layer by :mod:`embedpipe.crosscheck.verdict`, and shown in the report's tables
that its entry names. A new measure is one entry here and its figure in ``metrics.py``; the
rules that judge a record by a measure stay in ``verdict.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: (aggregate statistic, the report's column heading): one column of a summary table
Shown = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Measure:
    """``key`` in a record; ``scope`` pooled or residue (only with per-residue vectors);
    ``source`` its name in the metrics function's dict; ``must_be_finite``: a non-finite value
    fails the record; ``cosine``: shown with the cosine format. The report's tables it appears
    in: ``column``, its heading in the worst-records table; ``per_layer`` and ``per_length_bin``,
    the aggregate statistics shown per stored layer and per length bin (a measure with
    ``per_length_bin`` is also aggregated per bin in ``crosscheck.json``)."""

    key: str
    scope: str
    source: str
    must_be_finite: bool = False
    column: str | None = None
    cosine: bool = False
    per_layer: Shown = ()
    per_length_bin: Shown = ()


MEASURES: tuple[Measure, ...] = (
    Measure("pooled_cosine", "pooled", "cosine", must_be_finite=True, column="pooled cos", cosine=True,
            per_layer=(("min", "min cos"), ("p1", "p1 cos"), ("p5", "p5 cos"), ("median", "median cos"),
                       ("max", "max cos")),
            per_length_bin=(("min", "min cos"), ("median", "median cos"))),
    Measure("pooled_max_abs_diff", "pooled", "max_abs_diff", must_be_finite=True, column="max |diff|",
            per_layer=(("max", "max |diff|"),), per_length_bin=(("max", "max |diff|"),)),
    Measure("pooled_mean_abs_diff", "pooled", "mean_abs_diff"),
    Measure("pooled_rel_l2", "pooled", "rel_l2", must_be_finite=True, column="rel L2",
            per_layer=(("median", "median rel L2"), ("max", "max rel L2")),
            per_length_bin=(("median", "median rel L2"), ("max", "max rel L2"))),
    Measure("residue_min_cosine", "residue", "min_cosine", must_be_finite=True, column="min residue cos", cosine=True,
            per_layer=(("min", "min residue cos"),)),
    Measure("residue_mean_cosine", "residue", "mean_cosine", cosine=True),
    Measure("residue_max_abs_diff", "residue", "max_abs_diff", must_be_finite=True),
    Measure("residue_mean_abs_diff", "residue", "mean_abs_diff"),
    Measure("residue_rel_l2", "residue", "rel_l2"),
)
BY_KEY: dict[str, Measure] = {m.key: m for m in MEASURES}
POOLED: tuple[Measure, ...] = tuple(m for m in MEASURES if m.scope == "pooled")
RESIDUE: tuple[Measure, ...] = tuple(m for m in MEASURES if m.scope == "residue")


def key(name: str) -> str:
    """The key of the registered measure ``name``: a rule or card that names a measure fails
    at import when the entry is gone, not at the first cross-check."""
    return BY_KEY[name].key


#: the measures the verdict's rules and the report's verdict cards name, looked up by name
POOLED_COSINE = key("pooled_cosine")
POOLED_MAX_ABS_DIFF = key("pooled_max_abs_diff")
RESIDUE_MIN_COSINE = key("residue_min_cosine")


def _in_scope(m: Measure, per_residue: bool) -> bool:
    return per_residue or m.scope == "pooled"


def shown(per_residue: bool) -> tuple[Measure, ...]:
    """The measures the report's worst-records table shows, in order."""
    return tuple(m for m in MEASURES if m.column and _in_scope(m, per_residue))


def per_layer_columns(scope: str) -> tuple[tuple[Measure, str, str], ...]:
    """(measure, statistic, heading) of the per-layer table's columns of ``scope``, in order."""
    return tuple((m, stat, heading) for m in MEASURES if m.scope == scope for stat, heading in m.per_layer)


def per_length_bin_columns() -> tuple[tuple[Measure, str, str], ...]:
    """(measure, statistic, heading) of the length-bin table's columns, in order."""
    return tuple((m, stat, heading) for m in MEASURES for stat, heading in m.per_length_bin)


def binned() -> tuple[Measure, ...]:
    """The measures aggregated per length bin (those the length-bin table shows)."""
    return tuple(m for m in MEASURES if m.per_length_bin)
