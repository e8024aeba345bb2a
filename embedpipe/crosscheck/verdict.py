"""The cross-check's judgement: per-record status, aggregates, the verdict and its reasons.

Pure functions over the per-record comparison dicts that :mod:`embedpipe.crosscheck.compare`
builds; the rules are documented in docs/crosscheck.md ("Verdict").
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from embedpipe.core.options import Thresholds
from embedpipe.crosscheck.downstream import downstream_rules
from embedpipe.crosscheck.formatting import format_cosine
from embedpipe.crosscheck.measures import MEASURES, POOLED_COSINE, RESIDUE_MIN_COSINE, binned
from embedpipe.crosscheck.metrics import aggregate, is_finite_number, wilson_interval

__all__ = ["VERDICTS", "applied_rules", "decide_verdict", "judge", "record_status", "store_figures", "summarise"]

#: verdicts, best first
VERDICTS = ("pass", "warn", "fail")


def judge(records: list[dict], layers: list[int], bins: list[dict], t: Thresholds, pass_cos: float, k: int,
          problems: list[str], model_info: dict,
          downstream: dict | None = None) -> tuple[dict[str, Any], str, list[str]]:
    """Set each record's ``status``; return the summary, the verdict and its reasons."""
    for rec in records:
        rec["status"] = record_status(rec, t, pass_cos)
    summary = summarise(records, layers, bins, pass_cos, k)
    verdict, reasons = decide_verdict(summary, records, t, pass_cos, k, problems, model_info, downstream)
    return summary, verdict, reasons


def record_status(rec: dict, t: Thresholds, pass_cos: float) -> str:
    """pass, warn or fail for one record and layer (docs/crosscheck.md, "Verdict")."""
    values = [rec[m.key] for m in MEASURES if m.must_be_finite and (m.scope == "pooled" or RESIDUE_MIN_COSINE in rec)]
    if not rec.get("stored_finite", True) or not all(is_finite_number(v) for v in values):
        return "fail"
    if rec[POOLED_COSINE] < t.fail_cosine:
        return "fail"
    if rec[POOLED_COSINE] < pass_cos:
        return "warn"
    if RESIDUE_MIN_COSINE in rec and rec[RESIDUE_MIN_COSINE] < t.residue_cosine:
        return "warn"
    return "pass"


_METRICS = tuple(m.key for m in MEASURES)


