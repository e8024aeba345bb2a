"""store/filters.py: one place for the HDF5 filters, and new stores still get, dataset by
dataset, the filters of the archived v2 example (tests/data, written before the module
existed): the same gzip level, shuffle and fletcher32 (byte-compatible stores)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from embedpipe.store import EmbeddedRecord, filters, merge_stores
from embedpipe.store.columns import COLUMNS
from helpers.stores import write_store

ARCHIVED_V2 = Path(__file__).resolve().parents[1] / "data" / "store-v2-example.h5"


def _filters(path: Path) -> dict[str, tuple]:
    """dataset name -> (compression, level, shuffle, fletcher32) of every stored dataset; the
    layer number dropped from ``mean/layer_N`` so stores of different layers compare."""
    out: dict[str, tuple] = {}
    with h5py.File(path, "r") as f:
        def visit(name: str, obj: object) -> None:
            if isinstance(obj, h5py.Dataset) and not obj.is_virtual:
                key = name.rsplit("_", 1)[0] if "/layer_" in name else name
                out[key] = (obj.compression, obj.compression_opts, obj.shuffle, obj.fletcher32)
        f.visititems(visit)
    return out


def _records(prefix: str, n: int) -> list[EmbeddedRecord]:
    out = []
    for i in range(n):
        rows = np.cos(np.arange((5 + i) * 4, dtype=np.float32).reshape(5 + i, 4) + i)
        out.append(EmbeddedRecord(id=f"{prefix}{i}", sequence="ACDEFGHIKLMNPQRSTVWY"[:5 + i], precision_used="fp32",
                                  mean={2: rows.sum(axis=0, dtype=np.float32) / np.float32(len(rows))},
                                  per_residue={2: rows}, embedded_length=len(rows)))
    return out


def test_new_stores_get_the_archived_stores_filters(tmp_path):
    archived = _filters(ARCHIVED_V2)
    assert len(archived) == 16  # every dataset of the example, the ID index included
    shards = [write_store(tmp_path / f"s{k}.h5", _records(f"s{k}_", 4), storage_dtype="float16") for k in range(2)]
    new = _filters(shards[0])
    assert {name: new[name] for name in archived} == archived
    # columns added since the archive (optional in format 2, e.g. ``reused_from``) take one of its filter sets
    added = set(new) - set(archived)
    assert added <= {c.name for c in COLUMNS.values() if not c.required_in(2)}, added
    assert {new[name] for name in added} <= set(archived.values())
    merged = _filters(merge_stores(shards, out=tmp_path / "m.h5").out)
    # a merged store's per-residue rows are virtual; every stored dataset it has, the shard has too
    assert merged and all(merged[name] == new[name] for name in merged), merged


def test_the_three_filter_sets_are_what_the_archive_holds():
    archived = set(_filters(ARCHIVED_V2).values())
    as_tuple = {name: (f.get("compression"), f.get("compression_opts", 4 if f.get("compression") else None),
                       f.get("shuffle", False), f["fletcher32"])
                for name, f in (("plain", filters.PLAIN), ("numbers", filters.NUMBERS), ("text", filters.TEXT))}
    assert set(as_tuple.values()) == archived
    assert filters.numbers(True) is filters.NUMBERS and filters.numbers(False) is filters.PLAIN


def test_the_reuse_index_takes_its_filters_from_the_module(tmp_path):
    from embedpipe.store.reuse_index import build_index

    store = write_store(tmp_path / "s.h5", _records("r", 5), storage_dtype="float16")
    build_index(store, tmp_path / "index.h5")
    got = _filters(tmp_path / "index.h5")
    plain = (None, None, False, True)
    assert got == {"keys": plain, "rows": plain, "fence": (None, None, False, False)}  # fence: docs/store-format.md
    assert filters.PLAIN == {"fletcher32": True}


def test_no_store_module_spells_a_filter_argument():
    """Store compression is a change to filters.py alone (docs/architecture.md, "Where a change starts")."""
    package = Path(filters.__file__).resolve().parent
    for module in sorted(package.glob("*.py")):
        if module.name != "filters.py":
            text = module.read_text(encoding="utf-8")
            for argument in ("fletcher32=", "compression=", "compression_opts=", "shuffle="):
                assert argument not in text, (module.name, argument)
