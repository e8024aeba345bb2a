"""The cross-check report as one self-contained HTML page.

:func:`render_html` turns the data of ``crosscheck.json`` (see :mod:`embedpipe.crosscheck`)
into a page with no external assets and no script: inline CSS, plots drawn here as inline
SVG. Every piece of text that comes from data is escaped. The order is the reader's: the
verdict and its reasons first, then the figures that support it, then whole-store context
and provenance.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["LAYER_COLOURS", "render_html"]

#: one colour per stored layer (cycled); also used by the browser test to find the plots
LAYER_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")
VERDICT_COLOURS = {"pass": ("#1b7f3b", "#e6f4ea"), "warn": ("#9a6700", "#fff4d6"), "fail": ("#b3261e", "#fde7e7")}
#: smallest 1 - cosine / relative error drawn on log axes; smaller values sit on this floor
LOG_FLOOR = 1e-9

_CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Liberation Sans", sans-serif;
       color: #1f2328; background: #ffffff; margin: 0; }
main { max-width: 1200px; margin: 0 auto; padding: 24px 28px 48px; }
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
td.mono { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; text-align: left;
          word-break: break-all; }
.pass { color: #1b7f3b; } .warn { color: #9a6700; } .fail { color: #b3261e; font-weight: 600; }
figure { margin: 8px 0 16px; }
figcaption { color: #57606a; font-size: 12px; max-width: 760px; }
svg { display: block; background: #ffffff; }
svg text { font: 11px system-ui, "Liberation Sans", sans-serif; fill: #1f2328; }
.legend span.sw { display: inline-block; width: 12px; height: 12px; margin: 0 4px -2px 10px; }
details { margin: 6px 0; }
"""


# =============================================================================== formatting


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _num(x: Any, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "n/a"
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}"
    return str(x)


def _cos(x: Any) -> str:
    """A cosine with enough decimals to show how far below 1 it is (at least 6, at most 9)."""
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    gap = 1.0 - x
    digits = 6
    if 0 < gap < 1e-5:
        digits = min(9, math.ceil(-math.log10(gap)) + 1)
    return f"{x:.{digits}f}"


def _pct(x: Any) -> str:
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    return f"{100 * x:.1f}%"


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


def _colour(i: int) -> str:
    return LAYER_COLOURS[i % len(LAYER_COLOURS)]


# =============================================================================== SVG plotting


