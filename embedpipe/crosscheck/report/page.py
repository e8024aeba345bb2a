"""The cross-check report as one self-contained HTML page.

:func:`render_html` turns the data of ``crosscheck.json`` (see :mod:`embedpipe.crosscheck.run`)
into a page with no external assets and no script: inline CSS, plots drawn as inline SVG
(:mod:`embedpipe.crosscheck.report.figures`). Every piece of text that comes from data is escaped. The order is the reader's: the
verdict and its reasons first, then the figures that support it, then whole-store context
and provenance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from embedpipe.crosscheck import measures
from embedpipe.crosscheck.formatting import escape as _e
from embedpipe.crosscheck.formatting import format_cosine as _cos
from embedpipe.crosscheck.formatting import format_count
from embedpipe.crosscheck.formatting import format_number as _num
from embedpipe.crosscheck.formatting import format_percent as _pct
from embedpipe.crosscheck.report.figures import activation_histogram, cosine_histogram, error_scatter, fold_scores, overlap_bars

__all__ = ["VERDICT_COLOURS", "render_html"]

VERDICT_COLOURS = {"pass": ("#1b7f3b", "#e6f4ea"), "warn": ("#9a6700", "#fff4d6"), "fail": ("#b3261e", "#fde7e7")}

_CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Liberation Sans", sans-serif;
       color: #1f2328; background: #ffffff; margin: 0; }
main { max-width: 1360px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 32px 0 8px; padding-bottom: 4px; border-bottom: 1px solid #d0d7de; }
h3 { font-size: 15px; margin: 18px 0 6px; }
p.sub { color: #57606a; margin: 0 0 16px; }
.verdict { border: 2px solid; border-radius: 8px; padding: 14px 18px; margin: 12px 0 18px; }
.verdict .word { font-size: 30px; font-weight: 700; letter-spacing: 0.04em; }
.verdict ul { margin: 6px 0 0; padding-left: 20px; }
.notes { border-left: 4px solid #b3261e; background: #fde7e7; padding: 8px 12px; margin: 10px 0; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 10px 0 4px; }
.card { border: 1px solid #d0d7de; border-radius: 6px; padding: 8px 12px; min-width: 150px; }
.card .v { font-size: 18px; font-weight: 600; }
.card .l { color: #57606a; font-size: 12px; }
.scroll { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; margin: 6px 0 12px; font-variant-numeric: tabular-nums; font-size: 13px; }
th, td { border: 1px solid #d0d7de; padding: 3px 6px; text-align: right; vertical-align: top; }
th { background: #f6f8fa; font-weight: 600; }
td { white-space: nowrap; }
td.t, th.t { text-align: left; }
td.t { white-space: normal; min-width: 6em; }  /* prose wraps: no table wider than the page */
td.mono { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; text-align: left;
          word-break: break-all; white-space: normal; }
table.kv { table-layout: fixed; width: 100%; } table.kv th { width: 16em; }
.pass { color: #1b7f3b; } .warn { color: #9a6700; } .fail { color: #b3261e; font-weight: 600; }
figure { margin: 8px 0 16px; }
figcaption { color: #57606a; font-size: 12px; max-width: 760px; }
svg { display: block; background: #ffffff; }
svg text { font: 11px system-ui, "Liberation Sans", sans-serif; fill: #1f2328; }
.legend span.sw { display: inline-block; width: 12px; height: 12px; margin: 0 4px -2px 10px; }
details { margin: 6px 0; }
"""


# =============================================================================== formatting


def _status(word: str) -> str:
    return f'<span class="{_e(word)}">{_e(word)}</span>'


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], *, text_cols: Sequence[int] = (0,),
           raw: bool = False) -> str:
    """A table; cells are escaped unless ``raw`` (then the caller has escaped them)."""
    head = "".join(f'<th class="{"t" if i in text_cols else ""}">{_e(h)}</th>' for i, h in enumerate(header))
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="{"t" if i in text_cols else ""}">{c if raw else _e(c)}</td>' for i, c in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


# =============================================================================== sections


