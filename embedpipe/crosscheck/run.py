"""Cross-check a store against fp32: sample records, re-embed them in fp32, compare, report.

``embedpipe crosscheck STORE.h5 --out DIR`` answers the question users ask of every
half-precision run: how different are these embeddings from fp32, and does the difference
matter downstream? The steps, all from the store alone:

1. a length-stratified, seeded sample of records (:func:`embedpipe.crosscheck.metrics.stratified_sample`),
   and besides it, always, the risky records: the longest, those over the model's window and
   the fp32 fallbacks, each group bounded (:mod:`embedpipe.crosscheck.sampling`);
2. their stored ``sequence`` re-embedded in fp32 with the store's model (checked by sha256),
   the same layers, per-residue output, long-sequence handling, attention and batch budget;
3. per record and stored layer: pooled cosine, max / mean |difference|, relative L2 error,
   and the same per residue when the store has per-residue vectors;
4. a downstream proxy: each sampled record's k nearest neighbours (cosine) among all pooled
   vectors of the store, queried with the stored and with the fp32 vector: overlap@k;
5. whole-store figures (fallbacks, precision used, max activation) and a verdict;
6. with ``labels``, the downstream result itself: the sample is drawn from the labelled
   records (:mod:`embedpipe.crosscheck.labels`) and one model is fitted on the stored and on
   the fp32 vectors, on the same folds (:mod:`embedpipe.crosscheck.downstream`).

The store is read only through :class:`embedpipe.Store`, whose reads all go through one
checked read: a missing dataset or a failed read (a flipped byte) is one
``StoreError`` naming the file, the dataset and the rows, and ``open_store`` refuses a merged
store whose shard stores were rewritten after the merge (docs/store-format.md).

Steps 3 and 4 are :mod:`embedpipe.crosscheck.compare`, the verdict and the aggregates
:mod:`embedpipe.crosscheck.verdict`. Results go to ``DIR/crosscheck.json`` (the data) and
``DIR/crosscheck.html`` (a rendering of the same data, :mod:`embedpipe.crosscheck.report.page`), both written
atomically. Metrics, thresholds and verdict rules are documented in ``docs/crosscheck.md``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedpipe.core.atomic import check_output_path, write_text_atomic
from embedpipe.core.checksums import file_sha256
from embedpipe.core.cpus import thread_count, use_threads
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import CROSSCHECK_K, CROSSCHECK_SAMPLE, CROSSCHECK_SEED, DEFAULT_DEVICE, Thresholds
from embedpipe.core.output_guard import guard_outputs
from embedpipe.core.version import __version__
from embedpipe.crosscheck.compare import REFUSAL, compare_records, neighbour_overlap
from embedpipe.crosscheck.downstream import downstream_lines, evaluate_downstream
from embedpipe.crosscheck.formatting import format_cosine, format_short, json_safe
from embedpipe.crosscheck.labels import Labelled, LabelOptions, resolve_labels, sample_labelled
from embedpipe.crosscheck.metrics import describe_length_bins, length_bins, stratified_sample
from embedpipe.crosscheck.reference import fp32_reference
from embedpipe.crosscheck.report.page import render_html
from embedpipe.crosscheck.sampling import MAX_RISK, Selection, select
from embedpipe.crosscheck.verdict import VERDICTS, judge, store_figures
from embedpipe.model.registry import model_files
from embedpipe.store import utc_now
from embedpipe.store.attrjson import load_json_attr
from embedpipe.store.merged_provenance import platform_lines, platforms
from embedpipe.store.reader import Store, open_store
from embedpipe.store.sources import pinned_by

__all__ = ["CROSSCHECK_FORMAT_VERSION", "CrosscheckReport", "LabelOptions", "Thresholds", "VERDICTS", "run_crosscheck"]

#: version of the crosscheck.json layout (bump on incompatible changes)
CROSSCHECK_FORMAT_VERSION = 1
#: length bins for stratified sampling and per-bin figures
DEFAULT_LENGTH_BINS = 4
TABLE_BLOCK = 1 << 16  # rows of the per-record table read at once
# the per-record text columns the store figures count (crosscheck_verdict.store_figures)
COUNTED_COLUMNS = ("precision_used", "fallback_reason", "long_handling", "reused_from")
OUTPUT_NAMES = ("crosscheck.json", "crosscheck.html")


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
            f"  pooled cosine to fp32: min {format_cosine(overall['pooled_cosine']['min'])}, "
            f"median {format_cosine(overall['pooled_cosine']['median'])}; "
            f"max |diff| {format_short(overall['pooled_max_abs_diff']['max'])}"
        )
        k = d["neighbours"]["k"]
        if k:
            lines.append(f"  overlap@{k}: median {format_short(overall['overlap']['median'])}, "
                         f"min {format_short(overall['overlap']['min'])}")
        if d.get("downstream"):
            lines += downstream_lines(d["downstream"])
        lines.append("  sample: " + ", ".join(f"{n} {reason}" for reason, n in d["sampling"]["chosen_because"].items())
                     + f" (at most {d['sampling']['max_size']})")
        fb = d["store_figures"]["fallback"]
        lines.append(f"  fp32 fallback in the store: {fb['count']} of {d['store']['records']} records ({fb['rate']:.2%})")
        for note in d["notes"]:
            lines.append(f"  note: {note}")
        lines.append(f"  report: {self.html_path}  data: {self.json_path}")
        return "\n".join(lines)


#: ``chosen_because`` of the random part: without labels, and with them
RANDOM_REASON = "length-stratified random"
LABELLED_REASON = "label-stratified random"


@dataclass
class _Sample:
    """The sampled rows, the length bins they were drawn from, each sampled record as read,
    and why each was chosen."""

    rows: np.ndarray
    edges: np.ndarray
    bin_of: np.ndarray
    records: list[dict[str, Any]]
    bins: list[dict[str, Any]]
    selection: Selection

    def random_part(self, fp32: dict[int, Any]) -> tuple[list[dict[str, Any]], dict[int, Any]]:
        """The records the random draw chose, and their fp32 re-runs renumbered alike (the
        downstream fit is on the label-stratified draw only)."""
        keep = [i for i, rec in enumerate(self.records) if LABELLED_REASON in rec["chosen_because"]]
        return [self.records[i] for i in keep], {j: fp32[i] for j, i in enumerate(keep)}


# =============================================================================== the command


def run_crosscheck(
    store: Path | str,
    *,
    out: Path | str,
    sample: int = CROSSCHECK_SAMPLE,
    seed: int = CROSSCHECK_SEED,
    device: str = DEFAULT_DEVICE,
    model: str | None = None,
    thresholds: Thresholds | None = None,
    k: int = CROSSCHECK_K,
    allow_model_mismatch: bool = False,
    threads: int | None = None,
    quiet: bool = False,
    labels: LabelOptions | None = None,
) -> CrosscheckReport:
    """Sample ``sample`` records of ``store`` (the labelled ones with ``labels``), re-embed them in
    fp32 and write the report to ``out``; ``threads`` caps torch's CPU threads (a job's cores)."""
    thresholds, store_path, out_dir = thresholds or Thresholds(), Path(store), Path(out)
    _check_arguments(thresholds, sample, k, out_dir, labels, store_path, model)
    use_threads(thread_count(threads), quiet=quiet)  # --threads, else the CPUs the job owns (docs/cluster.md, "CPU threads")
    started, notes = time.perf_counter(), list[str]()
    with open_store(store_path) as st:
        st.check_sources()  # every source pinned, not only the sampled ones' (docs/store-format.md)
        provenance, layers = st.provenance, st.layers
        table, lengths = _store_table(st)
        labelled = resolve_labels(labels, st) if labels is not None else None
        drawn = _draw_sample(st, store_path, table, sample, seed, labelled, labels, computed_rows(table))
        reference = fp32_reference(st, provenance, layers, drawn.records, device, model, allow_model_mismatch,
                                   notes, quiet)
        records, problems = compare_records(st, drawn.records, reference.records, layers)
        notes += [f"records computed on several platforms (their numbers differ slightly): {line}"
                  for line in platform_lines(platforms(provenance))]
        k_eff = min(k, len(st) - 1)
        _add_overlap(st, drawn.records, reference.records, layers, records, k_eff, quiet)
    downstream = evaluate_downstream(labelled, labels, *drawn.random_part(reference.records), layers, seed)
    policy = str(provenance.get("precision_policy", "unknown"))
    pass_cos = thresholds.pass_cosine_for(policy == "fp32")
    summary, verdict, reasons = judge(records, layers, drawn.bins, thresholds, pass_cos, k_eff, problems, reference.model_info,
                                      downstream)
    data = {
        **_versions(),
        "verdict": verdict,
        "verdict_reasons": reasons,
        "mode": "determinism" if policy == "fp32" else "precision",
        **_store_part(store_path, provenance, len(lengths), layers, reference.dim, records, quiet),
        "model": reference.model_info,
        "reference": reference.settings,
        **_sample_part(drawn, seed, sample), "reuse": reuse_part(table, provenance),
        "thresholds": asdict(thresholds) | {"effective_pass_cosine": pass_cos},
        "length_bins": drawn.bins,
        "neighbours": _neighbours_part(k_eff, k, len(lengths)),
        "records": records,
        "summary": summary,
        "downstream": downstream,
        "store_figures": store_figures(table, lengths),
        "problems": problems,
        "notes": notes,
        "seconds": round(time.perf_counter() - started, 3),
    }
    return _write_outputs(out_dir, data)


def _check_arguments(thresholds: Thresholds, sample: int, k: int, out_dir: Path, labels: LabelOptions | None,
                     store_path: Path, model: str | None) -> None:
    """Refuse bad options and unwritable outputs before the (slow) fp32 re-embedding, not after;
    no output may be the store, the model, the label file or a source the store pins."""
    thresholds.validate()
    if labels is not None:
        labels.validate()
    if sample < 1:
        raise EmbedpipeError(f"--sample must be at least 1, not {sample}")
    if k < 1:
        raise EmbedpipeError(f"k must be at least 1, not {k}")
    if out_dir.exists() and not out_dir.is_dir():
        raise EmbedpipeError(f"--out {out_dir} exists and is not a directory")
    for name in OUTPUT_NAMES:
        check_output_path(out_dir / name)
    inputs = [store_path, *(model_files(model) if model else []),
              *([Path(labels.path)] if labels is not None else [])]
    guard_outputs("crosscheck", [("--out", out_dir / name) for name in OUTPUT_NAMES], inputs, pinned=pinned_by([store_path]))


def _draw_sample(st: Store, store_path: Path, table: dict[str, np.ndarray], sample: int, seed: int,
                 labelled: Labelled | None = None, labels: LabelOptions | None = None,
                 candidates: np.ndarray | None = None) -> _Sample:
    """Step 1: a seeded, length-stratified sample (with labels: stratified by class, from the
    labelled records; else from ``candidates``, the computed rows, when given) and, from the
    same records, the risky ones (sampling.py); each record read with its stored vectors."""
    if len(st) == 0:
        raise EmbedpipeError(f"{store_path}: the store holds no records; nothing to cross-check")
    lengths = table["length"]
    reason, rule = RANDOM_REASON, (f"{sample} records drawn at random per length bin (quantile bins of the lengths, "
                                   f"in proportion to their sizes, at least one per bin), seed {seed}")
    if labelled is not None and labels is not None:
        candidates = labelled.rows
        random_rows = sample_labelled(labelled, sample, seed, labels.folds)
        reason, rule = LABELLED_REASON, (f"{sample} labelled records drawn at random per class (numbers: per quartile "
                                         f"of the target), at least {labels.folds} per class, seed {seed}; the "
                                         "downstream fit uses these only")
    elif candidates is not None:  # embed --reuse: the copies were cross-checked with their source
        random_rows = candidates[stratified_sample(lengths[candidates], sample, seed, n_bins=DEFAULT_LENGTH_BINS)]
        rule += ", from the computed records"
    else:
        random_rows = stratified_sample(lengths, sample, seed, n_bins=DEFAULT_LENGTH_BINS)
    selection = select(lengths, table["long_handling"], table["fallback_reason"], random_rows, random_reason=reason,
                       random_rule=rule, sample=sample, candidates=candidates)
    rows = selection.rows
    edges, bin_of = length_bins(lengths, n_bins=min(DEFAULT_LENGTH_BINS, rows.size))
    records = []
    for row, why in zip(rows.tolist(), selection.chosen_because):
        rid = str(st.records(rows=slice(row, row + 1))["id"][0])
        for layer in st.layers:  # the bytes the writer stored (docs/store-format.md, "Row digests"), first:
            st.check_digests(f"mean/layer_{layer}", slice(row, row + 1),  # the refusal in the cross-check's words
                             st.mean_rows(slice(row, row + 1), layer), refusal=REFUSAL)
        rec = st[rid]
        records.append({
            "row": int(row),
            "id": rid,
            "sequence": rec["sequence"],
            "length": int(rec["length"]),
            "bin": int(bin_of[row]),
            "precision_used": rec.get("precision_used", ""),
            "fallback_reason": rec.get("fallback_reason", ""),
            "embedded_length": int(rec.get("embedded_length", rec["length"])),
            "long_handling": rec.get("long_handling", "none"),
            "chosen_because": why,
            "mean": {layer: np.asarray(rec["mean"][layer]) for layer in st.layers},
        })
    return _Sample(rows=rows, edges=edges, bin_of=bin_of, records=records,
                   bins=describe_length_bins(edges, bin_of, rows), selection=selection)


def computed_rows(table: dict[str, np.ndarray]) -> np.ndarray | None:
    """The rows ``embed --reuse`` computed (the sample is drawn from them: the copies were
    cross-checked with their source), or None to sample from all (none reused, or all)."""
    reused = np.asarray(table["reused_from"] != "", dtype=bool)
    return None if not reused.any() or reused.all() else np.flatnonzero(~reused)


def reuse_part(table: dict[str, np.ndarray], provenance: dict[str, Any]) -> dict[str, Any]:
    """The report's ``reuse`` entry: records copied by ``embed --reuse`` and their source stores."""
    reused = int(np.count_nonzero(np.asarray(table["reused_from"] != "", dtype=bool)))
    listed = provenance.get("reused_sources") or "[]"
    return {"reused_records": reused, "computed_records": len(table["reused_from"]) - reused,
            "sampled_from": "all records" if computed_rows(table) is None else "computed records only",
            "sources": load_json_attr(listed, "reused_sources") if isinstance(listed, str) else listed}


