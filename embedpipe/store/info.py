"""``embedpipe info``: provenance, counts, precision/fallback statistics and sizes of a store,
as JSON-friendly data (:func:`store_info`) and as text (:func:`render_info`).

Per-record columns are read block by block, as ``validate`` reads them: string columns as
their distinct values per block, numbers summed, maximised or summarised in passes
(:func:`embedpipe.core.stats.streamed_summary`). Before, every string of ``precision_used``,
``fallback_reason`` and ``long_handling`` was a Python string at once (~135 bytes a record: a
UniRef50-sized store, 60M records, ~8 GB; a crafted 2.6 MB store 1.16 GB).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.core.stats import streamed_summary
from embedpipe.core.units import human_bytes
from embedpipe.store.format import (
    check_format,
    dataset_label,
    open_h5,
    poolings_of,
    read_blocks,
    read_root_attrs,
    stored_layers,
    string_counts,
)
from embedpipe.store.merged_provenance import platform_lines, platforms
from embedpipe.store.sources import source_problems

#: root attributes shown as the format line, not as provenance
_FORMAT_ATTRS = ("format", "format_version", "complete", "encoding-type", "encoding-version")


#: rows of a string column read at a time (its distinct values decoded per block)
STRING_ROWS = 1 << 18
#: distinct values of a string column counted one by one; rows holding any further value are
#: counted together under :data:`OTHER_VALUES` (a crafted store with a value per record held
#: one counter entry per record)
MAX_DISTINCT = 1000
OTHER_VALUES = "(other values)"


def _blocks(f: h5py.File, name: str) -> Callable[[], Iterator[np.ndarray]]:
    """The blocks of column ``name`` (about READ_BLOCK_BYTES each), read anew on each call."""
    return lambda: (block for _, block in read_blocks(f[name], name, f.filename))


def _distribution(f: h5py.File, name: str) -> dict[str, Any]:
    """count (finite values), nonfinite, and min/median/max of the finite values."""
    agg = streamed_summary(_blocks(f, name))
    return {**agg, "count": agg["count"] - agg["nonfinite"]}


def _total(f: h5py.File, name: str) -> int:
    return sum(int(np.sum(block, dtype=np.int64)) for block in _blocks(f, name)())


def _value_counts(f: h5py.File, name: str) -> dict[str, int]:
    """How many rows hold each value of string column ``name``; beyond :data:`MAX_DISTINCT`
    values, the rest counted as :data:`OTHER_VALUES`."""
    counts: Counter[str] = Counter()
    for values, rows in string_counts(f[name], dataset_label(f[name]), STRING_ROWS):
        for value, k in zip(values, rows.tolist()):
            counts[value if value in counts or len(counts) < MAX_DISTINCT else OTHER_VALUES] += k
    return dict(counts)


def _counts(f: h5py.File, n: int) -> dict[str, Any]:
    counts: dict[str, Any] = {"records": n}
    if "length" in f:
        counts["residues"] = _total(f, "length")
    if "embedded_length" in f:
        counts["embedded_residues"] = _total(f, "embedded_length")
    if "per_residue/offsets" in f:
        counts["per_residue_rows"] = int(f["per_residue/offsets"][-1]) if n else 0
    return counts


def _record_stats(f: h5py.File, n: int) -> dict[str, Any]:
    """Precision used, fallbacks, max |activation|, long-sequence handling, windows."""
    info: dict[str, Any] = {}
    if "precision_used" in f:
        info["precision_used"] = _value_counts(f, "precision_used")
    if "fallback_reason" in f:
        reasons = {r: k for r, k in _value_counts(f, "fallback_reason").items() if r}
        total = sum(reasons.values())
        info["fallback"] = {"count": total, "rate": (total / n) if n else 0.0, "by_reason": reasons}
    if "max_abs_activation" in f:
        info["max_abs_activation"] = _distribution(f, "max_abs_activation")
    if "long_handling" in f:
        info["long_handling"] = _value_counts(f, "long_handling")
    if "windows" in f and n:
        info["windows"] = {"max": max(int(np.max(block)) for block in _blocks(f, "windows")() if block.size)}
    return info


def _reused(attrs: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Records copied by ``embed --reuse``, per source store: the root's ``reused_count`` and
    ``reused_sources`` (a merged store's: summed per source uuid, store/reuse_index.py); a store
    without them copied none (docs/store-format.md, ``reused_from``)."""
    listed = attrs.get("reused_sources") or "[]"
    try:
        sources = json.loads(listed) if isinstance(listed, str) else list(listed)
    except ValueError:
        raise StoreError(f"{path}: root attribute reused_sources is not a JSON list: {str(listed)[:80]!r}") from None
    return {"count": int(attrs.get("reused_count", 0)), "sources": sources}


