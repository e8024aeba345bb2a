"""Cross-check a store against fp32: sample records, re-embed them in fp32, compare, report.

``embedpipe crosscheck STORE.h5 --out DIR`` answers the question users ask of every
half-precision run: how different are these embeddings from fp32, and does the difference
matter downstream? The steps, all from the store alone:

1. a length-stratified, seeded sample of records (:func:`embedpipe.metrics.stratified_sample`);
2. their stored ``sequence`` re-embedded in fp32 with the store's model (checked by sha256),
   the same layers, per-residue output, long-sequence handling, attention and batch budget;
3. per record and stored layer: pooled cosine, max / mean |difference|, relative L2 error,
   and the same per residue when the store has per-residue vectors;
4. a downstream proxy: each sampled record's k nearest neighbours (cosine) among all pooled
   vectors of the store, queried with the stored and with the fp32 vector: overlap@k;
5. whole-store figures (fallbacks, precision used, max activation) and a verdict.

The store is read only through :class:`embedpipe.store.Store`, whose reads all go through
:func:`embedpipe.store.reader.read_dataset`: a missing dataset or a failed read (a flipped byte) is one
``StoreError`` naming the file, the dataset and the rows, and ``open_store`` refuses a merged
store whose shard stores were rewritten after the merge (docs/store-format.md).

Results go to ``DIR/crosscheck.json`` (the data) and ``DIR/crosscheck.html`` (a rendering
of the same data, :mod:`embedpipe.report`), both written atomically. Metrics, thresholds
and verdict rules are documented in ``docs/crosscheck.md``.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedpipe import __version__
from embedpipe.atomic import check_output_path, write_text_atomic
from embedpipe.checksums import file_sha256
from embedpipe.devices import claim_device
from embedpipe.errors import EmbedpipeError
from embedpipe.metrics import (
    aggregate,
    compare_pooled,
    compare_residues,
    knn_overlap,
    length_bins,
    stratified_sample,
    top_k_neighbours,
    wilson_interval,
)
from embedpipe.model import is_model_name, load_model
from embedpipe.progress import progress_bar, say
from embedpipe.store import open_store, utc_now
from embedpipe.worker import EmbedOptions, Embedder

__all__ = ["CROSSCHECK_FORMAT_VERSION", "CrosscheckReport", "Thresholds", "VERDICTS", "run_crosscheck"]

#: version of the crosscheck.json layout (bump on incompatible changes)
CROSSCHECK_FORMAT_VERSION = 1
#: verdicts, best first
VERDICTS = ("pass", "warn", "fail")
#: neighbours per query for overlap@k (fewer when the store holds fewer other records)
DEFAULT_K = 10
#: length bins for stratified sampling and per-bin figures
DEFAULT_LENGTH_BINS = 4
#: database rows scored per block in the neighbour search (float64 working set ~ rows x dim x 8)
_KNN_BLOCK_BYTES = 64 << 20


@dataclass(frozen=True)
class Thresholds:
    """Verdict thresholds (documented in docs/crosscheck.md, section "Cross-check").

    * ``pass_cosine``: every sampled record's pooled cosine to fp32, in every stored layer,
      must be at least this for ``pass`` (below it: ``warn``).
    * ``fail_cosine``: any pooled cosine below this is ``fail``.
    * ``pass_overlap``: each layer's median overlap@k must be at least this for ``pass``
      (below it: ``warn``).
    * ``residue_cosine``: with per-residue vectors stored, any sampled residue whose cosine
      to fp32 is below this makes the verdict at least ``warn``.
    * ``determinism_cosine``: for a store computed in fp32 (a determinism check) the pass
      threshold is ``max(pass_cosine, determinism_cosine)``.
    """

    pass_cosine: float = 0.999
    fail_cosine: float = 0.99
    pass_overlap: float = 0.9
    residue_cosine: float = 0.99
    determinism_cosine: float = 0.99999

    def validate(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not -1.0 <= value <= 1.0:
                raise EmbedpipeError(f"threshold {name} must be a number in [-1, 1], not {value!r}")
        if self.fail_cosine > self.pass_cosine:
            raise EmbedpipeError(
                f"the fail cosine ({self.fail_cosine}) must not exceed the pass cosine ({self.pass_cosine})"
            )
        if not 0.0 <= self.pass_overlap <= 1.0:
            raise EmbedpipeError(f"the pass overlap must be in [0, 1], not {self.pass_overlap}")

    def pass_cosine_for(self, determinism: bool) -> float:
        return max(self.pass_cosine, self.determinism_cosine) if determinism else self.pass_cosine


@dataclass
class CrosscheckReport:
    """What :func:`run_crosscheck` found; ``data`` is exactly what crosscheck.json holds."""

    verdict: str
    json_path: Path
    html_path: Path
    data: dict[str, Any] = field(repr=False)

    def render(self) -> str:
        """A few lines for stderr: verdict, cosines, overlap, fallback rate, paths."""
        d = self.data
        overall = d["summary"]["overall"]
        lines = [f"crosscheck: {self.verdict.upper()} ({d['mode']} check of {d['sample_size']} sampled records "
                 f"of {d['store']['records']}, seed {d['sample_seed']}, layers {', '.join(map(str, d['store']['layers']))})"]
        for reason in d["verdict_reasons"][:5]:
            lines.append(f"  - {reason}")
        lines.append(
            f"  pooled cosine to fp32: min {_fmt_cos(overall['pooled_cosine']['min'])}, "
            f"median {_fmt_cos(overall['pooled_cosine']['median'])}; "
            f"max |diff| {_fmt_num(overall['pooled_max_abs_diff']['max'])}"
        )
        k = d["neighbours"]["k"]
        if k:
            lines.append(
                f"  overlap@{k}: median {_fmt_num(overall['overlap']['median'])}, min {_fmt_num(overall['overlap']['min'])}"
            )
        fb = d["store_figures"]["fallback"]
        lines.append(f"  fp32 fallback in the store: {fb['count']} of {d['store']['records']} records ({fb['rate']:.2%})")
        for note in d["notes"]:
            lines.append(f"  note: {note}")
        lines.append(f"  report: {self.html_path}  data: {self.json_path}")
        return "\n".join(lines)


# =============================================================================== the command


def run_crosscheck(
    store: Path | str,
    *,
    out: Path | str,
    sample: int = 64,
    seed: int = 0,
    device: str = "auto",
    model: str | None = None,
    thresholds: Thresholds | None = None,
    k: int = DEFAULT_K,
    allow_model_mismatch: bool = False,
    threads: int | None = None,
    quiet: bool = False,
) -> CrosscheckReport:
    """Sample ``sample`` records of ``store``, re-embed them in fp32 and write the report to ``out``.

    ``threads`` caps torch's CPU threads (a cluster job should use only the cores it holds).
    """

    thresholds = thresholds or Thresholds()
    thresholds.validate()
    if threads:
        import torch

        torch.set_num_threads(threads)
    if sample < 1:
        raise EmbedpipeError(f"--sample must be at least 1, not {sample}")
    if k < 1:
        raise EmbedpipeError(f"k must be at least 1, not {k}")
    store_path = Path(store)
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise EmbedpipeError(f"--out {out_dir} exists and is not a directory")
    for name in ("crosscheck.json", "crosscheck.html"):  # before the fp32 re-embedding, not after
        check_output_path(out_dir / name)
    started = time.perf_counter()

    with open_store(store_path) as st:
        provenance = st.provenance
        n_records = len(st)
        if n_records == 0:
            raise EmbedpipeError(f"{store_path}: the store holds no records; nothing to cross-check")
        table = st.records()
        lengths = np.asarray(table["length"], dtype=np.int64)
        layers = st.layers
        policy = str(provenance.get("precision_policy", "unknown"))
        determinism = policy == "fp32"

        # -- 1. the sample ---------------------------------------------------------------------
        rows = stratified_sample(lengths, sample, seed, n_bins=DEFAULT_LENGTH_BINS)
        edges, bin_of = length_bins(lengths, n_bins=min(DEFAULT_LENGTH_BINS, rows.size))
        ids = st.ids
        sampled = []
        for row in rows.tolist():
            rec = st[ids[row]]
            sampled.append({
                "row": int(row),
                "id": ids[row],
                "sequence": rec["sequence"],
                "length": int(rec["length"]),
                "bin": int(bin_of[row]),
                "precision_used": rec.get("precision_used", ""),
                "fallback_reason": rec.get("fallback_reason", ""),
                "embedded_length": int(rec.get("embedded_length", rec["length"])),
                "long_handling": rec.get("long_handling", "none"),
                "mean": {layer: np.asarray(rec["mean"][layer]) for layer in layers},
            })

        # -- 2. the fp32 reference -------------------------------------------------------------
        notes: list[str] = []
        with claim_device(device) as gpu:  # before loading: a job waiting for a GPU holds no model
            loaded, model_info = _load_reference_model(provenance, model, allow_model_mismatch, notes, quiet)
            if loaded.embed_dim != st.dim:
                raise EmbedpipeError(
                    f"model {model_info['path']} has embedding dim {loaded.embed_dim} but the store holds dim {st.dim}"
                )
            if max(layers) > loaded.num_layers:
                raise EmbedpipeError(
                    f"the store holds layer {max(layers)} but model {model_info['path']} has only {loaded.num_layers} layers"
                )
            if not loaded.trained:
                notes.append("the model has random (untrained) weights: a test or smoke run, not a real measurement")
            options, reference = _reference_options(provenance, layers, st.has_per_residue)
            fp32 = _reembed(loaded, options, gpu, [(s["id"], s["sequence"]) for s in sampled], quiet)
        reference["device"] = fp32.pop("device")
        reference["seconds"] = fp32.pop("seconds")

        # -- 3. per record and layer ------------------------------------------------------------
        problems: list[str] = []
        records = _compare(st, sampled, fp32["records"], layers, problems)

        # -- 4. neighbours ---------------------------------------------------------------------
        k_eff = min(k, n_records - 1)
        overlap_by_layer = _neighbour_overlap(st, sampled, fp32["records"], layers, k_eff, quiet)
        for rec in records:
            rec["overlap_at_k"] = overlap_by_layer[rec["layer"]].get(rec["row"]) if k_eff > 0 else None
            rec["k"] = k_eff

    # -- 5. verdict, figures, outputs ------------------------------------------------------------
    pass_cos = thresholds.pass_cosine_for(determinism)
    for rec in records:
        rec["status"] = _record_status(rec, thresholds, pass_cos)
    bins = _bin_table(edges, bin_of, rows)
    summary = _summarise(records, layers, bins, thresholds, pass_cos, k_eff)
    verdict, reasons = _verdict(summary, records, thresholds, pass_cos, k_eff, problems, model_info)
    store_sha = file_sha256(store_path, quiet=quiet)
    json_path, html_path = out_dir / "crosscheck.json", out_dir / "crosscheck.html"

    data: dict[str, Any] = {
        "crosscheck_format_version": CROSSCHECK_FORMAT_VERSION,
        "created_utc": utc_now(),
        "embedpipe_version": __version__,
        "verdict": verdict,
        "verdict_reasons": reasons,
        "mode": "determinism" if determinism else "precision",
        "store": {
            "path": str(store_path),
            "sha256": store_sha,
            "records": n_records,
            "layers": layers,
            "dim": int(loaded.embed_dim),
            "storage_dtype": str(provenance.get("storage_dtype", "")),
            "precision_policy": policy,
            "per_residue": bool(any("residue_min_cosine" in r for r in records)),
            "merged": "merged_from" in provenance,
        },
        "store_sha256": store_sha,
        "provenance": provenance,
        "model": model_info,
        "reference": reference,
        "sample_seed": int(seed),
        "sample_requested": int(sample),
        "sample_size": int(rows.size),
        "sample_rows": [int(r) for r in rows],
        "sample_ids": [s["id"] for s in sampled],
        "thresholds": asdict(thresholds) | {"effective_pass_cosine": pass_cos},
        "length_bins": bins,
        "neighbours": {"k": k_eff, "requested_k": int(k), "database_records": n_records, "metric": "cosine",
                       "database": "stored pooled vectors of every record, the query's own record excluded"},
        "records": records,
        "summary": summary,
        "store_figures": _store_figures(table, lengths),
        "problems": problems,
        "notes": notes,
        "seconds": round(time.perf_counter() - started, 3),
        "outputs": {"json": str(json_path), "html": str(html_path)},
    }
    data = _json_safe(data)
    from embedpipe.report import render_html

    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(json_path, json.dumps(data, indent=1, sort_keys=False, allow_nan=False) + "\n")
    write_text_atomic(html_path, render_html(data))
    return CrosscheckReport(verdict=verdict, json_path=json_path, html_path=html_path, data=data)


# =============================================================================== model


def _load_reference_model(provenance: dict[str, Any], override: str | None, allow_mismatch: bool,
                          notes: list[str], quiet: bool):
    """Load the store's model (or ``override``) and check its sha256 against the store's."""
    config = provenance.get("config") if isinstance(provenance.get("config"), dict) else {}
    expected = provenance.get("model_sha256")
    name = provenance.get("model_name")
    if override is not None:
        spec, how = str(override), "--model"
    else:
        candidates = [config.get("model"), provenance.get("model_source")]
        spec = next((str(c) for c in candidates if c and Path(str(c)).is_file()), None)
        how = "store provenance"
        if spec is None and isinstance(name, str) and is_model_name(name):
            spec = name
        if spec is None:
            where = next((c for c in candidates if c), None)
            raise EmbedpipeError(
                f"the store's model checkpoint {where or '(not recorded)'} is not here; pass --model PATH "
                f"(a checkpoint whose sha256 is {expected or 'recorded in the store'})"
            )
    loaded = load_model(spec)
    matches = bool(expected) and loaded.sha256 == expected
    info = {
        "spec": spec,
        "from": how,
        "path": loaded.source,
        "name": loaded.name,
        "sha256": loaded.sha256,
        "expected_sha256": expected,
        "sha256_matches": matches,
        "trained": bool(loaded.trained),
        "num_layers": int(loaded.num_layers),
    }
    if not expected:
        notes.append("the store records no model_sha256: the reference model could not be verified")
    elif not matches:
        message = (
            f"model {loaded.source} has sha256 {loaded.sha256[:16]}... but the store was made with "
            f"{name or 'a model'} of sha256 {str(expected)[:16]}..."
        )
        if not allow_mismatch:
            raise EmbedpipeError(
                f"{message}; pass the store's checkpoint with --model, or --allow-model-mismatch to compare anyway"
            )
        warning = f"MODEL MISMATCH: {message}; the comparison is not against the store's own model"
        notes.append(warning)
        say(f"embedpipe: WARNING: {warning}", quiet=False)
    return loaded, info


def _reference_options(provenance: dict[str, Any], layers: list[int], per_residue: bool):
    """fp32 ``EmbedOptions`` that reproduce the store's pooling and long-sequence handling."""
    config = provenance.get("config") if isinstance(provenance.get("config"), dict) else {}
    defaults = EmbedOptions()

    def pick(key: str) -> Any:
        value = config.get(key, provenance.get(key))
        return getattr(defaults, key) if value is None else value

    options = EmbedOptions(
        precision="fp32",
        layers=tuple(int(k) for k in layers),
        per_residue=bool(per_residue),
        tokens_per_batch=int(pick("tokens_per_batch")),
        device="auto",
        storage_dtype="float32",
        long_sequences=str(pick("long_sequences")),
        attention=str(pick("attention")),
    )
    options.validate()
    reference = {
        "precision": "fp32",
        "layers": list(options.layers),
        "per_residue": options.per_residue,
        "tokens_per_batch": options.tokens_per_batch,
        "long_sequences": options.long_sequences,
        "attention": options.attention,
        "tf32": False,
    }
    return options, reference


