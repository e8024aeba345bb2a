"""The downstream cross-check: does the precision policy change a result on the user's labels?

The same scikit-learn model is fitted twice per stored layer, once on the stored pooled
vectors of the sampled records and once on their fp32 recomputation, on the same k folds
(``StratifiedKFold`` for classes, ``KFold`` for numbers; shuffled with the sampling seed):

* classes: ``StandardScaler`` then ``LogisticRegression(max_iter=2000)``; score: accuracy;
* numbers: ``StandardScaler`` then ``Ridge(alpha=1.0)``; score: R², with Spearman's rho too.

Scores are over the pooled out-of-fold predictions (every sampled record predicted once, by
the model that did not see it), and per fold for the plot. The paired difference (stored
minus fp32) gets a percentile bootstrap 95% interval over records, both inputs resampled
together; agreement is the fraction of test predictions that are the same (numbers: within
1% of the labels' standard deviation). docs/crosscheck.md, "Downstream: your own labels".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from embedpipe.crosscheck.formatting import format_short
from embedpipe.crosscheck.labels import Labelled, LabelOptions

__all__ = ["MODELS", "downstream_lines", "downstream_rules", "evaluate_downstream", "make_model", "make_folds"]

#: what is fitted, as the report says it
MODELS = {"classes": "StandardScaler + LogisticRegression(max_iter=2000)",
          "numbers": "StandardScaler + Ridge(alpha=1.0)"}
#: the score the rule judges
SCORE = {"classes": "accuracy", "numbers": "R2"}
#: numeric predictions agree when closer than this fraction of the labels' standard deviation
NUMBER_AGREEMENT = 0.01
_BOOTSTRAP_BLOCK = 250  # resamples computed at once (memory: block x records x 8 bytes)


def make_model(kind: str) -> Any:
    """A fresh, unfitted model for ``kind`` (the same for both inputs)."""
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    head = LogisticRegression(max_iter=2000) if kind == "classes" else Ridge(alpha=1.0)
    return make_pipeline(StandardScaler(), head)


def make_folds(kind: str, y: np.ndarray, folds: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (train, test) index pairs both fits use."""
    from sklearn.model_selection import KFold, StratifiedKFold

    splitter = (StratifiedKFold if kind == "classes" else KFold)(n_splits=folds, shuffle=True, random_state=seed)
    return [(train, test) for train, test in splitter.split(np.zeros((len(y), 1)), y)]


def _score(kind: str, y: np.ndarray, pred: np.ndarray) -> float:
    from sklearn.metrics import accuracy_score, r2_score

    return float(accuracy_score(y, pred)) if kind == "classes" else float(r2_score(y, pred))


def _spearman(y: np.ndarray, pred: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(y, pred).statistic)


def _cross_predict(kind: str, x: np.ndarray, y: np.ndarray, splits: list) -> tuple[np.ndarray, list[float]]:
    """Out-of-fold predictions of every record, and each fold's score."""
    pred = np.empty(len(y), dtype=y.dtype)
    per_fold = []
    for train, test in splits:
        model = make_model(kind).fit(x[train], y[train])
        pred[test] = model.predict(x[test])
        per_fold.append(_score(kind, y[test], pred[test]))
    return pred, per_fold