def _datasets(f: h5py.File) -> dict[str, Any]:
    datasets: dict[str, Any] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            datasets[name] = {
                "shape": list(obj.shape),
                "dtype": str(obj.dtype),
                "stored_bytes": int(obj.id.get_storage_size()),
                "virtual": bool(obj.is_virtual),
            }

    f.visititems(visit)
    return datasets


def _info(f: h5py.File, path: Path, version: int) -> dict[str, Any]:
    attrs = read_root_attrs(f)
    n = int(f["ids"].shape[0]) if "ids" in f else 0
    info: dict[str, Any] = {
        "path": str(path),
        "file_size": path.stat().st_size,
        "format": attrs.get("format"),
        "format_version": version,
        "complete": bool(attrs.get("complete", False)),
        "provenance": {k: v for k, v in attrs.items() if k not in _FORMAT_ATTRS},
        "layers": stored_layers(f),
        "dim": attrs.get("dim"),
        "storage_dtype": attrs.get("storage_dtype"),
        "counts": _counts(f, n),
        "per_residue": "per_residue" in f,
        "pooling": poolings_of(f),
    }
    info.update(_record_stats(f, n))
    info["reused"] = _reused(attrs, path)
    info["datasets"] = _datasets(f)
    info["aliases"] = int(f["aliases/id"].shape[0]) if "aliases/id" in f else 0
    info["skipped"] = int(f["skipped/id"].shape[0]) if "skipped/id" in f else 0
    if "merged_from" in attrs:
        info["merged_from"] = attrs["merged_from"]
        # a merged store reads per-residue rows from its sources: say when they are unusable
        info["source_problems"] = [p.message for p in source_problems(f, path, full=False)]
        info["platforms"] = platforms(attrs)  # [] unless its shards ran on several
    return info


def store_info(path: Path) -> dict[str, Any]:
    """Provenance, counts, precision/fallback statistics and sizes of a store (JSON-friendly)."""
    path = Path(path)
    with open_h5(path) as f:
        try:
            return _info(f, path, check_format(f, path))
        except StoreError:
            raise
        except (OSError, KeyError, ValueError) as exc:
            raise StoreError(f"{path}: cannot read store: {exc}") from None


def _fmt_counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k or '(empty)'} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def _batches_line(prov: Mapping[str, Any]) -> list[str]:
    """How the batches ran, for stores that record it (older stores do not; a merged store
    whose shards differ keeps it per shard only, in ``shard_provenance``)."""
    if "tokens_per_batch" not in prov:
        return []
    config = prov["config"] if isinstance(prov.get("config"), Mapping) else {}
    given = " (auto)" if config.get("tokens_per_batch") == "auto" else ""
    return [f"  batches     {prov['tokens_per_batch']} tokens{given}, {prov.get('batch_layout', '?')}; attention path "
            f"{prov.get('attention_path', '?')}, q/k/v {prov.get('attention_inputs', '?')}"]


def _requested_line(prov: Mapping[str, Any]) -> list[str]:
    """The policy asked for and why the one above was chosen (``--precision auto``; stores
    embedded with a named policy record neither: docs/store-format.md)."""
    if "precision_requested" not in prov and "precision_reason" not in prov:
        return []
    return [f"  requested   precision {prov.get('precision_requested', '?')}: {prov.get('precision_reason', '?')}"]


