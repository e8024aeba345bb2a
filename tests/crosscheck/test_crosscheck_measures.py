"""The cross-check's per-record measures are registered once (embedpipe/crosscheck/measures.py):
compare, verdict and the report take their keys from the registry (issue 21)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from embedpipe.crosscheck import measures, metrics, verdict

PACKAGE = Path(measures.__file__).resolve().parent


def test_every_figure_the_metrics_compute_is_registered():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    assert [m.source for m in measures.POOLED] == list(metrics.compare_pooled(a[0], b[0]))
    assert [m.source for m in measures.RESIDUE] == list(metrics.compare_residues(a, b))
    assert len({m.key for m in measures.MEASURES}) == len(measures.MEASURES) == 9


def test_the_verdict_aggregates_every_registered_measure():
    rec = {m.key: float(i) for i, m in enumerate(measures.MEASURES)}
    assert set(verdict._metric_aggregates([rec])) >= {m.key for m in measures.MEASURES}


def test_a_non_finite_gating_measure_fails_the_record():
    from embedpipe.core.options import Thresholds

    good = {m.key: 1.0 for m in measures.MEASURES} | {"stored_finite": True}
    assert verdict.record_status(good, Thresholds(), 0.99) == "pass"
    for m in measures.MEASURES:
        status = verdict.record_status(good | {m.key: float("nan")}, Thresholds(), 0.99)
        assert status == ("fail" if m.must_be_finite else "pass"), m.key


def test_no_module_spells_the_measure_keys_by_hand():
    for name in ("compare.py", "verdict.py", "report/page.py"):
        text = (PACKAGE / name).read_text(encoding="utf-8")
        for m in measures.MEASURES:
            assert f'"{m.key}"' not in text, (name, m.key)