class _Plot:
    """A minimal 2-D plot in SVG: linear or log10 axes, ticks, and a few mark types."""

    def __init__(self, x_range: tuple[float, float], y_range: tuple[float, float], *, xlog: bool = False,
                 ylog: bool = False, width: int = 720, height: int = 280, label: str = "") -> None:
        self.xlog, self.ylog = xlog, ylog
        self.width, self.height = width, height
        self.left, self.right, self.top, self.bottom = 70, 20, 14, 46
        self.x0, self.x1 = self._prep(x_range, xlog)
        self.y0, self.y1 = self._prep(y_range, ylog)
        self.parts: list[str] = []
        self.label = label

    @staticmethod
    def _prep(rng: tuple[float, float], log: bool) -> tuple[float, float]:
        lo, hi = float(rng[0]), float(rng[1])
        if log:
            lo, hi = math.log10(max(lo, LOG_FLOOR)), math.log10(max(hi, LOG_FLOOR))
        if not math.isfinite(lo) or not math.isfinite(hi):
            lo, hi = 0.0, 1.0
        if hi <= lo:
            hi = lo + 1.0
        return lo, hi

    def px(self, x: float) -> float:
        v = math.log10(max(x, LOG_FLOOR)) if self.xlog else x
        span = self.width - self.left - self.right
        return self.left + (v - self.x0) / (self.x1 - self.x0) * span

    def py(self, y: float) -> float:
        v = math.log10(max(y, LOG_FLOOR)) if self.ylog else y
        span = self.height - self.top - self.bottom
        return self.height - self.bottom - (v - self.y0) / (self.y1 - self.y0) * span

    def clamp_x(self, x: float) -> float:
        return min(max(x, self.left), self.width - self.right)

    # -- marks ---------------------------------------------------------------------------------
    def rect(self, x0: float, x1: float, y0: float, y1: float, fill: str, opacity: float = 1.0, title: str = "") -> None:
        a, b = sorted((self.clamp_x(self.px(x0)), self.clamp_x(self.px(x1))))
        c, d = sorted((self.py(y0), self.py(y1)))
        t = f"<title>{_e(title)}</title>" if title else ""
        op = f' fill-opacity="{opacity:g}"' if opacity < 1 else ""
        self.parts.append(
            f'<rect x="{a:.2f}" y="{c:.2f}" width="{max(b - a, 0.5):.2f}" height="{max(d - c, 0.0):.2f}" '
            f'fill="{fill}"{op}>{t}</rect>'
        )

    def band(self, x0: float, x1: float, fill: str) -> None:
        """A full-height background band between x0 and x1 (data units)."""
        a, b = sorted((self.clamp_x(self.px(x0)), self.clamp_x(self.px(x1))))
        if b - a <= 0:
            return
        self.parts.append(
            f'<rect x="{a:.2f}" y="{self.top}" width="{b - a:.2f}" height="{self.height - self.top - self.bottom}" '
            f'fill="{fill}"/>'
        )

    def vline(self, x: float, colour: str, text: str = "", dash: str = "5,3") -> None:
        p = self.px(x)
        if not self.left <= p <= self.width - self.right:
            return
        self.parts.append(
            f'<line x1="{p:.2f}" x2="{p:.2f}" y1="{self.top}" y2="{self.height - self.bottom}" stroke="{colour}" '
            f'stroke-width="1.5" stroke-dasharray="{dash}"/>'
        )
        if text:
            right = p > self.width - self.right - 80  # near the right edge: label on the left of the line
            x, anchor = (p - 3, "end") if right else (p + 3, "start")
            self.parts.append(f'<text x="{x:.2f}" y="{self.top + 11}" text-anchor="{anchor}" '
                              f'style="fill:{colour}">{_e(text)}</text>')

    def circle(self, x: float, y: float, colour: str, title: str = "") -> None:
        t = f"<title>{_e(title)}</title>" if title else ""
        self.parts.append(
            f'<circle cx="{self.px(x):.2f}" cy="{self.py(y):.2f}" r="4" fill="{colour}" stroke="#ffffff" '
            f'stroke-width="0.8">{t}</circle>'
        )

    # -- axes ----------------------------------------------------------------------------------
    @staticmethod
    def _ticks(lo: float, hi: float, log: bool) -> list[tuple[float, str]]:
        if log:
            start, stop = math.ceil(lo - 1e-9), math.floor(hi + 1e-9)
            step = max(1, math.ceil((stop - start + 1) / 9))
            return [(10.0 ** e, f"1e{e}") for e in range(start, stop + 1, step)]
        span = hi - lo
        raw = span / 6
        mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
        step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
        first = math.ceil(lo / step) * step
        out, v = [], first
        while v <= hi + step * 1e-9:
            label = f"{v:.0f}" if step >= 1 else f"{v:.{max(0, -math.floor(math.log10(step)) + 1)}f}"
            out.append((v, label))
            v += step
        return out

    def axes(self, xlabel: str, ylabel: str, xticks: list[tuple[float, str]] | None = None) -> None:
        bottom, right = self.height - self.bottom, self.width - self.right
        out = [f'<rect x="{self.left}" y="{self.top}" width="{right - self.left}" height="{bottom - self.top}" '
               f'fill="none" stroke="#8c959f"/>']
        xt = xticks if xticks is not None else self._ticks(self.x0, self.x1, self.xlog)
        for value, text in xt:
            p = self.px(value)
            if self.left - 0.5 <= p <= right + 0.5:
                out.append(f'<line x1="{p:.2f}" x2="{p:.2f}" y1="{bottom}" y2="{bottom + 4}" stroke="#57606a"/>')
                out.append(f'<text x="{p:.2f}" y="{bottom + 16}" text-anchor="middle">{_e(text)}</text>')
        for value, text in self._ticks(self.y0, self.y1, self.ylog):
            p = self.py(value)
            if self.top - 0.5 <= p <= bottom + 0.5:
                out.append(f'<line x1="{self.left - 4}" x2="{self.left}" y1="{p:.2f}" y2="{p:.2f}" stroke="#57606a"/>')
                out.append(f'<line x1="{self.left}" x2="{right}" y1="{p:.2f}" y2="{p:.2f}" stroke="#eaeef2"/>')
                out.append(f'<text x="{self.left - 7}" y="{p + 4:.2f}" text-anchor="end">{_e(text)}</text>')
        out.append(f'<text x="{(self.left + right) / 2:.1f}" y="{self.height - 8}" text-anchor="middle">{_e(xlabel)}</text>')
        out.append(
            f'<text transform="translate(14,{(self.top + bottom) / 2:.1f}) rotate(-90)" text-anchor="middle">{_e(ylabel)}</text>'
        )
        # grid lines go under the marks, frame and labels over them
        grid = [p for p in out if 'stroke="#eaeef2"' in p]
        rest = [p for p in out if 'stroke="#eaeef2"' not in p]
        self.parts = grid + self.parts + rest

    def svg(self, css_class: str) -> str:
        return (
            f'<svg class="plot {css_class}" width="{self.width}" height="{self.height}" '
            f'viewBox="0 0 {self.width} {self.height}" role="img" aria-label="{_e(self.label)}">'
            + "".join(self.parts)
            + "</svg>"
        )