def _versions() -> dict[str, Any]:
    """The report's format version, creation time and embedpipe version."""
    return {"crosscheck_format_version": CROSSCHECK_FORMAT_VERSION, "created_utc": utc_now(),
            "embedpipe_version": __version__}


def _store_table(st: Store) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The columns the store figures count, and every record's length, read block by block.

    Per record only numbers are kept: lengths, max |activation| and, for the text columns,
    a shared reference to one string per distinct value; never IDs or sequences, so memory
    stays a few bytes per record (docs/benchmarks.md, "Sharding at scale", "Merging with the manifest").
    """
    n = len(st)
    lengths = np.empty(n, dtype=np.int64)
    max_abs = np.empty(n, dtype=np.float64)
    categories: dict[str, dict[str, int]] = {name: {} for name in COUNTED_COLUMNS}
    codes = {name: np.empty(n, dtype=np.int32) for name in COUNTED_COLUMNS}
    for lo in range(0, n, TABLE_BLOCK):
        hi = min(n, lo + TABLE_BLOCK)
        block = st.records(rows=slice(lo, hi))
        lengths[lo:hi] = block["length"]
        max_abs[lo:hi] = block["max_abs_activation"]
        for name in COUNTED_COLUMNS:
            seen = categories[name]
            codes[name][lo:hi] = [seen.setdefault(str(value), len(seen)) for value in block[name].tolist()]
    table = {"length": lengths, "max_abs_activation": max_abs}
    for name in COUNTED_COLUMNS:
        values = np.empty(len(categories[name]), dtype=object)
        values[:] = list(categories[name])
        table[name] = values[codes[name]]
    return table, lengths


def _add_overlap(st: Store, sampled: list[dict], fp32: dict[int, Any], layers: list[int], records: list[dict],
                 k: int, quiet: bool) -> None:
    """Step 4: each record's overlap@k (None when the store has no other record)."""
    overlap_by_layer = neighbour_overlap(st, sampled, fp32, layers, k, quiet)
    for rec in records:
        rec["overlap_at_k"] = overlap_by_layer[rec["layer"]].get(rec["row"]) if k > 0 else None
        rec["k"] = k