def _header_lines(info: Mapping[str, Any]) -> list[str]:
    """Format, model, precision, storage, software, layers and counts."""
    prov = info.get("provenance", {})
    counts = info.get("counts", {})
    return [
        f"{info.get('path')}: {info.get('format')} v{info.get('format_version')}"
        + ("" if info.get("complete") else "  ** INCOMPLETE **"),
        f"  model       {prov.get('model_name', '?')}  sha256 {str(prov.get('model_sha256', '?'))[:16]}"
        + ("" if prov.get("model_trained", True) else "  (UNTRAINED test model)"),
        f"  precision   policy {prov.get('precision_policy', '?')}: weights {prov.get('weight_dtype', '?')}, "
        f"matmuls {prov.get('compute_dtype', '?')}, islands {prov.get('island_dtype', '?')}, "
        f"fallback {prov.get('fallback_dtype', '?')}; attention {prov.get('attention', '?')}",
        *_requested_line(prov),
        *_batches_line(prov),
        f"  storage     {info.get('storage_dtype')}; device {prov.get('device', '?')}"
        + (f"; platform {prov['platform']}" if "platform" in prov else ""),
        f"  software    embedpipe {prov.get('embedpipe_version', '?')}, torch {prov.get('torch_version', '?')}"
        + (f", fair-esm {prov['fair_esm_version']}" if "fair_esm_version" in prov else "")  # ESM-2 families only
        + f"; created {prov.get('created_utc', '?')}",
        f"  layers      {info.get('layers')}  dim {info.get('dim')}  pooled {', '.join(info.get('pooling', ['mean']))}"
        + "  per-residue " + ("on" if info.get("per_residue") else "off"),
        f"  records     {counts.get('records', 0)}  residues {counts.get('residues', 0)}"
        + (f"  embedded {counts['embedded_residues']}" if "embedded_residues" in counts else "")
        + (f"  per-residue rows {counts['per_residue_rows']}" if "per_residue_rows" in counts else ""),
    ]


def _stats_lines(info: Mapping[str, Any]) -> list[str]:
    """Precision used, fallbacks, max |activation| and long-sequence handling."""
    lines = []
    if "precision_used" in info:
        lines.append(f"  used        {_fmt_counts(info['precision_used'])}")
    fb = info.get("fallback")
    if fb is not None:
        lines.append(
            f"  fallback    {fb['count']} ({100 * fb['rate']:.2f}%)"
            + (f": {_fmt_counts(fb['by_reason'])}" if fb["by_reason"] else "")
        )
    mx = info.get("max_abs_activation")
    if mx:
        if mx.get("count"):
            lines.append(
                f"  max|act|    min {mx['min']:.4g}  median {mx['median']:.4g}  max {mx['max']:.4g}"
                + (f"  (non-finite/unknown {mx['nonfinite']})" if mx.get("nonfinite") else "")
            )
        else:
            lines.append(f"  max|act|    not recorded ({mx.get('nonfinite', 0)} records)")
    if "long_handling" in info:
        lines.append(f"  long seqs   {_fmt_counts(info['long_handling'])}")
    lines += _reused_lines(info)
    return lines


def _reused_lines(info: Mapping[str, Any]) -> list[str]:
    """How many records were copied from which ``--reuse`` store(s), none when nothing was."""
    reused = info.get("reused") or {}
    if not reused.get("count"):
        return []
    total = info.get("counts", {}).get("records", 0)
    lines = [f"  reused      {reused['count']} of {total} records copied by embed --reuse, not computed"]
    for source in reused.get("sources", []):
        lines.append(f"              {source.get('records', '?')} from {source.get('path', '?')} "
                     f"(store_uuid {source.get('store_uuid', '?')})")
    return lines


def render_info(info: Mapping[str, Any]) -> str:
    """Compact human-readable summary of :func:`store_info`."""
    lines = _header_lines(info) + _stats_lines(info)
    if info.get("merged_from"):
        lines.append(
            f"  merged      {len(info['merged_from'])} store(s); aliases {info.get('aliases', 0)}; "
            f"skipped {info.get('skipped', 0)}"
        )
        lines += [f"  ** SOURCE  {message}" for message in info.get("source_problems", [])]
        lines += [f"  platform    {line}" for line in platform_lines(info.get("platforms", []))]
    ds = info.get("datasets", {})
    stored = sum(v["stored_bytes"] for v in ds.values())
    virtual = sum(1 for v in ds.values() if v["virtual"])
    lines.append(
        f"  size        file {human_bytes(info.get('file_size', 0))}; datasets {len(ds)} "
        f"({human_bytes(stored)} stored" + (f", {virtual} virtual" if virtual else "") + ")"
    )
    return "\n".join(lines)