def _bootstrap(kind: str, y: np.ndarray, a: np.ndarray, b: np.ndarray, resamples: int, seed: int) -> list[float]:
    """Percentile 95% interval of score(a) - score(b) over records resampled with replacement."""
    rng = np.random.default_rng(seed)
    n = len(y)
    diffs = []
    if kind == "classes":
        hit_a, hit_b = (a == y).astype(np.float64), (b == y).astype(np.float64)
    for start in range(0, resamples, _BOOTSTRAP_BLOCK):
        idx = rng.integers(0, n, size=(min(_BOOTSTRAP_BLOCK, resamples - start), n))
        if kind == "classes":
            diffs.append(hit_a[idx].mean(axis=1) - hit_b[idx].mean(axis=1))
            continue
        yy = y[idx]
        total = ((yy - yy.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
        total = np.where(total > 0, total, np.nan)  # a resample of one repeated value has no R2
        diffs.append((((yy - b[idx]) ** 2).sum(axis=1) - ((yy - a[idx]) ** 2).sum(axis=1)) / total)
    values = np.concatenate(diffs)
    lo, hi = np.nanquantile(values, [0.025, 0.975])
    return [float(lo), float(hi)]


def _agreement(kind: str, y: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    if kind == "classes":
        return float(np.mean(a == b))
    return float(np.mean(np.abs(a - b) <= NUMBER_AGREEMENT * float(np.std(y))))


def _layer_result(kind: str, y: np.ndarray, stored: np.ndarray, fp32: np.ndarray, splits: list, opts: LabelOptions,
                  seed: int) -> dict[str, Any]:
    pred_s, folds_s = _cross_predict(kind, stored, y, splits)
    pred_f, folds_f = _cross_predict(kind, fp32, y, splits)
    score_s, score_f = _score(kind, y, pred_s), _score(kind, y, pred_f)
    out = {
        "stored": score_s, "fp32": score_f, "difference": score_s - score_f,
        "ci95": _bootstrap(kind, y, pred_s, pred_f, opts.bootstrap, seed),
        "agreement": _agreement(kind, y, pred_s, pred_f),
        "per_fold": {"stored": folds_s, "fp32": folds_f},
    }
    if kind == "numbers":
        out["spearman"] = {"stored": _spearman(y, pred_s), "fp32": _spearman(y, pred_f)}
    return out


def evaluate_downstream(labelled: Labelled | None, opts: LabelOptions | None, sampled: list[dict],
                        fp32: dict[int, Any], layers: list[int], seed: int) -> dict[str, Any] | None:
    """crosscheck.json's ``downstream`` entry: both fits per stored layer, on the same folds
    (None without labels)."""
    if labelled is None or opts is None:
        return None
    label_of = dict(zip(labelled.rows.tolist(), labelled.labels))
    kind = labelled.kind
    raw = [label_of[s["row"]] for s in sampled]
    y = np.array([float(v) for v in raw]) if kind == "numbers" else np.array(raw, dtype=object)
    splits = make_folds(kind, y, opts.folds, seed)
    result: dict[str, Any] = {}
    for layer in layers:
        stored = np.stack([np.asarray(s["mean"][layer], dtype=np.float64) for s in sampled])
        ref = np.stack([np.asarray(fp32[i].mean[layer], dtype=np.float64) for i in range(len(sampled))])
        result[str(layer)] = _layer_result(kind, y, stored, ref, splits, opts, seed)
    sampled_classes = dict(sorted((str(k), int(v)) for k, v in zip(*np.unique(y, return_counts=True)))) \
        if kind == "classes" else {}
    return {
        "labels": str(labelled.path), "kind": kind, "kind_from": labelled.how, "model": MODELS[kind],
        "score": SCORE[kind], "folds": opts.folds, "fold_seed": int(seed), "bootstrap_resamples": opts.bootstrap,
        "interval": "percentile bootstrap 95% over records, paired", "label_lines": labelled.n_entries,
        "labelled_in_store": int(labelled.rows.size), "sampled": len(sampled),
        "classes": labelled.classes(), "sampled_classes": sampled_classes,
        "unknown_ids": {"count": len(labelled.unknown_ids), "ids": list(labelled.unknown_ids)},
        "agreement_rule": ("same predicted class" if kind == "classes"
                           else f"|difference| <= {NUMBER_AGREEMENT} x the labels' standard deviation"),
        "layers": result,
    }


def downstream_rules(downstream: dict[str, Any], tolerance: float) -> list[tuple[int, str]]:
    """(level, reason) per layer whose interval is not within ±tolerance: 1 when it reaches
    past it, 2 when it lies wholly outside (the score surely moved by more)."""
    out = []
    score = downstream["score"]
    for layer, entry in downstream["layers"].items():
        lo, hi = entry["ci95"]
        if -tolerance <= lo and hi <= tolerance:
            continue
        level = 2 if hi < -tolerance or lo > tolerance else 1
        out.append((level, f"layer {layer}: {score} on your labels {format_short(entry['stored'])} stored, "
                           f"{format_short(entry['fp32'])} fp32; difference {entry['difference']:+.4f}, 95% interval "
                           f"[{lo:+.4f}, {hi:+.4f}] not within ±{tolerance:g}"))
    return out


def downstream_lines(downstream: dict[str, Any]) -> list[str]:
    """The stderr summary's lines: per layer, both scores, the difference and agreement."""
    lines = [f"  downstream ({downstream['kind']}, {downstream['model']}, {downstream['folds']} folds, "
             f"{downstream['sampled']} labelled records):"]
    for layer, e in downstream["layers"].items():
        lines.append(f"    layer {layer}: {downstream['score']} {format_short(e['stored'])} stored, "
                     f"{format_short(e['fp32'])} fp32, difference {e['difference']:+.4f} "
                     f"[{e['ci95'][0]:+.4f}, {e['ci95'][1]:+.4f}], agreement {e['agreement']:.3f}")
    return lines