def _reembed(loaded, options, device, pairs: list[tuple[str, str]], quiet: bool) -> dict[str, Any]:
    """fp32 forward of ``pairs`` on the claimed ``device`` (the worker's fp32 policy already pins
    true fp32 matmuls, no TF32)."""
    started = time.perf_counter()
    out: dict[int, Any] = {}
    embedder = Embedder(loaded, options, device)
    plan = embedder.plan(pairs)
    for index, record in embedder.embed(pairs, plan, quiet=quiet):
        out[index] = record
    return {"records": out, "device": str(device), "seconds": round(time.perf_counter() - started, 3)}


# =============================================================================== comparison


def _compare(st, sampled: list[dict], fp32: dict[int, Any], layers: list[int], problems: list[str]) -> list[dict]:
    records: list[dict] = []
    for i, s in enumerate(sampled):
        ref = fp32[i]
        if ref.embedded_length != s["embedded_length"] or ref.long_handling != s["long_handling"]:
            problems.append(
                f"record {s['id']!r}: the store embedded {s['embedded_length']} residues ({s['long_handling']}), "
                f"the fp32 re-run {ref.embedded_length} ({ref.long_handling})"
            )
        for layer in layers:
            stored = s["mean"][layer]
            pooled = compare_pooled(stored, ref.mean[layer])
            rec: dict[str, Any] = {
                "id": s["id"],
                "row": s["row"],
                "length": s["length"],
                "layer": int(layer),
                "length_bin": s["bin"],
                "precision_used": s["precision_used"],
                "fallback_reason": s["fallback_reason"],
                "long_handling": s["long_handling"],
                "pooled_cosine": pooled["cosine"],
                "pooled_max_abs_diff": pooled["max_abs_diff"],
                "pooled_mean_abs_diff": pooled["mean_abs_diff"],
                "pooled_rel_l2": pooled["rel_l2"],
                "stored_finite": bool(np.all(np.isfinite(stored))),
            }
            if st.has_per_residue and ref.per_residue is not None:
                stored_res = st.per_residue(s["id"], layer)
                rec["stored_finite"] = rec["stored_finite"] and bool(np.all(np.isfinite(stored_res)))
                ref_res = ref.per_residue[layer]
                if stored_res.shape != ref_res.shape:
                    problems.append(
                        f"record {s['id']!r} layer {layer}: {stored_res.shape[0]} stored residue rows, "
                        f"{ref_res.shape[0]} in the fp32 re-run"
                    )
                    residues = {"min_cosine": math.nan, "mean_cosine": math.nan, "max_abs_diff": math.nan,
                                "mean_abs_diff": math.nan, "rel_l2": math.nan}
                else:
                    residues = compare_residues(stored_res, ref_res)
                rec.update({f"residue_{key}": value for key, value in residues.items()})
            records.append(rec)
    return records


