"""The cross-check page's figures, drawn as inline SVG (no script, no external assets).

:class:`_Plot` is a minimal 2-D plot (linear or log10 axes, ticks, bars, bands, points);
the functions below turn the data of ``crosscheck.json`` into the page's figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from embedpipe.crosscheck.formatting import escape as _e
from embedpipe.crosscheck.formatting import format_cosine

__all__ = ["LAYER_COLOURS", "LOG_FLOOR", "activation_histogram", "cosine_histogram", "error_scatter", "fold_scores",
           "overlap_bars"]

#: one colour per stored layer (cycled); also used by the browser test to find the plots
LAYER_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")
#: smallest 1 - cosine / relative error drawn on log axes; smaller values sit on this floor
LOG_FLOOR = 1e-9


def _colour(i: int) -> str:
    return LAYER_COLOURS[i % len(LAYER_COLOURS)]


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

    def circle(self, x: float, y: float, colour: str, title: str = "", hollow: bool = False) -> None:
        t = f"<title>{_e(title)}</title>" if title else ""
        fill, stroke, width = ("#ffffff", colour, 2) if hollow else (colour, "#ffffff", 0.8)
        self.parts.append(
            f'<circle cx="{self.px(x):.2f}" cy="{self.py(y):.2f}" r="4" fill="{fill}" stroke="{stroke}" '
            f'stroke-width="{width:g}">{t}</circle>'
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
        out: list[tuple[float, str]] = []
        v: float = first
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


def cosine_histogram(data: dict) -> str:
    """Histogram of 1 - pooled cosine per layer on a log axis, with the pass/warn/fail bands."""
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
        f"axis; values below {edges[0]:.0e} (where the axis starts; exact agreement too) sit in the leftmost bin. "
        f"Green: pass, "
        f"amber: warn, red: fail.{_e(extra)}</figcaption></figure>"
    )


def error_scatter(data: dict) -> str:
    """Relative L2 error of each sampled record against its length (long records drift more)."""
    layers = data["store"]["layers"]
    recs = [r for r in data["records"] if isinstance(r.get("pooled_rel_l2"), (int, float))]
    # the whole input: up to the store's longest record, not the sample's
    lengths = [r["length"] for r in data["records"]] + [data["store_figures"]["length"]["max"] or 1]
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
                          f"cosine {format_cosine(r['pooled_cosine'])}, {r['precision_used']}; chosen because: "
                          f"{', '.join(r.get('chosen_because', []))}")
    plot.axes("sequence length (residues); dotted lines: length-bin edges", "relative L2 error (log)")
    return (
        f"<figure>{plot.svg('error-scatter')}{_legend(layers)}<figcaption>Relative L2 error "
        f"||stored - fp32|| / ||fp32|| of each sampled record's pooled vector against its length. The length axis "
        f"covers every record of the store, up to its longest ({xmax:,.0f} residues). Values below "
        f"{LOG_FLOOR:g} are drawn on that floor.</figcaption></figure>"
    )


def overlap_bars(data: dict) -> str:
    """How many of its k neighbours each record keeps when the fp32 vector is the query."""
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


def activation_histogram(figures: dict) -> str:
    """Every record's largest |activation|, against the fp16 maximum (where overflow starts)."""
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


def fold_scores(data: dict) -> str:
    """Each fold's downstream score per layer: stored (filled) beside fp32 (hollow), joined
    by a line, so a fold where the stored vectors score differently stands out."""
    ds = data["downstream"]
    layers = list(ds["layers"])
    folds = int(ds["folds"])
    values = [v for e in ds["layers"].values() for v in _finite_values(e["per_fold"]["stored"] + e["per_fold"]["fp32"])]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    pad = max((hi - lo) * 0.1, 0.02)
    plot = _Plot((-0.5, len(layers) * (folds + 1) - 1.5), (lo - pad, hi + pad), height=240,
                 label=f"per-fold {ds['score']}")
    ticks = []
    for i, layer in enumerate(layers):
        entry = ds["layers"][layer]
        for j, (a, b) in enumerate(zip(entry["per_fold"]["stored"], entry["per_fold"]["fp32"])):
            x = i * (folds + 1) + j
            if a is None or b is None:
                continue
            plot.parts.append(f'<line x1="{plot.px(x):.2f}" x2="{plot.px(x):.2f}" y1="{plot.py(a):.2f}" '
                              f'y2="{plot.py(b):.2f}" stroke="#8c959f" stroke-width="1"/>')
            plot.circle(x, b, _colour(i), title=f"layer {layer}, fold {j + 1}: {ds['score']} {b:.4f} on fp32 vectors",
                        hollow=True)
            plot.circle(x, a, _colour(i), title=f"layer {layer}, fold {j + 1}: {ds['score']} {a:.4f} on stored vectors")
        ticks.append((i * (folds + 1) + (folds - 1) / 2, f"layer {layer}"))
    plot.axes(f"fold 1..{folds} of each stored layer", f"{ds['score']} on the held-out fold", xticks=ticks)
    return (
        f"<figure>{plot.svg('fold-scores')}{_legend([int(x) for x in layers])}<figcaption>The {ds['score']} of each "
        f"of the {folds} held-out folds: filled, the model fitted on the stored vectors; hollow, the same model "
        f"fitted on their fp32 recomputation, on the same folds. Where the two marks coincide the precision "
        f"policy did not change that fold's result.</figcaption></figure>"
    )