def _metric_aggregates(recs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in _METRICS:
        values = [r[metric] for r in recs if metric in r]
        if values:
            out[metric] = aggregate(values)
    overlaps = [r["overlap_at_k"] for r in recs if r.get("overlap_at_k") is not None]
    out["overlap"] = aggregate(overlaps)
    return out


def summarise(records: list[dict], layers: list[int], bins: list[dict], pass_cos: float, k: int) -> dict[str, Any]:
    """Aggregates per layer (overall, per length bin, per precision used) and over all records."""
    per_layer: dict[str, Any] = {}
    for layer in layers:
        recs = [r for r in records if r["layer"] == layer]
        n = len(recs)
        above = sum(1 for r in recs if is_finite_number(r[POOLED_COSINE]) and r[POOLED_COSINE] >= pass_cos)
        lo, hi = wilson_interval(above, n)
        entry = _metric_aggregates(recs)
        entry["n"] = n
        entry["fraction_above_pass"] = {
            "threshold": pass_cos, "count": above, "n": n, "fraction": above / n if n else None,
            "ci95": [lo, hi], "method": "Wilson score interval, 95%",
        }
        if k > 0:
            hist = Counter(round(r["overlap_at_k"] * k) for r in recs if r.get("overlap_at_k") is not None)
            entry["overlap_histogram"] = {str(j): hist.get(j, 0) for j in range(k + 1)}
        entry["status"] = dict(Counter(r["status"] for r in recs))
        entry["by_length_bin"] = []
        for b in bins:
            in_bin = [r for r in recs if r["length_bin"] == b["bin"]]
            entry["by_length_bin"].append({
                "bin": b["bin"], "min_length": b["min_length"], "max_length": b["max_length"], "n": len(in_bin),
                **{m.key: aggregate([r[m.key] for r in in_bin]) for m in binned()},
            })
        entry["by_precision_used"] = {
            used: aggregate([r[POOLED_COSINE] for r in recs if r["precision_used"] == used])
            for used in sorted({r["precision_used"] for r in recs})
        }
        per_layer[str(layer)] = entry
    overall = _metric_aggregates(records)
    above = sum(1 for r in records if is_finite_number(r[POOLED_COSINE]) and r[POOLED_COSINE] >= pass_cos)
    lo, hi = wilson_interval(above, len(records))
    overall["fraction_above_pass"] = {
        "threshold": pass_cos, "count": above, "n": len(records),
        "fraction": above / len(records) if records else None, "ci95": [lo, hi],
        "method": "Wilson score interval, 95% (record-layer pairs)",
    }
    overall["status"] = dict(Counter(r["status"] for r in records))
    return {"layers": per_layer, "overall": overall}


def decide_verdict(summary: dict, records: list[dict], t: Thresholds, pass_cos: float, k: int, problems: list[str],
                   model_info: dict, downstream: dict | None = None) -> tuple[str, list[str]]:
    """The worst verdict over problems, layers, records and the downstream rule, with one
    reason per rule that fired; a pass names every rule that was applied."""
    fired: list[tuple[int, str]] = [(2, problem) for problem in problems]
    for layer, entry in summary["layers"].items():
        fired += _layer_rules(layer, entry, [r for r in records if str(r["layer"]) == layer], t, pass_cos, k)
    if downstream:
        fired += downstream_rules(downstream, t.downstream_tolerance)
    if model_info.get("expected_sha256") and not model_info.get("sha256_matches"):
        fired.append((1, "the reference model is not the store's model (sha256 mismatch, --allow-model-mismatch)"))
    if not fired:
        per_residue = any(RESIDUE_MIN_COSINE in r for r in records)
        return VERDICTS[0], [f"pass: {'; '.join(applied_rules(t, pass_cos, k, per_residue, downstream))}"]
    level = max(new for new, _ in fired)
    return VERDICTS[level], [f"{VERDICTS[new]}: {reason}" for new, reason in fired]


def _layer_rules(layer: str, entry: dict, recs: list[dict], t: Thresholds, pass_cos: float,
                 k: int) -> list[tuple[int, str]]:
    """(level, reason) for each geometric rule one stored layer breaks."""
    fired: list[tuple[int, str]] = []
    nonfinite = [r["id"] for r in recs if r["status"] == "fail" and not _all_finite(r)]
    if nonfinite:
        fired.append((2, f"layer {layer}: non-finite values for {len(nonfinite)} record(s) ({', '.join(nonfinite[:5])})"))
    cos = entry[POOLED_COSINE]
    if cos["min"] is not None and cos["min"] < pass_cos:
        bound, level = (t.fail_cosine, 2) if cos["min"] < t.fail_cosine else (pass_cos, 1)
        low = sum(1 for r in recs if is_finite_number(r[POOLED_COSINE]) and r[POOLED_COSINE] < bound)
        fired.append((level, f"layer {layer}: {low} record(s) with pooled cosine below {bound} "
                             f"(min {format_cosine(cos['min'])})"))
    res = entry.get(RESIDUE_MIN_COSINE)
    if res and res["min"] is not None and res["min"] < t.residue_cosine:
        fired.append((1, f"layer {layer}: per-residue cosine down to {format_cosine(res['min'])} "
                         f"(below {t.residue_cosine})"))
    ov = entry["overlap"]
    if k > 0 and ov["median"] is not None and ov["median"] < t.pass_overlap:
        fired.append((1, f"layer {layer}: median overlap@{k} {ov['median']:.3f} below {t.pass_overlap}"))
    return fired


def applied_rules(t: Thresholds, pass_cos: float, k: int, per_residue: bool, downstream: dict | None) -> list[str]:
    """Every rule a pass had to meet, in the order docs/crosscheck.md ("Verdict") lists them."""
    rules = [f"every sampled pooled cosine >= {pass_cos} in every stored layer"]
    if per_residue:
        rules.append(f"every sampled residue's cosine >= {t.residue_cosine}")
    if k > 0:
        rules.append(f"median overlap@{k} >= {t.pass_overlap} in every layer")
    if downstream:
        rules.append(f"the 95% interval of the {downstream['score']} difference on your labels (stored - fp32) "
                     f"within ±{t.downstream_tolerance:g} in every layer")
    rules += ["all values finite", "the store and the fp32 re-run embedded the same residues"]
    return rules


def _all_finite(rec: dict) -> bool:
    return rec.get("stored_finite", True) and all(is_finite_number(rec[m]) for m in _METRICS if m in rec)


def store_figures(table: dict[str, np.ndarray], lengths: np.ndarray) -> dict[str, Any]:
    """Whole-store context over every record: fallbacks, precision used, max |activation|."""
    n = int(lengths.size)
    figures: dict[str, Any] = {"records": n, "length": aggregate(lengths)}
    used = Counter(str(x) for x in table.get("precision_used", []))
    figures["precision_used"] = {key: {"count": c, "rate": c / n} for key, c in sorted(used.items())}
    reasons = Counter(str(x) for x in table.get("fallback_reason", []) if str(x))
    total = sum(reasons.values())
    figures["fallback"] = {
        "count": total,
        "rate": total / n if n else 0.0,
        "by_reason": {key: {"count": c, "rate": c / n} for key, c in sorted(reasons.items())},
    }
    if "max_abs_activation" in table:
        values = np.asarray(table["max_abs_activation"], dtype=np.float64)
        figures["max_abs_activation"] = aggregate(values)
        finite = values[np.isfinite(values) & (values > 0)]
        if finite.size:
            lo, hi = math.floor(math.log10(finite.min())), math.ceil(math.log10(finite.max()))
            hi = max(hi, lo + 1)
            edges = np.logspace(lo, hi, num=(hi - lo) * 4 + 1)
            counts, _ = np.histogram(finite, bins=edges)
            figures["max_abs_activation"]["histogram"] = {
                "edges": [float(e) for e in edges], "counts": [int(c) for c in counts], "scale": "log10",
            }
        if "precision_used" in table:
            figures["max_abs_activation"]["by_precision_used"] = {
                key: aggregate(values[np.asarray(table["precision_used"], dtype=object) == key]) for key in sorted(used)
            }
    if "long_handling" in table:
        figures["long_handling"] = dict(sorted(Counter(str(x) for x in table["long_handling"]).items()))
    return figures