def _database_blocks(st, layer: int, bar):
    arr = st.mean(layer)
    n, dim = arr.shape
    rows = max(1, _KNN_BLOCK_BYTES // max(1, dim * 8))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        block = np.asarray(arr[start:stop].compute())
        bar.update(stop - start)
        yield start, block


def _neighbour_overlap(st, sampled: list[dict], fp32: dict[int, Any], layers: list[int], k: int,
                       quiet: bool) -> dict[int, dict[int, float | None]]:
    """layer -> {row: overlap@k of the stored-vector query with the fp32-vector query}."""
    result: dict[int, dict[int, float | None]] = {layer: {} for layer in layers}
    if k <= 0 or not sampled:
        return result
    bar = progress_bar(quiet=quiet, total=len(st) * len(layers), unit="vec", unit_scale=True, desc="neighbours")
    try:
        for layer in layers:
            stored_q = np.stack([s["mean"][layer].astype(np.float64) for s in sampled])
            fp32_q = np.stack([fp32[i].mean[layer].astype(np.float64) for i in range(len(sampled))])
            exclude = np.array([s["row"] for s in sampled] * 2, dtype=np.int64)
            nbrs, _ = top_k_neighbours(np.concatenate([stored_q, fp32_q]), _database_blocks(st, layer, bar), k,
                                       exclude=exclude)
            q = len(sampled)
            overlap = knn_overlap(nbrs[:q], nbrs[q:])
            # None for a non-finite query (no neighbours); such a record fails on its values anyway
            result[layer] = {s["row"]: (float(o) if math.isfinite(o) else None) for s, o in zip(sampled, overlap)}
    finally:
        bar.close()
    return result


# =============================================================================== verdict


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _record_status(rec: dict, t: Thresholds, pass_cos: float) -> str:
    values = [rec[k] for k in ("pooled_cosine", "pooled_max_abs_diff", "pooled_rel_l2")]
    if "residue_min_cosine" in rec:
        values += [rec["residue_min_cosine"], rec["residue_max_abs_diff"]]
    if not rec.get("stored_finite", True) or not all(_finite(v) for v in values):
        return "fail"
    if rec["pooled_cosine"] < t.fail_cosine:
        return "fail"
    if rec["pooled_cosine"] < pass_cos:
        return "warn"
    if "residue_min_cosine" in rec and rec["residue_min_cosine"] < t.residue_cosine:
        return "warn"
    return "pass"


def _bin_table(edges: np.ndarray, bin_of: np.ndarray, rows: np.ndarray) -> list[dict]:
    sampled_bins = Counter(int(bin_of[r]) for r in rows.tolist())
    counts = Counter(int(b) for b in bin_of.tolist())
    out = []
    for b in range(len(edges) - 1):
        out.append({
            "bin": b,
            "min_length": float(edges[b]),
            "max_length": float(edges[b + 1]),
            "closed_right": b == len(edges) - 2,
            "records": counts.get(b, 0),
            "sampled": sampled_bins.get(b, 0),
        })
    return out


_METRICS = ("pooled_cosine", "pooled_max_abs_diff", "pooled_mean_abs_diff", "pooled_rel_l2",
            "residue_min_cosine", "residue_mean_cosine", "residue_max_abs_diff", "residue_mean_abs_diff",
            "residue_rel_l2")


def _metric_aggregates(recs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in _METRICS:
        values = [r[metric] for r in recs if metric in r]
        if values:
            out[metric] = aggregate(values)
    overlaps = [r["overlap_at_k"] for r in recs if r.get("overlap_at_k") is not None]
    out["overlap"] = aggregate(overlaps)
    return out


def _summarise(records: list[dict], layers: list[int], bins: list[dict], t: Thresholds, pass_cos: float,
               k: int) -> dict[str, Any]:
    per_layer: dict[str, Any] = {}
    for layer in layers:
        recs = [r for r in records if r["layer"] == layer]
        n = len(recs)
        above = sum(1 for r in recs if _finite(r["pooled_cosine"]) and r["pooled_cosine"] >= pass_cos)
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
                "pooled_cosine": aggregate([r["pooled_cosine"] for r in in_bin]),
                "pooled_rel_l2": aggregate([r["pooled_rel_l2"] for r in in_bin]),
                "pooled_max_abs_diff": aggregate([r["pooled_max_abs_diff"] for r in in_bin]),
            })
        entry["by_precision_used"] = {
            used: aggregate([r["pooled_cosine"] for r in recs if r["precision_used"] == used])
            for used in sorted({r["precision_used"] for r in recs})
        }
        per_layer[str(layer)] = entry
    overall = _metric_aggregates(records)
    above = sum(1 for r in records if _finite(r["pooled_cosine"]) and r["pooled_cosine"] >= pass_cos)
    lo, hi = wilson_interval(above, len(records))
    overall["fraction_above_pass"] = {
        "threshold": pass_cos, "count": above, "n": len(records),
        "fraction": above / len(records) if records else None, "ci95": [lo, hi],
        "method": "Wilson score interval, 95% (record-layer pairs)",
    }
    overall["status"] = dict(Counter(r["status"] for r in records))
    return {"layers": per_layer, "overall": overall}