def _legend(layers: Sequence[int]) -> str:
    items = "".join(f'<span class="sw" style="background:{_colour(i)}"></span>layer {_e(layer)}'
                    for i, layer in enumerate(layers))
    return f'<div class="legend">{items}</div>'


def _finite_values(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def _cosine_histogram(data: dict) -> str:
    layers = data["store"]["layers"]
    t = data["thresholds"]
    pass_cos, fail_cos = t["effective_pass_cosine"], t["fail_cosine"]
    series = {layer: [1.0 - v for v in _finite_values(r["pooled_cosine"] for r in data["records"] if r["layer"] == layer)]
              for layer in layers}
    everything = [v for vs in series.values() for v in vs]
    missing = sum(1 for r in data["records"] if r["pooled_cosine"] is None)
    positive = [v for v in everything if v > LOG_FLOOR]
    lo = math.floor(math.log10(min(positive))) if positive else -7
    lo = min(lo, math.floor(math.log10(max(1.0 - pass_cos, LOG_FLOOR))) - 1)
    lo = max(lo, round(math.log10(LOG_FLOOR)))
    hi = math.ceil(math.log10(max(everything))) if everything and max(everything) > LOG_FLOOR else lo + 1
    hi = max(hi, math.ceil(math.log10(max(1.0 - fail_cos, LOG_FLOOR))) + 1, lo + 1)
    hi = min(hi, 1)  # 1 - cosine <= 2
    per_decade = 4
    edges = [10 ** (lo + i / per_decade) for i in range((hi - lo) * per_decade + 1)]
    counts = {layer: [0] * (len(edges) - 1) for layer in layers}
    for layer, values in series.items():
        for v in values:
            v = min(max(v, edges[0]), edges[-1])
            idx = min(int((math.log10(v) - lo) * per_decade), len(edges) - 2)
            counts[layer][idx] += 1
    top = max([c for cs in counts.values() for c in cs] + [1])
    plot = _Plot((edges[0], edges[-1]), (0, top * 1.1), xlog=True, label="histogram of 1 - pooled cosine")
    plot.band(edges[0], 1.0 - pass_cos, "#eef7f0")
    plot.band(1.0 - pass_cos, 1.0 - fail_cos, "#fff7e0")
    plot.band(1.0 - fail_cos, edges[-1], "#fdeeee")
    n_layers = max(1, len(layers))
    for b in range(len(edges) - 1):
        a, z = math.log10(edges[b]), math.log10(edges[b + 1])
        width = (z - a) / n_layers
        for i, layer in enumerate(layers):
            c = counts[layer][b]
            if c:
                x0, x1 = 10 ** (a + i * width + 0.05 * width), 10 ** (a + (i + 1) * width - 0.05 * width)
                label = f"layer {layer}: {c} record(s) with 1 - cosine in [{edges[b]:.2e}, {edges[b + 1]:.2e})"
                plot.rect(x0, x1, 0, c, _colour(i), title=label)
    plot.vline(1.0 - pass_cos, "#1b7f3b", f"pass {pass_cos:g}")
    plot.vline(1.0 - fail_cos, "#b3261e", f"fail {fail_cos:g}")
    plot.axes("1 - pooled cosine to fp32 (log scale; further left = closer to fp32)", "records")
    extra = f" {missing} non-finite value(s) are not drawn." if missing else ""
    return (
        f"<figure>{plot.svg('cosine-histogram')}{_legend(layers)}<figcaption>Pooled (mean over residues) cosine "
        f"similarity of each sampled record's stored vector to its fp32 recomputation, drawn as 1 - cosine on a log "
        f"axis; values below {LOG_FLOOR:g} (including exact agreement) sit in the leftmost bin. Green: pass, "
        f"amber: warn, red: fail.{_e(extra)}</figcaption></figure>"
    )


def _error_scatter(data: dict) -> str:
    layers = data["store"]["layers"]
    recs = [r for r in data["records"] if isinstance(r.get("pooled_rel_l2"), (int, float))]
    lengths = [r["length"] for r in data["records"]] or [1]
    errors = [max(r["pooled_rel_l2"], LOG_FLOOR) for r in recs]
    ylo = 10 ** math.floor(math.log10(min(errors))) if errors else 1e-7
    yhi = 10 ** math.ceil(math.log10(max(errors))) if errors else 1e-1
    if yhi <= ylo:
        yhi = ylo * 10
    xmax = max(lengths)
    plot = _Plot((0, xmax * 1.04 + 1), (ylo, yhi), ylog=True, label="relative L2 error against length")
    for b in data["length_bins"][1:]:
        plot.vline(b["min_length"], "#afb8c1", "", dash="2,3")
    index = {layer: i for i, layer in enumerate(layers)}
    for r in recs:
        i = index.get(r["layer"], 0)
        plot.circle(r["length"], max(r["pooled_rel_l2"], LOG_FLOOR), _colour(i),
                    title=f"{r['id']} (layer {r['layer']}, {r['length']} residues): relative L2 {r['pooled_rel_l2']:.3e}, "
                          f"cosine {_cos(r['pooled_cosine'])}, {r['precision_used']}")
    plot.axes("sequence length (residues); dotted lines: length-bin edges", "relative L2 error (log)")
    return (
        f"<figure>{plot.svg('error-scatter')}{_legend(layers)}<figcaption>Relative L2 error "
        f"||stored - fp32|| / ||fp32|| of each sampled record's pooled vector against its length. Values below "
        f"{LOG_FLOOR:g} are drawn on that floor.</figcaption></figure>"
    )


def _overlap_bars(data: dict) -> str:
    k = data["neighbours"]["k"]
    layers = data["store"]["layers"]
    hists = {layer: data["summary"]["layers"][str(layer)].get("overlap_histogram", {}) for layer in layers}
    top = max([int(v) for h in hists.values() for v in h.values()] + [1])
    plot = _Plot((-0.5, k + 0.5), (0, top * 1.1), label=f"overlap@{k} histogram")
    n_layers = max(1, len(layers))
    for j in range(k + 1):
        for i, layer in enumerate(layers):
            c = int(hists[layer].get(str(j), 0))
            if c:
                w = 0.8 / n_layers
                x0 = j - 0.4 + i * w
                plot.rect(x0, x0 + w * 0.92, 0, c, _colour(i), title=f"layer {layer}: {c} record(s) with {j}/{k} shared")
    ticks = [(float(j), f"{j}/{k}") for j in range(k + 1)]
    plot.axes(f"neighbours shared between the stored-vector and the fp32-vector query (of {k})", "records", xticks=ticks)
    return (
        f"<figure>{plot.svg('overlap-histogram')}{_legend(layers)}<figcaption>For each sampled record, its {k} "
        f"nearest neighbours by cosine among all {data['neighbours']['database_records']:,} pooled vectors of the "
        f"store (itself excluded), found once with the stored vector and once with the fp32 vector as the query. "
        f"{k}/{k} means the fp32 vector would have retrieved exactly the same neighbours.</figcaption></figure>"
    )


def _activation_histogram(figures: dict) -> str:
    hist = figures.get("max_abs_activation", {}).get("histogram")
    if not hist:
        return ""
    edges, counts = hist["edges"], hist["counts"]
    plot = _Plot((edges[0], edges[-1]), (0, max(counts + [1]) * 1.1), xlog=True, height=220,
                 label="max activation histogram")
    for a, b, c in zip(edges, edges[1:], counts):
        if c:
            plot.rect(a * 1.02, b / 1.02, 0, c, "#8c8c8c", title=f"{c} record(s) with max |activation| in [{a:.3g}, {b:.3g})")
    plot.vline(65504.0, "#b3261e", "fp16 max")
    plot.axes("largest |activation| of the record in the store's policy pass (log scale)", "records")
    return f"<figure>{plot.svg('activation-histogram')}<figcaption>Every record of the store.</figcaption></figure>"


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
        (_cos(overall["pooled_cosine"]["min"]), "min pooled cosine"),
        (_cos(overall["pooled_cosine"]["median"]), "median pooled cosine"),
        (_num(overall["pooled_max_abs_diff"]["max"]), "max |difference| (pooled)"),
        (f"{_pct(frac['fraction'])} [{_pct(frac['ci95'][0])}, {_pct(frac['ci95'][1])}]",
         f"cosine >= {frac['threshold']:g} (95% CI)"),
        (_num(overall["overlap"]["median"]) if k else "n/a", f"median overlap@{k}"),
        (f"{fb['count']:,} ({_pct(fb['rate'])})", "fp32 fallbacks in the store"),
    ]
    card_html = "".join(f'<div class="card"><div class="v">{_e(v)}</div><div class="l">{_e(l)}</div></div>'
                        for v, l in cards)
    return (
        f'<section id="verdict"><h1>embedpipe cross-check: {_e(store["path"])}</h1>'
        f'<p class="sub">{_e(mode)}; {data["sample_size"]:,} of {store["records"]:,} records sampled '
        f'(seed {_e(data["sample_seed"])}), layers {_e(", ".join(map(str, store["layers"])))}; {_e(data["created_utc"])}</p>'
        f'<div class="verdict verdict-{_e(verdict)}" style="border-color:{fg};background:{bg}">'
        f'<div class="word" style="color:{fg}">{_e(verdict.upper())}</div><ul>{reasons}</ul></div>'
        f"{notes}<div class=\"cards\">{card_html}</div></section>"
    )