def _verdict_section(data: dict) -> str:
    verdict = data["verdict"]
    fg, bg = VERDICT_COLOURS.get(verdict, ("#1f2328", "#f6f8fa"))
    store, overall = data["store"], data["summary"]["overall"]
    mode = ("determinism check (the store was computed in fp32)" if data["mode"] == "determinism"
            else f"precision check: {store['precision_policy']} against fp32")
    reasons = "".join(f"<li>{_e(r)}</li>" for r in data["verdict_reasons"])
    notes = "".join(f"<div class=\"notes\">{_e(n)}</div>" for n in data["notes"])
    frac = overall["fraction_above_pass"]
    k = data["neighbours"]["k"]
    fb = data["store_figures"]["fallback"]
    cards = [
        (_cos(overall[measures.POOLED_COSINE]["min"]), "min pooled cosine"),
        (_cos(overall[measures.POOLED_COSINE]["median"]), "median pooled cosine"),
        (_num(overall[measures.POOLED_MAX_ABS_DIFF]["max"]), "max |difference| (pooled)"),
        (f"{_pct(frac['fraction'])} [{_pct(frac['ci95'][0])}, {_pct(frac['ci95'][1])}]",
         f"cosine >= {frac['threshold']:g} (95% CI)"),
        (_num(overall["overlap"]["median"]) if k else "n/a", f"median overlap@{k}"),
        (f"{fb['count']:,} ({_pct(fb['rate'])})", "fp32 fallbacks in the store"),
    ]
    card_html = "".join(f'<div class="card"><div class="v">{_e(v)}</div><div class="l">{_e(label)}</div></div>'
                        for v, label in cards)
    return (
        f'<section id="verdict"><h1>embedpipe cross-check: {_e(store["path"])}</h1>'
        f'<p class="sub">{_e(mode)}; {data["sample_size"]:,} of {store["records"]:,} records sampled '
        f'(seed {_e(data["sample_seed"])}), layers {_e(", ".join(map(str, store["layers"])))}; {_e(data["created_utc"])}</p>'
        f'<div class="verdict verdict-{_e(verdict)}" style="border-color:{fg};background:{bg}">'
        f'<div class="word" style="color:{fg}">{_e(verdict.upper())}</div><ul>{reasons}</ul></div>'
        f"{notes}<div class=\"cards\">{card_html}</div></section>"
    )


def _stat(cells: dict, m: measures.Measure, stat: str) -> str:
    """One aggregate of a measure in the report's format (absent: n/a)."""
    return (_cos if m.cosine else _num)((cells.get(m.key) or {}).get(stat))


def _layer_table(data: dict) -> str:
    """Per stored layer: the measures' per-layer columns (measures.py), the pass fraction,
    overlap and the record counts."""
    k = data["neighbours"]["k"]
    pooled = measures.per_layer_columns("pooled")
    residue = measures.per_layer_columns("residue") if data["store"]["per_residue"] else ()
    header = ["layer", "n", *(h for _, _, h in pooled), "cos >= pass, 95% CI", *(h for _, _, h in residue)]
    if k:
        header += [f"median overlap@{k}"]
    header += ["pass / warn / fail"]
    rows = []
    for layer in data["store"]["layers"]:
        e = data["summary"]["layers"][str(layer)]
        f = e["fraction_above_pass"]
        row = [_e(layer), _e(e["n"]), *(_stat(e, m, stat) for m, stat, _ in pooled),
               _e(f"{f['count']}/{f['n']} [{100 * f['ci95'][0]:.1f}, {100 * f['ci95'][1]:.1f}]%"),
               *(_stat(e, m, stat) for m, stat, _ in residue)]
        if k:
            row += [_num(e["overlap"]["median"])]
        s = e["status"]
        row += [f'<span class="pass">{s.get("pass", 0)}</span> / <span class="warn">{s.get("warn", 0)}</span> / '
                f'<span class="fail">{s.get("fail", 0)}</span>']
        rows.append(row)
    return _table(header, rows, raw=True)


def _length_bin_table(data: dict) -> str:
    """Per layer and length bin: the measures' per-length-bin columns (measures.py)."""
    columns = measures.per_length_bin_columns()
    rows = []
    for layer in data["store"]["layers"]:
        for b in data["summary"]["layers"][str(layer)]["by_length_bin"]:
            info = data["length_bins"][b["bin"]]
            close = "]" if info["closed_right"] else ")"
            rows.append([_e(layer), _e(f"[{format_count(b['min_length'])}, {format_count(b['max_length'])}{close}"),
                         _e(f"{info['records']:,}"), _e(b["n"]), *(_stat(b, m, stat) for m, stat, _ in columns)])
    return _table(["layer", "length bin", "records in store", "sampled", *(h for _, _, h in columns)], rows,
                  text_cols=(0, 1), raw=True)