def _verdict(summary: dict, records: list[dict], t: Thresholds, pass_cos: float, k: int, problems: list[str],
             model_info: dict) -> tuple[str, list[str]]:
    level = 0
    reasons: list[str] = []

    def raise_to(new: int, reason: str) -> None:
        nonlocal level
        level = max(level, new)
        reasons.append(f"{VERDICTS[new]}: {reason}")

    for problem in problems:
        raise_to(2, problem)
    for layer, entry in summary["layers"].items():
        recs = [r for r in records if str(r["layer"]) == layer]
        nonfinite = [r["id"] for r in recs if r["status"] == "fail" and not _all_finite(r)]
        if nonfinite:
            raise_to(2, f"layer {layer}: non-finite values for {len(nonfinite)} record(s) ({', '.join(nonfinite[:5])})")
        cos = entry["pooled_cosine"]
        if cos["min"] is not None and cos["min"] < t.fail_cosine:
            low = sum(1 for r in recs if _finite(r["pooled_cosine"]) and r["pooled_cosine"] < t.fail_cosine)
            raise_to(2, f"layer {layer}: {low} record(s) with pooled cosine below {t.fail_cosine} "
                        f"(min {_fmt_cos(cos['min'])})")
        elif cos["min"] is not None and cos["min"] < pass_cos:
            low = sum(1 for r in recs if _finite(r["pooled_cosine"]) and r["pooled_cosine"] < pass_cos)
            raise_to(1, f"layer {layer}: {low} record(s) with pooled cosine below {pass_cos} "
                        f"(min {_fmt_cos(cos['min'])})")
        res = entry.get("residue_min_cosine")
        if res and res["min"] is not None and res["min"] < t.residue_cosine:
            raise_to(1, f"layer {layer}: per-residue cosine down to {_fmt_cos(res['min'])} "
                        f"(below {t.residue_cosine})")
        ov = entry["overlap"]
        if k > 0 and ov["median"] is not None and ov["median"] < t.pass_overlap:
            raise_to(1, f"layer {layer}: median overlap@{k} {ov['median']:.3f} below {t.pass_overlap}")
    if model_info.get("expected_sha256") and not model_info.get("sha256_matches"):
        raise_to(1, "the reference model is not the store's model (sha256 mismatch, --allow-model-mismatch)")
    if not reasons:
        k_text = f" and median overlap@{k} >= {t.pass_overlap}" if k > 0 else ""
        reasons.append(f"pass: every sampled pooled cosine >= {pass_cos} in every stored layer{k_text}")
    return VERDICTS[level], reasons


def _all_finite(rec: dict) -> bool:
    return rec.get("stored_finite", True) and all(_finite(rec[m]) for m in _METRICS if m in rec)


# =============================================================================== whole store


def _store_figures(table: dict[str, np.ndarray], lengths: np.ndarray) -> dict[str, Any]:
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


# =============================================================================== helpers


def _json_safe(value: Any) -> Any:
    """numpy scalars/arrays to Python, non-finite floats to None (crosscheck.json is strict JSON)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return [_json_safe(v) for v in value.tolist()]
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int)) or value is None:
        return value
    return str(value)


def _fmt_cos(x: Any) -> str:
    """At least 6 decimals, more when needed to show the distance from 1 (``0.99999997``)."""
    if x is None or not _finite(x):
        return "n/a"
    gap = 1.0 - x
    digits = min(12, math.ceil(-math.log10(gap)) + 1) if 0 < gap < 1e-5 else 6
    return f"{x:.{digits}f}"


def _fmt_num(x: Any) -> str:
    if x is None or not _finite(x):
        return "n/a"
    return f"{x:.3g}"