def _layer_table(data: dict) -> str:
    k = data["neighbours"]["k"]
    per_residue = data["store"]["per_residue"]
    header = ["layer", "n", "min cos", "p1 cos", "p5 cos", "median cos", "max cos", "max |diff|", "median rel L2",
              "max rel L2", "cos >= pass, 95% CI"]
    if per_residue:
        header += ["min residue cos"]
    if k:
        header += [f"median overlap@{k}"]
    header += ["pass / warn / fail"]
    rows = []
    for layer in data["store"]["layers"]:
        e = data["summary"]["layers"][str(layer)]
        c, f = e["pooled_cosine"], e["fraction_above_pass"]
        row = [_e(layer), _e(e["n"]), _cos(c["min"]), _cos(c["p1"]), _cos(c["p5"]), _cos(c["median"]), _cos(c["max"]),
               _num(e["pooled_max_abs_diff"]["max"]), _num(e["pooled_rel_l2"]["median"]), _num(e["pooled_rel_l2"]["max"]),
               _e(f"{f['count']}/{f['n']} [{100 * f['ci95'][0]:.1f}, {100 * f['ci95'][1]:.1f}]%")]
        if per_residue:
            row += [_cos((e.get("residue_min_cosine") or {}).get("min"))]
        if k:
            row += [_num(e["overlap"]["median"])]
        s = e["status"]
        row += [f'<span class="pass">{s.get("pass", 0)}</span> / <span class="warn">{s.get("warn", 0)}</span> / '
                f'<span class="fail">{s.get("fail", 0)}</span>']
        rows.append(row)
    return _table(header, rows, raw=True)


