"""The cross-check's comparisons: each sampled record against its fp32 re-run, and the
downstream proxy overlap@k over every pooled vector of the store (docs/crosscheck.md,
"What it does", steps 3 and 4)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from embedpipe.core.progress import progress_bar
from embedpipe.crosscheck.measures import POOLED, RESIDUE
from embedpipe.crosscheck.metrics import compare_pooled, compare_residues, knn_overlap, top_k_neighbours
from embedpipe.store.reader import Store

__all__ = ["compare_records", "neighbour_overlap"]

#: what the cross-check does with vectors whose bytes differ from those written (row digests)
REFUSAL = "crosscheck refuses to judge them"
#: database rows scored per block in the neighbour search (float64 working set ~ rows x dim x 8)
_KNN_BLOCK_BYTES = 64 << 20


def compare_records(st: Store, sampled: list[dict], fp32: dict[int, Any],
                    layers: list[int]) -> tuple[list[dict], list[str]]:
    """One dict per sampled record and stored layer: pooled (and per-residue) figures against
    the fp32 re-run ``fp32[i]`` of ``sampled[i]``; and the problems: disagreements on what
    was embedded."""
    records: list[dict] = []
    problems: list[str] = []
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
                "chosen_because": s["chosen_because"],
                **{m.key: pooled[m.source] for m in POOLED},
                "stored_finite": bool(np.all(np.isfinite(stored))),
            }
            if st.has_per_residue and ref.per_residue is not None:
                stored_res = st.per_residue(s["id"], layer)
                st.check_digests(f"per_residue/layer_{layer}", slice(s["row"], s["row"] + 1), stored_res,
                                 np.array([0, len(stored_res)]), refusal=REFUSAL)
                rec["stored_finite"] = rec["stored_finite"] and bool(np.all(np.isfinite(stored_res)))
                ref_res = ref.per_residue[layer]
                if stored_res.shape != ref_res.shape:
                    problems.append(
                        f"record {s['id']!r} layer {layer}: {stored_res.shape[0]} stored residue rows, "
                        f"{ref_res.shape[0]} in the fp32 re-run"
                    )
                    residues = {m.source: math.nan for m in RESIDUE}
                else:
                    residues = compare_residues(stored_res, ref_res)
                rec.update({m.key: residues[m.source] for m in RESIDUE})
            records.append(rec)
    return records, problems


def _database_blocks(st: Store, layer: int, bar: Any) -> Iterator[tuple[int, np.ndarray]]:
    """The store's pooled vectors of ``layer`` in blocks that bound the search's memory."""
    arr = st.mean(layer)
    n, dim = arr.shape
    rows = max(1, _KNN_BLOCK_BYTES // max(1, dim * 8))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        block = np.asarray(arr[start:stop].compute())
        st.check_digests(f"mean/layer_{layer}", slice(start, stop), block, refusal=REFUSAL)
        bar.update(stop - start)
        yield start, block


def neighbour_overlap(st: Store, sampled: list[dict], fp32: dict[int, Any], layers: list[int], k: int,
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