def _overlap_table(data: dict) -> str:
    k = data["neighbours"]["k"]
    rows = []
    for layer in data["store"]["layers"]:
        o = data["summary"]["layers"][str(layer)]["overlap"]
        rows.append([str(layer), str(o["count"]), _num(o["min"]), _num(o["p5"]), _num(o["median"]), _num(o["mean"]),
                     _num(o["max"])])
    return _table(["layer", "records", f"min overlap@{k}", "p5", "median", "mean", "max"], rows)


def _worst_table(data: dict, limit: int = 12) -> str:
    def key(r: dict) -> float:
        c = r[measures.POOLED_COSINE]
        return -math.inf if c is None else c

    worst = sorted(data["records"], key=lambda r: (key(r), r["row"], r["layer"]))[:limit]
    per_residue = data["store"]["per_residue"]
    columns = measures.shown(per_residue)
    header = ["id", "layer", "length", "precision used", "chosen because", *(str(m.column) for m in columns),
              "overlap@k", "status"]
    rows = []
    for r in worst:
        row = [_e(r["id"]), _e(r["layer"]), _e(r["length"]),
               _e(r["precision_used"] + (f" ({r['fallback_reason']})" if r.get("fallback_reason") else "")),
               _e(", ".join(r.get("chosen_because", []))),
               *((_cos if m.cosine else _num)(r.get(m.key)) for m in columns),
               _num(r.get("overlap_at_k")), _status(r["status"])]
        rows.append(row)
    return _table(header, rows, text_cols=(0, 3, 4), raw=True)


def _sample_section(data: dict) -> str:
    """How the sample was drawn: each rule with its bound and what it found, then every
    sampled record with the reasons it was chosen for."""
    sampling = data["sampling"]
    rules = [[r["reason"], r["rule"], f"{r['bound']:,}", f"{r['eligible']:,}", f"{r['chosen']:,}"]
             for r in sampling["rules"]]
    text = (f"<p>{data['sample_size']:,} of {data['store']['records']:,} records sampled. Besides the random draw "
            "of --sample records, the sample always holds the store's longest records, its records over the model's "
            "window and its fp32 fallbacks, each group up to its bound (a larger group is spread evenly over its "
            f"lengths); so it never holds more than {sampling['max_size']:,} records. A record chosen by several "
            "rules is sampled once, with every reason. Risky records are over-represented: figures over the sample "
            "are pessimistic for the store as a whole.</p>")
    by_id: dict[str, dict] = {}
    for r in data["records"]:
        by_id.setdefault(r["id"], r)
    listed = [[r["id"], f"{r['row']:,}", f"{r['length']:,}", r["long_handling"],
               r["precision_used"] + (f" ({r['fallback_reason']})" if r.get("fallback_reason") else ""),
               ", ".join(r["chosen_because"])] for r in by_id.values()]
    return (_table(["chosen because", "rule", "bound", "eligible records", "chosen"], rules, text_cols=(0, 1)) + text
            + f"<details><summary>The {len(listed):,} sampled records</summary>"
            + _table(["id", "row", "length", "long handling", "precision used", "chosen because"], listed,
                     text_cols=(0, 3, 4, 5))
            + "</details>")


def _downstream_section(data: dict) -> str:
    """The user's labels: both scores per layer, the paired difference and its interval, agreement."""
    ds, tol = data["downstream"], data["thresholds"]["downstream_tolerance"]
    numbers = ds["kind"] == "numbers"
    header = ["layer", f"{ds['score']} stored", f"{ds['score']} fp32", "difference (stored - fp32)", "95% interval",
              f"within ±{tol:g}", "predictions agreeing"]
    if numbers:
        header[3:3] = ["Spearman stored", "Spearman fp32"]
    rows = []
    for layer, e in ds["layers"].items():
        lo, hi = e["ci95"]
        row = [_e(layer), _num(e["stored"]), _num(e["fp32"]), _e(f"{e['difference']:+.4f}"),
               _e(f"[{lo:+.4f}, {hi:+.4f}]"), _status("pass" if -tol <= lo and hi <= tol else
                                                      "fail" if hi < -tol or lo > tol else "warn"),
               _pct(e["agreement"])]
        if numbers:
            row[3:3] = [_num(e["spearman"]["stored"]), _num(e["spearman"]["fp32"])]
        rows.append(row)
    unknown = ds["unknown_ids"]
    classes = ", ".join(f"{name} ({count})" for name, count in ds["sampled_classes"].items())
    facts = [
        f"Labels {ds['labels']}: {ds['kind']} ({ds['kind_from']}); {ds['labelled_in_store']:,} of "
        f"{ds['label_lines']:,} labelled IDs are in the store"
        + (f" ({unknown['count']:,} not, left out: listed in crosscheck.json)" if unknown["count"] else "") + ".",
        f"{ds['sampled']:,} sampled" + (f": {classes}" if classes else "") + f". Model: {ds['model']}, "
        f"{ds['folds']} folds (seed {ds['fold_seed']}), the same folds for both inputs; scores over the out-of-fold "
        f"predictions; {ds['interval']} ({ds['bootstrap_resamples']:,} resamples); agreement: {ds['agreement_rule']}.",
    ]
    return (_table(header, rows, raw=True) + fold_scores(data)
            + "".join(f"<p>{_e(text)}</p>" for text in facts))


