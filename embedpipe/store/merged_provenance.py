"""What a merged store's root says of its shards: the attributes they must agree on, and the
provenance they share (the rest is kept per shard, docs/store-format.md "Merged stores")."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from embedpipe.core.errors import StoreError
from embedpipe.store.format import RESERVED_ATTRS
from embedpipe.store.reuse_index import REUSED_ATTRS
from embedpipe.store.sources import MERGED_SOURCES_ATTR

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
        else:
            varying.append(key)
    return common, varying, config_varying