def _store_part(store_path: Path, provenance: dict[str, Any], n_records: int, layers: list[int], dim: int,
                records: list[dict], quiet: bool) -> dict[str, Any]:
    """The report's ``store``, ``store_sha256`` and ``provenance`` entries."""
    store_sha = file_sha256(store_path, quiet=quiet)
    return {
        "store": {
            "path": str(store_path),
            "sha256": store_sha,
            "records": n_records,
            "layers": layers,
            "dim": dim,
            "storage_dtype": str(provenance.get("storage_dtype", "")),
            "precision_policy": str(provenance.get("precision_policy", "unknown")),
            "per_residue": bool(any("residue_min_cosine" in r for r in records)),
            "merged": "merged_from" in provenance,
            "platforms": platforms(provenance),  # which records came from which platform, when several
        },
        "store_sha256": store_sha,
        "provenance": provenance,
    }


def _neighbours_part(k: int, requested: int, n_records: int) -> dict[str, Any]:
    """The report's ``neighbours`` entry: how overlap@k was measured."""
    return {"k": k, "requested_k": int(requested), "database_records": n_records, "metric": "cosine",
            "database": "stored pooled vectors of every record, the query's own record excluded"}


def _sample_part(drawn: _Sample, seed: int, requested: int) -> dict[str, Any]:
    """The report's ``sample_*`` entries."""
    return {
        "sample_seed": int(seed),
        "sample_requested": int(requested),
        "sample_size": int(drawn.rows.size),
        "sample_rows": [int(r) for r in drawn.rows],
        "sample_ids": [s["id"] for s in drawn.records],
        "sample_chosen_because": [s["chosen_because"] for s in drawn.records],
        "sampling": {"rules": drawn.selection.rules, "max_size": int(requested) + MAX_RISK,
                     "chosen_because": drawn.selection.counts},
    }


def _write_outputs(out_dir: Path, data: dict[str, Any]) -> CrosscheckReport:
    """Step 5: crosscheck.json and crosscheck.html, each written atomically."""
    json_path, html_path = (out_dir / name for name in OUTPUT_NAMES)
    data["outputs"] = {"json": str(json_path), "html": str(html_path)}
    data = json_safe(data)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(json_path, json.dumps(data, indent=1, sort_keys=False, allow_nan=False) + "\n")
    write_text_atomic(html_path, render_html(data))
    return CrosscheckReport(verdict=data["verdict"], json_path=json_path, html_path=html_path, data=data)