def _store_section(data: dict) -> str:
    fig = data["store_figures"]
    n = fig["records"]
    fb = fig["fallback"]
    fb_rows = [[reason, f"{v['count']:,}", _pct(v["rate"])] for reason, v in fb["by_reason"].items()]
    fb_rows.append(["all reasons", f"{fb['count']:,}", _pct(fb["rate"])])
    used_rows = [[key, f"{v['count']:,}", _pct(v["rate"])] for key, v in fig["precision_used"].items()]
    parts = [
        "<h3>fp32 fallback</h3>",
        _table(["reason", "records", "rate"], fb_rows),
        "<h3>Records per precision used</h3>",
        _table(["precision_used", "records", "share"], used_rows),
    ]
    act = fig.get("max_abs_activation")
    if act:
        parts.append("<h3>Max |activation| per record</h3>")
        parts.append(_table(["", "count", "non-finite", "min", "p5", "median", "p95", "max"],
                            [["all records", f"{act['count']:,}", f"{act['nonfinite']:,}", _num(act["min"]),
                              _num(act["p5"]), _num(act["median"]), _num(act["p95"]), _num(act["max"])]]
                            + [[f"precision_used = {key}", f"{v['count']:,}", f"{v['nonfinite']:,}", _num(v["min"]),
                                _num(v["p5"]), _num(v["median"]), _num(v["p95"]), _num(v["max"])]
                               for key, v in act.get("by_precision_used", {}).items()]))
        parts.append(activation_histogram(fig))
    if fig.get("long_handling"):
        parts.append("<h3>Long-sequence handling</h3>")
        parts.append(_table(["handling", "records"], [[k, f"{v:,}"] for k, v in fig["long_handling"].items()]))
    lengths = fig["length"]
    parts.append(f"<p>{n:,} records; lengths {format_count(lengths['min'])} to {format_count(lengths['max'])} "
                 f"(median {format_count(lengths['median'])}).</p>")
    return "".join(parts)


def _thresholds_section(data: dict) -> str:
    t = data["thresholds"]
    k = data["neighbours"]["k"]
    rows = [
        ["pass", f"every sampled record's pooled cosine >= {t['effective_pass_cosine']:g} in every stored layer, "
                 f"median overlap@{k} >= {t['pass_overlap']:g} in every layer, every sampled residue's cosine >= "
                 f"{t['residue_cosine']:g} (when stored), all values finite"],
        ["warn", f"some pooled cosine in [{t['fail_cosine']:g}, {t['effective_pass_cosine']:g}), or a median "
                 f"overlap@{k} below {t['pass_overlap']:g}, or a residue cosine below {t['residue_cosine']:g}, or a "
                 "reference model whose sha256 differs from the store's (--allow-model-mismatch)"],
        ["fail", f"any pooled cosine below {t['fail_cosine']:g}, any non-finite value, or the store and the fp32 "
                 "re-run disagree on what was embedded"],
    ]
    if data.get("downstream"):
        score = data["downstream"]["score"]
        rows[0][1] += (f", the 95% interval of the {score} difference on your labels within "
                       f"±{t['downstream_tolerance']:g} in every layer")
        rows[1][1] += f", or that interval reaching past ±{t['downstream_tolerance']:g}"
        rows[2][1] += f", or that interval wholly outside ±{t['downstream_tolerance']:g}"
    note = ""
    if data["mode"] == "determinism":
        note = (f"<p>The store was computed in fp32, so this is a determinism check: the pass cosine is "
                f"max(pass_cosine {t['pass_cosine']:g}, determinism_cosine {t['determinism_cosine']:g}).</p>")
    return (_table(["verdict", "rule"], [[_status(a), _e(b)] for a, b in rows], text_cols=(0, 1), raw=True) + note
            + "<p>Thresholds are set with <code>embedpipe crosscheck --pass-cosine --fail-cosine --pass-overlap "
              "--residue-cosine --determinism-cosine --downstream-tolerance</code>; see docs/crosscheck.md.</p>")