def _bin_table(data: dict) -> str:
    rows = []
    for layer in data["store"]["layers"]:
        for b in data["summary"]["layers"][str(layer)]["by_length_bin"]:
            info = data["length_bins"][b["bin"]]
            close = "]" if info["closed_right"] else ")"
            rows.append([str(layer), f"[{b['min_length']:g}, {b['max_length']:g}{close}", f"{info['records']:,}",
                         str(b["n"]), _cos(b["pooled_cosine"]["min"]), _cos(b["pooled_cosine"]["median"]),
                         _num(b["pooled_rel_l2"]["median"]), _num(b["pooled_rel_l2"]["max"]),
                         _num(b["pooled_max_abs_diff"]["max"])])
    return _table(["layer", "length bin", "records in store", "sampled", "min cos", "median cos", "median rel L2",
                   "max rel L2", "max |diff|"], rows, text_cols=(0, 1))


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
        c = r["pooled_cosine"]
        return -math.inf if c is None else c

    worst = sorted(data["records"], key=lambda r: (key(r), r["row"], r["layer"]))[:limit]
    per_residue = data["store"]["per_residue"]
    header = ["id", "layer", "length", "precision used", "pooled cos", "max |diff|", "rel L2"]
    if per_residue:
        header += ["min residue cos"]
    header += ["overlap@k", "status"]
    rows = []
    for r in worst:
        row = [_e(r["id"]), _e(r["layer"]), _e(r["length"]),
               _e(r["precision_used"] + (f" ({r['fallback_reason']})" if r.get("fallback_reason") else "")),
               _cos(r["pooled_cosine"]), _num(r["pooled_max_abs_diff"]), _num(r["pooled_rel_l2"])]
        if per_residue:
            row += [_cos(r.get("residue_min_cosine"))]
        row += [_num(r.get("overlap_at_k")), _status(r["status"])]
        rows.append(row)
    return _table(header, rows, text_cols=(0, 3), raw=True)


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
        parts.append(_activation_histogram(fig))
    if fig.get("long_handling"):
        parts.append("<h3>Long-sequence handling</h3>")
        parts.append(_table(["handling", "records"], [[k, f"{v:,}"] for k, v in fig["long_handling"].items()]))
    lengths = fig["length"]
    parts.append(f"<p>{n:,} records; lengths {_num(lengths['min'])} to {_num(lengths['max'])} "
                 f"(median {_num(lengths['median'])}).</p>")
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
    note = ""
    if data["mode"] == "determinism":
        note = (f"<p>The store was computed in fp32, so this is a determinism check: the pass cosine is "
                f"max(pass_cosine {t['pass_cosine']:g}, determinism_cosine {t['determinism_cosine']:g}).</p>")
    return (_table(["verdict", "rule"], [[_status(a), _e(b)] for a, b in rows], text_cols=(0, 1), raw=True) + note
            + "<p>Thresholds are set with <code>embedpipe crosscheck --pass-cosine --fail-cosine --pass-overlap "
              "--residue-cosine --determinism-cosine</code>; see docs/crosscheck.md.</p>")


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
    table = "".join(f'<tr><th class="t">{_e(a)}</th><td class="mono">{_e(b)}</td></tr>' for a, b in rows)
    prov = "".join(f'<tr><th class="t">{_e(a)}</th><td class="mono">{_e(b)}</td></tr>'
                   for a, b in _kv_rows(data["provenance"]))
    return (f"<table>{table}</table><details><summary>All store attributes</summary><table>{prov}</table></details>")


def render_html(data: dict) -> str:
    """The whole report page for the data of crosscheck.json."""
    k = data["neighbours"]["k"]
    sections: list[tuple[str, str, Callable[[], str]]] = [
        ("cosine", "Pooled cosine to fp32", lambda: _cosine_histogram(data)),
        ("error-vs-length", "Error against length", lambda: _error_scatter(data)),
        ("layers", "Per-layer summary", lambda: _layer_table(data)),
        ("length-bins", "By length bin", lambda: _bin_table(data)),
    ]
    if k:
        sections.append(("overlap", f"Downstream proxy: nearest-neighbour overlap@{k}",
                         lambda: _overlap_bars(data) + _overlap_table(data)))
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
