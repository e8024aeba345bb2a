"""Issue 24 §2: ``open_store`` of a merged store costs O(1) HDF5 work in its sources.

A merged store's ``per_residue/layer_k`` are virtual datasets over every shard store. Opening
one decodes all K source mappings, and its ``is_virtual`` / ``chunks`` copy them again: at
16,000 sources ``open_store`` took +202 MiB that way (docs/benchmarks.md, "Merge and validate
at scale"). embedpipe reads those rows from the shard stores (``merged_from``,
``merged_rows``), so the reader must never open the virtual datasets: the tests record every
object HDF5 is asked to open (``h5o.open``) and every file (``h5f.open``) while opening and
reading a merged store of many small shards, and compare the rows with the shard stores'
own."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import embedpipe
from embedpipe.core.errors import StoreError
from embedpipe.store import EmbeddedRecord, merge_stores
from helpers.stores import as_format2, write_store

SHARDS = 24
LAYERS = (1, 2)


def _records(shard: int) -> list[EmbeddedRecord]:
    rng = np.random.default_rng(shard)
    out = []
    for i in range(2):
        length = 3 + (shard + i) % 4
        rows = {k: rng.standard_normal((length, 4)).astype(np.float32) for k in LAYERS}
        out.append(EmbeddedRecord(
            id=f"s{shard}r{i}", sequence="ACDEFG"[:length], precision_used="fp32", fallback_reason="",
            mean={k: rows[k].sum(axis=0, dtype=np.float32) / np.float32(length) for k in LAYERS},
            per_residue=rows, max_abs_activation=1.0, embedded_length=length))
    return out


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lazy")
    (root / "stores").mkdir()
    shards = [write_store(root / "stores" / f"shard-{s:05d}.h5", _records(s)) for s in range(SHARDS)]
    return merge_stores(shards, out=root / "embeddings.h5") and root / "embeddings.h5"


@pytest.fixture
def opened(monkeypatch) -> list[tuple[str, str]]:
    """(file, object) of every object opened through h5py, and (file, "") of every file."""
    seen: list[tuple[str, str]] = []
    real_object, real_file = h5py.h5o.open, h5py.h5f.open

    def open_object(loc, name, *args, **kwargs):
        seen.append((Path(h5py.h5f.get_name(loc).decode()).name, name.decode() if isinstance(name, bytes) else name))
        return real_object(loc, name, *args, **kwargs)

    def open_file(name, *args, **kwargs):
        seen.append((Path(name.decode() if isinstance(name, bytes) else name).name, ""))
        return real_file(name, *args, **kwargs)

    monkeypatch.setattr(h5py.h5o, "open", open_object)
    monkeypatch.setattr(h5py.h5f, "open", open_file)
    return seen


def _virtual_opened(seen: list[tuple[str, str]]) -> list[str]:
    return [obj for file, obj in seen if file == "embeddings.h5" and obj.startswith("per_residue/layer_")]


def _shard_rows(merged: Path, shard: int, layer: int) -> np.ndarray:
    with h5py.File(merged.parent / "stores" / f"shard-{shard:05d}.h5", "r") as g:
        return g[f"per_residue/layer_{layer}"][()]


def test_open_store_opens_no_source_and_no_virtual_dataset(merged, opened):
    with h5py.File(merged, "r") as f:  # the premise: these are virtual datasets over every shard
        assert f["per_residue/layer_2"].is_virtual and len(f["per_residue/layer_2"].virtual_sources()) == SHARDS
    opened.clear()
    store = embedpipe.open_store(merged)
    try:
        assert [file for file, obj in opened if not obj] == ["embeddings.h5"]
        assert _virtual_opened(opened) == []
        # one record of shard 7: only that shard store is opened, and its rows are the shard's
        opened.clear()
        rows = store.per_residue("s7r1", layer=2)
        assert [file for file, obj in opened if not obj] == ["shard-00007.h5"] and _virtual_opened(opened) == []
        with h5py.File(merged.parent / "stores" / "shard-00007.h5", "r") as g:
            lo, hi = g["per_residue/offsets"][1], g["per_residue/offsets"][2]
        np.testing.assert_array_equal(rows, _shard_rows(merged, 7, 2)[lo:hi])
        # the whole array, lazily and then computed: every shard's rows in order
        whole = store.per_residue_array(layer=1).compute()
        np.testing.assert_array_equal(whole, np.concatenate([_shard_rows(merged, s, 1) for s in range(SHARDS)]))
        assert _virtual_opened(opened) == []
    finally:
        store.close()


def test_a_merged_store_without_merged_rows_still_reads_through_its_virtual_datasets(merged, tmp_path):
    """Stores merged before ``merged_rows`` existed: the old path (the virtual datasets, checked at open)."""
    root = tmp_path / "old"
    (root / "stores").mkdir(parents=True)
    for p in (merged.parent / "stores").iterdir():
        (root / "stores" / p.name).write_bytes(p.read_bytes())
    (root / "embeddings.h5").write_bytes(merged.read_bytes())
    with h5py.File(root / "embeddings.h5", "r+") as f:
        del f.attrs["merged_rows"]
        as_format2(f)  # merged_rows came before format 3's digests
    with embedpipe.open_store(root / "embeddings.h5") as store:
        whole = store.per_residue_array(layer=2).compute()
    np.testing.assert_array_equal(whole, np.concatenate([_shard_rows(merged, s, 2) for s in range(SHARDS)]))


@pytest.mark.parametrize(("attr", "value", "message"), [
    ("encoding-type", "sparse-array", r"dataset per_residue/layer_1 has encoding-type 'sparse-array'"),
    ("encoding-version", "99", r"per_residue/layer_1 has encoding-version 99"),
])
def test_the_tags_of_a_virtual_dataset_are_still_checked_at_open(merged, tmp_path, attr, value, message):
    """Read by name, without opening the dataset: an unknown tag is refused as before."""
    (tmp_path / "stores").symlink_to(merged.parent / "stores")
    copy = tmp_path / "embeddings.h5"
    copy.write_bytes(merged.read_bytes())
    with h5py.File(copy, "r+") as f:
        f["per_residue/layer_1"].attrs[attr] = value
    with pytest.raises(StoreError, match=message):
        embedpipe.open_store(copy)