def _kv_rows(mapping: dict, prefix: str = "") -> list[list[str]]:
    rows = []
    for key in sorted(mapping):
        value = mapping[key]
        if isinstance(value, dict):
            rows.extend(_kv_rows(value, f"{prefix}{key}."))
        else:
            text = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
            rows.append([f"{prefix}{key}", text])
    return rows


def _provenance_section(data: dict) -> str:
    store, model, ref = data["store"], data["model"], data["reference"]
    rows = [
        ["store", store["path"]], ["store sha256", store["sha256"]], ["records", f"{store['records']:,}"],
        ["precision policy", store["precision_policy"]], ["storage dtype", store["storage_dtype"]],
        ["merged store", str(store["merged"])],
        ["reference model", model["path"]], ["model sha256", model["sha256"]],
        ["store's model sha256", str(model.get("expected_sha256"))],
        ["sha256 matches", str(model["sha256_matches"])], ["model trained", str(model["trained"])],
        ["reference", f"fp32 on {ref.get('device')}, attention {ref.get('attention')}, long sequences "
                      f"{ref.get('long_sequences')}, {ref.get('tokens_per_batch')} tokens per batch, "
                      f"{ref.get('seconds')} s"],
        ["sample", f"{data['sample_size']} of {store['records']} (requested {data['sample_requested']}), "
                   f"seed {data['sample_seed']}, {len(data['length_bins'])} length bin(s)"],
        ["embedpipe", data["embedpipe_version"]], ["report created", data["created_utc"]],
    ]
    reuse = data.get("reuse") or {}
    if reuse.get("reused_records"):  # embed --reuse: copies are the source's, cross-checked there
        rows.insert(-2, ["reused records", f"{reuse['reused_records']:,} copied, not computed (the sample is drawn "
                                           f"from {reuse['sampled_from']}); from " + ", ".join(
                                               f"{s['store_uuid']} ({s['path']}, {s['records']:,})"
                                               for s in reuse["sources"])])
    table = "".join(f'<tr><th class="t">{_e(a)}</th><td class="mono">{_e(b)}</td></tr>' for a, b in rows)
    prov = "".join(f'<tr><th class="t">{_e(a)}</th><td class="mono">{_e(b)}</td></tr>'
                   for a, b in _kv_rows(data["provenance"]))
    return (f'<table class="kv">{table}</table><details><summary>All store attributes</summary>'
            f'<table class="kv">{prov}</table></details>')


def render_html(data: dict) -> str:
    """The whole report page for the data of crosscheck.json."""
    k = data["neighbours"]["k"]
    sections: list[tuple[str, str, Callable[[], str]]] = [
        ("cosine", "Pooled cosine to fp32", lambda: cosine_histogram(data)),
        ("error-vs-length", "Error against length", lambda: error_scatter(data)),
        ("layers", "Per-layer summary", lambda: _layer_table(data)),
        ("length-bins", "By length bin", lambda: _length_bin_table(data)),
        ("sample", "How the sample was drawn", lambda: _sample_section(data)),
    ]
    if k:
        sections.append(("overlap", f"Downstream proxy: nearest-neighbour overlap@{k}",
                         lambda: overlap_bars(data) + _overlap_table(data)))
    if data.get("downstream"):
        sections.append(("downstream", f"Downstream: your labels ({data['downstream']['kind']})",
                         lambda: _downstream_section(data)))
    sections += [
        ("worst", "Records furthest from fp32", lambda: _worst_table(data)),
        ("store", "Whole store: fallbacks, precision used, activations", lambda: _store_section(data)),
        ("thresholds", "Verdict rules", lambda: _thresholds_section(data)),
        ("provenance", "Provenance", lambda: _provenance_section(data)),
    ]
    problems = ""
    if data.get("problems"):
        problems = "<div class=\"notes\"><b>Problems:</b><ul>" + "".join(
            f"<li>{_e(p)}</li>" for p in data["problems"]) + "</ul></div>"
    body = "".join(f'<section id="{sid}"><h2>{_e(title)}</h2>{render()}</section>' for sid, title, render in sections)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        "<link rel=\"icon\" href=\"data:,\">"
        f"<title>crosscheck {_e(data['verdict'].upper())}: {_e(data['store']['path'])}</title>"
        f"<style>{_CSS}</style></head><body><main>"
        f"{_verdict_section(data)}{problems}{body}</main></body></html>\n"
    )
