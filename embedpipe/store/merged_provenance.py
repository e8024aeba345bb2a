"""What a merged store's root says of its shards: the attributes they must agree on, the
provenance they share (the rest is kept per shard, docs/store-format.md "Merged stores"), and
which records came from which platform when the shards ran on several (``embed
--accept-platform-mix``: info, validate and the cross-check say so)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from embedpipe.core.errors import StoreError
from embedpipe.store.format import RESERVED_ATTRS
from embedpipe.store.reuse_index import REUSED_ATTRS
from embedpipe.store.sources import MERGED_SOURCES_ATTR

#: the root attribute, and the ``embed_identity`` field, naming the platform that computed a store
PLATFORM = "platform"
#: shard attributes that must be identical for stores to be merged
MUST_AGREE = ("model_sha256", "precision_policy", "layers", "storage_dtype", "dim", "per_residue", "pooling")
#: attributes describing one file, never carried over as merged provenance
PER_FILE = {"created_utc", "complete", "merged_from", "merged_rows", "shard_provenance", "varying_attrs",
             "config_varying", "alias_count", "skipped_count", MERGED_SOURCES_ATTR, *REUSED_ATTRS} | set(RESERVED_ATTRS)


def check_agreement(shards: Sequence[tuple[Path, Mapping[str, Any]]]) -> None:
    """One line naming the first shard (path, root attributes) that differs from the first in
    an attribute of :data:`MUST_AGREE`."""
    first_path, first = shards[0]
    for path, attrs in shards[1:]:
        for key in MUST_AGREE:
            a, b = first.get(key), attrs.get(key)
            if a != b:
                raise StoreError(
                    f"{path}: {key} is {b!r} but {first_path} has {a!r}; "
                    f"stores to merge must agree on {', '.join(MUST_AGREE)}"
                )


def _same(values: Sequence[Any]) -> bool:
    return all(json.dumps(x, sort_keys=True, default=str) == json.dumps(values[0], sort_keys=True, default=str)
               for x in values)


def common_provenance(shards: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], list[str], list[str]]:
    """Attributes equal in every shard's root attributes; names that differ; config keys that differ."""
    keys = sorted({k for attrs in shards for k in attrs} - PER_FILE)
    common: dict[str, Any] = {}
    varying: list[str] = []
    config_varying: list[str] = []
    for key in keys:
        values = [attrs.get(key) for attrs in shards]
        configs = [v for v in values if isinstance(v, dict)]
        if key == "config" and len(configs) == len(values):
            merged_config = {}
            for ck in sorted({ck for v in configs for ck in v}):
                cv = [v.get(ck) for v in configs]
                if _same(cv):
                    merged_config[ck] = cv[0]
                else:
                    config_varying.append(ck)
            common["config"] = merged_config
        elif all(v == values[0] for v in values):
            common[key] = values[0]
        elif key == "embed_identity" and (mixed := _mixed_identity(values)) is not None:
            common[key] = mixed
        else:
            varying.append(key)
    return common, varying, config_varying


def _mixed_identity(values: Sequence[Any]) -> str | None:
    """One identity for shards whose identities differ only in the platform: theirs, with the
    platform ``mixed: A; B`` (a run accepting a platform mix may reuse the merged store, any
    other run is refused naming the platform); None when anything else differs."""
    try:
        parsed = [json.loads(v) for v in values]
    except (TypeError, ValueError):
        return None
    if not all(isinstance(p, dict) for p in parsed):
        return None
    rest = [{k: v for k, v in p.items() if k != PLATFORM} for p in parsed]
    if not _same(rest):
        return None
    names = sorted({str(p.get(PLATFORM)) for p in parsed})
    return json.dumps(rest[0] | {PLATFORM: "mixed: " + "; ".join(names)}, sort_keys=True)


def platforms(attrs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """For a merged store whose shards ran on several platforms: each platform with its
    records, row ranges and shard stores (``shard_provenance`` and ``merged_rows``); [] for a
    store of one platform, or of shards that did not record it."""
    shards, starts = attrs.get("shard_provenance"), attrs.get("merged_rows")
    if not isinstance(shards, list) or starts is None or len(starts) != len(shards) + 1:
        return []
    found: dict[str, dict[str, Any]] = {}
    for shard, lo, hi in zip(shards, starts[:-1], starts[1:]):
        name = str(shard.get(PLATFORM, "(not recorded)")) if isinstance(shard, Mapping) else "(not recorded)"
        entry = found.setdefault(name, {"platform": name, "records": 0, "rows": [], "stores": []})
        entry["records"] += int(hi) - int(lo)
        if entry["rows"] and entry["rows"][-1][1] == int(lo):  # adjacent shards: one range
            entry["rows"][-1][1] = int(hi)
        else:
            entry["rows"].append([int(lo), int(hi)])
        entry["stores"].append(str(shard.get("path", "?")) if isinstance(shard, Mapping) else "?")
    return list(found.values()) if len(found) > 1 else []


def platform_lines(found: Sequence[Mapping[str, Any]], shown: int = 3) -> list[str]:
    """:func:`platforms`' answer as lines (``A: 12 records, rows 0-11 (shard-00000.h5)``), the
    first ``shown`` row ranges and stores of each named, the rest counted."""
    return [f"{p['platform']}: {p['records']} records, rows "
            + _listed([f"{lo}-{hi - 1}" for lo, hi in p["rows"] if hi > lo], shown)
            + f" ({_listed(p['stores'], shown)})" for p in found]


def _listed(items: Sequence[str], shown: int) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
