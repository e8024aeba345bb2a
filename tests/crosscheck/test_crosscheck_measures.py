"""The cross-check's per-record measures are registered once (embedpipe/crosscheck/measures.py):
compare, verdict and the report take their keys from the registry (issue 21)."""

from __future__ import annotations

import html
import re
import sys
import types
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


def test_a_fifth_pooled_measure_imports_and_the_named_measures_keep_their_keys(monkeypatch):
    source = (PACKAGE / "measures.py").read_text(encoding="utf-8")
    entry = '    Measure("pooled_mean_abs_diff", "pooled", "mean_abs_diff"),\n'
    assert entry in source
    extended = source.replace(entry, entry + '    Measure("pooled_l1", "pooled", "l1", per_layer=(("max", "max L1"),)),\n')
    module = types.ModuleType("measures_with_a_fifth")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look their module up
    exec(compile(extended, module.__name__, "exec"), module.__dict__)  # noqa: S102 - the module's own source
    namespace = module.__dict__
    assert [m.key for m in namespace["POOLED"]][3] == "pooled_l1" and len(namespace["POOLED"]) == 5
    assert (namespace["POOLED_COSINE"], namespace["POOLED_MAX_ABS_DIFF"], namespace["RESIDUE_MIN_COSINE"]) == (
        "pooled_cosine", "pooled_max_abs_diff", "residue_min_cosine")


def _summary_data(per_residue: bool) -> dict:
    stats = {"min": 0.25, "p1": 0.5, "p5": 0.75, "median": 1.5, "max": 2.5}
    entry = {m.key: dict(stats) for m in measures.MEASURES} | {
        "n": 3, "fraction_above_pass": {"count": 2, "n": 3, "ci95": [0.1, 0.9]}, "status": {"pass": 3},
        "by_length_bin": [{"bin": 0, "min_length": 5, "max_length": 9, "n": 3,
                           **{m.key: dict(stats) for m in measures.binned()}}]}
    return {"neighbours": {"k": 0}, "store": {"per_residue": per_residue, "layers": [4]},
            "summary": {"layers": {"4": entry}}, "length_bins": [{"records": 7, "closed_right": True}]}


def test_the_report_tables_take_their_columns_from_the_registry(monkeypatch):
    from embedpipe.crosscheck.report import page

    def headings(html: str) -> list[str]:
        return re.findall(r"<th[^>]*>([^<]*)</th>", html)

    want = ["layer", "n", "min cos", "p1 cos", "p5 cos", "median cos", "max cos", "max |diff|", "median rel L2",
            "max rel L2", "cos >= pass, 95% CI", "min residue cos", "pass / warn / fail"]
    assert [html.unescape(h) for h in headings(page._layer_table(_summary_data(True)))] == want
    assert "min residue cos" not in headings(page._layer_table(_summary_data(False)))
    extra = measures.Measure("pooled_l1", "pooled", "l1", per_layer=(("max", "max L1"),),
                             per_length_bin=(("min", "min L1"),))
    monkeypatch.setattr(measures, "MEASURES", (*measures.MEASURES, extra))
    data = _summary_data(False)
    layer_html, bin_html = page._layer_table(data), page._length_bin_table(data)
    assert headings(layer_html)[headings(layer_html).index("max rel L2") + 1] == "max L1"
    assert headings(bin_html)[-1] == "min L1" and bin_html.count("<td") == 4 + 6  # 4 fixed cells, 5 registered stats and L1
